"""Preparing data: cut raw files into indexed chunks, check them, and size epochs.

The command line is ``python -m infinibatch_like chunk | verify | inspect``; the same
work from Python is `chunk_corpus`, `verify_chunks` and `load_index`.
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
