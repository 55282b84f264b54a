"""Finite passes that end on the same step on every rank (for DDP evaluation).

torch is an optional dependency: the collective is made only while a process group is
initialized (`infinibatch_like.distributed.ranks`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from .._core.checks import require_callable, require_checkpointable
from .._core.fingerprint import described
from .._core.protocol import CheckpointableIterator, State
from .._core.regroup import Regroup
from .._core.schema import FieldSpec, Int, OneOf
from .._core.stage import Stage, fast_iterator, source_state
from . import ranks
from .arrivals import Arrivals

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

T = TypeVar("T")


_POLICIES = ("pad", "drop")
_NOTHING: Any = object()
_PHASES = ("running", "padding", "ended")


class EqualLengthIterator(Stage[T]):
    """Makes every rank yield the same number of items in a finite pass (for DDP).

    In a distributed evaluation, ranks whose shares differ in length would run different
    numbers of steps, and the collectives inside DistributedDataParallel would hang. Before
    each item the ranks agree (one ``all_reduce`` of four integers over `group`: three
    flags, and the rank's arrival, from which statistics tell the rank the others
    wait for) on whether to go on:

    - ``policy="pad"`` (default): the pass lasts as long as the longest rank's share. A
      rank whose share has ended yields padding: its share again from the start (cycling,
      like ``DistributedSampler``) or, with `fill`, ``fill()``. `last_is_padding` tells
      whether the item just yielded is padding, so that metrics can skip it. If a rank
      has nothing to repeat (an empty share and no `fill`), every rank raises the same
      RuntimeError at the same step.
    - ``policy="drop"``: the pass ends on every rank when the shortest share ends. The
      other ranks count the rest of their share (reading it) as dropped: the dropped items
      are the last ``counts["dropped"]`` items of that rank's share.

    Each rank keeps ``counts``: ``{"real", "padded", "dropped"}``. The wrapper is for
    finite passes (``train=False``, or training with ``epochs=``); on an endless stream it
    only adds a collective per item. In a training epoch under DDP a padding step must
    still run forward and backward: give a `fill` that makes a batch of the real batches'
    structure (e.g. one item of one pad token, ``fill=lambda: [[PAD]]``, before
    collation) or repeat the share, and weight the loss of a padding step by 0. Without a
    process group (a single process) it needs no torch.

    Args:
        source_iterator: this rank's finite pass (e.g. batches); reset after it ends when
            it pads by repeating.
        policy: ``"pad"`` or ``"drop"``.
        fill: with ``"pad"``, makes a padding item instead of repeating the share: an
            empty batch (``list``) for metrics, a batch the model accepts in training.
        group: the process group of the ranks that must agree (default: the whole job).

    Raises:
        ValueError: for a bad `policy` or a source that is not checkpointable.
        TypeError: for a `fill` that is not callable.

    Checkpoint:
        ``{"source", "phase", "real", "padded", "dropped"}``: the source's state (when
        padding by repeating, its position in the repeated share), the phase
        (``"running"``, ``"padding"`` or ``"ended"``) and the counts. Constant size; a
        restore re-reads nothing. All ranks must restore states taken at the same step
        (e.g. from one `gather_state`). Over a `ShardedIterator` (under `MapIterator`
        stages), `restore_state` resumes it on another number of ranks: the real items
        left move with their shards, and the new ranks start with phase ``"running"``
        and zero counts (see `infinibatch_like.distributed.elastic`). A rank with no real item yet
        that must pad restarts its share to learn whether there is anything to repeat.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "phase": OneOf(*_PHASES),
        "real": Int(0),
        "padded": Int(0),
        "dropped": Int(0),
    }
    _user_callables = ("fill",)
    _source_field = "source"
    _not_elastic = None

    @classmethod
    def _regrouped(cls, states: list[Any], regroup: Regroup) -> State:
        """Counting afresh on the new ranks; the shards of an old rank that was past its
        real items are ended (see `infinibatch_like.distributed.elastic`)."""
        unit = regroup.pooling.unit
        phases = [regroup.field(state, cls.__name__, "phase") for state in states]
        ended = [phase == "ended" for phase in phases]
        if any(ended) and not all(ended):
            raise regroup.error(
                f"the {unit}s' EqualLengthIterator states are of different steps (phases "
                f"{phases}): every {unit} ends the pass at the same step"
            )
        pairs = zip(regroup.finished, phases, strict=True)
        finished = [done or phase != "running" for done, phase in pairs]
        result = regroup.around(cls.__name__, "source", states, finished)
        result.update(phase="ended" if all(ended) else "running", real=0, padded=0, dropped=0)
        return result

    def __init__(
        self,
        source_iterator: CheckpointableIterator[T],
        policy: str = "pad",
        fill: Callable[[], T] | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        require_checkpointable("EqualLengthIterator", "source_iterator", source_iterator)
        if policy not in _POLICIES:
            raise ValueError(
                f"EqualLengthIterator: policy must be one of {_POLICIES}, got {policy!r}"
            )
        if fill is not None:
            require_callable("EqualLengthIterator", "fill", fill)
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._drop = policy == "drop"
        self._fill = fill
        self._group = group
        self._restore(None)

    def _arguments(self) -> State:
        return {"policy": "drop" if self._drop else "pad", "fill": described(self._fill)}

    @property
    def last_is_padding(self) -> bool:
        """Whether the item yielded last is padding (the share had ended)."""
        return self._phase == "padding"

    @property
    def counts(self) -> dict[str, int]:
        """This rank's items so far: ``{"real", "padded", "dropped"}``."""
        return {"real": self._real, "padded": self._padded, "dropped": self._dropped}

    def _state(self) -> State:
        return {"source": source_state(self._source), "phase": self._phase, **self.counts}

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        if state is None:
            self._phase, self._real, self._padded, self._dropped = "running", 0, 0, 0
        else:
            self._phase, self._real = state["phase"], state["real"]
            self._padded, self._dropped = state["padded"], state["dropped"]
        self._iterator = self._generate()

    def _restarted(self) -> Iterator[T]:
        """The source, restarted from the start of the share (to repeat it as padding)."""
        self.restore_source(self._source, None)
        return fast_iterator(self._source)

    def _generate(self) -> Iterator[T]:
        pull = fast_iterator(self._source)
        first: Any = _NOTHING  # the share's first item, read to learn if there is one
        arrivals = Arrivals(ranks.rank_in(self._group))  # which rank the others wait for
        while self._phase != "ended":
            running = self._phase == "running"
            item = next(pull, _NOTHING) if running else _NOTHING
            has_item = item is not _NOTHING
            stuck = False
            repeats = not has_item and not self._drop and self._fill is None
            if running and repeats and self._real == 0:
                # Nothing real yet: the share is empty, or this rank took other ranks'
                # shards in an elastic restore; restart the share to see if it has items.
                pull = self._restarted()
                first = next(pull, _NOTHING)
                stuck = first is _NOTHING
            flags = [int(not has_item), int(has_item), int(stuck), arrivals.code()]
            entered = time.perf_counter()
            someone_lacks, someone_has, someone_stuck, last = ranks.all_reduce_max(
                flags, self._group
            )
            arrivals.left_collective(entered, last, self._probe)
            if someone_lacks if self._drop else not someone_has:
                self._phase = "ended"
                if has_item:
                    self._dropped += 1 + sum(1 for _ in pull)
                return
            if someone_stuck:
                raise RuntimeError(
                    "EqualLengthIterator: a rank's share is empty, so it has nothing to repeat "
                    "as padding; pass fill= (e.g. fill=list for empty batches) or use "
                    'policy="drop"'
                )
            if has_item:
                self._real += 1
            else:
                if self._fill is not None:
                    item = self._fill()
                else:
                    item, first = first, _NOTHING
                    if item is _NOTHING:
                        item = next(pull, _NOTHING)
                    if item is _NOTHING:  # repeat the share from its start
                        pull = self._restarted()
                        item = next(pull)
                self._phase = "padding"
                self._padded += 1
            yield cast(T, item)
