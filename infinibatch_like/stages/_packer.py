"""The packing decisions of `PackingIterator`, apart from its checkpoints and outputs:
documents in, finished sequences out, deterministic in the documents' lengths."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from typing import Any

AGE_LIMIT = 4
"""A sequence open while `AGE_LIMIT * window` others were finished is finished too."""


class Bin:
    """A sequence being filled: its pieces (token arrays) and the document that opened it
    (-1 for a phantom: a sequence open at a restore's replay point, of known fill only)."""

    __slots__ = ("born", "fill", "first", "order", "origins", "pieces")

    def __init__(self, order: int, first: int, fill: int = 0, born: int = 0) -> None:
        self.order, self.first, self.fill, self.born = order, first, fill, born
        self.pieces: list[Any] = []
        self.origins: list[tuple[int, int]] = []  # (origin, offset) per piece, if traced


class Packer:
    """The packing decisions alone: documents in, finished sequences out (in `ready`).

    Deterministic in the documents' lengths, so that a replay from a recorded point
    rebuilds the same sequences. ``concat`` keeps one open sequence and splits documents
    across sequences. ``best_fit`` puts each document in the open sequence with the least
    room that fits it (the oldest among equals); if none fits, it opens a sequence, first
    finishing the oldest one if `window` are open. A sequence that is full is finished at
    once; a document longer than `seq_len` gives full sequences of its leading tokens (or
    is truncated) and its rest is placed like a document. A sequence still open after
    ``4 * window`` others were finished is finished too (this bounds what a restore
    re-reads). At the end, the open sequences are finished oldest first.
    """

    def __init__(self, seq_len: int, window: int, best_fit: bool, traced: bool) -> None:
        self.seq_len, self.window, self.best_fit = seq_len, window, best_fit
        self.traced, self._origin = traced, 0
        self.open: dict[int, Bin] = {}  # by order of opening
        self.room: list[tuple[int, int]] = []  # (room left, order), sorted: best fit
        self.ready: deque[Bin] = deque()
        self._order = 0
        self.finished = 0  # sequences finished so far (ages count in them)

    def reopen(self, fills: list[int], ages: list[int]) -> None:
        """Open phantom sequences of these fills and ages (those open at a replay point)."""
        for fill, age in zip(fills, ages, strict=True):
            self._open(-1, fill).born = self.finished - age

    def fills(self) -> list[int]:
        return [bin_.fill for bin_ in self.open.values()]

    def ages(self) -> list[int]:
        """How many sequences were finished since each open one was opened."""
        return [self.finished - bin_.born for bin_ in self.open.values()]

    def oldest_document(self, default: int) -> int:
        """The first document of the oldest sequence not yet yielded (or `default`)."""
        firsts = [bin_.first for bin_ in self.open.values()]
        firsts.extend(bin_.first for bin_ in self.ready)
        return min(firsts, default=default)

    def add(self, tokens: Any, document: int, origin: int = 0) -> None:
        """Place a document (`origin`: its lineage, recorded per piece if traced)."""
        length, seq_len = len(tokens), self.seq_len
        self._origin = origin
        if not self.best_fit:
            start, open_ = 0, self.open
            while start < length:
                bin_ = next(iter(open_.values())) if open_ else self._open(document, 0)
                take = seq_len - bin_.fill
                if take >= length - start:
                    self._put(bin_, tokens[start:] if start else tokens, start)
                    return
                self._put(bin_, tokens[start : start + take], start)
                start += take
            return
        start, finished = 0, self.finished
        while length - start >= seq_len:
            full = Bin(-1, document)
            self._put(full, tokens[start : start + seq_len], start, reindex=False)
            start += seq_len
        if start < length:
            self._place(tokens[start:] if start else tokens, document, start)
        while self.finished != finished and self.open:  # ages grew: finish the too old
            oldest = next(iter(self.open.values()))
            if self.finished - oldest.born <= AGE_LIMIT * self.window:
                break
            self._finish(oldest.order)

    def finish_all(self) -> None:
        for order in list(self.open):
            self._finish(order)

    def _place(self, piece: Any, document: int, offset: int) -> None:
        size = len(piece)
        index = bisect_left(self.room, (size, -1))
        if index < len(self.room):
            order = self.room.pop(index)[1]
            self._put(self.open[order], piece, offset, reindex=False)
            return
        if len(self.open) >= self.window:
            self._finish(next(iter(self.open)))
        self._put(self._open(document, 0), piece, offset)

    def _open(self, document: int, fill: int) -> Bin:
        bin_ = Bin(self._order, document, fill, self.finished)
        self._order += 1
        self.open[bin_.order] = bin_
        if self.best_fit:
            self._index(bin_)
        return bin_

    def _index(self, bin_: Bin) -> None:
        insort(self.room, (self.seq_len - bin_.fill, bin_.order))

    def _put(self, bin_: Bin, piece: Any, offset: int, reindex: bool = True) -> None:
        """Add `piece` (starting at token `offset` of its document) to `bin_` (whose room
        entry, if any, the caller removed if not `reindex`); finish the bin if full."""
        if self.best_fit and reindex:
            self.room.remove((self.seq_len - bin_.fill, bin_.order))
        bin_.pieces.append(piece)
        if self.traced:
            bin_.origins.append((self._origin, offset))
        bin_.fill += len(piece)
        if bin_.fill == self.seq_len:
            self.open.pop(bin_.order, None)
            self._emit(bin_)
        elif self.best_fit:
            self._index(bin_)

    def _finish(self, order: int) -> None:
        bin_ = self.open.pop(order)
        if self.best_fit:
            self.room.remove((self.seq_len - bin_.fill, order))
        self._emit(bin_)

    def _emit(self, bin_: Bin) -> None:
        self.ready.append(bin_)
        self.finished += 1
