"""Compression chosen from a chunk's suffix, with the fastest decompressor installed.

gzip uses python-isal's ``igzip`` if installed, else zlib-ng's ``gzip_ng``, else the
standard library; ``.zst`` needs zstandard (see `_zstd`); ``.bz2`` and ``.xz`` use the
standard library. Every reader decompresses at most about the bytes asked for per read, so
a decompression bomb is read in bounded memory.
The wrappers never close the raw stream under them; their caller does. Written gzip headers
carry no time stamp and no file name, so the same data compresses to the same bytes (with
the same gzip implementation and level).
"""

from __future__ import annotations

import bz2
import gzip
import importlib
import io
import lzma
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any, BinaryIO, cast

from ._zstd import ZstdReader, zstandard_module

REFUSED_SUFFIXES = frozenset(
    {".lz4", ".lzma", ".lz", ".lzo", ".br", ".snappy", ".sz", ".z", ".zip", ".7z", ".tgz"}
    | {".zlib", ".deflate", ".rar"}
)
"""Suffixes of compressions and archives that are refused rather than read as plain data."""
TAR_SUFFIXES = (".tar", ".tar.gz", ".tar.zst", ".tar.bz2", ".tar.xz")
"""Tar archives: opened as bytes (`open_chunk`, `open_output`); their records are read by
`read_webdataset`, and the line and record readers refuse them."""


def refuse_archive(ref: str, reader: str) -> None:
    """ValueError if `ref` names a tar archive, which `reader` would read as garbage."""
    if ref.lower().endswith(TAR_SUFFIXES):
        raise ValueError(
            f"{ref}: {reader} cannot read a tar archive; read WebDataset tar shards with "
            "infinibatch_like.io.read_webdataset"
        )


@dataclass(frozen=True)
class Codec:
    """A compression: how to wrap a raw byte stream for reading and for writing."""

    name: str
    reader: Callable[[BinaryIO], IO[bytes]]
    writer: Callable[[BinaryIO, int | None], IO[bytes]]


def codec_for(ref: str) -> Codec | None:
    """The codec of `ref`'s suffix, or None for uncompressed data.

    Raises:
        ValueError: for a suffix of an unsupported compression or archive (e.g. ``.lz4``).
        MissingExtraError: for ``.zst`` without zstandard.
    """
    name = ref.rsplit("/", 1)[-1]
    suffix = name[name.rfind(".") :].lower() if "." in name else ""
    if suffix == ".zst":
        zstandard_module()  # a missing extra is reported before any I/O
    if suffix in _CODECS:
        return _CODECS[suffix]
    if suffix in REFUSED_SUFFIXES:
        raise ValueError(
            f"{ref}: the compression suffix {suffix!r} is not supported; supported: "
            f"{', '.join(sorted(_CODECS))}, or no compression suffix for plain data"
        )
    return None


def _gzip_module() -> Any:
    """python-isal's igzip, else zlib-ng's gzip_ng, else the standard library's gzip."""
    for name in ("isal.igzip", "zlib_ng.gzip_ng"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return gzip


def _gzip_reader(raw: BinaryIO) -> IO[bytes]:
    return cast(IO[bytes], _gzip_module().GzipFile(fileobj=raw, mode="rb"))


def _gzip_writer(raw: BinaryIO, level: int | None) -> IO[bytes]:
    module = _gzip_module()
    kwargs: dict[str, Any] = {} if level is None else {"compresslevel": level}
    if module is gzip and level is None:
        kwargs["compresslevel"] = 6  # the standard library's default, 9, is needlessly slow
    return cast(
        IO[bytes], module.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0, **kwargs)
    )


def _zstd_reader(raw: BinaryIO) -> IO[bytes]:
    return io.BufferedReader(ZstdReader(raw), buffer_size=1 << 20)


def _zstd_writer(raw: BinaryIO, level: int | None) -> IO[bytes]:
    compressor = zstandard_module().ZstdCompressor(level=3 if level is None else level)
    return cast(IO[bytes], compressor.stream_writer(raw, closefd=False))


def _bz2_writer(raw: BinaryIO, level: int | None) -> IO[bytes]:
    return bz2.BZ2File(raw, "wb", compresslevel=9 if level is None else level)


def _xz_writer(raw: BinaryIO, level: int | None) -> IO[bytes]:
    return lzma.LZMAFile(raw, "wb", preset=level)


_CODECS = {
    ".gz": Codec("gzip", _gzip_reader, _gzip_writer),
    ".bz2": Codec("bzip2", lambda raw: bz2.BZ2File(raw, "rb"), _bz2_writer),
    ".xz": Codec("xz", lambda raw: lzma.LZMAFile(raw, "rb"), _xz_writer),  # noqa: SIM115
    ".zst": Codec("zstd", _zstd_reader, _zstd_writer),
}
