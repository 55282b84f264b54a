"""Seeded random generators whose position fits in one integer.

infinibatch draws from one continuing ``random.Random(seed)`` per component; to give the
same items we must draw the same numbers. Instead of storing the generator's 2.5 KB
internal state, `CountingRandom` counts the 32-bit words it has drawn: ``(seed, draws)``
identifies its position, and `CountingRandom.at` gets back there by drawing that many
words in C (about 7 ns a word here). Every draw of ``random.Random`` goes through
``random()`` (two words) or ``getrandbits(k)`` (``ceil(k / 32)`` words), so counting
those two covers ``shuffle``, ``randrange``, ``choice``, ``sample``, ``gauss`` and the rest.
"""

from __future__ import annotations

import operator
import random
from collections.abc import MutableSequence
from typing import Any

from ._base import Stage

_c_random = random.Random.random
_c_getrandbits = random.Random.getrandbits
_JUMP_WORDS = 1 << 16

Seed = int | str


def resolve_seed(owner: str, seed: object) -> tuple[Seed, bool]:
    """Return ``(seed, drawn)``: the seed to use, and whether it was drawn because None.

    A None seed is replaced by a fresh 63-bit seed from the operating system, kept by the
    stage (and stored in its checkpoints) so that ``setstate(None)`` and restores reproduce.
    """
    if seed is None:
        return random.SystemRandom().getrandbits(63), True
    if isinstance(seed, str):
        return seed, False
    if isinstance(seed, bool):
        raise TypeError(f"{owner}: seed must be an int, a str or None, got {seed!r}")
    try:
        return operator.index(seed), False  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{owner}: seed must be an int, a str or None, got {seed!r}") from None


class CountingRandom(random.Random):
    """A ``random.Random`` that knows how many 32-bit words it has drawn.

    Its numbers are exactly those of ``random.Random(seed)``. Calling ``seed``,
    ``setstate`` or ``jumpahead``-like tricks on it from user code loses the count.
    """

    draws: int
    gauss_next: float | None

    def __init__(self, seed: Seed = 0) -> None:
        super().__init__(seed)
        self.draws = 0

    @classmethod
    def at(cls, seed: Seed, draws: int, gauss_next: float | None = None) -> CountingRandom:
        """The generator ``random.Random(seed)`` after `draws` words, at C speed."""
        rng = cls(seed)
        remaining = draws
        while remaining > 0:
            step = min(remaining, _JUMP_WORDS)
            _c_getrandbits(rng, 32 * step)
            remaining -= step
        rng.draws = draws
        rng.gauss_next = gauss_next
        return rng

    def random(self) -> float:
        self.draws += 2
        return _c_random(self)

    def getrandbits(self, k: int) -> int:
        self.draws += (k + 31) >> 5
        return _c_getrandbits(self, k)

    def below(self, n: int) -> int:
        """``randrange(n)`` for n >= 1, drawing exactly as ``random.Random`` does."""
        bits = n.bit_length()
        per_call = (bits + 31) >> 5  # getrandbits(k) takes ceil(k / 32) 32-bit words
        value = _c_getrandbits(self, bits)
        words = per_call
        while value >= n:
            value = _c_getrandbits(self, bits)
            words += per_call
        self.draws += words
        return value

    def shuffle(self, x: MutableSequence[Any]) -> None:
        """Shuffle `x` in place, exactly as ``random.Random.shuffle`` does (Fisher-Yates).

        Each index takes one 32-bit word: lists are shorter than 2**32 items."""
        words = 0
        for i in range(len(x) - 1, 0, -1):
            n = i + 1
            bits = n.bit_length()
            j = _c_getrandbits(self, bits)
            words += 1
            while j >= n:
                j = _c_getrandbits(self, bits)
                words += 1
            x[i], x[j] = x[j], x[i]
        self.draws += words


def adopt_seed(stage: Stage[Any], own: Seed, drawn: bool, saved: Seed) -> Seed:
    """The seed a stage continues with after a restore from a state holding `saved`.

    A stage built with ``seed=None`` takes the checkpoint's seed (it was drawn at random);
    a stage built with an explicit seed accepts only a checkpoint taken with that seed.
    """
    if saved == own or drawn:
        return saved
    raise stage.mismatch(f"the checkpoint was taken with seed {saved!r}, this stage has {own!r}")
