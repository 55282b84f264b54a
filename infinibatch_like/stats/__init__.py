"""Per-stage statistics of a pipeline: where the time goes, which stage limits throughput,
and whether the training loop waits for data.

```python
from infinibatch_like import stats

stats.enable(pipeline)          # at run time; stats.disable(pipeline) switches them off
for step, batch in enumerate(pipeline):
    train_step(batch)
    if step % 1000 == 0:
        print(stats.report(pipeline))                 # a tree, the limiting stage named
        writer_log(stats.flat(pipeline), step)        # {"data/<stage path>/items_out": ...}
```

Off (the default), stages run exactly the iterators they build, with no wrapper and no
counter. On, every stage counts its items exactly and times a random sample of its pulls
(one in `sample_every` on average, every pull of a slow stage); counters of worker
processes come back with their messages a few times per second. Stages that work ahead
(prefetchers, parallel maps, chunk read-ahead) also show gauges read at the time of the
call: their buffer fill, what is in flight and their workers' busy time. `storage` tells
what this process and the worker processes of its stages fetched from object stores
(requests, bytes, cache hits) since then, which `report` and `flat` include. Statistics
are never part of a checkpoint.

Modules: `_collect` (the counters as plain data), `_report` (the readable tree),
`_headspace` (the pipeline's and the consumer's rates), `_plot` (`History`), `_storage`
(object-store reads), `lineage` (which chunk and record each sample came from).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .._core.checks import require_int
from .._core.probe import instrument
from .._core.protocol import CheckpointableIterator
from ._collect import StageStats, collect, consumer_wait_share, flat, limiting
from ._headspace import Rate, consumer_rate, headspace
from ._plot import History
from ._report import report
from ._storage import mark, storage

__all__ = [
    "History",
    "Rate",
    "StageStats",
    "collect",
    "consumer_rate",
    "consumer_wait_share",
    "disable",
    "enable",
    "enabled",
    "flat",
    "headspace",
    "limiting",
    "report",
    "storage",
]


def enable(pipeline: CheckpointableIterator[Any], sample_every: int = 4096) -> None:
    """Switch statistics on for every stage of `pipeline`, with fresh counters.

    The pipeline is restored in place from its own state, which rebuilds its stages' item
    iterators with counters: the stream continues exactly where it was, at the cost of a
    restore (a block-wise shuffle re-reads its current block; background workers restart).
    Switch statistics on before iterating, or right after a restore, where this costs
    nothing extra. Stages of this library only: a user-defined iterator in the chain is
    left as it is (and its sources are not reached).

    Args:
        pipeline: the outermost stage (the one you iterate).
        sample_every: time one pull in this many on average (>= 1; 1 times every pull,
            which costs about a microsecond per item and stage). Items are always counted
            exactly.

    Checkpoint:
        Unchanged: states are exactly those without statistics.
    """
    require_int("stats.enable", "sample_every", sample_every, 1)
    instrument(pipeline, sample_every)
    mark(pipeline)


def disable(pipeline: CheckpointableIterator[Any]) -> None:
    """Switch statistics off: the stages go back to their plain iterators (restored in
    place, as in `enable`); their counters are dropped."""
    instrument(pipeline, None)


@contextlib.contextmanager
def enabled(
    pipeline: CheckpointableIterator[Any], sample_every: int = 4096
) -> Iterator[CheckpointableIterator[Any]]:
    """``with stats.enabled(pipeline):`` statistics on for the block, off after it."""
    enable(pipeline, sample_every)
    try:
        yield pipeline
    finally:
        if not getattr(pipeline, "_closed", False):
            disable(pipeline)
