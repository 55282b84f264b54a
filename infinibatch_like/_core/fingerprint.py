"""Short, stable fingerprints of item lists, for the stream-deciding arguments in states.

A state records its stage's arguments (contract C10) so that a state is refused by a
pipeline built over another list. Lists are not stored: a fingerprint is the length and
a 64-bit hash of a stable encoding of the items (str, bytes, numbers, None and paths by
value; a tuple, named tuples included, or a list by its length and first 8 elements,
two levels deep; any other item by its type only, since its ``repr`` may hold a memory
address). It is computed once, about 0.15 s for 10**6 file names; longer lists are
hashed at a stride, at most 2**20 items (2**14 where the items are tuples or lists, e.g.
in-memory token lists).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

_BY_VALUE = (str, bytes, int, float, bool, type(None))
_MOST_HASHED = 1 << 20
_MOST_NESTED = 1 << 14
_NESTED_HEAD = 8
"""A tuple or list item is encoded by its length and its first elements only, so that the
cost stays bounded for in-memory data (e.g. a million token lists)."""
_NESTED_DEPTH = 2


def items_fingerprint(items: Sequence[Any]) -> str:
    """``"<length> items #<hash>"``, equal for equal lists on every machine and run."""
    if isinstance(items, range):
        return repr(items)
    nested = len(items) > 0 and isinstance(items[0], (tuple, list))
    stride = max(1, len(items) // (_MOST_NESTED if nested else _MOST_HASHED))
    hashed = items if stride == 1 else items[::stride]
    digest = hashlib.blake2b(digest_size=8)
    digest.update("\x1f".join(map(_encoded, hashed)).encode("utf-8", "surrogatepass"))
    return f"{len(items)} items #{digest.hexdigest()}"


def described(value: object) -> str | None:
    """An optional callable argument as plain data: None, or ``"callable"``."""
    return None if value is None else "callable"


def _encoded(item: Any, depth: int = 0) -> str:
    kind = type(item)
    if kind is str:
        return item  # type: ignore[no-any-return]
    if kind in _BY_VALUE or isinstance(item, PurePath):
        return repr(item)
    if isinstance(item, tuple) or kind is list:  # named tuples (chunk references) too
        if depth >= _NESTED_DEPTH:
            return f"({len(item)})"
        head = item[:_NESTED_HEAD]
        return f"({len(item)}:" + ",".join(_encoded(part, depth + 1) for part in head) + ")"
    return f"<{kind.__module__}.{kind.__qualname__}>"
