"""Checking chunks against their index: every chunk read back and compared."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..io._store import StorageOptions, Store
from ..io.readers import json_values_in, lines_in
from ..io.records import records_in
from ..io.retry import RetryPolicy
from ..io.streams import open_stream
from ..io.webdataset import Samples
from ._refs import join_ref
from .index import INDEX_NAME, ChunkEntry, ChunkIndex, chunk_names, missing_and_unlisted

READERS: dict[str, Callable[[str, Store], Iterable[Any]]] = {
    "lines": lines_in,
    "jsonl": json_values_in,
    "files": records_in,
    "wds": Samples,
}
"""The reader of each kind of chunk (`read_lines`, `read_jsonl`, `read_records`,
`read_webdataset`): what a pipeline's ``read_chunk_fn`` would be."""
_BLOCK = 1 << 20


@dataclass(frozen=True)
class Problem:
    """A chunk that does not match the index: its file name and what is wrong."""

    chunk: str
    message: str

    def __str__(self) -> str:
        return f"{self.chunk}: {self.message}"


def verify_chunks(
    index: ChunkIndex,
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> Iterable[tuple[ChunkEntry | None, list[Problem]]]:
    """Check every chunk of `index` (existence, stored size, SHA-256 of the content, item
    count read with the kind's reader); yield each chunk with its problems (none if it is
    sound), then ``(None, problems)`` for chunk files that the index does not list.

    Args:
        index: the index (`load_index`).
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).
    """
    store = Store.of(storage_options, retry)
    present = chunk_names(index.location, store)
    missing, unlisted = missing_and_unlisted(index, present)
    absent = set(missing)
    for chunk in index.chunks:
        if chunk.name in absent:
            yield chunk, [Problem(chunk.name, "missing (listed in the index, no such file)")]
        else:
            yield chunk, _check(index, chunk, store)
    yield (
        None,
        [
            Problem(name, f"not listed in {INDEX_NAME} (left by another or an unfinished job?)")
            for name in unlisted
        ],
    )


def _check(index: ChunkIndex, chunk: ChunkEntry, store: Store) -> list[Problem]:
    ref = join_ref(index.location, chunk.name)
    problems = []
    size = store.size(ref)
    if size != chunk.size:
        problems.append(Problem(chunk.name, f"{size} bytes, the index says {chunk.size}"))
    try:
        digest = hashlib.sha256()
        with open_stream(ref, store) as stream:
            while block := stream.read(_BLOCK):
                digest.update(block)
        items = sum(1 for _ in READERS[index.kind](ref, store))
    except Exception as error:  # a damaged chunk is a finding, whatever the reader raises
        return [*problems, Problem(chunk.name, f"unreadable: {type(error).__name__}: {error}")]
    if digest.hexdigest() != chunk.sha256:
        found = f"content SHA-256 {digest.hexdigest()}, the index says {chunk.sha256}"
        problems.append(Problem(chunk.name, found))
    if items != chunk.items:
        problems.append(Problem(chunk.name, f"{items} items, the index says {chunk.items}"))
    return problems
