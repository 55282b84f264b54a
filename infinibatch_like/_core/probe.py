"""Per-stage counters for `infinibatch_like.stats`: the probe a stage carries while
statistics are on, and the transport of worker processes' counters to the consumer.

A probe wraps its stage's item iterator (``_iterator``) each time the stage is restored
(it observes `Stage._set`), so that downstream stages, which pull from it directly, pull
through the probe. The wrapper is C-level (``chain.from_iterable`` over ``islice`` stretches, see
`infinibatch_like._core.stretch`): a Python frame runs once per stretch, not per item. It
counts every item exactly and times one pull per stretch; stretch lengths are drawn at random (mean
`sample_every`), before the pull they follow, so that sampling never locks onto a periodic
pattern and a timed pull stands for itself and its stretch (an unbiased estimate). Slow
stages, whose items have come `SLOW_ITEM_S` or more apart on average (wall time since
their first item), are timed pull by pull. A fast stage with rare long pulls (a chunk
read every 10,000 lines) gets an unbiased but noisy estimate of them: `collect` never
lets a stage's time fall below its sources' (a block-wise shuffle's block read is timed
through the pulls of its source).

Probes never touch states: statistics are not part of any checkpoint. Without a probe a
stage's ``_iterator`` is left exactly as the stage built it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from typing import Any, NamedTuple, TypeVar

from .graph import walk
from .protocol import CheckpointableIterator
from .stage import Stage, observe_restores
from .stretch import stretch, yielded

T = TypeVar("T")

SLOW_ITEM_S = 200e-6
"""Stages whose items come this far apart or more on average have every pull timed (timing
costs well under 1 % of that time)."""

REPORT_S = 0.25
"""How often a worker process sends its counters to the consumer (with a message)."""


class StageProbe:
    """The counters of one stage: items out (exact), sampled pull times, wall clock.

    The time spent pulling this stage's items (its work plus its upstream's, in the thread
    that pulls them) is `estimated_s` plus the `exact_s` of this stage and of its
    upstream stages in that thread: steps timed in full (`timed`: a chunk read, a shuffle
    block) wherever they happen, and the rest of each timed pull, standing for itself and
    the untimed pulls of the stretch after it, in `estimated_s`. Counters received from a
    worker process are added in.
    """

    def __init__(self, sample_every: int, seed: int = 0) -> None:
        self.sample_every = sample_every
        self._rng = random.Random(seed)
        self.wrapped: Iterator[Any] | None = None
        self._counts: tuple[int, Iterator[Any] | None] = (0, None)
        """Items counted before the last stretch, and that stretch (None before the
        first): one attribute, so that a reader in another thread never sees a stretch
        counted twice or not at all."""
        self.estimated_s = 0.0
        self.exact_s = 0.0
        self.started: float | None = None
        """When the first item was asked for (``time.perf_counter``)."""
        self.ended_at: float | None = None
        self.remote_items = 0
        self.worker_busy_s = 0.0
        """Summed compute time of the stage's own workers (a parallel map's transform)."""
        self.collective_s = 0.0
        """Time in collectives waiting for other ranks (part of `exact_s`)."""
        self.waited_for: dict[int, float] = {}
        """`collective_s` by the rank that came last to each collective."""
        self.remote_gauges: Gauges | None = None
        """The stage's gauges as a worker process last sent them (the stage runs there)."""

    @property
    def items_out(self) -> int:
        """Items this stage yielded (counted here or in a worker process)."""
        done, items = self._counts
        return done + (0 if items is None else yielded(items)) + self.remote_items

    def attach(self, stage: Stage[Any]) -> None:
        """Wrap `stage`'s item iterator (after each restore); idempotent."""
        runner = getattr(stage, "_runner", None)
        if runner is not None:
            runner.probe = self
        if stage._iterator is not self.wrapped:
            self.wrapped = stage._iterator = chain.from_iterable(self._stretches(stage._iterator))

    def detach(self, stage: Stage[Any]) -> None:
        """Forget `stage`'s runner (the stage's next restore builds an unwrapped iterator)."""
        runner = getattr(stage, "_runner", None)
        if runner is not None and getattr(runner, "probe", None) is self:
            runner.probe = None

    def _stretches(self, pull: Iterator[Any]) -> Iterator[Iterable[Any]]:
        clock, draw, span = time.perf_counter, self._rng.random, 2 * self.sample_every - 1
        thread, slow = _THREAD, SLOW_ITEM_S if span > 1 else 0.0
        if self.started is None:
            self.started = clock()
        started = self.started
        done, items = self._counts  # a stretch left by the iterator before a restore
        done += 0 if items is None else yielded(items)
        self._counts = (done, None)
        while True:
            start = clock()
            # Chosen before the pull, so that a sample's weight never depends on its time.
            length = 0 if start - started >= slow * done else int(draw() * span)
            exact_before = thread.exact_s
            try:
                item = next(pull)
            except StopIteration:  # the stretch before may have ended early
                self.ended_at = clock()
                done, items = self._counts
                self._counts = (done + (0 if items is None else yielded(items)), None)
                return
            # less the steps timed in full in the pull, here or upstream
            took = clock() - start - (thread.exact_s - exact_before)
            self.estimated_s += took * (1 + length)
            done += 1
            if length:
                items = stretch(pull, length)
                self._counts = (done, items)
                yield (item,)
                yield items
                done += length  # used up (or the stream ended in it: see above)
            else:
                self._counts = (done, None)
                yield (item,)

    def timed(self, work: Callable[[], T]) -> T:
        """``work()``, its time added to the stage's in full: for a stage's rare long
        steps (reading a chunk, a shuffle block), which sampling would catch only now
        and then. Steps nest: the time of those inside it counts for their own stages."""
        before, start = _THREAD.exact_s, time.perf_counter()
        try:
            return work()
        finally:  # less the steps timed in full inside it (a chunk read in a block read)
            own = time.perf_counter() - start - (_THREAD.exact_s - before)
            self.exact_s += own
            _THREAD.exact_s += own

    def waited(self, seconds: float, last_rank: int) -> None:
        """Count `seconds` spent in a collective, waiting for `last_rank` (the last rank
        to arrive): timed in full, as waiting, not as the stage's work."""
        self.exact_s += seconds
        _THREAD.exact_s += seconds
        self.collective_s += seconds
        self.waited_for[last_rank] = self.waited_for.get(last_rank, 0.0) + seconds

    def counters(self) -> Counters:
        """(items out, sampled seconds, exact seconds, worker busy seconds)."""
        return (self.items_out, self.estimated_s, self.exact_s, self.worker_busy_s)

    def absorb(self, counters: Counters) -> None:
        """Add counters that a worker process measured for this stage."""
        items, sampled, exact, busy = counters
        self.remote_items += items
        self.estimated_s += sampled
        self.exact_s += exact
        self.worker_busy_s += busy


class _ThreadTotals(threading.local):
    def __init__(self) -> None:
        self.exact_s = 0.0
        """Seconds of steps timed in full (`StageProbe.timed`) in this thread so far."""


_THREAD = _ThreadTotals()

Counters = tuple[int, float, float, float]

_ZERO: Counters = (0, 0.0, 0.0, 0.0)


def probe_of(stage: object) -> StageProbe | None:
    """`stage`'s probe, if statistics are on for it."""
    return getattr(stage, "_probe", None) if isinstance(stage, Stage) else None


def _attach(stage: Stage[Any], direct: bool) -> None:
    """After a restore of `stage`, with statistics on: count what its new iterator yields."""
    if stage._probe is not None:
        stage._probe.attach(stage)


observe_restores(_attach)


def _stages(pipeline: CheckpointableIterator[Any]) -> list[CheckpointableIterator[Any]]:
    """`pipeline` and its upstream iterators, in `walk` order."""
    return [place.stage for place in walk(pipeline)]


def instrument(pipeline: CheckpointableIterator[Any], sample_every: int | None) -> None:
    """Give every stage of `pipeline` a fresh probe (None: remove them), then restore the
    pipeline in place from its own state, which rebuilds every item iterator (wrapped or
    not). The stream continues exactly where it was (checkpoint contract C2)."""
    state = pipeline.getstate()
    for index, stage in enumerate(_stages(pipeline)):
        if isinstance(stage, Stage):
            old = stage._probe
            if old is not None:
                old.detach(stage)
            stage._probe = None if sample_every is None else StageProbe(sample_every, index)
    pipeline.setstate(state)


def probing(source: CheckpointableIterator[Any]) -> int:
    """The `sample_every` of `source`'s probe, or 0 if statistics are off for it."""
    probe = probe_of(source)
    return 0 if probe is None else probe.sample_every


class Gauges(NamedTuple):
    """What a stage with buffers or workers of its own shows at this moment (read when
    statistics are collected, never counted per item). A stage provides them with a
    ``_gauges()`` method returning Gauges, or None while it has nothing running here."""

    queue_fill: float | None
    """Its buffer's fill (0..1)."""
    in_flight: int | None
    """Items (for a chunk read-ahead: chunks) taken up and not yet delivered."""
    workers: int | None = None
    """Its workers (threads or processes) that work concurrently."""
    busy_s: float = 0.0
    """Its workers' busy time on work in progress, not yet in its probe's counters."""
    unit: str = "items"
    """What its workers take up and `in_flight` counts: ``"items"``, or ``"chunks"`` for
    a chunk read-ahead (its workers are readers)."""


def gauges_of(stage: object) -> Gauges | None:
    """`stage`'s gauges now, read in this process (None if it has none running here)."""
    read = getattr(stage, "_gauges", None)
    return None if read is None else read()


def current_gauges(stage: object) -> Gauges | None:
    """`stage`'s gauges: read here if it runs here, else as its worker process sent them."""
    gauges = gauges_of(stage)
    probe = probe_of(stage)
    return gauges if gauges is not None or probe is None else probe.remote_gauges


Delta = tuple[list[Counters], list[Gauges | None]]
"""What a worker process sends: per stage of its source (depth first), the counters since
the previous delta and the gauges now."""


class WorkerStats:
    """In a worker process: the counters of its copy of the source, as deltas at most
    every `REPORT_S` seconds (attached to outgoing messages), with the stages' gauges."""

    def __init__(self, source: CheckpointableIterator[Any], sample_every: int) -> None:
        instrument(source, sample_every)  # fresh probes: forked ones hold the parent's counts
        self._stages = _stages(source)
        self._probes = [probe_of(stage) for stage in self._stages]
        self._sent: list[Counters] = [_ZERO for _ in self._probes]
        self._due = 0.0

    def due(self) -> bool:
        """Whether a delta should go out with the next message."""
        return time.monotonic() >= self._due

    def delta(self) -> Delta:
        """The counters since the previous delta, and the gauges now."""
        self._due = time.monotonic() + REPORT_S
        out = []
        for index, probe in enumerate(self._probes):
            now = _ZERO if probe is None else probe.counters()
            (items, sampled, exact, busy), before = now, self._sent[index]
            out.append(
                (items - before[0], sampled - before[1], exact - before[2], busy - before[3])
            )
            self._sent[index] = now
        return out, [current_gauges(stage) for stage in self._stages]


def absorb_delta(source: CheckpointableIterator[Any], delta: Delta) -> None:
    """Add a worker's `delta` to the probes of the consumer's copy of `source`, whose
    stages then show the gauges it sent."""
    counters, gauges = delta
    for stage, values, stage_gauges in zip(_stages(source), counters, gauges, strict=False):
        probe = probe_of(stage)
        if probe is not None:
            probe.absorb(values)
            probe.remote_gauges = stage_gauges
