"""Checking chunks against their index: every chunk read back and compared."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..io import open_chunk, read_jsonl, read_lines, read_records, read_webdataset
from ._refs import join_ref, stored_size
from .index import INDEX_NAME, ChunkEntry, ChunkIndex, chunk_names, missing_and_unlisted

READERS: dict[str, Callable[..., Iterable[Any]]] = {
    "lines": read_lines,
    "jsonl": read_jsonl,
    "files": read_records,
    "wds": read_webdataset,
}
"""The reader of each kind of chunk: what a pipeline's ``read_chunk_fn`` would be."""
_BLOCK = 1 << 20


@dataclass(frozen=True)
class Problem:
    """A chunk that does not match the index: its file name and what is wrong."""

    chunk: str
    message: str

    def __str__(self) -> str:
        return f"{self.chunk}: {self.message}"


def verify_chunks(
    index: ChunkIndex, *, storage_options: dict[str, Any] | None = None
) -> Iterable[tuple[ChunkEntry | None, list[Problem]]]:
    """Check every chunk of `index` (existence, stored size, SHA-256 of the content, item
    count read with the kind's reader); yield each chunk with its problems (none if it is
    sound), then ``(None, problems)`` for chunk files that the index does not list."""
    present = chunk_names(index.location, storage_options)
    missing, unlisted = missing_and_unlisted(index, present)
    absent = set(missing)
    for chunk in index.chunks:
        if chunk.name in absent:
            yield chunk, [Problem(chunk.name, "missing (listed in the index, no such file)")]
        else:
            yield chunk, _check(index, chunk, storage_options)
    yield (
        None,
        [
            Problem(name, f"not listed in {INDEX_NAME} (left by another or an unfinished job?)")
            for name in unlisted
        ],
    )


def _check(
    index: ChunkIndex, chunk: ChunkEntry, storage_options: dict[str, Any] | None
) -> list[Problem]:
    ref = join_ref(index.location, chunk.name)
    problems = []
    size = stored_size(ref, storage_options=storage_options)
    if size != chunk.size:
        problems.append(Problem(chunk.name, f"{size} bytes, the index says {chunk.size}"))
    try:
        digest = hashlib.sha256()
        with open_chunk(ref, storage_options=storage_options) as stream:
            while block := stream.read(_BLOCK):
                digest.update(block)
        items = sum(1 for _ in READERS[index.kind](ref, storage_options=storage_options))
    except Exception as error:  # a damaged chunk is a finding, whatever the reader raises
        return [*problems, Problem(chunk.name, f"unreadable: {type(error).__name__}: {error}")]
    if digest.hexdigest() != chunk.sha256:
        found = f"content SHA-256 {digest.hexdigest()}, the index says {chunk.sha256}"
        problems.append(Problem(chunk.name, found))
    if items != chunk.items:
        problems.append(Problem(chunk.name, f"{items} items, the index says {chunk.items}"))
    return problems
