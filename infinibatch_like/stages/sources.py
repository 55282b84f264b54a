"""Source stages: where a pipeline's items come from."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any, ClassVar, TypeVar

from .._core.checks import require_int
from .._core.fingerprint import items_fingerprint
from .._core.protocol import State
from .._core.rng import (
    MARK_FIELDS,
    CountingRandom,
    Mark,
    Seed,
    adopt_seed,
    mark_fields,
    read_mark,
    resolve_seed,
)
from .._core.schema import FieldSpec, Int
from .._core.stage import Stage, skip_items

_INDEXED = (list, tuple, range)

T = TypeVar("T")


class NativeCheckpointableIterator(Stage[T]):
    """Iterates over a re-iterable collection (a list, a tuple, a range, or any iterable
    whose ``iter()`` starts over).

    Args:
        iterable: the collection. An iterator (``iter(x) is x``) cannot be restarted and
            raises ValueError. Do not modify the collection while iterating.

    Checkpoint:
        ``{"consumed": n, "fingerprint": {"iterable"}}``: the number of items yielded, and
        a fingerprint of a list, tuple or range (its length and a hash of its items, see
        `items_fingerprint`) or the type of another iterable: a state taken over other
        items is refused. A restore of a list, tuple or range jumps to n directly; any
        other iterable is iterated again and n items are skipped (n is checked against
        ``len(iterable)`` first where the iterable has a length).
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {"consumed": Int(0)}

    def __init__(self, iterable: Iterable[T]) -> None:
        if iter(iterable) is iterable:
            raise ValueError(
                "NativeCheckpointableIterator: iterable must be re-iterable, got an iterator "
                f"({type(iterable).__name__}), which cannot be restarted after a restore"
            )
        self._iterable = iterable
        self._indexed = type(iterable) in _INDEXED
        self._consumed = 0
        self._restore(None)

    def _arguments(self) -> State:
        if self._indexed:
            return {"iterable": items_fingerprint(self._iterable)}  # type: ignore[arg-type]
        kind = type(self._iterable)
        return {"iterable": f"<{kind.__module__}.{kind.__qualname__}>"}

    def _state(self) -> State:
        if self._indexed:
            iterable: Sequence[Any] = self._iterable  # type: ignore[assignment]
            return {"consumed": len(iterable) - operator.length_hint(self._indexed_iterator)}
        return {"consumed": self._consumed}

    def _restore(self, state: State | None) -> None:
        consumed = 0 if state is None else state["consumed"]
        length = len(self._iterable) if isinstance(self._iterable, Sized) else -1
        if 0 <= length < consumed:
            raise self.mismatch(
                f"the checkpoint skips {consumed} items, but the iterable has {length}"
            )
        iterator = iter(self._iterable)
        if self._indexed:
            iterator.__setstate__(consumed)  # type: ignore[attr-defined]
            self._iterator = self._indexed_iterator = iterator  # the first may be wrapped
        else:
            skip_items(iterator, consumed, self._name, "the iterable")
            self._consumed = consumed
            self._iterator = self._counting(iterator)

    def _state_before_last(self) -> State | None:
        state = self.getstate()
        if state["consumed"] < 1:
            return None
        state["consumed"] -= 1
        return state

    def _counting(self, iterator: Iterator[T]) -> Iterator[T]:
        for item in iterator:
            self._consumed += 1
            yield item


def ChunkedSourceIterator(
    source_items: Sequence[T], num_instances: int = 1, instance_rank: int = 0
) -> NativeCheckpointableIterator[T]:
    """One pass over this rank's contiguous share of `source_items`.

    The list is cut into `num_instances` consecutive parts whose sizes differ by at most
    one, the first ``len % num_instances`` parts holding the extra item (7 items over 3
    ranks: [0, 1, 2], [3, 4], [5, 6]). Concatenating the ranks' outputs in rank order gives
    the list in order.

    Raises:
        ValueError: if `instance_rank` is not in ``range(num_instances)``.

    Checkpoint:
        That of `NativeCheckpointableIterator`; a restore jumps to the position directly.
    """
    num_instances, instance_rank = check_rank(
        "ChunkedSourceIterator", num_instances, instance_rank
    )
    base, extra = divmod(len(source_items), num_instances)

    def start(rank: int) -> int:
        return rank * base + min(rank, extra)

    return NativeCheckpointableIterator(
        list(source_items[start(instance_rank) : start(instance_rank + 1)])
    )


class InfinitePermutationSourceIterator(Stage[T]):
    """Endless passes over a list, reshuffled before every pass, strided over ranks.

    Conceptually the stream P0 + P1 + P2 + ..., where Pk is the list shuffled by the k-th
    ``shuffle`` of one ``random.Random(seed)`` (each pass shuffles a fresh copy of the
    original order); rank r takes positions r, r + n, r + 2n, ... of that stream. With
    ``shuffle=False`` each pass is the list in order (a strided cycle).

    With ``epochs=k`` the stream ends after the first k passes: rank r takes the same
    positions below ``k * len(source_items)``, so its stream is a prefix of its endless
    one. From every pass each rank takes the positions congruent to r modulo n: the ranks'
    shares of a pass are disjoint, cover it and differ in size by at most one (the rank
    with the extra item rotates from pass to pass when n does not divide the length).

    Args:
        source_items: the items (e.g. chunk file names); must not be empty.
        seed: seed of the shuffles; None draws one (kept in checkpoints).
        shuffle: reshuffle before each pass.
        num_instances: the number of ranks (>= 1).
        instance_rank: this rank (0 <= instance_rank < num_instances).
        epochs: None for endless passes, or the number of passes (>= 1) before the stream
            ends.

    Checkpoint:
        ``{"seed", "position", "draws", "generator", "fingerprint"}``: the next position in
        the concatenated stream and the generator position before the current pass's
        shuffle (see `infinibatch_like._core.rng`), and a fingerprint of `source_items`,
        `shuffle`, `num_instances`, `instance_rank` and `epochs`, which cannot change at a
        restart (a state taken with other values is refused). Constant size; a restore
        redraws at most 2**24 words (C speed) and shuffles one copy of the list. At the end
        of an `epochs` stream the position is this rank's first one past the last pass, and
        a restore from there is exhausted at once.
    """

    _not_elastic = "it reads this rank's share of the chunks"
    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "seed": (int, str),
        "position": int,
        **MARK_FIELDS,
    }

    def __init__(
        self,
        source_items: Sequence[T],
        seed: Seed | None = 0,
        shuffle: bool = True,
        num_instances: int = 1,
        instance_rank: int = 0,
        *,
        epochs: int | None = None,
    ) -> None:
        owner = "InfinitePermutationSourceIterator"
        if len(source_items) == 0:
            raise ValueError(f"{owner}: source_items must not be empty")
        self._num_instances, self._instance_rank = check_rank(owner, num_instances, instance_rank)
        self._epochs = check_epochs(owner, epochs)
        self._items = list(source_items)
        self._end = None if epochs is None else epochs * len(self._items)
        self._shuffle = bool(shuffle)
        self._seed, self._seed_drawn = resolve_seed(owner, seed)
        self._restore(None)

    def _arguments(self) -> State:
        return {
            "source_items": items_fingerprint(self._items),
            "shuffle": self._shuffle,
            "num_instances": self._num_instances,
            "instance_rank": self._instance_rank,
            "epochs": self._epochs,
        }

    def _state(self) -> State:
        return {"seed": self._seed, "position": self._position, **mark_fields(self._mark)}

    def _restore(self, state: State | None) -> None:
        if state is None:
            position = self._instance_rank
            passes = position // len(self._items)  # that this rank skips before its first
            if self._epochs is not None:
                passes = min(passes, self._epochs)
            mark = self._mark_before_pass(passes)
        else:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            position = state["position"]
            check_position(self, position, self._num_instances, self._instance_rank, self._end)
            mark = read_mark(self, state["draws"], state["generator"])
        self._position, self._mark = position, mark
        self._iterator = self._generate(position, mark)

    def _mark_before_pass(self, index: int) -> Mark:
        """The generator's position before the shuffle of pass `index` (ranks >= len)."""
        rng = CountingRandom(self._seed)
        order = list(range(len(self._items)))
        for _ in range(index if self._shuffle else 0):
            rng.shuffle(order)
        return rng.mark()

    def _generate(self, position: int, mark: Mark) -> Iterator[T]:
        items, stride, end = self._items, self._num_instances, self._end
        length = len(items)
        rng = CountingRandom.from_mark(self._seed, mark)
        pass_start = position - position % length

        def permutation() -> list[T]:
            if not self._shuffle:
                return items
            order = list(items)
            rng.shuffle(order)
            return order

        while end is None or pass_start < end:
            current = permutation()
            offsets = range(position - pass_start, length, stride)
            following = pass_start + offsets[-1] + stride  # this rank's first in a later pass
            next_start = following - following % length
            stop = next_start if end is None else min(next_start, end)
            for _ in range((stop - pass_start) // length - 1):  # passes this rank skips
                permutation()
            next_mark = rng.mark()
            for offset in offsets[:-1]:
                self._position = pass_start + offset + stride
                yield current[offset]
            self._position, self._mark = following, next_mark
            yield current[offsets[-1]]
            position, pass_start = following, next_start


class RandomIterator(Stage[float]):
    """Endless floats of ``random.Random(seed).random()``.

    Checkpoint:
        ``{"seed", "count", "generator"}``: the floats drawn so far, and beyond 2**23 of
        them the generator itself (see `infinibatch_like._core.rng`); a restore redraws at most
        2**24 words at C speed.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "seed": (int, str),
        "count": Int(0),
        "generator": MARK_FIELDS["generator"],
    }

    def __init__(self, seed: Seed | None = 0) -> None:
        self._seed, self._seed_drawn = resolve_seed("RandomIterator", seed)
        self._restore(None)

    def _state(self) -> State:
        return {"seed": self._seed, "count": self._count, "generator": self._generator()}

    def _generator(self) -> str | None:
        generator: str | None = mark_fields(self._rng.mark())["generator"]
        return generator

    def _restore(self, state: State | None) -> None:
        mark: Mark = (0, None)
        if state is not None:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            mark = read_mark(self, 2 * state["count"], state["generator"], "2 x 'count'")
        self._count = mark[0] // 2
        self._rng = CountingRandom.from_mark(self._seed, mark)
        self._iterator = self._generate(self._rng)

    def _generate(self, rng: CountingRandom) -> Iterator[float]:
        draw = rng.random
        while True:
            value = draw()
            self._count += 1
            yield value


def create_source_iterator(
    source_items: Sequence[T],
    train: bool = True,
    seed: Seed | None = None,
    shuffle: bool = True,
    num_instances: int = 1,
    instance_rank: int = 0,
    *,
    epochs: int | None = None,
) -> Stage[T]:
    """The source for training (reshuffled passes) or evaluation (one ordered pass).

    ``train=True`` gives an `InfinitePermutationSourceIterator` with ranks strided, endless
    or, with ``epochs=n``, ending after n passes; ``train=False`` gives a
    `ChunkedSourceIterator` with contiguous rank shares and needs ``shuffle=False`` and
    ``epochs=None``.

    Raises:
        ValueError: for ``train=False`` with ``shuffle=True`` or with `epochs`, and for a
            bad rank or `epochs`.
    """
    owner = "create_source_iterator"
    if train:
        return InfinitePermutationSourceIterator(
            source_items,
            seed=seed,
            shuffle=shuffle,
            num_instances=num_instances,
            instance_rank=instance_rank,
            epochs=epochs,
        )
    if shuffle:
        raise ValueError(f"{owner}: shuffle=True is not supported when train=False")
    if epochs is not None:
        raise ValueError(f"{owner}: {EVALUATION_HAS_NO_EPOCHS}, got epochs={epochs!r}")
    return ChunkedSourceIterator(
        source_items, num_instances=num_instances, instance_rank=instance_rank
    )


EVALUATION_HAS_NO_EPOCHS = (
    "epochs applies to training streams (train=True); with train=False the stream is one "
    "ordered pass over this rank's contiguous share of the items, so leave epochs=None"
)


def check_rank(owner: str, num_instances: int, instance_rank: int) -> tuple[int, int]:
    require_int(owner, "num_instances", num_instances, 1)
    require_int(owner, "instance_rank", instance_rank, 0)
    if instance_rank >= num_instances:
        raise ValueError(
            f"{owner}: instance_rank must be < num_instances ({num_instances}), got {instance_rank}"
        )
    return num_instances, instance_rank


def check_epochs(owner: str, epochs: int | None) -> int | None:
    """`epochs` if it is None or an int >= 1, else a TypeError/ValueError naming `owner`."""
    return None if epochs is None else require_int(owner, "epochs", epochs, 1)


def rank_end(end: int, num_instances: int, instance_rank: int) -> int:
    """The first position at or after `end` of the stream strided over ranks that rank
    `instance_rank` takes: where its share of a stream of `end` positions stops."""
    return end + (instance_rank - end) % num_instances


def check_position(
    stage: Stage[Any], position: int, num_instances: int, instance_rank: int, end: int | None
) -> None:
    """Refuse (a StateMismatchError) a restored `position` that rank `instance_rank` of
    `num_instances` cannot reach in a stream of `end` positions (None: endless)."""
    if position < 0 or position % num_instances != instance_rank:
        raise stage.mismatch(
            f"position {position} does not fit rank {instance_rank} of {num_instances}"
        )
    if end is not None and position > rank_end(end, num_instances, instance_rank):
        raise stage.mismatch(
            f"position {position} is past the end of the stream (this rank stops at "
            f"position {rank_end(end, num_instances, instance_rank)})"
        )
