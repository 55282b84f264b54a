"""Bad records: skip items whose reading or transform raises, within a budget, with a ledger.

``on_error="raise"`` (the default of every stage) lets an error stop the pipeline.
``on_error=SkipPolicy(max_skips=m, per_items=n)`` skips the failing record instead, as long
as at most `m` of every window of `n` consecutive items fail, and keeps a ledger of what was
skipped; ``on_error="skip"`` is `DEFAULT_SKIP_POLICY` (at most 10 in every 10,000).
Skipping is deterministic: it depends only on the data, and the budget window and the
ledger are part of the checkpoint, so a restored pipeline skips exactly the same records.
Stages that take `on_error`: `MapIterator`, `ParallelMapIterator`, `SelectManyIterator`
and `chunked_dataset_iterator`. They derive from `BudgetedStage`, whose filter is the one
place where bad records are counted and left out: a failure becomes a `BadRecord` where it
happens (a `MapIterator`'s transform call, `Guarded` transforms in workers, `tolerant`
chunk readers) and the filter meets it in the stage's input.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from .._core.names import short_repr
from .._core.notes import lost_input
from .._core.protocol import CheckpointableIterator, State, StateMismatchError
from .._core.schema import FieldSpec, Int, ListOf, Omissible, Pair, Record
from .._core.stage import Stage
from ._failures import MESSAGE_LIMIT, BadRecord

T = TypeVar("T")
U = TypeVar("U")

@dataclass(frozen=True)
class SkipPolicy:
    """Skip records whose reading or transform raises, at most `max_skips` per window.

    Args:
        max_skips: how many records may be skipped in each window (>= 0).
        per_items: the window: items ``[0, n)``, ``[n, 2n)``, ... of the stage's input
            (>= 1 and > `max_skips`); None: one window over the whole run (a total budget).
            The budget is exceeded when a window holds more than `max_skips` failures.
        keep_last: how many ledger entries (and chunks with per-chunk counts) to keep;
            the counts cover the whole run.

    Raises:
        TypeError, ValueError: for a bad argument, naming it.
    """

    max_skips: int
    per_items: int | None = None
    keep_last: int = 32

    def __post_init__(self) -> None:
        for name, minimum in (("max_skips", 0), ("per_items", 1), ("keep_last", 0)):
            value = getattr(self, name)
            if value is None and name == "per_items":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"SkipPolicy: {name} must be an int, got {value!r}")
            if value < minimum:
                raise ValueError(f"SkipPolicy: {name} must be >= {minimum}, got {value}")
        if self.per_items is not None and self.max_skips >= self.per_items:
            raise ValueError(
                f"SkipPolicy: max_skips={self.max_skips} must be < per_items={self.per_items} "
                "(a budget allowing every item of a window to fail is no budget)"
            )

    @property
    def longest_run(self) -> int:
        """A run of this many consecutive failures always exceeds the budget."""
        return self.max_skips + 1 if self.per_items is None else 2 * self.max_skips + 1


DEFAULT_SKIP_POLICY = SkipPolicy(max_skips=10, per_items=10_000)
"""What ``on_error="skip"`` means: at most 10 bad records in every 10,000 items (0.1 %).
The rare bad records of a real corpus are skipped, while a systematic failure (a wrong
reader, a broken transform, a corpus in another format) stops the run after at most 21
failures in a row, rather than skipping everything."""

OnError = Literal["raise", "skip"] | SkipPolicy
"""What a stage does when reading or transforming a record raises."""


def resolve_on_error(owner: str, on_error: object) -> SkipPolicy | None:
    """The policy of `on_error` (None for ``"raise"``), or TypeError naming `owner`."""
    if isinstance(on_error, SkipPolicy):
        return on_error
    if on_error == "raise":
        return None
    if on_error == "skip":
        return DEFAULT_SKIP_POLICY
    raise TypeError(
        f"{owner}: on_error must be 'raise', 'skip' (that is {DEFAULT_SKIP_POLICY!r}) or a "
        f"SkipPolicy, got {on_error!r}"
    )


class SkipBudgetExceeded(RuntimeError):
    """More records failed than a stage's `SkipPolicy` allows.

    Raised from the stage's ``next()``, with the last failure as ``__cause__`` (where it
    was raised in this process, not in a worker process); `stage`, `policy` and `last`
    (the latest ledger entries) tell the rest.
    """

    def __init__(self, stage: str, policy: SkipPolicy, window: str, last: list[State]) -> None:
        self.stage, self.policy, self.last = stage, policy, last
        errors = "; ".join(describe_entry(entry) for entry in last[-3:])
        super().__init__(
            f"{stage}: more than {policy.max_skips} bad records {window}, beyond its budget "
            f"on_error={policy!r}; the last errors: {errors}"
        )


def describe_entry(entry: State) -> str:
    """``chunk 'a.jsonl' record 3: ValueError: bad line``: one ledger entry in words."""
    where = f"item {entry['position']}"
    if entry["chunk"] is not None:
        where = f"chunk {entry['chunk']} " + (
            "(whole chunk)" if entry["kind"] == "chunk" else f"record {entry['position']}"
        )
    return f"{where}: {entry['error']}: {entry['message']}"


@dataclass(frozen=True)
class SkipLedger:
    """What a stage skipped: counts over the whole run and the latest entries.

    Each entry is a dict ``{"in_stage", "kind", "chunk", "position", "error", "message"}``:
    `kind` is ``"record"`` (a record of a chunk), ``"chunk"`` (a chunk that could not be
    read at all) or ``"item"`` (an item whose transform raised); `chunk` is the chunk's
    short repr (None for a transform), `position` the record's index in the chunk or the
    item's index in the stage's input.
    """

    stage: str
    records: int = 0
    chunks: int = 0
    per_chunk: dict[str, int] = field(default_factory=dict)
    last: list[State] = field(default_factory=list)


class ParsedRecords(Iterator[U]):
    """``parse(record)`` for each of `records`, for a chunk reader: where `parse` raises,
    ``next()`` raises and the next ``next()`` goes on with the next record (a generator
    would end instead). Returned by a ``read_chunk_fn``, it lets a `SelectManyIterator`
    (or `chunked_dataset_iterator`) with a `SkipPolicy` skip just the bad record, and
    its ledger name the chunk and the record's index in it.

    For instance ``read_chunk_fn=lambda path: ParsedRecords(read_lines(path), json.loads)``.
    """

    def __init__(self, records: Iterable[T], parse: Callable[[T], U]) -> None:
        self._records, self._parse = iter(records), parse

    def __next__(self) -> U:
        return self._parse(next(self._records))


_LEDGER_ENTRY = Record(
    {
        "in_stage": str,
        "kind": str,
        "chunk": (str, type(None)),
        "position": int,
        "error": str,
        "message": str,
    },
    exact=True,
)
SKIPS = Record(
    {
        "seen": Int(0),
        "window": Int(0),
        "in_window": Int(0),
        "records": Int(0),
        "chunks": Int(0),
        "per_chunk": ListOf(Pair(str, Int(0))),
        "last": ListOf(_LEDGER_ENTRY),
    }
)
"""The schema of a `Budget`'s state (the ``"skips"`` field of a stage's state)."""


class Budget:
    """A stage's skip budget and ledger: what the ``"skips"`` field of its state holds.

    Checkpoint:
        ``{"seen", "window", "in_window", "records", "chunks", "per_chunk", "last"}``: the
        items of the stage's input so far, the current window's index and its failures,
        the counts, per-chunk counts of the latest `keep_last` chunks with failures
        (``[[chunk, count], ...]``) and the latest `keep_last` entries. Bounded by
        `keep_last`.
    """

    def __init__(self, stage: str, policy: SkipPolicy) -> None:
        self.stage, self.policy = stage, policy
        self.restore(None)

    def restore(self, state: State | None) -> None:
        """Continue from `state` (None: a fresh ledger), checked against `SKIPS`; a
        ValueError if its window does not fit the policy."""
        self.seen = self.window = self.in_window = self.records = self.chunks = 0
        self.per_chunk: dict[str, int] = {}
        self.last: list[State] = []
        if state is None:
            return
        seen, window, in_window = state["seen"], state["window"], state["in_window"]
        size = self.policy.per_items
        if in_window > self.policy.max_skips or (size is not None and window > seen // size):
            raise ValueError(
                f"state field 'skips' holds {in_window} failures in window {window} after "
                f"{seen} items, which does not fit on_error={self.policy!r}"
            )
        per_chunk, last = state["per_chunk"], state["last"]
        self.seen, self.window, self.in_window = seen, window, in_window
        self.records, self.chunks = state["records"], state["chunks"]
        keep = self.policy.keep_last
        self.per_chunk = {name: count for name, count in per_chunk[max(0, len(per_chunk) - keep) :]}
        self.last = [dict(entry) for entry in last[max(0, len(last) - keep) :]]

    def state(self, seen: int) -> State:
        """The state, with `seen` items of the stage's input so far."""
        return {
            "seen": seen,
            "window": self.window,
            "in_window": self.in_window,
            "records": self.records,
            "chunks": self.chunks,
            "per_chunk": [[name, count] for name, count in self.per_chunk.items()],
            "last": [dict(entry) for entry in self.last],
        }

    def skip(self, bad: BadRecord, position: int, chunk: Any = None, record: int = 0) -> None:
        """Count the failure `bad` of the item at `position` of the stage's input (`chunk`
        as in `SkipLedger`; `record`: its index in the chunk), or raise
        `SkipBudgetExceeded` (counting nothing)."""
        kind = bad.kind
        window = 0 if self.policy.per_items is None else position // self.policy.per_items
        in_window = (self.in_window if window == self.window else 0) + 1
        name = None if chunk is None else short_repr(chunk, MESSAGE_LIMIT)
        entry = {
            "in_stage": self.stage,
            "kind": kind,
            "chunk": name,
            "position": position if chunk is None else record,
            "error": bad.error_type,
            "message": bad.message,
        }
        if in_window > self.policy.max_skips:
            size = self.policy.per_items
            where = "in the run"
            if size is not None:
                where = f"in items {window * size}..{(window + 1) * size - 1}"
            raise SkipBudgetExceeded(self.stage, self.policy, where, [*self.last, entry])
        self.window, self.in_window = window, in_window
        if kind == "chunk":
            self.chunks += 1
        else:
            self.records += 1
        if name is not None:
            self.per_chunk[name] = self.per_chunk.pop(name, 0) + 1
            while len(self.per_chunk) > self.policy.keep_last:
                del self.per_chunk[next(iter(self.per_chunk))]
        self.last.append(entry)
        del self.last[: max(0, len(self.last) - self.policy.keep_last)]

    def ledger(self, stage: str | None = None) -> SkipLedger:
        return SkipLedger(
            stage or self.stage,
            self.records,
            self.chunks,
            dict(self.per_chunk),
            [dict(entry) for entry in self.last],
        )


class BudgetedStage(Stage[T]):
    """A stage that may skip bad records: its state holds ``"skips"`` (the `Budget`'s
    state) when it was built with a `SkipPolicy`, and nothing more otherwise.

    Its bad-record filter is `_skip_bad`, which counts a `BadRecord` met at a position of
    the stage's input, and `_without_bad_records`, which leaves them out of a stream of
    one output per input item, numbering the input in `_seen`.

    `on_error` may change at a restart: a state without ``"skips"`` (taken with
    ``on_error="raise"``) starts a fresh ledger, and one with it given to a stage that
    raises has its ledger ignored.
    """

    _budget: Budget | None = None
    _seen = 0
    """Items of the stage's input so far, skipped ones included (`_without_bad_records`)."""

    def _init_budget(self, owner: str, on_error: object) -> None:
        """Set up the budget of `on_error` (see `Stage`: a base's setup sets fields only)."""
        policy = resolve_on_error(owner, on_error)
        self._budget = None if policy is None else Budget(self._name, policy)

    @property
    def skip_ledger(self) -> SkipLedger:
        """What this stage skipped so far (an empty ledger with ``on_error="raise"``); the
        ledgers of a whole pipeline are `skip_ledgers`."""
        if self._budget is None:
            return SkipLedger(self._name)
        return self._budget.ledger()

    @property
    def skipped(self) -> SkipLedger:
        """Deprecated: `skip_ledger` (``skipped`` is a count elsewhere, e.g.
        ``SkipIterator.skipped``)."""
        warnings.warn(
            f"{self._name}.skipped is deprecated; use .skip_ledger (the same SkipLedger)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.skip_ledger

    def _skip_fields(self, seen: int) -> State:
        """``{"skips": ...}`` with `seen` items of the input so far (nothing without a budget)."""
        return {} if self._budget is None else {"skips": self._budget.state(seen)}

    def _state_schema(self) -> Mapping[str, FieldSpec]:
        fields = super()._state_schema()
        return fields if self._budget is None else {**fields, "skips": Omissible(SKIPS)}

    def _restore_budget(self, state: State | None) -> None:
        """Put the budget and `_seen` into place from `state` (None: afresh)."""
        self._seen = 0
        if self._budget is None:
            return
        try:
            self._budget.restore(None if state is None else state.get("skips"))
        except ValueError as error:
            raise self.mismatch(str(error)) from None
        self._seen = self._budget.seen

    def _without_bad_records(self, outputs: Iterable[Any]) -> Iterator[Any]:
        """`outputs`, one per item of the input (numbered by `_seen`), without their
        `BadRecord`s, which `_skip_bad` counts."""
        for output in outputs:
            if type(output) is BadRecord:
                self._skip_bad(output, self._seen)
                self._seen += 1
                continue
            self._seen += 1
            yield output

    def _skip_bad(self, bad: BadRecord, position: int, chunk: Any = None, record: int = 0) -> None:
        """Count `bad`, the failure of input item number `position` (`chunk` and `record`
        as in `Budget.skip`), or raise `SkipBudgetExceeded` from its error. An ``"item"``
        beyond the budget is consumed without a position after it: the stage's state then
        steps back to it or refuses (see `lost_input`)."""
        assert self._budget is not None
        try:
            self._budget.skip(bad, position, chunk, record)
        except SkipBudgetExceeded as exceeded:
            if bad.kind == "item":
                self._lost_input = lost_input(
                    f"{exceeded}; the item it failed on is consumed from the source and the "
                    "source cannot step back to it"
                )
            raise exceeded from bad.error


def skip_ledgers(
    pipeline: CheckpointableIterator[Any] | Mapping[str, Any],
) -> dict[str, SkipLedger]:
    """The ledgers of every stage of `pipeline` that skips bad records, by chain path
    (e.g. ``"MapIterator.source > PrefetchIterator.source > SelectManyIterator"``: the
    path of `infinibatch_like._core.graph`, its steps the fields of the state).

    `pipeline` is a pipeline, whose state is read (so stages inside worker processes are
    included, as of their latest snapshot), or a state, e.g. one loaded from a checkpoint.
    """
    state = pipeline.getstate() if isinstance(pipeline, CheckpointableIterator) else pipeline
    found: dict[str, SkipLedger] = {}
    _collect(state, [], found)
    return found


def _collect(state: object, path: list[str], found: dict[str, SkipLedger]) -> None:
    """Add the ledgers in `state` to `found`; `path`: the path down to `state`, its last
    step open (``["MapIterator.source"]``) where `state` is a stage's field."""
    if isinstance(state, list):
        for index, item in enumerate(state):
            _collect(item, _step(path, f"[{index}]"), found)
        return
    if not isinstance(state, dict):
        return
    name = state.get("stage")
    here = [*path, name] if isinstance(name, str) else path
    skips = state.get("skips")
    if isinstance(name, str) and isinstance(skips, dict):
        keep = max(len(skips.get("last") or ()), len(skips.get("per_chunk") or ()), 1)
        budget = Budget(name, SkipPolicy(2**62, None, keep))  # reads any budget's state
        try:
            SKIPS.check(skips, "skips", None)
            budget.restore(skips)
        except ValueError as error:
            raise StateMismatchError(str(error), tuple(here)) from None
        key = " > ".join(here)
        found[key] = budget.ledger(key)
    for key, value in state.items():
        if key not in ("skips", "fingerprint"):
            _collect(value, _step(here, f".{key}"), found)


def _step(path: list[str], step: str) -> list[str]:
    """`path` with `step` (``".source"``, ``"[1]"``) added to its last part."""
    return [*path[:-1], path[-1] + step] if path else path
