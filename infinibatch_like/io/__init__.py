"""Reading and writing chunks where they live: local disks and object stores (through
fsspec), compressed or not, with retries of transient failures.

`list_chunks` finds the chunk files; `read_lines`, `read_jsonl`, `read_records` and
`read_webdataset` (tar shards) read one, and each serves as ``read_chunk_fn`` of
`chunked_dataset_iterator`; `list_parquet_chunks` and `list_arrow_chunks` give a chunk per
row group (record batch) of columnar files, read by `read_parquet` and `read_arrow`.
`open_chunk` and `open_output` are the streams under them; `write_records` packs small
files into a record chunk and `write_webdataset` samples into a tar shard. Every error
names the chunk. Every function that reaches a store takes ``storage_options=`` (the fsspec
file system's options) and ``retry=`` (a `RetryPolicy`), made into one `Store` there and
passed inward. `FetchOptions` sets how remote objects are fetched (concurrent byte ranges,
a local cache shared by the processes of a host); `storage_counts` tells what was fetched.

Modules:

- `streams`: `open_chunk`, a chunk's decompressed bytes, local or remote.
- `readers`: `read_lines` and `read_jsonl`; `_lines`: the line splitter under them.
- `records`: binary record files (many small blobs in one chunk).
- `webdataset`: WebDataset tar shards.
- `parquet`, `arrow_ipc`, `_tables`: columnar files, one chunk per row group or batch.
- `listing`, `_walk`: finding chunk files (globs, recursive walks).
- `output`: `open_output`, writing a chunk atomically, locally or to a store.
- `errors`: the chunk errors, each naming the chunk.
- `retry`: retries of transient storage failures.
- `_store`: `Store`, a store's options, retry and fetch policies, built once at the edge.
- `fetch_options`, `_ranges`, `_cancellable`, `_cache`: how remote objects are fetched
  (ranges in flight, cancelled on close; the local cache).
- `_storage`, `_compression`, `_zstd`, `_counts`: filesystems, decompressors, fetch counts.
"""

from .._core.protocol import SkippableIterator
from ._counts import reset_storage_counts, storage_counts
from ._tables import TableChunk
from .arrow_ipc import list_arrow_chunks, read_arrow
from .errors import (
    ChunkAccessError,
    ChunkError,
    ChunkFormatError,
    ChunkNotFoundError,
    ChunkReadError,
)
from .fetch_options import FetchOptions
from .listing import list_chunks
from .output import open_output
from .parquet import list_parquet_chunks, read_parquet
from .readers import read_jsonl, read_lines
from .records import Record, read_records, write_records
from .retry import DEFAULT_RETRY, RetryPolicy, reset_retry_counts, retry_counts
from .streams import open_chunk
from .webdataset import read_webdataset, write_webdataset

__all__ = [
    "DEFAULT_RETRY",
    "ChunkAccessError",
    "ChunkError",
    "ChunkFormatError",
    "ChunkNotFoundError",
    "ChunkReadError",
    "FetchOptions",
    "Record",
    "RetryPolicy",
    "SkippableIterator",
    "TableChunk",
    "list_arrow_chunks",
    "list_chunks",
    "list_parquet_chunks",
    "open_chunk",
    "open_output",
    "read_arrow",
    "read_jsonl",
    "read_lines",
    "read_parquet",
    "read_records",
    "read_webdataset",
    "reset_retry_counts",
    "reset_storage_counts",
    "retry_counts",
    "storage_counts",
    "write_records",
    "write_webdataset",
]
