"""`report`: the chain as a readable tree, with the limiting stage and the consumer's wait."""

from __future__ import annotations

from typing import Any

from .._core.protocol import CheckpointableIterator
from ._collect import StageStats, collect, consumer_wait_share, limiting, pooled
from ._storage import storage, storage_line

STARVED = 0.05
"""A consumer that waits for data longer than this share of the time is data-bound."""


def report(pipeline: CheckpointableIterator[Any]) -> str:
    """A readable tree of `pipeline`'s stages (outermost first) with items/s, each stage's
    share of the pipeline's work and its own time, the stage that limits throughput, and
    how long the consumer (the training loop) waited for data. Background stages show
    their buffer fill and what is in flight, and their workers' busy time. The shard
    pipelines of a `ShardedIterator` show once per worker, their counters added up over
    its shards (``MapIterator x16``).

    A last line tells what this process and the worker processes of its stages fetched
    from object stores since statistics were switched on, if anything (see `storage`).

    Statistics must be on (`enable`). Raises ValueError if they are off.
    """
    text = render(collect(pipeline))
    line = storage_line(storage(pipeline))
    return text if line is None else f"{text}\n{line}"


def render(entries: list[StageStats]) -> str:
    """The text of `report` for `entries` (a `collect` result)."""
    lines = [
        f"pipeline statistics over {entries[0]['wall_s']:.2f} s "
        f"(items/s, share of the pipeline's work, share of the consumer's wait it causes, "
        "own time)"
    ]
    for entry, copies in pooled(entries):
        lines.append(_line(entry, copies))
    lines.append(_verdict(entries))
    return "\n".join(lines)


def _line(entry: StageStats, copies: int) -> str:
    indent = "   " * entry["depth"] + ("└─ " if entry["depth"] else "")
    name = f"{indent}{entry['stage']}" + (f" x{copies}" if copies > 1 else "")
    if entry["items_out"] is None:
        return f"{name:<52} (no statistics: not a stage of this library)"
    rate = entry["items_per_s"]
    text = f"{name:<52} {0 if rate is None else rate:>12,.0f}/s {100 * entry['share']:5.1f} %"
    text += f"  wait {100 * entry['stall_share']:5.1f} %  own {entry['self_s'] or 0.0:7.3f} s"
    if entry["collective_s"]:
        text += (
            f"  waiting for other ranks {entry['collective_s']:.3f} s (mostly rank "
            f"{entry['slowest_rank']})"
        )
    reads_chunks = entry["unit"] == "chunks"
    if entry["workers"]:
        who = "readers" if reads_chunks else "workers"
        text += f"  {who} busy {entry['worker_busy_s'] or 0.0:.3f} s over {entry['workers']}"
    if entry["queue_fill"] is not None:
        text += f"  buffer {100 * entry['queue_fill']:.0f} % full"
    if entry["in_flight"] is not None:
        text += f", {entry['in_flight']} {'chunks' if reads_chunks else 'items'} in flight"
    if entry["runs_in"] != "consumer":
        text += f"  [{entry['runs_in']}]"
    return text


def _verdict(entries: list[StageStats]) -> str:
    root = entries[0]
    wait = consumer_wait_share(entries)
    text = f"the consumer waited {root['time_s'] or 0.0:.2f} s for data ({100 * wait:.1f} %)"
    collective = sum(entry["collective_s"] or 0.0 for entry in entries)
    if collective > 0:
        waits = [entry for entry in entries if entry["collective_s"]]
        rank = max(waits, key=lambda entry: entry["collective_s"] or 0.0)["slowest_rank"]
        text += (
            f", {collective:.2f} s of it in collectives waiting for other ranks (mostly "
            f"for rank {rank}, the last to arrive)"
        )
        wait = max(0.0, (root["time_s"] or 0.0) - collective) / root["wall_s"] if wait else 0.0
    slowest = limiting(entries)
    if wait < STARVED:
        if collective > STARVED * root["wall_s"]:
            text += ": this rank's pipeline keeps up; the wait is for a slower rank"
        else:
            text += ": the training loop is the limit, not the data"
        return text if slowest is None else f"{text}; most of the wait: {_named(slowest)}"
    if slowest is None:
        return f"{text}; no stage caused measurable waiting yet"
    return f"{text}: data-bound; limiting stage: {_named(slowest)}"


def _named(entry: StageStats) -> str:
    return f"{entry['path']} ({100 * entry['stall_share']:.0f} % of the wait)"
