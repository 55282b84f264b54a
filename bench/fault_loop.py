"""The training loop that `fault_harness` kills: a full pipeline, checkpoints, a consumed log.

``python bench/fault_loop.py WORKDIR CORPUS --batches N --every K --start-method M
--prefetch-mode P --nesting {flat,nested} [--arrays]`` trains on N batches (a
"model" that counts its steps and digests what it saw; 5 ms of work a step), reading two
gzip-chunked data sets through chunk read-ahead, weighted mixing, a prefetcher, a parallel
map and bucketing (with ``--arrays`` the parallel map adds a 72 kB numpy array to each
item, which the worker processes send through shared memory).
Every K steps it fsyncs the consumed log and saves the model and the data state with
`save_checkpoint` (``WORKDIR/ckpt-{step}.json``, the last 2 kept). Every batch it takes
is appended to ``WORKDIR/consumed.log`` (one JSON line, flushed, not fsync'd).

On start it loads the latest intact checkpoint, if any (none: a first run; all damaged:
the run fails rather than start over), truncates the log back to the length
recorded with it and restores the pipeline; so the log always ends up holding exactly the
batches the model trained on, as a run that was never interrupted would have. SIGTERM
is turned into SystemExit (a preemption notice: the loop stops, closing the pipeline,
without saving), SIGINT is Python's KeyboardInterrupt. A run that finishes writes
``WORKDIR/finished.json``: its file descriptors, threads and child processes before
building the pipeline and after closing it. ``WORKDIR/singletons-started`` tells the
harness that multiprocessing's own helper processes are up (from then on, the loop's
other children are the pipeline's workers). With ``--disk-full-at STEP``, the disk fills
up at the first save at or after STEP: from then on no file may grow past 512 bytes
(``RLIMIT_FSIZE``), so that save fails and the loop dies of the error.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/x.py` puts only bench/ on sys.path
    sys.path.insert(1, str(REPO_ROOT))

from _proc import children_of, command_of  # noqa: E402

from infinibatch_like import load_checkpoint, save_checkpoint  # noqa: E402
from infinibatch_like.datasets import chunked_dataset_iterator  # noqa: E402
from infinibatch_like.iterators import (  # noqa: E402
    BucketedReadaheadBatchIterator,
    CheckpointableIterator,
    ParallelMapIterator,
    PrefetchIterator,
    WeightedMultiplexIterator,
)

STEP_SECONDS = 0.005
CHECKPOINTS = "ckpt-{step}.json"


def read_gzip_lines(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as file:
        return file.read().splitlines()


def featurize(line: str) -> list[Any]:
    """The parallel map's work: the line and a digest of it (deterministic)."""
    return [line, hashlib.blake2s(line.encode(), digest_size=4).hexdigest()]


ARRAY_ITEMS = 9000
"""Items of the array of `featurize_with_array` (72 kB: above the shared-memory threshold)."""


def featurize_with_array(line: str) -> list[Any]:
    """`featurize`, plus a numpy array made from the line (which the worker processes send
    through shared memory)."""
    import numpy as np

    features = featurize(line)
    return [*features, np.full(ARRAY_ITEMS, int(features[1], 16), dtype=np.int64)]


def loggable(batch: list[Any]) -> list[Any]:
    """A batch as JSON: an item's array as its sum and length (a torn or reused segment
    would show in them)."""
    return [[*item[:2], [int(item[2].sum()), len(item[2])]] if len(item) > 2 else item
            for item in batch]


def line_length(item: list[Any]) -> int:
    return len(item[0])


def build_pipeline(
    corpus: Path, start_method: str, prefetch_mode: str, nesting: str, arrays: bool = False
) -> Any:
    datasets = [
        chunked_dataset_iterator(
            sorted(str(path) for path in (corpus / name).glob("*.gz")),
            read_gzip_lines,
            buffer_size=40,
            seed=seed,
            read_ahead_chunks=2,
        )
        for name, seed in (("a", 11), ("b", 12))
    ]
    mixed: CheckpointableIterator[Any] = WeightedMultiplexIterator(datasets, [2.0, 1.0], seed=3)

    def prefetch(source: CheckpointableIterator[Any]) -> CheckpointableIterator[Any]:
        return PrefetchIterator(
            source, 4, mode=prefetch_mode, start_method=start_method, snapshot_every=10
        )

    def parallel_map(source: CheckpointableIterator[Any]) -> CheckpointableIterator[Any]:
        transform = featurize_with_array if arrays else featurize
        return ParallelMapIterator(
            source, transform, 2, 4, start_method=start_method, snapshot_every=10
        )

    if nesting == "flat":
        featurized = parallel_map(prefetch(mixed))
    else:  # the pool lives inside the prefetcher's worker (process mode)
        featurized = prefetch(parallel_map(mixed))
    return BucketedReadaheadBatchIterator(featurized, 24, line_length, 4, seed=4)


def start_singletons(start_method: str) -> None:
    """Start multiprocessing's own helper processes, which live as long as the interpreter
    (the resource tracker; the fork server), so that the baseline of `snapshot_resources`
    includes them and only what the pipeline leaves behind shows as a difference."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    if start_method == "forkserver":
        forkserver.ensure_running()


def fill_disk() -> None:
    """From now on no file of this process may grow past 512 bytes, as on a full disk."""
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (512, hard))


def snapshot_resources() -> dict[str, Any]:
    children = sorted(f"{pid} {command_of(pid, 100)}" for pid in children_of(os.getpid()))
    return {
        "fds": sorted(os.listdir("/proc/self/fd")),
        "threads": sorted(thread.name for thread in threading.enumerate()),
        "children": children,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--batches", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--start-method", default="fork")
    parser.add_argument("--prefetch-mode", default="process")
    parser.add_argument("--nesting", choices=("flat", "nested"), default="flat")
    parser.add_argument("--disk-full-at", type=int, default=0, help="the disk fills at a save")
    parser.add_argument("--arrays", action="store_true", help="items carry a 72 kB array")
    args = parser.parse_args()

    def preempted(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, preempted)
    pattern = str(args.workdir / CHECKPOINTS)
    log_path = args.workdir / "consumed.log"
    try:
        checkpoint = load_checkpoint(pattern)
    except FileNotFoundError:  # no checkpoint yet (a damaged one is not: it falls back or raises)
        checkpoint = {"model": {"step": 0, "digest": ""}, "log_bytes": 0, "data": None}
    model = checkpoint["model"]
    start_singletons(args.start_method)
    (args.workdir / "singletons-started").touch()
    before = snapshot_resources()
    with open(log_path, "ab") as log:
        log.truncate(checkpoint["log_bytes"])
        with build_pipeline(
            args.corpus, args.start_method, args.prefetch_mode, args.nesting, args.arrays
        ) as pipeline:
            pipeline.setstate(checkpoint["data"])
            while model["step"] < args.batches:
                batch = next(pipeline)
                line = json.dumps(loggable(batch)).encode()
                model["digest"] = hashlib.sha256(model["digest"].encode() + line).hexdigest()
                model["step"] += 1
                time.sleep(STEP_SECONDS)  # the training step
                log.write(line + b"\n")
                log.flush()
                if model["step"] % args.every == 0:
                    os.fsync(log.fileno())
                    state = {"model": model, "log_bytes": log.tell(), "data": pipeline.getstate()}
                    if args.disk_full_at and model["step"] >= args.disk_full_at:
                        fill_disk()
                    save_checkpoint(pattern, state, step=model["step"], keep=2)
    after = snapshot_resources()
    (args.workdir / "finished.json").write_text(json.dumps({"before": before, "after": after}))


if __name__ == "__main__":
    main()
