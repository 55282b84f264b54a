"""Preparing data: cut raw files into indexed chunks, check them, and size epochs.

The command line is ``python -m infinibatch_like chunk | verify | inspect``; the same
work from Python is `chunk_corpus`, `verify_chunks` and `load_index`.

Modules:

- `cli`: the ``chunk``, ``verify`` and ``inspect`` commands (the inspection itself is
  `infinibatch_like.checkpoint.inspect`).
- `plan`, `job`, `writer`, `_files`: planning and running a chunking job.
- `checks`: checking lines as they are read (UTF-8, JSON).
- `index`: the chunk index and its epoch arithmetic; `balancing`: shards of equal counts.
- `verify`: chunks read back and compared with their index.
- `progress`: progress bars for long passes; `_refs`: chunk references.
"""

from .index import ChunkEntry, ChunkIndex, ChunkIndexError, load_index, read_index
from .job import chunk_corpus
from .verify import Problem, verify_chunks

__all__ = [
    "ChunkEntry",
    "ChunkIndex",
    "ChunkIndexError",
    "Problem",
    "chunk_corpus",
    "load_index",
    "read_index",
    "verify_chunks",
]
