"""Seeded random generators whose position fits in a small, plain-data state.

infinibatch draws from one continuing ``random.Random(seed)`` per component; to give the
same items we must draw the same numbers. `CountingRandom` counts the 32-bit words it has
drawn: while that count is at most `REDRAW_LIMIT`, ``(seed, draws)`` identifies its
position and a restore gets back there by drawing that many words in C (about 7 ns a
word, so at most a few tenths of a second). Beyond the limit a state also records the
generator itself, packed into a base64 string of 3,336 characters, and a restore is
instant; a count beyond the limit without it is refused as damaged, so no state makes a
restore run for long. Every draw of ``random.Random`` goes through ``random()`` (two
words) or ``getrandbits(k)`` (``ceil(k / 32)`` words), so counting those two covers
``shuffle``, ``randrange``, ``choice``, ``sample``, ``gauss`` and the rest.

Every seeded stage keeps its position as a `Mark` and stores it with `mark_fields` /
`read_mark`: the ``"draws"`` and ``"generator"`` fields of its state.
"""

from __future__ import annotations

import _random
import base64
import binascii
import operator
import random
import struct
from collections.abc import MutableSequence
from typing import Any

from .protocol import State
from .schema import FieldSpec, Int
from .stage import Stage

_c_random = random.Random.random
_c_getrandbits = random.Random.getrandbits
_c_getstate = _random.Random.getstate
_c_setstate = _random.Random.setstate
_JUMP_WORDS = 1 << 16

REDRAW_LIMIT = 1 << 24
"""The most words a restore redraws (about 0.1 s); beyond it states hold the generator."""

_PACKED = struct.Struct("<625I")  # the Mersenne Twister's 624 words and its index
_PACKED_LENGTH = 4 * -(-_PACKED.size // 3)  # base64 characters

Mark = tuple[int, tuple[int, ...] | None]
"""A generator position: the words drawn, and its internal state when beyond the limit."""

MARK_FIELDS: dict[str, FieldSpec] = {"draws": Int(0), "generator": (str, type(None))}
"""The state fields that `mark_fields` writes, for a stage's ``_state_fields``."""

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

    @classmethod
    def from_mark(cls, seed: Seed, mark: Mark, gauss_next: float | None = None) -> CountingRandom:
        """The generator ``random.Random(seed)`` at `mark` (from `mark` or `read_mark`)."""
        draws, internal = mark
        if internal is None:
            return cls.at(seed, draws, gauss_next)
        rng = cls(seed)
        _c_setstate(rng, internal)
        rng.draws = draws
        rng.gauss_next = gauss_next
        return rng

    def mark(self) -> Mark:
        """This generator's position; its internal state is taken only beyond the limit."""
        draws = self.draws
        return draws, (None if draws <= REDRAW_LIMIT else _c_getstate(self))

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


def mark_fields(mark: Mark) -> State:
    """``{"draws", "generator"}``: `mark` as plain data (the generator None or packed)."""
    draws, internal = mark
    packed = None if internal is None else base64.b64encode(_PACKED.pack(*internal)).decode()
    return {"draws": draws, "generator": packed}


def read_mark(stage: Stage[Any], draws: int, generator: str | None, field: str = "'draws'") -> Mark:
    """The `Mark` stored by `mark_fields`, checked: a StateMismatchError if it is damaged.

    `field` names the count of words in messages (a stage may derive it from another).
    """
    if generator is None:
        if draws > REDRAW_LIMIT:
            raise stage.mismatch(
                f"{field} is {draws} words, beyond {REDRAW_LIMIT}, but the state holds no "
                "'generator' (states record the generator itself beyond that): it is damaged"
            )
        return draws, None
    try:
        if len(generator) != _PACKED_LENGTH:
            raise ValueError(f"{len(generator)} characters, expected {_PACKED_LENGTH}")
        internal = _PACKED.unpack(base64.b64decode(generator, validate=True))
        if internal[-1] > 624:
            raise ValueError(f"index {internal[-1]} > 624")
    except (ValueError, binascii.Error, struct.error) as error:
        raise stage.mismatch(f"'generator' is not a packed generator state: {error}") from None
    return draws, internal


def adopt_seed(stage: Stage[Any], own: Seed, drawn: bool, saved: Seed) -> Seed:
    """The seed a stage continues with after a restore from a state holding `saved`.

    A stage built with ``seed=None`` takes the checkpoint's seed (it was drawn at random);
    a stage built with an explicit seed accepts only a checkpoint taken with that seed.
    """
    if saved == own or drawn:
        return saved
    raise stage.mismatch(f"the checkpoint was taken with seed {saved!r}, this stage has {own!r}")
