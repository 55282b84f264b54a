"""Lines from a chunk's decompressed bytes, a block at a time, in linear time: the one
line splitter of the library (the readers and the chunking tool).

`LineSplitter` turns blocks of bytes into lists of lines: decoded text (`LineSplitter.text`)
or bytes as stored (`LineSplitter.raw`); either way a line ends with ``"\n"`` or
``"\r\n"``, both removed. A bad line (text that does not decode, or a line longer than
the limit) becomes a `BadLine` in its place: an iterator that raises the line's error once
and then ends. Chained with ``itertools.chain.from_iterable``, the consumer gets the error
where the line was and, if it calls ``next()`` again (as a stage with a `SkipPolicy` does),
the lines after it.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from typing import IO, Any, Generic, Protocol, TypeVar

from .errors import ChunkFormatError

AnyStr = TypeVar("AnyStr", str, bytes)
_Decoded = TypeVar("_Decoded", str, bytes, covariant=True)

SKIP_HINT = (
    "a stage reading chunks (chunked_dataset_iterator, SelectManyIterator) skips bad records "
    "with on_error='skip' or on_error=SkipPolicy(...)"
)
"""How to skip a bad record, for the errors naming one."""


class BadLine(Iterator[Any]):
    """A bad line among blocks of lines: raises its error when first advanced, then ends."""

    __slots__ = ("_error",)

    def __init__(self, error: ChunkFormatError) -> None:
        self._error: ChunkFormatError | None = error

    def __next__(self) -> Any:
        error, self._error = self._error, None
        if error is None:
            raise StopIteration
        raise error


def bad_line(
    ref: str, number: int, what: str, cause: BaseException | None = None, hint: str = SKIP_HINT
) -> BadLine:
    """A `BadLine` whose error names `ref`, the line's `number` (from 1) and `what` is wrong."""
    error = ChunkFormatError(f"{ref}, line {number}: {what}; {hint}")
    error.__cause__ = cause
    return BadLine(error)


Block = list[str] | BadLine
"""Complete lines of text, or a bad line in place of one."""


class _Decoder(Protocol[_Decoded]):
    """What `LineSplitter` needs of a ``codecs.IncrementalDecoder``."""

    def decode(self, data: bytes, final: bool = False) -> _Decoded: ...
    def getstate(self) -> tuple[bytes, int]: ...
    def setstate(self, state: tuple[bytes, int], /) -> None: ...


class _Bytes:
    """The decoder of `LineSplitter.raw`: the bytes as they are."""

    def decode(self, data: bytes, final: bool = False) -> bytes:
        return data

    def getstate(self) -> tuple[bytes, int]:
        return b"", 0

    def setstate(self, state: tuple[bytes, int], /) -> None:
        pass


class LineSplitter(Generic[AnyStr]):
    """The lines of one chunk's decompressed bytes, given a block at a time: decoded text
    (`text`) or bytes as stored (`raw`).

    Lines end with ``"\\n"`` or ``"\\r\\n"`` (both removed); a lone ``"\\r"`` is part of
    its line. The text of a line that goes on past a block waits as pieces, which are
    joined once, when its end comes, so a line of n blocks costs O(n) and memory up to
    `limit` characters (bytes, for `raw`): a longer line is a bad line as soon as it passes
    the limit, and the rest of it is dropped as it is read, never held.
    """

    @staticmethod
    def text(ref: str, encoding: str, errors: str, limit: int | None) -> LineSplitter[str]:
        """A splitter of the text of `ref`, decoded from `encoding` (as `bytes.decode`)."""
        decoder = codecs.getincrementaldecoder(encoding)(errors)
        return LineSplitter(ref, decoder, ("", "\r", "\n"), encoding, limit)

    @staticmethod
    def raw(ref: str, limit: int | None = None) -> LineSplitter[bytes]:
        """A splitter of the bytes of `ref`, undecoded."""
        return LineSplitter(ref, _Bytes(), (b"", b"\r", b"\n"), "bytes", limit)

    def __init__(
        self,
        ref: str,
        decoder: _Decoder[AnyStr],
        marks: tuple[AnyStr, AnyStr, AnyStr],
        encoding: str,
        limit: int | None,
    ) -> None:
        self._ref, self._encoding, self._limit = ref, encoding, limit
        self._decoder: _Decoder[AnyStr] = decoder
        self._empty: AnyStr = marks[0]  # "", "\r" and "\n" (or their bytes)
        self._return: AnyStr = marks[1]
        self._newline: AnyStr = marks[2]
        self._offset = 0  # decompressed bytes given so far
        self._pieces: list[AnyStr] = []  # the text so far of the line under way
        self._length = 0  # its length
        self._cr = False  # the text so far ended with a "\r", held back from the pieces
        self._dropping = False  # the line under way is bad: its text is dropped
        self._line = 1  # the number of the line under way

    def blocks(self, data: bytes) -> Iterator[list[AnyStr] | BadLine]:
        """The lines that `data` completes; empty `data` marks the end of the chunk."""
        final = not data
        while True:
            buffered, flag = self._decoder.getstate()
            try:
                text = self._decoder.decode(data, final)
            except UnicodeDecodeError as error:
                # `error` counts from the bytes the decoder held back from the last block.
                whole, start = buffered + data, self._offset - len(buffered)
                self._decoder.setstate((b"", flag))
                yield from self._split(self._decoder.decode(whole[: error.start]))
                yield from self._keep_cr()  # not followed by "\n": part of the line
                yield from self._fail(
                    f"not valid {self._encoding} text at byte {start + error.start} of its "
                    f"decompressed data ({error.reason})",
                    error,
                )
                data, self._offset = whole[error.end :], start + error.end
                continue
            self._offset += len(data)
            yield from self._split(text)
            if final:
                yield from self._finish()
            return

    def _split(self, text: AnyStr) -> Iterator[list[AnyStr] | BadLine]:
        """The lines that decoded `text` completes; the rest waits for the next text."""
        cr, lf = self._return, self._newline
        if self._cr:
            text, self._cr = cr + text, False
        if text.endswith(cr):  # perhaps a "\r\n" cut by the block's end
            text, self._cr = text[:-1], True
        if cr in text:
            text = text.replace(cr + lf, lf)
        if lf not in text:
            yield from self._grow(text)
            return
        if self._pieces:
            self._pieces.append(text)
            text = self._empty.join(self._pieces)
            self._pieces, self._length = [], 0
        lines = text.split(lf)
        rest = lines.pop()
        if self._dropping:  # the bad line ends here
            del lines[0]
            self._dropping = False
            self._line += 1
        limit = self._limit
        if limit is not None and len(text) > limit and max(map(len, lines), default=0) > limit:
            yield from self._limited(lines, limit)
        elif lines:
            yield lines
        self._line += len(lines)
        yield from self._grow(rest)

    def _limited(self, lines: list[AnyStr], limit: int) -> Iterator[list[AnyStr] | BadLine]:
        """`lines`, with a bad line in place of each line longer than `limit`."""
        good: list[AnyStr] = []
        for number, line in enumerate(lines, self._line):
            if len(line) <= limit:
                good.append(line)
                continue
            if good:
                yield good
                good = []
            yield bad_line(self._ref, number, self._too_long(), hint=self._limit_hint())
        if good:
            yield good

    def _grow(self, text: AnyStr) -> Iterator[BadLine]:
        """Add `text` to the line under way."""
        if self._dropping or not text:
            return
        self._length += len(text)
        if self._limit is not None and self._length > self._limit:
            yield from self._fail(self._too_long(), hint=self._limit_hint())
        else:
            self._pieces.append(text)

    def _fail(
        self, what: str, cause: BaseException | None = None, hint: str = SKIP_HINT
    ) -> Iterator[BadLine]:
        """The line under way is bad: a `BadLine` (once per line), and drop the rest of it."""
        if not self._dropping:
            yield bad_line(self._ref, self._line, what, cause, hint)
        self._pieces, self._length, self._cr, self._dropping = [], 0, False, True

    def _keep_cr(self) -> Iterator[BadLine]:
        """Add the ``"\\r"`` held back, if any, to the line under way."""
        if self._cr:
            self._cr = False
            yield from self._grow(self._return)

    def _finish(self) -> Iterator[list[AnyStr] | BadLine]:
        """The last line, if the chunk does not end with a line ending."""
        yield from self._keep_cr()
        if self._pieces and not self._dropping:
            yield [self._empty.join(self._pieces)]

    def _too_long(self) -> str:
        unit = "bytes" if isinstance(self._empty, bytes) else "characters"
        return f"longer than max_line_length={self._limit} {unit}"

    def _limit_hint(self) -> str:
        return f"read it with a larger max_line_length (or None: no limit), or {SKIP_HINT}"


def line_blocks(
    stream: IO[bytes], splitter: LineSplitter[AnyStr], block_size: int
) -> Iterator[list[AnyStr] | BadLine]:
    """The lines of `stream` by `splitter`, read `block_size` bytes at a time."""
    while True:
        data = stream.read(block_size)
        yield from splitter.blocks(data)
        if not data:
            return
