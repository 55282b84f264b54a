"""Chunk references: local paths and URLs joined, split and sized the same way everywhere."""

from __future__ import annotations

import os
from typing import Any

from ..io._storage import filesystem, is_url

__all__ = ["base_name", "is_url", "join_ref", "stored_size"]


def join_ref(base: str, name: str) -> str:
    """`name` inside the directory or URL `base`."""
    if is_url(base):
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def base_name(ref: str) -> str:
    """The last component of a path or URL."""
    return ref.rstrip("/").rsplit("/", 1)[-1] if is_url(ref) else os.path.basename(ref)


def stored_size(ref: str, *, storage_options: dict[str, Any] | None = None) -> int:
    """The size in bytes of the file or object `ref` as stored (compressed).

    Raises:
        FileNotFoundError: if it does not exist.
    """
    if not is_url(ref):
        return os.path.getsize(ref)
    fs, path = filesystem(ref, storage_options)
    return int(fs.size(path))
