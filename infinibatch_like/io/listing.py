"""`list_chunks`: the sorted chunk references matching a local or URL glob."""

from __future__ import annotations

import glob
import os

from ._storage import StorageOptions, filesystem, is_url
from .errors import ChunkNotFoundError
from .retry import RetryPolicy, call_with_retries


def list_chunks(
    pattern: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> list[str]:
    """The files matching a glob, sorted: the ``chunk_refs`` of a chunked data set.

    Local patterns use `glob.glob` (``**`` matches directories recursively, ``~`` is
    expanded); URL patterns (``s3://``, ``gs://``, ``az://``, ``http(s)://``, ``memory://``,
    ``file://``, any fsspec protocol) use the fsspec file system's ``glob``, freshly (its
    listing cache is cleared first). Directories are left out. URLs keep their protocol, so
    that they can be opened again (``s3://bucket/key``). The order is that of Python's
    string sort, the same on every machine.

    Args:
        pattern: the glob, e.g. ``"data/*.txt.gz"`` or ``"s3://bucket/corpus/*.jsonl.zst"``.
        storage_options: options of the fsspec file system of a URL (see `open_chunk`).
        retry: the retry policy of transient listing failures (`DEFAULT_RETRY` if None).

    Raises:
        ChunkNotFoundError: if no file matches, naming the pattern.
        ChunkAccessError, ChunkReadError: if the store refuses or keeps failing the listing.
        MissingExtraError: naming the extra to install for a URL (``remote``).
    """
    text = os.fspath(pattern)
    if is_url(text):
        fs, path = filesystem(text, storage_options)

        def find() -> list[str]:
            fs.invalidate_cache()
            found = fs.glob(path, detail=True)
            return [fs.unstrip_protocol(p) for p, info in found.items() if info["type"] == "file"]

        refs = call_with_retries(find, text, "listing", retry)
    else:
        matches = glob.glob(os.path.expanduser(text), recursive=True)
        refs = [match for match in matches if os.path.isfile(match)]
    if not refs:
        raise ChunkNotFoundError(f"list_chunks: no file matches the pattern {text!r}")
    return sorted(refs)
