"""One-to-one transforms of items."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from random import Random
from typing import ClassVar, TypeVar

from ._base import (
    CheckpointableIterator,
    Stage,
    State,
    fast_iterator,
    require_callable,
    require_checkpointable,
    source_state,
)
from ._rng import (
    MARK_FIELDS,
    CountingRandom,
    Seed,
    adopt_seed,
    mark_fields,
    read_mark,
    resolve_seed,
)

T = TypeVar("T")
U = TypeVar("U")


class MapIterator(Stage[U]):
    """Yields ``transform(item)`` for each item of the source.

    The source is not reset (as in infinibatch). Chains of MapIterators run as nested
    builtin ``map`` objects: a stage adds only the cost of calling its transform.

    Checkpoint:
        ``{"source"}``: the source's state; nothing is re-read on restore.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {"source": dict}

    def __init__(
        self, source_iterator: CheckpointableIterator[T], transform: Callable[[T], U]
    ) -> None:
        require_checkpointable("MapIterator", "source_iterator", source_iterator)
        require_callable("MapIterator", "transform", transform)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._transform = transform
        self._iterator = map(transform, fast_iterator(source_iterator))

    def _state(self) -> State:
        return {"source": source_state(self._source)}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"], "source")
        self._iterator = map(self._transform, fast_iterator(self._source))


class SamplingRandomMapIterator(Stage[U]):
    """Yields ``transform(rng, item)`` for each item, with one checkpointed ``Random(seed)``.

    `rng` is a ``random.Random`` drawing exactly the numbers of ``random.Random(seed)``;
    the transform may call any of its methods except ``seed``/``setstate``.

    Checkpoint:
        ``{"source", "seed", "draws", "generator", "gauss_next"}``: the source's state and
        the generator's position (see `infinibatch_like._rng`). Constant size; a restore
        redraws at most 2**24 words at C speed.
    """

    _state_fields: ClassVar[dict[str, type | tuple[type, ...]]] = {
        "source": dict,
        "seed": (int, str),
        **MARK_FIELDS,
        "gauss_next": (float, type(None)),
    }

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        transform: Callable[[Random, T], U],
        seed: Seed | None = 0,
    ) -> None:
        require_checkpointable("SamplingRandomMapIterator", "source_iterator", source_iterator)
        require_callable("SamplingRandomMapIterator", "transform", transform)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._transform = transform
        self._seed, self._seed_drawn = resolve_seed("SamplingRandomMapIterator", seed)
        self._restore(None)

    def _state(self) -> State:
        rng = self._rng
        return {
            "source": source_state(self._source),
            "seed": self._seed,
            **mark_fields(rng.mark()),
            "gauss_next": rng.gauss_next,
        }

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"], "source")
        if state is None:
            self._rng = CountingRandom(self._seed)
        else:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            mark = read_mark(self, state["draws"], state["generator"])
            self._rng = CountingRandom.from_mark(self._seed, mark, state["gauss_next"])
        self._iterator = map(partial(self._transform, self._rng), fast_iterator(self._source))
