"""Shuffled indices for map-style data: a permutation of ``range(num_items)`` per epoch,
computed index by index in constant memory.

Millions of small files, or records addressed by index, are read in a random order by
mapping positions to indices through a seeded bijection instead of shuffling a list of
them: a Feistel network over the next power of two, restricted to ``range(num_items)`` by
cycle-walking. Its keys are derived from (seed, epoch), so each epoch has its own order
and any position of any epoch is computed directly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import ClassVar

from .._core.checks import require_int
from .._core.protocol import State
from .._core.rng import Seed, adopt_seed, resolve_seed
from .._core.schema import FieldSpec, Int
from .._core.stage import Stage
from .sources import check_epochs, check_position, check_rank

MAX_ITEMS = 1 << 64
"""The largest `num_items`: the round function mixes 64-bit words."""

_MASK64 = (1 << 64) - 1
_MULTIPLIER_1 = 0xFF51AFD7ED558CCD  # the multipliers of MurmurHash3's 64-bit finalizer
_MULTIPLIER_2 = 0xC4CEB9FE1A85EC53
_SMALL_DOMAIN_BITS = 8
_ROUNDS_SMALL = 12
_ROUNDS = 8
"""Rounds of the network. Tiny domains mix slowly (a network of 3 bits with ideal random
round functions still orders pairs measurably unevenly after 8 rounds, evenly after 12),
so domains of up to 2**8 items get 12 rounds; larger ones 8."""


class IndexPermutation:
    """A seeded bijection of ``range(size)``: ``permutation(position)`` is the index at
    `position`.

    An unbalanced Feistel network over ``2**bits`` values (``bits`` the width of
    ``size - 1``, at least 2) in which each round replaces one part by itself xor a keyed
    64-bit mix of the other part, and cycle-walking: a value ``>= size`` is put through
    the network again until it falls in ``range(size)``, which keeps the map a bijection
    (on average fewer than two passes for sizes from 3, as ``2**bits < 2 * size``). The
    round keys are 64-bit words derived from `key` with SHAKE-256. Costs a few
    microseconds per index and a few hundred bytes, whatever `size`.

    Args:
        size: the number of indices, 1 <= size <= 2**64 (not checked here: see
            `PermutationSourceIterator`).
        key: any bytes; equal keys give equal permutations (see `epoch_key`).
    """

    def __init__(self, size: int, key: bytes) -> None:
        self._size = size
        bits = max(2, (size - 1).bit_length())
        high, low = bits // 2, bits - bits // 2
        count = _ROUNDS_SMALL if bits <= _SMALL_DOMAIN_BITS else _ROUNDS
        words = hashlib.shake_256(key).digest(8 * count)
        keys = [int.from_bytes(words[8 * i : 8 * i + 8], "little") for i in range(count)]
        # Round i writes a part of `high` bits (even i) or `low` bits (odd i): the top bits
        # of the mix. An even number of rounds brings the parts back to (high, low).
        self._rounds = tuple(
            (key_word, 64 - (high if i % 2 == 0 else low)) for i, key_word in enumerate(keys)
        )
        self._low = low
        self._low_mask = (1 << low) - 1

    def __call__(self, position: int) -> int:
        size, low, low_mask, rounds = self._size, self._low, self._low_mask, self._rounds
        value = position
        while True:
            left, right = value >> low, value & low_mask
            for key_word, shift in rounds:
                mixed = ((right ^ key_word) * _MULTIPLIER_1) & _MASK64
                mixed ^= mixed >> 32
                left, right = right, left ^ (((mixed * _MULTIPLIER_2) & _MASK64) >> shift)
            value = (left << low) | right
            if value < size:
                return value


def epoch_key(seed: Seed, epoch: int) -> bytes:
    """The key of one epoch's permutation: distinct for distinct (seed, epoch) pairs."""
    return f"infinibatch_like.stages.permutation|{type(seed).__name__}:{seed}|{epoch}".encode()


class PermutationSourceIterator(Stage[int]):
    """The indices ``0 .. num_items - 1`` in a seeded random order, reshuffled every epoch,
    in constant memory: a source for map-style data (files or records addressed by index).

    Epoch e is a pseudo-random permutation of ``range(num_items)`` (an `IndexPermutation`
    keyed by (seed, e)), computed position by position: nothing is held per item, so
    ``num_items`` may be in the billions. Conceptually the stream is E0 + E1 + E2 + ...,
    endless or, with ``epochs=n``, ending after n epochs (the first n of the endless
    ones). Rank r of `num_instances` takes the positions r, r + n, r + 2n, ... of that
    stream, as `InfinitePermutationSourceIterator` does: in every epoch the ranks' shares
    are disjoint, cover all indices and differ in size by at most one.

    Every index lands at every position, and each pair of indices comes in either order,
    with the frequencies of a uniform shuffle (tested by chi-square over many seeds); not
    every one of the ``num_items!`` orders can occur (a Feistel network over 2**k values
    only makes even permutations), which no training loop can notice.

    Load the items with a `MapIterator` (or a `ParallelMapIterator` for slow reads)::

        files = sorted(glob.glob("images/*.jpg"))
        indices = PermutationSourceIterator(len(files), seed=1, epochs=10,
                                            num_instances=world_size, instance_rank=rank)
        images = MapIterator(indices, lambda index: load_image(files[index]))

    The list itself is not part of the state: restore with the same `files` in the same
    order.

    Args:
        num_items: the number of items (1 <= num_items <= 2**64).
        seed: seed of the permutations (an int or a str); None draws one (kept in
            checkpoints).
        epochs: None for endless epochs, or the number of epochs (>= 1) before the
            stream ends.
        num_instances: the number of ranks (>= 1).
        instance_rank: this rank (0 <= instance_rank < num_instances).

    Raises:
        TypeError, ValueError: for a bad argument, naming it.

    Checkpoint:
        ``{"seed", "epoch_number", "position", "fingerprint"}``: the epoch (counted from 0)
        and the position within it of the next index this rank yields (not named "epoch",
        a key that training code often adds to states), and a fingerprint of `num_items`,
        `epochs`, `num_instances` and `instance_rank`, which cannot change at a restart (a
        state taken with other values, or another explicit `seed`, is refused). Constant
        size; a restore derives the epoch's keys and re-reads nothing. At the end of an
        `epochs` stream, ``epoch_number`` is `epochs` (or beyond it, for a rank with
        nothing left) and a restore from there is exhausted at once.
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "seed": (int, str),
        "epoch_number": Int(0),
        "position": Int(0, below=lambda stage: stage._num_items, name="num_items"),
    }

    def __init__(
        self,
        num_items: int,
        seed: Seed | None = 0,
        epochs: int | None = None,
        num_instances: int = 1,
        instance_rank: int = 0,
    ) -> None:
        owner = "PermutationSourceIterator"
        self._num_items = require_int(owner, "num_items", num_items, 1)
        if num_items > MAX_ITEMS:
            raise ValueError(f"{owner}: num_items must be <= 2**64, got {num_items}")
        self._epochs = check_epochs(owner, epochs)
        self._num_instances, self._instance_rank = check_rank(owner, num_instances, instance_rank)
        self._end = None if epochs is None else epochs * num_items
        self._seed, self._seed_drawn = resolve_seed(owner, seed)
        self._restore(None)

    def _arguments(self) -> State:
        return {
            "num_items": self._num_items,
            "epochs": self._epochs,
            "num_instances": self._num_instances,
            "instance_rank": self._instance_rank,
        }

    def _state(self) -> State:
        epoch, position = divmod(self._position, self._num_items)
        return {"seed": self._seed, "epoch_number": epoch, "position": position}

    def _restore(self, state: State | None) -> None:
        if state is None:
            position = self._instance_rank
        else:
            self._seed = adopt_seed(self, self._seed, self._seed_drawn, state["seed"])
            epoch, within = state["epoch_number"], state["position"]
            position = epoch * self._num_items + within
            check_position(self, position, self._num_instances, self._instance_rank, self._end)
        self._position = position
        self._iterator = self._generate(position)

    def _generate(self, position: int) -> Iterator[int]:
        size, stride, end = self._num_items, self._num_instances, self._end
        while end is None or position < end:
            epoch, start = divmod(position, size)
            index_at = IndexPermutation(size, epoch_key(self._seed, epoch))
            first = epoch * size + stride  # the stream position after offset 0's
            for offset in range(start, size, stride):
                self._position = first + offset
                yield index_at(offset)
            position = self._position
