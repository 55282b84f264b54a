"""The local cache of remote objects, shared by the processes of one host.

An object is a file ``chunk-<hash>`` in the cache directory, the hash of its URL, size and
ETag: a changed object has another name, and is never served stale. A file appears whole
or not at all: it is written as ``chunk-<hash>.tmp.<pid>.<token>`` and renamed when its
last byte is in, so readers (which take no lock) never see a partial file. The least
recently used files (by modification time, set again at each hit) are removed to keep the
finished files under the size limit, under an exclusive ``flock`` of ``.chunk-cache.lock``,
which also removes the temporary files of writers that died (a SIGKILL in the middle) or
stalled for `STALE_S`. A reader that holds an evicted file open reads it to its end.
Writing is best effort: a full disk or a read-only directory never fails a read (a
warning is logged once per cache directory and the object is read from the store).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from typing import BinaryIO

from ._counts import count

PREFIX = "chunk-"
TMP = ".tmp."
LOCK = ".chunk-cache.lock"
STALE_S = 3600.0
"""A temporary file not written to for this long is taken for a dead writer's."""
logger = logging.getLogger("infinibatch_like.io")
_warned: set[str] = set()


class ChunkCache:
    """The cache in `directory`, holding at most `max_bytes` bytes of finished objects."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        self.directory, self.max_bytes = directory, max_bytes

    def path(self, ref: str, version: str, size: int) -> str:
        """Where the object `ref` with this `version` (ETag) and `size` is kept."""
        digest = hashlib.sha256(f"{ref}\0{version}\0{size}".encode()).hexdigest()[:40]
        return os.path.join(self.directory, PREFIX + digest)

    def open(self, path: str, size: int) -> BinaryIO | None:
        """The cached file at `path` (unbuffered, marked as used now), or None if it is not
        there."""
        try:
            file = open(path, "rb", buffering=0)  # noqa: SIM115 - the caller's stream
        except OSError:
            count("cache_misses")
            return None
        if os.fstat(file.fileno()).st_size != size:  # cannot happen through this module
            file.close()
            count("cache_misses")
            return None
        with contextlib.suppress(OSError):
            os.utime(path)
        count("cache_hits")
        return file

    def writer(self, path: str, size: int) -> CacheWriter | None:
        """A writer of the object of `size` bytes to be kept at `path`, room made for it;
        None if it cannot be cached (larger than the cache, or the directory unusable)."""
        if size > self.max_bytes:
            return None
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.evict(size)
            temporary = f"{path}{TMP}{os.getpid()}.{secrets.token_hex(4)}"
            return CacheWriter(self, open(temporary, "xb"), temporary, path, size)
        except OSError as error:
            self.warn(error)
            return None

    def evict(self, room: int) -> None:
        """Remove dead writers' temporary files, and the least recently used objects until
        those left and `room` more bytes fit in the limit."""
        with self._locked():
            now = time.time()
            entries: list[tuple[float, int, str]] = []
            for item in os.scandir(self.directory):
                if not item.name.startswith(PREFIX):
                    continue
                try:
                    stat = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if TMP not in item.name:
                    entries.append((stat.st_mtime, stat.st_size, item.path))
                elif _abandoned(item.name, stat.st_mtime, now):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(item.path)
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total + room <= self.max_bytes:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    count("cache_evicted")
                total -= size

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        import fcntl

        descriptor = os.open(os.path.join(self.directory, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)  # releases the lock

    def warn(self, error: OSError) -> None:
        if self.directory not in _warned:
            _warned.add(self.directory)
            logger.warning(
                "the chunk cache in %s cannot be written (%s: %s); objects are read from "
                "the store without it",
                self.directory,
                type(error).__name__,
                error,
            )


def _abandoned(name: str, mtime: float, now: float) -> bool:
    """Whether the temporary file `name` is a dead or stalled writer's."""
    if now - mtime > STALE_S:
        return True
    try:
        pid = int(name.split(TMP, 1)[1].split(".", 1)[0])
    except ValueError:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


class CacheWriter:
    """Writes one object's bytes to its temporary file; `commit` renames it into place."""

    def __init__(
        self, cache: ChunkCache, file: BinaryIO, temporary: str, path: str, size: int
    ) -> None:
        self._cache, self._file = cache, file
        self._temporary, self._path, self._size = temporary, path, size
        self._written = 0

    def write(self, data: bytes) -> None:
        if self._file.closed:
            return
        try:
            self._file.write(data)
            self._written += len(data)
        except OSError as error:  # e.g. a full disk: read on without caching
            self._cache.warn(error)
            self.discard()

    def commit(self) -> None:
        """Put the file in place if it holds every byte (else drop it), then make room."""
        if self._file.closed:
            return
        try:
            self._file.close()
            if self._written != self._size:
                raise OSError(f"{self._written} bytes written of {self._size}")
            os.replace(self._temporary, self._path)
            self._cache.evict(0)
        except OSError as error:
            self._cache.warn(error)
            self.discard()

    def discard(self) -> None:
        """Drop the temporary file (nothing happens after `commit`)."""
        if not self._file.closed:
            self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._temporary)
