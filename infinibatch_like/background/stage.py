"""`BackgroundStage`: the base of the stages whose work happens in background workers."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar, Generic, TypeVar

from .._core.graph import Place, walk
from .._core.probe import Gauges
from .._core.protocol import CheckpointableIterator, State
from .._core.schema import FieldSpec, Int
from .._core.stage import Stage, source_state
from .cursor import ReplayCursor

T = TypeVar("T")


class Runner(ABC):
    """What a background stage runs: it owns the workers and the cursor, and holds no
    reference to the stage, so that garbage collection of the stage stops the workers."""

    def __init__(self, source: CheckpointableIterator[Any], snapshot_every: int) -> None:
        self.source = source
        self.snapshot_every = snapshot_every
        self.cursor = ReplayCursor({}, 0)
        self._startable = False

    probe: Any = None
    """The stage's statistics probe (`_core.probe.StageProbe`) while they are on."""

    sources_in_worker_process = False
    """Whether the source is read in a worker process (with its own copy of the source)."""

    pulls_source_in = "thread"
    """Where the source's items are pulled: ``"thread"`` or ``"process"`` (a worker of
    the stage), or ``"consumer"`` (the thread that pulls the stage's own items, which
    hands them to its workers)."""

    def reset(self, cursor: ReplayCursor) -> None:
        """Continue from `cursor` (the workers are stopped)."""
        self.cursor = cursor
        self._startable = True

    def start(self) -> None:
        """Start the workers from the cursor's position, once after each `reset` (later,
        e.g. once the source ended or failed, this does nothing)."""
        if self._startable:
            self._startable = False
            self._start()

    @abstractmethod
    def _start(self) -> None:
        """Start the workers from the cursor's position."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the workers (idempotent)."""

    def gauges(self) -> Gauges | None:
        """Its buffer and workers now (for statistics); None if it has not run here since
        its last reset (e.g. the consumer's copy of a stage that runs in a worker process)."""
        return None if self._startable else self._gauges()

    def _gauges(self) -> Gauges | None:
        return None

    @abstractmethod
    def generate(self) -> Iterator[Any]:
        """The stage's items from the cursor's position, starting the workers if needed and
        stopping them when the source ends or fails, or the generator is closed."""


class BackgroundStage(Stage[T], Generic[T]):
    """A stage whose items come from a `Runner` over one source: checkpoints, restore,
    early start, close and garbage collection are handled here.

    A subclass checks its arguments, builds its runner, calls `_init_background` and
    then, like every stage, ``self._restore(None)``.

    Checkpoint:
        ``{"source", "replay"}``: the source's state at the last snapshot at or before the
        consumer's position, and the number of items consumed since (at most
        `snapshot_every`; a state with more is refused).
    """

    _state_fields: ClassVar[dict[str, FieldSpec]] = {
        "source": dict,
        "replay": Int(
            0,
            lambda stage: stage._runner.snapshot_every,
            name="snapshot_every",
            hint="if the state came from a stage built with a larger snapshot_every, build this "
            "one with it too",
        ),
    }
    _runner: Runner
    _source_field = "source"

    def _init_background(self, source: CheckpointableIterator[Any], runner: Runner) -> None:
        """Read `source` through `runner` (fields only: see `Stage`)."""
        self._source = source
        self._sources = (source,)
        self._runner = runner
        self._finalizer = weakref.finalize(self, runner.stop)

    def _state(self) -> State:
        return self._runner.cursor.state()

    def _gauges(self) -> Gauges | None:
        return self._runner.gauges()

    def _restore(self, state: State | None) -> None:
        runner = self._runner
        runner.stop()
        self.restore_source(self._source, None if state is None else state["source"])
        if state is None:
            runner.reset(ReplayCursor(source_state(self._source), 0))
        else:
            runner.reset(ReplayCursor(state["source"], state["replay"]))
        self._iterator = runner.generate()

    def _source_pulled_in(self, probe: object) -> str | None:
        """Where this stage's source is pulled while statistics are on with `probe`:
        ``"thread"`` or ``"process"`` (its worker), or None (where this stage is pulled, as
        by a parallel map, or the runner does not count for `probe`)."""
        runner = self._runner
        if runner.probe is not probe or runner.pulls_source_in == "consumer":
            return None
        return runner.pulls_source_in

    def _state_around(self, source: State) -> State:
        return {"stage": self._name, "source": source, "replay": 0}

    def start(self) -> None:
        """Start the workers now rather than at the first ``next()``: their start-up and
        the replay of a restored checkpoint then overlap with the caller's own work."""
        if self._closed:
            raise RuntimeError(f"{self._name}.start: the iterator is closed")
        self._runner.start()

    def close(self) -> None:
        """Stop the workers (and, through the source, any nested ones), then close the
        source. Idempotent; afterwards ``next()`` and ``setstate()`` raise RuntimeError."""
        if not self._closed:
            self._runner.stop()
        super().close()


def start_background(pipeline: CheckpointableIterator[Any]) -> None:
    """Start the workers of every background stage of `pipeline` now, rather than at the
    first ``next()``: e.g. right after ``setstate()``, before loading the model, so that
    the workers' start-up and the replay of the checkpoint overlap with it.

    Stages inside a worker process (the source of a process `PrefetchIterator`) start
    with that worker. Stages that are not background stages are left as they are.
    """
    places = list(walk(pipeline, _reads_here))
    for place in reversed(places):  # sources first: a worker never starts one it reads
        if isinstance(place.stage, BackgroundStage):
            place.stage.start()


def _reads_here(place: Place) -> bool:
    """Whether the sources of the stage at `place` are read in this process."""
    stage = place.stage
    return not (isinstance(stage, BackgroundStage) and stage._runner.sources_in_worker_process)
