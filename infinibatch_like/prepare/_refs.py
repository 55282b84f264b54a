"""Chunk references: local paths and URLs joined and split the same way everywhere."""

from __future__ import annotations

import os

from ..io._store import is_url

__all__ = ["base_name", "is_url", "join_ref"]


def join_ref(base: str, name: str) -> str:
    """`name` inside the directory or URL `base`."""
    if is_url(base):
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def base_name(ref: str) -> str:
    """The last component of a path or URL."""
    return ref.rstrip("/").rsplit("/", 1)[-1] if is_url(ref) else os.path.basename(ref)
