"""The fan-out processes that `fault_harness.run_fanout_campaign` kills: an owner serving
the pipeline of `fault_loop.py` to consumer processes, each a training loop of its own.

``python bench/fault_fanout_loop.py owner WORKDIR CORPUS --consumers C --start-method M
--prefetch-mode P --nesting {flat,nested} [--arrays]`` builds the pipeline of
``fault_loop.py`` (``build_pipeline``; with ``--arrays`` its items carry numpy arrays,
which the consumers map from the owner's shared memory: every other item's array is
moved into an array made there, `shared_empty`, which is sent where it lies, and the
others are copied into the fan-out's own segments), serves it in ``"replicate"``
mode at ``WORKDIR/fan.sock`` and exits once every consumer has closed (or on SIGTERM). A
restarted owner (its predecessor killed with SIGKILL) serves where its predecessor did
(`serve` replaces the socket file a dead owner left); it starts its pipeline from the
beginning, and each consumer that attaches moves it to that consumer's own checkpoint.

``python bench/fault_fanout_loop.py consumer WORKDIR INDEX --batches N --every K`` attaches
to consumer INDEX and trains on N batches as ``fault_loop.py`` does: every batch goes to
``WORKDIR/consumer-INDEX/consumed.log`` (and a line to ``attached.log`` at each attach),
every K steps the log is fsync'd and the
consumer's state saved (``ckpt-{step}.json``, the last 2 kept). On start it loads its
latest checkpoint, truncates its log to the length recorded with it and restores its own
consumer (the others going on), or moves it to the start if there is no checkpoint yet.
When its owner dies (`WorkerError`), it does the same again, as a restarted job would: it
attaches to the restarted owner (waiting for it) and restores its latest checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(1, str(REPO_ROOT))

from fault_loop import CHECKPOINTS, STEP_SECONDS, build_pipeline, loggable  # noqa: E402

from infinibatch_like import (  # noqa: E402
    FanOut,
    MapIterator,
    WorkerError,
    attach,
    load_checkpoint,
    save_checkpoint,
    shared_empty,
)

SOCKET = "fan.sock"
ATTACHED = "attached.log"
OWNER_RESTARTS = 10
"""How many times a consumer re-attaches after losing its owner before it gives up."""


def half_in_shared_memory(batch: list[Any]) -> list[Any]:
    """`batch`, the arrays of its even items moved into arrays made in shared memory (the
    same values)."""
    moved = []
    for index, item in enumerate(batch):
        if len(item) > 2 and index % 2 == 0:
            array = shared_empty(item[2].shape, item[2].dtype)
            array[...] = item[2]
            item = [*item[:2], array]
        moved.append(item)
    return moved


def owner(args: argparse.Namespace) -> None:
    def preempted(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, preempted)
    address = args.workdir / SOCKET
    pipeline = build_pipeline(
        args.corpus, args.start_method, args.prefetch_mode, args.nesting, args.arrays
    )
    if args.arrays:
        pipeline = MapIterator(pipeline, half_in_shared_memory)
    with FanOut(pipeline, args.consumers, max_lag=4, timeout=60) as fan:
        fan.serve(str(address))
        while not fan.closed:
            time.sleep(0.05)


def consumer(args: argparse.Namespace) -> None:
    for restart in range(OWNER_RESTARTS + 1):
        try:
            train(args)
            return
        except WorkerError as error:  # the owner died: restart from the latest checkpoint
            if restart == OWNER_RESTARTS:
                raise
            print(f"consumer {args.index} restarts: {error}", file=sys.stderr, flush=True)


def train(args: argparse.Namespace) -> None:
    """Train from the latest checkpoint (or the start) to the end."""
    directory = args.workdir / f"consumer-{args.index}"
    directory.mkdir(exist_ok=True)
    pattern = str(directory / CHECKPOINTS)
    try:
        checkpoint = load_checkpoint(pattern)
    except FileNotFoundError:
        checkpoint = {"model": {"step": 0, "digest": ""}, "log_bytes": 0, "data": None}
    model = checkpoint["model"]
    with open(directory / "consumed.log", "ab") as log, attach(
        str(args.workdir / SOCKET), args.index, timeout=30
    ) as batches:
        log.truncate(checkpoint["log_bytes"])
        with open(directory / ATTACHED, "a") as attached:  # after the truncation
            attached.write(f"{os.getpid()}\n")
        batches.setstate(checkpoint["data"])  # this consumer alone; None: the start
        while model["step"] < args.batches:
            line = json.dumps(loggable(next(batches))).encode()
            model["digest"] = hashlib.sha256(model["digest"].encode() + line).hexdigest()
            model["step"] += 1
            time.sleep(STEP_SECONDS)
            log.write(line + b"\n")
            log.flush()
            if model["step"] % args.every == 0:
                os.fsync(log.fileno())
                state = {"model": model, "log_bytes": log.tell(), "data": batches.getstate()}
                save_checkpoint(pattern, state, step=model["step"], keep=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roles = parser.add_subparsers(dest="role", required=True)
    serving = roles.add_parser("owner")
    serving.add_argument("workdir", type=Path)
    serving.add_argument("corpus", type=Path)
    serving.add_argument("--consumers", type=int, default=2)
    serving.add_argument("--start-method", default="fork")
    serving.add_argument("--prefetch-mode", default="process")
    serving.add_argument("--nesting", choices=("flat", "nested"), default="flat")
    serving.add_argument(
        "--arrays",
        action="store_true",
        help="items carry a 72 kB array (consumers map it from the owner's shared memory)",
    )
    reading = roles.add_parser("consumer")
    reading.add_argument("workdir", type=Path)
    reading.add_argument("index", type=int)
    reading.add_argument("--batches", type=int, required=True)
    reading.add_argument("--every", type=int, required=True)
    args = parser.parse_args()
    (owner if args.role == "owner" else consumer)(args)


if __name__ == "__main__":
    main()
