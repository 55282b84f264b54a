"""`collect`: the counters of every stage as plain data; `flat`: as one flat dict."""

from __future__ import annotations

import time
from typing import Any, TypedDict

from .._core.graph import Place, walk
from .._core.probe import StageProbe, current_gauges, probe_of
from .._core.protocol import CheckpointableIterator
from ..background.stage import BackgroundStage
from ._storage import storage


class StageStats(TypedDict):
    """One stage's statistics (see `collect`). Times are seconds since statistics were
    switched on; None where a counter does not apply or the stage has no probe."""

    path: str
    """The stage's place in the chain, as error messages name it (``A.source > B``)."""
    pattern: str
    """`path` with the index of a copy of a replicated pipeline written ``*``
    (``ShardedIterator.source > _ShardGroup.sources[*] > MapIterator``: that stage in
    every shard pipeline of one worker); `path` itself elsewhere. `limiting` and `report`
    add up the entries that share a pattern."""
    stage: str
    """The class name."""
    depth: int
    """0 for the outermost stage, 1 for its sources, ..."""
    runs_in: str
    """``"consumer"``, or the worker thread or process of a background stage that pulls
    this stage's items (e.g. ``"worker process of PrefetchIterator"``)."""
    items_in: int | None
    """Items taken from the sources (the sum of their `items_out`)."""
    items_out: int | None
    """Items yielded (exact)."""
    items_per_s: float | None
    """`items_out` over the wall time since the outermost stage's first item was asked for."""
    time_s: float | None
    """Time spent pulling this stage's items (its own work plus its upstream's in the same
    thread; for a background stage, the wait for its workers): estimated from timed pulls,
    and at least `upstream_s`."""
    upstream_s: float | None
    """Of `time_s`, the time spent waiting for the sources (pulled in the same thread)."""
    self_s: float | None
    """``time_s - upstream_s``: the stage's own work, or, for a background stage, the
    consumer's wait for its workers."""
    worker_busy_s: float | None
    """A parallel map's workers' compute time, summed over them; a prefetcher's worker's
    time pulling its source; a chunk read-ahead's (``SelectManyIterator(read_ahead=n)``)
    reader threads' time reading, summed over them (reads in progress included)."""
    workers: int | None
    """A parallel map's worker count; for a chunk read-ahead, the most reader threads at
    once: ``read_ahead + 1`` (the chunks ahead and the one being yielded)."""
    queue_fill: float | None
    """Buffer fill (0..1) at the time of the call: a prefetcher's items produced and not
    yet taken over its `buffer_size` (at most 1); a parallel map's tasks in flight over
    `tasks_in_flight`; a chunk read-ahead's collections read and waiting over
    `read_ahead`. For a stage in a worker process, as that worker last sent it."""
    unit: str
    """What the stage's workers take up and `in_flight` counts: ``"items"``, or
    ``"chunks"`` for a chunk read-ahead (whose workers are readers)."""
    in_flight: int | None
    """A prefetcher's items produced by its worker and not yet taken by the consumer (in
    its queue, a worker process's outbox and pipe, the rest of the batch being taken); a
    parallel map's items in its tasks in flight; a chunk read-ahead's collections (chunks)
    being read, the one the consumer waits for included."""
    work_s: float
    """The stage's own work, as counted for the time shares: `self_s`, or for a parallel
    map its workers' busy time divided by their number (for a prefetcher, 0: its time is
    waiting, and the work is its source's)."""
    share: float
    """`work_s` over the sum of every stage's `work_s` (0..1)."""
    collective_s: float | None
    """Of `self_s`, the time spent in collectives waiting for other ranks (an
    `EqualLengthIterator`'s agreement on each step): waiting, not work."""
    slowest_rank: int | None
    """With `collective_s`: the rank that this rank waited for longest in those
    collectives (the last to arrive)."""
    stall_s: float
    """The part of the consumer's wait for data (the outermost stage's `time_s`) that
    this stage causes, as the gauges read: a stage pulled by the consumer causes its
    own time; the consumer's wait for a prefetcher (its buffer ran empty) is caused by
    the stages its worker pulls, in proportion to their own time; the wait for a
    parallel map's or a chunk read-ahead's workers by that stage, up to its workers'
    busy time over their number (not their start). A stage that keeps ahead (its buffer
    full) causes none, however busy its workers. Collective waits are left out."""
    stall_share: float
    """`stall_s` over the sum of every stage's `stall_s` (0..1)."""
    wall_s: float
    """Wall time since the outermost stage's first item was asked for."""


def collect(pipeline: CheckpointableIterator[Any]) -> list[StageStats]:
    """Every stage's statistics, in chain order (outermost first, sources depth first).

    Statistics must be on (`enable`); stages without a probe (user-defined iterators)
    appear with None counters. Counters of stages that run in a worker process arrive
    with the worker's messages, at most every quarter second (and at the source's end).

    Raises:
        ValueError: if statistics are off for `pipeline`.
    """
    root = probe_of(pipeline)
    if root is None:
        raise ValueError(
            f"stats.collect: statistics are off for this {type(pipeline).__name__}; switch "
            "them on with infinibatch_like.stats.enable(pipeline)"
        )
    now = time.perf_counter()
    wall = 0.0 if root.started is None else (root.ended_at or now) - root.started
    places = list(walk(pipeline))
    entries: list[StageStats] = []
    at: dict[int, StageStats] = {}  # by stage: its entry
    inner: dict[int, str] = {}  # by stage: where its sources' items are pulled
    tree: dict[int, list[StageStats]] = {}  # by entry: its sources' entries
    for place in places:  # downstream first: where each stage runs
        stage, parent = place.stage, place.parent
        runs_in = "consumer" if parent is None else inner[id(parent.stage)]
        probe = probe_of(stage)
        entry = _entry(stage, probe, place, runs_in, wall)
        entries.append(entry)
        tree[id(entry)] = []
        if parent is not None:
            tree[id(at[id(parent.stage)])].append(entry)
        at[id(stage)], inner[id(stage)] = entry, _sources_run_in(stage, probe, place.path, runs_in)
    exact: dict[int, float] = {}
    for place, entry in reversed(list(zip(places, entries, strict=True))):  # sources first
        exact[id(entry)] = _add_sources(place.stage, entry, tree[id(entry)], exact)
    top = entries[0]
    _stall(top, 1.0, tree)
    for key, part in (("work_s", "share"), ("stall_s", "stall_share")):
        total = sum(entry[key] for entry in entries)  # type: ignore[literal-required]
        for entry in entries:
            value = entry[key]  # type: ignore[literal-required]
            entry[part] = value / total if total > 0 else 0.0  # type: ignore[literal-required]
    return entries


def _stall(entry: StageStats, scale: float, tree: dict[int, list[StageStats]]) -> None:
    """Set `stall_s` of `entry` and its upstream stages: `scale` is the share of their
    own time that the consumer waits for (1 in the consumer's thread)."""
    own = scale * max(0.0, (entry["self_s"] or 0.0) - (entry["collective_s"] or 0.0))
    children = tree.get(id(entry), [])
    worker = children[0] if children and children[0]["runs_in"] != entry["runs_in"] else None
    pulled = 0.0 if worker is None else worker["time_s"] or 0.0
    if pulled > 0:
        entry["stall_s"] = 0.0  # a prefetcher: its worker's stages cause the wait
        scale = own / pulled
    elif entry["workers"]:  # at most what its workers did (not their start-up)
        entry["stall_s"] = min(own, (entry["worker_busy_s"] or 0.0) / entry["workers"])
    else:
        entry["stall_s"] = own
    for child in children:
        _stall(child, scale, tree)


def _add_sources(
    stage: CheckpointableIterator[Any],
    entry: StageStats,
    children: list[StageStats],
    exact: dict[int, float],
) -> float:
    """Complete `entry` with its sources' entries (`children`, complete already); return
    the time of the steps timed in full in its pulls (`exact`: theirs, by entry)."""
    probe = probe_of(stage)
    runs_in = entry["runs_in"]
    own = 0.0 if probe is None else probe.exact_s
    own += sum(exact[id(child)] for child in children if child["runs_in"] == runs_in)
    if probe is not None:  # the sampled rest, plus every step timed in full in its pulls
        entry["time_s"] = entry["self_s"] = probe.estimated_s + own
    if probe is not None and children:
        entry["items_in"] = sum(child["items_out"] or 0 for child in children)
        upstream = sum(child["time_s"] or 0.0 for child in children if child["runs_in"] == runs_in)
        time_s = max(entry["time_s"] or 0.0, upstream)  # it includes its sources' pulls
        entry["time_s"], entry["upstream_s"], entry["self_s"] = time_s, upstream, time_s - upstream
    if children and children[0]["runs_in"] != runs_in:  # a prefetcher: its worker's time pulling
        entry["worker_busy_s"] = children[0]["time_s"]
    entry["work_s"] = _work(stage, entry)
    return own


def _sources_run_in(
    stage: CheckpointableIterator[Any], probe: StageProbe | None, path: str, runs_in: str
) -> str:
    """Where the items of the sources of `stage` (at `path`, running in `runs_in`) are
    pulled: a prefetcher's worker thread or process, else where `stage` runs."""
    where = stage._source_pulled_in(probe) if isinstance(stage, BackgroundStage) else None
    return runs_in if probe is None or where is None else f"worker {where} of {path}"


def _entry(
    stage: CheckpointableIterator[Any],
    probe: StageProbe | None,
    place: Place,
    runs_in: str,
    wall: float,
) -> StageStats:
    items = None if probe is None else probe.items_out
    time_s = None if probe is None else probe.estimated_s
    entry: StageStats = {
        "path": place.path,
        "pattern": place.pattern,
        "stage": type(stage).__name__,
        "depth": place.depth,
        "runs_in": runs_in,
        "items_in": None,
        "items_out": items,
        "items_per_s": None if items is None or wall <= 0 else items / wall,
        "time_s": time_s,
        "upstream_s": None if probe is None else 0.0,
        "self_s": time_s,
        "worker_busy_s": None,
        "workers": None,
        "queue_fill": None,
        "unit": "items",
        "in_flight": None,
        "work_s": 0.0,
        "share": 0.0,
        "collective_s": None,
        "slowest_rank": None,
        "stall_s": 0.0,
        "stall_share": 0.0,
        "wall_s": wall,
    }
    if probe is not None and probe.waited_for:
        entry["collective_s"] = probe.collective_s
        entry["slowest_rank"] = max(probe.waited_for, key=probe.waited_for.__getitem__)
    gauges = current_gauges(stage)
    if probe is not None and gauges is not None:
        entry["queue_fill"], entry["in_flight"] = gauges.queue_fill, gauges.in_flight
        entry["unit"] = gauges.unit
        if gauges.workers is not None:
            entry["workers"] = gauges.workers
            entry["worker_busy_s"] = probe.worker_busy_s + gauges.busy_s
    return entry


def _work(stage: object, entry: StageStats) -> float:
    if not isinstance(stage, BackgroundStage):
        return entry["self_s"] or 0.0
    if entry["workers"]:
        return (entry["worker_busy_s"] or 0.0) / entry["workers"]
    return 0.0


def limiting(entries: list[StageStats]) -> StageStats | None:
    """The stage that limits throughput: the one that causes the largest part of the
    consumer's wait for data (`stall_s`), or None if none caused any. A background
    stage that keeps ahead of the consumer is never it, however busy its workers.

    The copies of a stage in the shard pipelines of a `ShardedIterator` (one `pattern`)
    count as one stage: their entries added up, its `path` the pattern (per worker:
    workers run in parallel, the shards of one worker one after the other)."""
    slowest = max((entry for entry, _ in pooled(entries)), key=_stall_of, default=None)
    return slowest if slowest is not None and slowest["stall_s"] > 0 else None


def _stall_of(entry: StageStats) -> float:
    return entry["stall_s"]


_COUNTERS = (
    "items_in",
    "items_out",
    "items_per_s",
    "time_s",
    "upstream_s",
    "self_s",
    "worker_busy_s",
    "queue_fill",
    "in_flight",
    "share",
    "collective_s",
    "stall_s",
    "stall_share",
)


_SUMMED = (*(name for name in _COUNTERS if name != "queue_fill"), "workers", "work_s")
"""The counters that `pooled` adds up (the buffer fill is averaged)."""


def pooled(entries: list[StageStats]) -> list[tuple[StageStats, int]]:
    """`entries` with those of one `pattern` merged (at the first one's place): counters
    added up, the buffer fill averaged, the path the pattern; and how many were merged."""
    groups: dict[str, list[StageStats]] = {}
    for entry in entries:
        groups.setdefault(entry["pattern"], []).append(entry)
    out = []
    for pattern, group in groups.items():
        if len(group) == 1:
            out.append((group[0], 1))
            continue
        merged = StageStats(**{**group[0], "path": pattern})
        for name in _SUMMED:
            values = [entry[name] for entry in group]  # type: ignore[literal-required]
            if all(value is not None for value in values):
                merged[name] = sum(values)  # type: ignore[literal-required]
        fills = [entry["queue_fill"] for entry in group if entry["queue_fill"] is not None]
        merged["queue_fill"] = sum(fills) / len(fills) if fills else None
        out.append((merged, len(group)))
    return out


def flat(pipeline: CheckpointableIterator[Any], prefix: str = "data/") -> dict[str, float]:
    """The counters of `collect` as one flat dict for TensorBoard or Weights & Biases:
    ``{prefix + stage path + "/" + counter: number}``, the path written with ``/``
    (``data/BucketedReadaheadBatchIterator/MapIterator/items_out``; a source of a
    multi-source stage as ``WeightedMultiplexIterator[1]/...``; counters that do not
    apply left out), plus ``prefix + "consumer_wait_share"``
    (the share of the wall time the consumer spent waiting for data) and this process's
    reads from object stores since statistics were switched on, ``prefix + "storage/" +
    name`` for each count of `storage`
    (``data/storage/requests``, ``data/storage/cache_hits``, ...).

    E.g. ``for key, value in stats.flat(it).items(): writer.add_scalar(key, value, step)``
    or ``wandb.log(stats.flat(it), step=step)``.
    """
    entries = collect(pipeline)
    out: dict[str, float] = {}
    for entry in entries:
        key = prefix + _key(entry["path"])
        for name in _COUNTERS:
            value = entry[name]  # type: ignore[literal-required]
            if value is not None:
                out[f"{key}/{name}"] = float(value)
    out[prefix + "consumer_wait_share"] = consumer_wait_share(entries)
    counts = storage(pipeline)
    out.update({f"{prefix}storage/{name}": float(value) for name, value in counts.items()})
    return out


def _key(path: str) -> str:
    return path.replace(".source > ", "/").replace(".sources[", "[").replace("] > ", "]/")


def consumer_wait_share(entries: list[StageStats]) -> float:
    """The share of the wall time that the consumer spent waiting in ``next()``."""
    root = entries[0]
    return min(1.0, (root["time_s"] or 0.0) / root["wall_s"]) if root["wall_s"] > 0 else 0.0
