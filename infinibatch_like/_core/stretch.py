"""Counted stretches of an iterator, for statistics' probes (`infinibatch_like._core.probe`).

A stretch yields the next n items of an iterator (fewer if it ends) at C speed: it is
``islice(pull, n)``, the only layer a probe adds per item between two timed pulls. How
many items it has yielded so far must stay readable (item counts are exact, also in the
middle of a stretch and at the stream's end), and `islice` does not tell it in Python.
CPython keeps it in a field of the object, which `yielded` reads with `ctypes`, at the
offset found (and checked on sample islices) when this module is imported. Where that
layout is not found, a stretch counts with one more layer (``compress`` over
``repeat(True, n + 1)``, whose selectors left tell the count): a few nanoseconds more
per item.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterator
from itertools import compress, islice, repeat
from operator import length_hint
from typing import Any


def _count_offset() -> int | None:
    """The offset of an ``islice`` object's count of items yielded, where the layout of
    CPython (source, next index, stop, step, count) holds on sample islices; else None."""
    if sys.implementation.name != "cpython":
        return None
    word = ctypes.sizeof(ctypes.c_ssize_t)
    samples = []
    for stop, taken in ((7, 3), (11, 10), (5, 0)):
        source = iter(range(20))
        sliced = islice(source, stop)
        for _ in range(taken):
            next(sliced)
        samples.append((sliced, source, [taken, stop, 1, taken]))
    for offset in range(0, islice.__basicsize__ - 5 * word + 1, word):
        if all(
            ctypes.c_size_t.from_address(id(sliced) + offset).value == id(source)
            and [_word(sliced, offset + index * word) for index in (1, 2, 3, 4)] == fields
            for sliced, source, fields in samples
        ):
            return offset + 4 * word
    return None


def _word(obj: object, offset: int) -> int:
    return int(ctypes.c_ssize_t.from_address(id(obj) + offset).value)


_OFFSET = _count_offset()


class _Counted(islice):  # type: ignore[type-arg]
    """A stretch that counts with selectors (where the islice count cannot be read)."""

    __slots__ = ("length", "selectors")
    length: int
    selectors: Iterator[bool]


def _counted_stretch(pull: Iterator[Any], length: int) -> Iterator[Any]:
    selectors = repeat(True, length + 1)  # one more: compress takes its item first
    counted = _Counted(compress(pull, selectors), length)
    counted.length, counted.selectors = length, selectors
    return counted


stretch: Callable[[Iterator[Any], int], Iterator[Any]] = (
    islice if _OFFSET is not None else _counted_stretch
)
"""``stretch(pull, n)``: the next n items of `pull`, as one C-level iterator (`yielded`
tells how many it has yielded)."""


def yielded(items: Iterator[Any]) -> int:
    """How many items a `stretch` has yielded so far (exact, at any time)."""
    if isinstance(items, _Counted):
        return items.length + 1 - length_hint(items.selectors)
    assert _OFFSET is not None
    return _word(items, _OFFSET)
