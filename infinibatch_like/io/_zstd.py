"""Reading zstd (with zstandard): bounded memory per read, and truncation detected.

zstandard's stream reader decompresses at most the bytes asked for per read, so a chunk of
a few KB that expands to gigabytes is read in bounded memory (the frame's window, at most
zstandard's default limit of 128 MiB, plus the pieces asked for). It ends silently where
the data stops inside a frame, so `_Frames` follows the frames' structure (headers and
block sizes, never the compressed data) as the reader pulls the bytes, and tells whether
the data stopped between frames.
"""

from __future__ import annotations

import importlib
import io
from typing import Any, BinaryIO

from .._core.extras import missing_extra

READ_SIZE = 1 << 18
"""Bytes of compressed input read at a time."""

_MAGIC = 0xFD2FB528
_SKIPPABLE, _SKIPPABLE_MASK = 0x184D2A50, 0xFFFFFFF0  # magics 0x184D2A50 to 0x184D2A5F
_DICTIONARY_ID_SIZES = (0, 1, 2, 4)
_CONTENT_SIZE_SIZES = (0, 2, 4, 8)  # the first is 1 in a single-segment frame


def zstandard_module() -> Any:
    """The zstandard module, or MissingExtraError naming the ``zstd`` extra."""
    try:
        return importlib.import_module("zstandard")
    except ImportError as error:
        raise missing_extra("zstandard", "zstd", "reading and writing .zst chunks") from error


class ZstdReader(io.RawIOBase):
    """The decompressed bytes of the zstd stream of one or more frames in `raw`; a stream
    that ends inside a frame raises EOFError. Closing it leaves `raw` open."""

    def __init__(self, raw: BinaryIO) -> None:
        self._frames = _Frames(raw)
        decompressor = zstandard_module().ZstdDecompressor()
        self._reader = decompressor.stream_reader(
            self._frames, read_size=READ_SIZE, read_across_frames=True, closefd=False
        )

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        size = int(self._reader.readinto(buffer))
        if not size and not self._frames.between_frames():
            raise EOFError("the zstd data ends inside a frame (truncated)")
        return size

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()


class _Frames:
    """A zstd stream's source (``read(size)``) that follows its frames as it is read."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._part = "magic"  # the header under way: magic, descriptor, block, skippable
        self._header = bytearray()  # its bytes so far
        self._size = 4  # its size
        self._skip = 0  # bytes to pass over before it (the frame header's fields, a block)
        self._checksum = False  # the frame ends with a 4-byte checksum
        self._lost = False  # not zstd data: zstandard reports it, so stop following

    def read(self, size: int) -> bytes:
        data = self._raw.read(size)
        if not self._lost:
            self._follow(memoryview(data))
        return data

    def between_frames(self) -> bool:
        """Whether the bytes read so far end between two frames (or are not zstd data)."""
        return self._lost or (self._part == "magic" and not self._header and not self._skip)

    def _follow(self, data: memoryview) -> None:
        at, end = 0, len(data)
        while at < end and not self._lost:
            if self._skip:
                step = min(self._skip, end - at)
                self._skip -= step
            else:
                step = min(self._size - len(self._header), end - at)
                self._header += data[at : at + step]
                if len(self._header) == self._size:
                    value = int.from_bytes(self._header, "little")
                    self._header.clear()
                    self._parse(value)
            at += step

    def _parse(self, value: int) -> None:
        """Take in the header just read, whose bytes are `value` (little-endian)."""
        if self._part == "magic":
            if value == _MAGIC:
                self._part, self._size = "descriptor", 1
            elif value & _SKIPPABLE_MASK == _SKIPPABLE:
                self._part, self._size = "skippable", 4
            else:
                self._lost = True
        elif self._part == "descriptor":
            single_segment = value >> 5 & 1
            self._checksum = bool(value >> 2 & 1)
            content_size = _CONTENT_SIZE_SIZES[value >> 6] or single_segment
            self._skip = (1 - single_segment) + _DICTIONARY_ID_SIZES[value & 3] + content_size
            self._part, self._size = "block", 3
        elif self._part == "block":
            kind = value >> 1 & 3  # raw, run-length (one byte), compressed, reserved
            self._lost = kind == 3
            self._skip = 1 if kind == 1 else value >> 3
            if value & 1:  # the frame's last block
                self._skip += 4 * self._checksum
                self._part, self._size = "magic", 4
        else:  # a skippable frame's size
            self._skip = value
            self._part, self._size = "magic", 4
