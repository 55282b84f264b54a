"""`open_output`: write a chunk (or any file) locally or to a store, compressed, atomically."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, cast

from ._compression import codec_for
from ._store import StorageOptions, Store, is_url, protocol_of
from .retry import RetryPolicy


@contextlib.contextmanager
def open_output(
    ref: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    compresslevel: int | None = None,
    retry: RetryPolicy | None = None,
) -> Iterator[BinaryIO]:
    """A binary file to write `ref` with, compressed from its suffix, that appears whole or
    not at all; use it as a context manager.

    The file exists at `ref` only once the ``with`` block ends without an exception. A local
    file is written to a temporary file in the same directory (created if needed), flushed
    to disk (``fsync``), renamed over `ref`, and the directory is synced; a URL is staged in
    a local temporary file and stored in one upload (a single PUT, or a multipart upload
    that only appears when completed) when the block ends, retried on transient failures.
    On an exception nothing is left behind, not even when the disk is full. A `ref` that
    exists and is not a regular file (a device such as ``/dev/null``, a FIFO, a directory,
    or a link to one) is refused before anything is written, rather than replaced.

    Args:
        ref: a local path or URL. Compression from its suffix: ``.gz`` (python-isal or
            zlib-ng if installed; no time stamp in the header, so equal data gives equal
            bytes), ``.zst`` (``zstd`` extra), ``.bz2``, ``.xz``, else none.
        storage_options: options of the fsspec file system of a URL.
        compresslevel: the compression level (None: the codec's default; gzip's default is
            that of the implementation in use, 6 for the standard library).
        retry: the retry policy of the upload (`DEFAULT_RETRY` if None).

    Raises:
        ValueError: for an unsupported compression suffix (e.g. ``.lz4``), before writing.
        FileExistsError: if a local `ref` exists and is not a regular file, naming it.
        OSError: from the file system (a full disk, a denied permission), its
            ``filename`` set to `ref` when the system did not name a file.
        ChunkAccessError, ChunkReadError: when the upload is refused or keeps failing.
    """
    with output_in(os.fspath(ref), Store.of(storage_options, retry), compresslevel) as file:
        yield file


@contextlib.contextmanager
def output_in(name: str, store: Store, compresslevel: int | None = None) -> Iterator[BinaryIO]:
    """`open_output` of `name` in `store`."""
    codec = codec_for(name)
    if is_url(name) and protocol_of(name) != "file":
        target: _Target = _RemoteTarget(name, store)
    else:
        target = _LocalTarget(name.split("://", 1)[1] if is_url(name) else name)
    try:
        writer = codec.writer(target.file, compresslevel) if codec is not None else target.file
        yield cast(BinaryIO, writer)
        if codec is not None:
            writer.close()  # writes the compressed stream's end; `target.file` stays open
        target.commit()
    except BaseException as error:
        target.abort()
        if isinstance(error, OSError) and error.errno is not None and error.filename is None:
            error.filename = name  # e.g. a full disk: say which file could not be written
        raise


class _Target:
    """Where the bytes go until `commit` puts them in place (or `abort` drops them)."""

    file: BinaryIO

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class _LocalTarget(_Target):
    def __init__(self, path: str) -> None:
        self._path = path
        _refuse_special_file(path)
        self._directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(self._directory, exist_ok=True)
        self._temporary = os.path.join(
            self._directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp"
        )
        # os.open applies the umask to 0o666, as open() does (mkstemp would give 0o600)
        descriptor = os.open(self._temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        self.file = os.fdopen(descriptor, "wb", buffering=1 << 20)

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        _refuse_special_file(self._path)  # again: one may have appeared while writing
        os.replace(self._temporary, self._path)
        _sync_directory(self._directory)

    def abort(self) -> None:
        _discard(self.file, self._temporary)


def _discard(file: BinaryIO, temporary: str) -> None:
    """Close `file` and remove `temporary`, its path. Closing flushes the buffer, which
    fails again on a full disk: that error is dropped (the one being handled says it)."""
    try:
        file.close()  # closes the descriptor even when the flush fails
    except OSError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _refuse_special_file(path: str) -> None:
    """Raise FileExistsError if `path` (or what a link at it points to) exists and is not
    a regular file: renaming over it would replace a device, a FIFO or a directory."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # nothing there, or a dangling link: the rename replaces it
        return
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _KINDS if test(mode)), f"of mode {mode:o}")
    raise FileExistsError(
        f"open_output: {path}: exists and is {kind}, not a regular file; refusing to "
        "replace it (write to a regular file's path)"
    )


def _sync_directory(directory: str) -> None:
    """fsync `directory`, so that a rename in it survives a crash (where the OS allows)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # e.g. Windows, which cannot open directories
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class _RemoteTarget(_Target):
    def __init__(self, ref: str, store: Store) -> None:
        self._ref, self._store = ref, store
        self._fs, self._path = store.filesystem(ref)
        self.file: Any = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed by commit/abort
            prefix="infinibatch_like-upload-", delete=False
        )

    def commit(self) -> None:
        self.file.close()
        try:
            self._store.call(
                lambda: self._fs.put_file(self.file.name, self._path), self._ref, "writing"
            )
        finally:
            os.unlink(self.file.name)

    def abort(self) -> None:
        _discard(self.file, self.file.name)
