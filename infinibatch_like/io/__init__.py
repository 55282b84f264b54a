"""Reading and writing chunks where they live: local disks and object stores (through
fsspec), compressed or not, with retries of transient failures.

`list_chunks` finds the chunk files; `read_lines`, `read_jsonl` and `read_records` read one,
and each serves as ``read_chunk_fn`` of `chunked_dataset_iterator`; `open_chunk` and
`open_output` are the streams under them; `write_records` packs small files into a record
chunk. Every error names the chunk. `FetchOptions` sets how remote objects are fetched
(concurrent byte ranges, a local cache shared by the processes of a host);
`storage_counts` tells what was fetched.
"""

from ._counts import reset_storage_counts, storage_counts
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
from .readers import read_jsonl, read_lines
from .records import Record, read_records, write_records
from .retry import DEFAULT_RETRY, RetryPolicy, reset_retry_counts, retry_counts
from .streams import open_chunk

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
    "list_chunks",
    "open_chunk",
    "open_output",
    "read_jsonl",
    "read_lines",
    "read_records",
    "reset_retry_counts",
    "reset_storage_counts",
    "retry_counts",
    "storage_counts",
    "write_records",
]
