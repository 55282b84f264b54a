"""One rank of the jobs that test/test_distributed.py launches with torchrun (gloo, CPU).

Usage: ``torchrun --standalone --nproc_per_node=N test/_torchrun_worker.py MODE OUT_DIR``

- ``first``: every check below, then a checkpoint of a mixing pipeline gathered on all
  ranks and saved by rank 0, a few more batches, and a hard exit (the job "crashes").
- ``resume``: restores the saved checkpoint on every rank and continues.
- ``three``: every check, and a restore of the 2-rank checkpoint (which must fail).

Each rank writes what it saw to ``OUT_DIR/MODE-rankR.json``.
"""

from __future__ import annotations

import json
import os
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import (
    EqualLengthIterator,
    gather_state,
    rank_and_world_size,
    restore_state,
)
from infinibatch_like.iterators import (
    CheckpointableIterator,
    FixedBatchIterator,
    WeightedMultiplexIterator,
)

TRAIN = [[f"t{chunk:02d}-{line}" for line in range(4)] for chunk in range(12)]
DIALOG = [[f"d{chunk}-{line}" for line in range(3)] for chunk in range(5)]
EVAL = [[f"e{chunk}-{line}" for line in range(chunk % 5 + 1)] for chunk in range(8)]
STEPS, CHECKPOINT_STEP, CURRICULUM_STEP = 20, 8, 5


CORPORA = {"train": TRAIN, "dialog": DIALOG, "eval": EVAL}


def read_chunk(ref: str) -> list[str]:
    name, index = ref.split(":")
    return CORPORA[name][int(index)]


def dataset(name: str, rank: int, world_size: int, **options: Any) -> CheckpointableIterator[str]:
    """This rank's share of one corpus (chunk references "name:index")."""
    refs = [f"{name}:{index}" for index in range(len(CORPORA[name]))]
    return chunked_dataset_iterator(
        refs, read_chunk, buffer_size=4, num_instances=world_size, instance_rank=rank, **options
    )


def eval_batches(rank: int, world_size: int) -> FixedBatchIterator[str]:
    return FixedBatchIterator(dataset("eval", rank, world_size, train=False, shuffle=False), 2)


class Mixture:
    """Batches of two training sets mixed 3:1, then 1:1 from batch CURRICULUM_STEP on."""

    def __init__(self, rank: int, world_size: int) -> None:
        sets = [
            dataset("train", rank, world_size, seed=1),
            dataset("dialog", rank, world_size, seed=2),
        ]
        self.mixer = WeightedMultiplexIterator(sets, [3, 1], seed=11)
        self.batches = FixedBatchIterator(self.mixer, 4)

    def run(self, start: int, stop: int) -> list[list[str]]:
        """The batches of steps start, start + 1, ..., stop - 1."""
        batches = []
        for step in range(start, stop):
            if step == CURRICULUM_STEP:
                self.mixer.set_weights([1, 1])
            batches.append(next(self.batches))
        return batches


def equal_length(rank: int, world_size: int, policy: str) -> dict[str, Any]:
    """An evaluation pass of equal length; with "pad", also a mid-pass gather and restore."""
    pipeline = EqualLengthIterator(eval_batches(rank, world_size), policy)
    batches, padding, gathered = [], [], None
    for step, batch in enumerate(pipeline):
        batches.append(batch)
        padding.append(pipeline.last_is_padding)
        if step == 1:
            gathered = gather_state(pipeline)
    report: dict[str, Any] = {"batches": batches, "padding": padding, "counts": pipeline.counts}
    if policy == "pad":
        assert gathered is not None
        fresh = EqualLengthIterator(eval_batches(rank, world_size), policy)
        restore_state(fresh, gathered)
        report["resumed"], report["resumed_at"] = list(fresh), 2
    return report


def checks(rank: int, world_size: int) -> dict[str, Any]:
    train = dataset("train", rank, world_size, seed=7)
    per_pass = len(TRAIN) // world_size * len(TRAIN[0])
    return {
        "rank_and_world_size": list(rank_and_world_size()),
        "train_corpus": [line for chunk in TRAIN for line in chunk],
        "train_passes": [list(islice(train, per_pass)) for _ in range(2)],
        "eval_corpus": [line for chunk in EVAL for line in chunk],
        "eval_items": [line for batch in eval_batches(rank, world_size) for line in batch],
        "eval_batches": list(eval_batches(rank, world_size)),
        "equal_pad": equal_length(rank, world_size, "pad"),
        "equal_drop": equal_length(rank, world_size, "drop"),
    }


def write(out: Path, mode: str, rank: int, report: dict[str, Any]) -> None:
    path = out / f"{mode}-rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = rank_and_world_size()
    checkpoint = out / "checkpoint.pt"
    report: dict[str, Any] = {}
    if mode in ("first", "three"):
        report = checks(rank, world_size)
        report["reference"] = Mixture(rank, world_size).run(0, STEPS)
        mixture = Mixture(rank, world_size)
        mixture.run(0, CHECKPOINT_STEP)
        report["gathered"] = gather_state(mixture.batches)
        report["checkpoint_step"] = CHECKPOINT_STEP
    if mode == "first":
        if rank == 0:
            torch.save({"data": report["gathered"], "step": CHECKPOINT_STEP}, checkpoint)
        dist.barrier()
        report["after_checkpoint"] = mixture.run(CHECKPOINT_STEP, CHECKPOINT_STEP + 3)
        write(out, mode, rank, report)
        dist.barrier()
        os._exit(3)  # killed mid-run: no clean shutdown
    saved = torch.load(checkpoint, weights_only=True)
    resumed = Mixture(rank, world_size)
    if mode == "resume":
        restore_state(resumed.batches, saved["data"])
        report["resumed_from"] = saved["step"]
        report["batches"] = resumed.run(saved["step"], STEPS)
    else:
        try:
            restore_state(resumed.batches, saved["data"])
            report["mismatch"] = "no error"
        except ValueError as error:
            report["mismatch"] = str(error)
    write(out, mode, rank, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
