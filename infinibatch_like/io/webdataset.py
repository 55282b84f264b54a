"""WebDataset tar shards: consecutive members that share a key make one sample.

The convention: a member's *key* is its path up to the first dot of its base name, its
*extension* the rest (``images/0001.seg.png``: key ``images/0001``, extension
``seg.png``); the members of a sample follow each other in the tar.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, BinaryIO, cast

from .._core.protocol import SkippableIterator
from ._compression import codec_for
from ._store import StorageOptions, Store
from .errors import ChunkError, ChunkFormatError
from .retry import RetryPolicy
from .streams import Ref, open_stream

DECODERS: dict[str, Callable[[bytes], Any]] = {
    "json": json.loads,
    "txt": lambda data: data.decode("utf-8"),
}
"""What ``decode`` can turn members into, by the last part of their extension."""


def split_name(name: str) -> tuple[str, str | None]:
    """(key, extension) of a member's path; the extension is None without a dot."""
    directory, _, base = name.rpartition("/")
    stem, dot, extension = base.partition(".")
    key = f"{directory}/{stem}" if directory else stem
    return key, extension if dot else None


def read_webdataset(
    ref: Ref,
    *,
    decode: Collection[str] = (),
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> Iterator[dict[str, Any]]:
    """The samples of a WebDataset tar shard, in order; usable as ``read_chunk_fn``.

    Each sample is a dict ``{"__key__": key, extension: data, ...}`` of the consecutive
    members that share a key, their data as bytes (``{"__key__": "0001", "jpg": b"...",
    "json": b"..."}``); directory entries are passed over. With ``decode=("json",
    "txt")``, members whose extension ends in ``.json`` are parsed and those in ``.txt``
    decoded as UTF-8. The shard is streamed, never read whole.

    A bad sample is one with a member that is not a regular file (a link, a device), a
    member without an extension, an extension twice, a key already seen earlier in the
    shard (members not kept together), or a member that does not decode: ``next()``
    raises a ChunkFormatError naming the shard, the sample and the member, and the next
    ``next()`` goes on with the next sample, so that ``on_error=SkipPolicy(...)`` of
    `chunked_dataset_iterator` skips just that sample, in its ledger. A truncated or
    damaged shard raises once, for the sample being read, and ends there.

    Checkpoint:
        The reader holds no state: `SelectManyIterator` records the shard and the samples
        taken (bad ones included). A restore reads the shard again from its start up to
        the sample (a compressed stream cannot be entered elsewhere), passing over the
        earlier samples without keeping or decoding their data.

    Args:
        ref: a ``.tar``, ``.tar.gz`` or ``.tar.zst`` shard: a local path or a URL.
        decode: extensions to decode: ``"json"``, ``"txt"``.
        storage_options: options of the fsspec file system of a URL.
        retry: the retry policy of transient remote failures (`DEFAULT_RETRY` if None).

    Raises:
        ValueError: for an unknown `decode` extension or an unsupported compression.
        ChunkFormatError: for a bad sample or a damaged shard, naming it (as above).
        ChunkError: as `open_chunk`, naming the shard.
    """
    name = os.fspath(ref)
    unknown = sorted(set(decode) - set(DECODERS))
    if isinstance(decode, str) or unknown:
        raise ValueError(
            f"read_webdataset: decode must be a collection of {sorted(DECODERS)}, got {decode!r}"
        )
    codec_for(name)  # a bad suffix or a missing extra is reported now, not on the first sample
    return Samples(name, Store.of(storage_options, retry), frozenset(decode))


class Samples(SkippableIterator[dict[str, Any]]):
    """The samples of one shard (see `read_webdataset`); a bad sample raises and the next
    ``next()`` goes on; ``skip`` groups members without keeping their data."""

    def __init__(self, ref: str, store: Store, decode: frozenset[str] = frozenset()) -> None:
        self._ref, self._store, self._decode = ref, store, decode
        self._stream: Any = None
        self._counted: _Counted
        self._tar: tarfile.TarFile | None = None
        self._pending: tarfile.TarInfo | None = None  # the next sample's first member
        self._seen: set[str] = set()
        self._ended = False
        self._last = "the start"

    def __next__(self) -> dict[str, Any]:
        return self._sample(load=True)

    def skip(self, count: int) -> int:
        for skipped in range(count):
            try:
                self._sample(load=False)
            except StopIteration:
                return skipped
            except ChunkFormatError:
                continue  # a bad sample is a position too
        return count

    def _sample(self, load: bool) -> dict[str, Any]:
        first = self._pending if self._pending is not None else self._member()
        if first is None:
            self._close()
            raise StopIteration
        key, _ = split_name(first.name)
        sample: dict[str, Any] = {"__key__": key}
        problem = ""
        if key in self._seen:
            problem = f"its key {key!r} (member {first.name!r}) was seen earlier in the shard"
        self._seen.add(key)
        member: tarfile.TarInfo | None = first
        while member is not None and split_name(member.name)[0] == key:
            problem = problem or self._add(sample, member, load)
            member = self._member()
        self._pending = member
        if problem:
            raise ChunkFormatError(f"{self._ref}: bad sample {key!r}: {problem}")
        return sample

    def _add(self, sample: dict[str, Any], member: tarfile.TarInfo, load: bool) -> str:
        """Put `member`'s data into `sample`; what is wrong with it ("" if nothing)."""
        _, extension = split_name(member.name)
        if not member.isreg():
            return f"the member {member.name!r} is not a regular file (tar type {member.type!r})"
        if extension is None:
            return f"the member {member.name!r} has no extension"
        if extension in sample:
            return f"the member {member.name!r} repeats the extension {extension!r}"
        if not load:
            sample[extension] = None
            return ""
        data = self._read(member)
        decoder = extension.rsplit(".", 1)[-1]
        if decoder in self._decode:
            try:
                sample[extension] = DECODERS[decoder](data)
            except ValueError as error:  # UnicodeDecodeError and JSONDecodeError too
                return f"the member {member.name!r} does not decode as {decoder}: {error}"
        else:
            sample[extension] = data
        return ""

    def _member(self) -> tarfile.TarInfo | None:
        """The next member that is not a directory, or None at the end of the shard."""
        if self._ended:
            return None
        while True:
            try:
                if self._tar is None:
                    self._stream = open_stream(self._ref, self._store)
                    self._counted = _Counted(self._stream)
                    self._tar = tarfile.open(fileobj=cast(Any, self._counted), mode="r|")  # noqa: SIM115
                member = self._tar.next()
            except (tarfile.TarError, ChunkFormatError, EOFError) as error:
                raise self._damaged(error) from error
            except ChunkError:
                self._close()
                raise
            if member is None:
                self._check_end_marker()
                self._close()
                return None
            self._last = f"the member {member.name!r}"
            if not member.isdir():
                return member

    def _check_end_marker(self) -> None:
        """Raise the damage error if the shard ends without a whole end-of-archive block
        (tarfile ends silently where a shard is cut at a member's header)."""
        assert self._tar is not None
        try:
            while self._counted.read(1 << 16):  # the padding after the end marker
                pass
        except (ChunkFormatError, EOFError) as error:
            raise self._damaged(error) from error
        if self._counted.count < self._tar.offset + tarfile.BLOCKSIZE:
            raise self._damaged(
                EOFError(f"it ends at byte {self._counted.count} without the end-of-archive block")
            )

    def _read(self, member: tarfile.TarInfo) -> bytes:
        assert self._tar is not None
        try:
            data = self._tar.extractfile(member).read()  # type: ignore[union-attr]
        except (tarfile.TarError, ChunkFormatError, EOFError) as error:
            raise self._damaged(error) from error
        return data

    def _damaged(self, error: BaseException) -> ChunkFormatError:
        """The error that ends a truncated or damaged shard (closed: the next call ends)."""
        self._close()
        self._pending = None
        return ChunkFormatError(
            f"{self._ref}: truncated or damaged tar shard, at {self._last}: "
            f"{type(error).__name__}: {error}"
        )

    def __del__(self) -> None:  # a pipeline may drop a shard half read: close its file
        self._close()

    def _close(self) -> None:
        self._ended = True
        tar, stream, self._tar, self._stream = self._tar, self._stream, None, None
        if tar is not None:
            tar.close()
        if stream is not None:
            stream.close()


class _Counted:
    """A stream's ``read``, counting the bytes it returned."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.count = stream, 0

    def read(self, size: int = -1) -> bytes:
        data: bytes = self._stream.read(size)
        self.count += len(data)
        return data


def write_webdataset(out: BinaryIO, samples: Iterable[Mapping[str, Any]]) -> int:
    """Write `samples` to `out` as a WebDataset tar shard; return how many were written.

    Each sample is a mapping ``{"__key__": key, extension: data, ...}`` (as
    `read_webdataset` yields them, undecoded): a member ``KEY.EXTENSION`` per extension,
    in the mapping's order. The tar is byte for byte the same for the same samples: no
    time stamps, owners or permissions but ``0o644``. `out` is typically
    ``open_output("shard-000000.tar.gz")``.

    Raises:
        TypeError: for a sample that is not such a mapping, or data that is not bytes.
        ValueError: for a key that is empty or whose base name has a dot, an empty
            extension, or a key that came before: each naming the sample's position.
    """
    seen: set[str] = set()
    count = 0
    with tarfile.open(fileobj=cast(Any, out), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for count, sample in enumerate(samples, 1):
            key = _checked_key(sample, count - 1, seen)
            for extension, data in sample.items():
                if extension == "__key__":
                    continue
                if not isinstance(extension, str) or not extension or "/" in extension:
                    raise ValueError(
                        f"write_webdataset: sample {count - 1} ({key!r}) has the extension "
                        f"{extension!r}; extensions are non-empty names without '/'"
                    )
                if not isinstance(data, (bytes, bytearray, memoryview)):
                    raise TypeError(
                        f"write_webdataset: sample {count - 1} ({key!r}): the data of "
                        f"{extension!r} must be bytes, got {type(data).__name__}"
                    )
                info = tarfile.TarInfo(f"{key}.{extension}")
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(bytes(data)))
    return count


def _checked_key(sample: object, index: int, seen: set[str]) -> str:
    """The key of `sample`, checked (and recorded in `seen`)."""
    if not isinstance(sample, Mapping) or not isinstance(sample.get("__key__"), str):
        raise TypeError(
            f"write_webdataset: sample {index} must be a mapping with a str '__key__', got "
            f"{type(sample).__name__}"
        )
    key: str = sample["__key__"]
    if not key or "." in key.rpartition("/")[2] or key.endswith("/"):
        raise ValueError(
            f"write_webdataset: sample {index} has the key {key!r}; a key is a path whose "
            "base name is non-empty and has no dot"
        )
    if key in seen:
        raise ValueError(f"write_webdataset: sample {index} repeats the key {key!r}")
    seen.add(key)
    return key
