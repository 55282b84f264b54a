"""Sequence packing: documents of tokens into fixed-length sequences for language models.

Each packed sequence comes with per-token segment (document) ids, positions that restart
per document, a loss mask and ``cu_seqlens``-style boundaries for varlen attention. The
state holds no tokens: it names a source position at or before the oldest pending
document, the fill levels and ages of the sequences open there, and counts to replay from
it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import accumulate
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypedDict

from .._core.checks import require_checkpointable, require_int
from .._core.extras import missing_extra
from .._core.protocol import CheckpointableIterator, State
from .._core.schema import FieldSpec, Int, ListOf
from .._core.stage import Stage, fast_iterator, source_state
from ._packer import AGE_LIMIT, Bin, Packer

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

_NAME = "PackingIterator"
_STRATEGIES = ("concat", "best_fit")
_LONG_DOCUMENTS = ("split", "truncate")
MOST_WINDOW = 128
"""The largest `window` of open sequences (it bounds the state: two ints per sequence)."""
_MOST_YIELDED = 1 << 20  # bounds a state's replay (C11): a document of 2**20 sequences
_MOST_EMPTY = 1 << 16  # empty documents a state may replay besides the tokens' bound
_KEPT_MARKS = 16  # replay points kept before the ones no state can use are dropped


class _PackedFields(TypedDict):
    tokens: npt.NDArray[np.int64]
    segment_ids: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int32]
    loss_mask: npt.NDArray[np.bool_]
    cu_seqlens: npt.NDArray[np.int32]


class PackedSequence(_PackedFields, total=False):
    """One packed sequence of `seq_len` tokens (numpy arrays).

    Attributes:
        tokens: int64, the documents' tokens back to back, then `pad_id`.
        segment_ids: int32, 1, 2, ... for the document pieces in order, 0 on padding.
        positions: int32, each token's position within its piece (restarting at 0 for each
            piece, and for the padding).
        loss_mask: bool, True on document tokens, False on padding.
        cu_seqlens: int32, the boundaries of the pieces (and of the padding, if any):
            ``[0, end of piece 1, ..., seq_len]``, as varlen attention kernels take them.
        origins: int64, shape ``(pieces, 2)``, only with ``traced=True``: each piece's
            document origin (see `infinibatch_like.stats.lineage`) and the offset of its first
            token in that document (16 bytes per piece).
    """

    origins: npt.NDArray[np.int64]


def _numpy() -> Any:
    try:
        import numpy
    except ModuleNotFoundError as error:  # pragma: no cover - numpy ships with the test extra
        raise missing_extra("numpy", "torch", f"infinibatch_like.{_NAME}") from error
    return numpy


class _Mark(NamedTuple):
    """A replay point: the source's state before document `read` was read, the fills and
    ages of the sequences open then, and the number of sequences yielded before it."""

    read: int
    source: State
    fills: list[int]
    ages: list[int]
    yielded: int


class PackingIterator(Stage[PackedSequence]):
    """Packs documents (lists or 1-D numpy arrays of token ids) into sequences of exactly
    `seq_len` tokens, yielded as `PackedSequence` dicts of numpy arrays.

    Strategies:

    - ``"concat"``: documents back to back, cut every `seq_len` tokens; a document may
      straddle sequences (its rest starts the next one). No padding but in the last
      sequence.
    - ``"best_fit"``: each document goes whole into the open sequence with the least room
      that fits it (the oldest among equals); if none fits, a new sequence is opened, and
      if `window` sequences are open the oldest is yielded first (padded). A sequence
      still open after ``4 * window`` others were finished is yielded too (this bounds
      what a restore re-reads; on log-normal corpora it changed the padding by at most
      0.01 points). A document longer than `seq_len` is cut into full sequences and a rest
      (``long_documents="split"``) or cut to `seq_len` tokens (``"truncate"``, also
      honoured by concat).

    Each document is read as ``[bos_id] + tokens + [eos_id]`` when those are given; an
    empty document is skipped. At the end of the source the open sequences are yielded,
    oldest first, padded with `pad_id`. Packing never depends on when (or whether)
    checkpoints are taken.

    Args:
        source_iterator: the documents; it is reset.
        seq_len: tokens per packed sequence, >= 1.
        strategy: ``"concat"`` or ``"best_fit"``.
        window: the most sequences open at once with ``best_fit`` (1 to 128, default 8);
            not accepted with ``concat``.
        long_documents: ``"split"`` (default) or ``"truncate"``.
        pad_id: the padding token id (default 0).
        bos_id: a token id put before every document, or None.
        eos_id: a token id put after every document, or None.
        traced: documents come as ``[origin, tokens]`` pairs (`infinibatch_like.stats.lineage`),
            and each sequence gets an ``origins`` array naming where its pieces came from.

    Raises:
        TypeError, ValueError: for bad arguments, naming them; TypeError (with a note
            naming this stage) for a document that is not a flat sequence of ints.

    Checkpoint:
        ``{"source", "fills", "ages", "read", "yielded", "ended", "fingerprint"}``: the
        source's state at a replay point at or before the oldest document not yet fully
        yielded, the fill levels and ages of the sequences open there (at most `window`
        of each), the documents read and the sequences yielded since, whether the source
        has ended, and the arguments above, which cannot change at a restart. No tokens:
        at most about 1.5 KB besides the source's state, whatever `seq_len` (a replay
        point is recorded before the first read after each yielded sequence, by one
        source snapshot). A restore re-reads the documents since the replay point and
        rebuilds the sequences not yet yielded: with ``best_fit`` at most about
        ``6 * window + 2`` sequences' worth of tokens (the window, the sequences finished
        while its oldest was open, those before it back to the replay point) plus the
        last document read; with ``concat`` about two sequences' worth plus the last
        document.
    """

    _not_elastic = "its open sequences hold this rank's documents"
    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "fills": ListOf(
            Int(1, lambda stage: stage._seq_len - 1, name="seq_len - 1"),
            most=lambda stage: stage._window,
        ),
        "ages": ListOf(Int(0, lambda stage: AGE_LIMIT * stage._window)),
        "read": Int(0),
        "yielded": Int(0, _MOST_YIELDED),
        "ended": bool,
    }

    def __init__(
        self,
        source_iterator: CheckpointableIterator[Any],
        seq_len: int,
        *,
        strategy: str = "concat",
        window: int | None = None,
        long_documents: str = "split",
        pad_id: int = 0,
        bos_id: int | None = None,
        eos_id: int | None = None,
        traced: bool = False,
    ) -> None:
        require_checkpointable(_NAME, "source_iterator", source_iterator)
        self._seq_len = require_int(_NAME, "seq_len", seq_len, 1)
        if strategy not in _STRATEGIES:
            raise ValueError(f"{_NAME}: strategy must be one of {_STRATEGIES}, got {strategy!r}")
        if long_documents not in _LONG_DOCUMENTS:
            raise ValueError(
                f"{_NAME}: long_documents must be one of {_LONG_DOCUMENTS}, got {long_documents!r}"
            )
        self._best_fit = strategy == "best_fit"
        if not self._best_fit and window is not None:
            raise ValueError(
                f"{_NAME}: window applies to strategy='best_fit' only (concat keeps one "
                f"sequence open), got window={window!r}"
            )
        self._window = 1 if window is None and not self._best_fit else 8
        if window is not None:
            self._window = require_int(_NAME, "window", window, 1)
            if window > MOST_WINDOW:
                raise ValueError(
                    f"{_NAME}: window must be <= {MOST_WINDOW} (the state holds one fill "
                    f"level per open sequence), got {window}"
                )
        self._truncate = long_documents == "truncate"
        self._pad_id = require_int(_NAME, "pad_id", pad_id, 0)
        self._bos = None if bos_id is None else require_int(_NAME, "bos_id", bos_id, 0)
        self._eos = None if eos_id is None else require_int(_NAME, "eos_id", eos_id, 0)
        self._traced = bool(traced)
        self._np = np = _numpy()
        self._empty = np.zeros(0, dtype=np.int64)
        self._heads = () if self._bos is None else (np.array([self._bos], dtype=np.int64),)
        self._tails = () if self._eos is None else (np.array([self._eos], dtype=np.int64),)
        self._ids = np.arange(1, self._seq_len + 2, dtype=np.int32)  # segment ids
        self._steps = np.arange(self._seq_len, dtype=np.int32)  # positions before restarts
        self._source = source_iterator
        self._sources = (source_iterator,)
        self._restore(None)

    @property
    def seq_len(self) -> int:
        """Tokens per packed sequence."""
        return self._seq_len

    def _arguments(self) -> State:
        return {
            "seq_len": self._seq_len,
            "strategy": _STRATEGIES[self._best_fit],
            "window": self._window,
            "long_documents": _LONG_DOCUMENTS[self._truncate],
            "pad_id": self._pad_id,
            "bos_id": self._bos,
            "eos_id": self._eos,
        }  # not `traced`: it adds origins, the sequences are the same

    # -- checkpoints -------------------------------------------------------------------

    def _state(self) -> State:
        mark = self._mark_for(self._packer.oldest_document(self._read))
        return {
            "source": mark.source,
            "fills": list(mark.fills),
            "ages": list(mark.ages),
            "read": self._read - mark.read,
            "yielded": self._yielded - mark.yielded,
            "ended": self._ended,
        }

    def _mark_for(self, document: int) -> _Mark:
        """The latest replay point at or before `document`."""
        marks = self._marks
        for index in range(len(marks) - 1, -1, -1):
            if marks[index].read <= document:
                return marks[index]
        raise AssertionError(f"{_NAME}: no replay point before document {document}")

    def _restore(self, state: State | None) -> None:
        self.restore_source(self._source, None if state is None else state["source"])
        self._packer = Packer(self._seq_len, self._window, self._best_fit, self._traced)
        self._read = self._yielded = 0
        self._ended = False
        self._want_mark = False
        fills, ages = ([], []) if state is None else self._checked_bins(state)
        self._marks = deque([_Mark(0, source_state(self._source), fills, ages, 0)])
        if state is not None:
            self._replay(state, fills, ages)
        self._iterator = self._generate()

    def _checked_bins(self, state: State) -> tuple[list[int], list[int]]:
        """The state's fills and ages of the sequences open at its replay point (each
        checked by the schema; here, one age per fill)."""
        fills, ages = state["fills"], state["ages"]
        if len(ages) != len(fills):
            raise self.mismatch(
                f"state field 'ages' holds {len(ages)} items, expected {len(fills)} (one per "
                f"fill): {ages!r:.200}"
            )
        return list(fills), list(ages)

    def _replay(self, state: State, fills: list[int], ages: list[int]) -> None:
        """Re-read the documents since the state's replay point and rebuild the sequences
        not yet yielded."""
        read, yielded = state["read"], state["yielded"]
        most_read = (yielded + 2 * self._window + 2) * self._seq_len + _MOST_EMPTY
        if read > most_read:
            raise self.mismatch(
                f"state field 'read' must be <= {most_read} with yielded={yielded}, got {read}"
            )
        packer, pull = self._packer, fast_iterator(self._source)
        packer.reopen(fills, ages)
        for document in range(read):
            try:
                item = next(pull)
            except StopIteration:
                raise self.mismatch(
                    f"the checkpoint replays {read} documents, but the source has {document}"
                ) from None
            self._add(item, document)
        if state["ended"]:
            if next(pull, _END) is not _END:
                raise self.mismatch(f"the source goes on after the {read} documents replayed")
            packer.finish_all()
        for count in range(yielded):
            if not packer.ready:
                raise self.mismatch(
                    f"the checkpoint skips {yielded} sequences, the replay gives {count}"
                )
            packer.ready.popleft()
        if packer.oldest_document(read) < 0:
            raise self.mismatch(
                f"the replay of {read} documents leaves a sequence open since before the "
                "replay point: the checkpoint's counts do not fit its source"
            )
        self._read, self._yielded, self._ended = read, yielded, state["ended"]

    # -- iteration ---------------------------------------------------------------------

    def _generate(self) -> Iterator[PackedSequence]:
        packer, source, marks = self._packer, self._source, self._marks
        ready = packer.ready
        pull = fast_iterator(source)
        while True:
            while ready:
                bin_ = ready.popleft()
                self._yielded += 1
                self._want_mark = True
                if len(marks) > _KEPT_MARKS:  # drop those before the one a state would use
                    oldest = packer.oldest_document(self._read)
                    while len(marks) > 1 and marks[1].read <= oldest:
                        marks.popleft()
                yield self._assembled(bin_)
            if self._ended:
                return
            if self._want_mark:
                marks.append(
                    _Mark(
                        self._read,
                        source_state(source),
                        packer.fills(),
                        packer.ages(),
                        self._yielded,
                    )
                )
                self._want_mark = False
            try:
                item = next(pull)
            except StopIteration:
                self._ended = True
                packer.finish_all()
                continue
            self._add(item, self._read)
            self._read += 1

    def _add(self, item: Any, document: int) -> None:
        if not self._traced:
            self._packer.add(self._tokens(item), document)
            return
        if not isinstance(item, (list, tuple)) or len(item) != 2 or type(item[0]) is not int:
            raise TypeError(
                f"{_NAME}: with traced=True a document must be an [origin, tokens] pair with an "
                f"int origin (see infinibatch_like.stats.lineage), got {_preview(item)}"
            )
        self._packer.add(self._tokens(item[1]), document, item[0])

    def _tokens(self, item: Any) -> Any:
        """`item` as a 1-D int array with BOS/EOS added, truncated if asked."""
        np = self._np
        if type(item) is not np.ndarray:
            try:
                item = np.asarray(item)
            except ValueError:  # ragged
                item = np.asarray(None)
        if item.ndim != 1 or (item.dtype.kind not in "iu" and item.size):
            raise TypeError(
                f"{_NAME}: a document must be a flat sequence of ints (a list or 1-D numpy "
                f"array), got {_preview(item)}"
            )
        if not item.size:
            item = self._empty
        if self._heads or self._tails:
            item = np.concatenate((*self._heads, item, *self._tails))
        if self._truncate and len(item) > self._seq_len:
            return item[: self._seq_len]
        return item

    def _assembled(self, bin_: Bin) -> PackedSequence:
        np, seq_len, fill = self._np, self._seq_len, bin_.fill
        pieces = bin_.pieces
        lengths = [len(piece) for piece in pieces]
        tokens = np.empty(seq_len, dtype=np.int64)
        np.concatenate(pieces, out=tokens[:fill], casting="unsafe")
        if fill < seq_len:
            tokens[fill:] = self._pad_id
            lengths.append(seq_len - fill)
        cu_seqlens = np.array([0, *accumulate(lengths)], dtype=np.int32)
        segment_ids = self._ids[: len(lengths)].repeat(lengths)
        segment_ids[fill:] = 0
        sequence: PackedSequence = {
            "tokens": tokens,
            "segment_ids": segment_ids,
            "positions": self._steps - cu_seqlens[:-1].repeat(lengths),
            "loss_mask": segment_ids > 0,
            "cu_seqlens": cu_seqlens,
        }
        if self._traced:
            sequence["origins"] = np.array(bin_.origins, dtype=np.int64).reshape(-1, 2)
        return sequence


_END = object()


def _preview(item: Any) -> str:
    text = repr(item)
    return text if len(text) <= 80 else text[:77] + "..."
