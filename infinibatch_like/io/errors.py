"""The errors of reading and writing chunks: each names the chunk (file or object)."""

from __future__ import annotations


class ChunkError(Exception):
    """Base of this package's reading and writing errors; the message names the chunk."""


class ChunkNotFoundError(ChunkError, FileNotFoundError):
    """The chunk (a file or object) does not exist, or a pattern matches nothing."""


class ChunkAccessError(ChunkError, PermissionError):
    """The store refused access to the chunk (missing or wrong credentials, no permission)."""


class ChunkReadError(ChunkError, OSError):
    """Reading or writing the chunk failed: a non-transient storage error, a transient one
    that outlasted every try of the retry policy, or a chunk that changed while it was read."""


class ChunkFormatError(ChunkError, ValueError):
    """The chunk's content is not what its name says: corrupt or truncated compressed data,
    a line that is not JSON, a record file that is truncated or not a record file."""
