"""`list_chunks`: the sorted chunk references matching a local or URL glob."""

from __future__ import annotations

import glob
import os
from typing import Any

from ._store import StorageOptions, Store, is_url
from ._walk import has_recursive_part, recursive_glob
from .errors import ChunkNotFoundError
from .retry import RetryPolicy


def list_chunks(
    pattern: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> list[str]:
    """The files matching a glob, sorted: the ``chunk_refs`` of a chunked data set.

    Local patterns have `glob.glob`'s meaning (``**`` matches directories recursively,
    following symbolic links but entering each directory once, so that a link loop lists
    each file once; ``~`` is expanded); URL patterns (``s3://``, ``gs://``, ``az://``,
    ``http(s)://``, ``memory://``, ``file://``, any fsspec protocol) use the fsspec file
    system's ``glob``, freshly (its listing cache is cleared first). Directories are left
    out. URLs keep their protocol, so that they can be opened again (``s3://bucket/key``).
    The order is that of Python's string sort, the same on every machine.

    Args:
        pattern: the glob, e.g. ``"data/*.txt.gz"`` or ``"s3://bucket/corpus/*.jsonl.zst"``.
        storage_options: options of the fsspec file system of a URL (see `open_chunk`).
        retry: the retry policy of transient listing failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkNotFoundError: if no file matches, naming the pattern (and saying so where it
            names a directory, a file whose name holds glob characters, or a bucket that
            does not exist).
        ChunkAccessError, ChunkReadError: if the store refuses or keeps failing the listing.
        MissingExtraError: naming the extra to install for a URL (``remote``).
    """
    return sorted(find_files(os.fspath(pattern), Store.of(storage_options, retry)))


def find_files(text: str, store: Store) -> dict[str, dict[str, Any]]:
    """`list_chunks`'s files (in no order) matching the glob `text` in `store`, each with
    what the listing told of it: the store's details of an object (``size``, ``ETag``,
    ...), nothing for a local file."""
    if is_url(text):
        fs, path = store.filesystem(text)

        def find() -> dict[str, dict[str, Any]]:
            fs.invalidate_cache()
            found = fs.glob(path, detail=True)
            return {
                fs.unstrip_protocol(p): info for p, info in found.items() if info["type"] == "file"
            }

        files = store.call(find, text, "listing")
    else:
        expanded = os.path.expanduser(text)
        if has_recursive_part(expanded):
            matches = recursive_glob(expanded)
        else:
            matches = [m for m in glob.glob(expanded, recursive=True) if os.path.isfile(m)]
        files = {match: {} for match in matches}
    if not files:
        raise ChunkNotFoundError(
            f"list_chunks: no file matches the pattern {text!r}{_why(text, store)}"
        )
    return files


def _why(pattern: str, store: Store) -> str:
    """Why `pattern` matches no file, where a cause other than no such name is found."""
    bucket = store.missing_bucket(pattern)
    if bucket is not None:
        return f": {bucket}"
    if is_url(pattern):
        fs, path = store.filesystem(pattern)
        try:
            is_dir, exists = fs.isdir(path), glob.has_magic(path) and fs.exists(path)
        except Exception:  # the store does not say: the error stands without a reason
            return ""
    else:
        path = os.path.expanduser(pattern)
        is_dir, exists = os.path.isdir(path), glob.has_magic(path) and os.path.isfile(path)
    if is_dir:
        base = pattern.rstrip("/")
        return (
            f": it is a directory: list its files with '{base}/*' (or '{base}/**/*' at any depth)"
        )
    if exists:
        return (
            ": a file has this very name, but it holds glob characters (*, ? or [ ]) and is "
            f"read as a pattern; pass {glob.escape(pattern)!r} to name the file itself"
        )
    return ""
