"""One rank of the elastic jobs that test/test_distributed.py launches with torchrun: a
chain of jobs on changing numbers of ranks, each killed mid-pass after a checkpoint.

Usage: ``torchrun --standalone --nproc_per_node=N test/_torchrun_elastic.py STEP OUT_DIR [last]``

Job STEP restores ``OUT_DIR/checkpoint-STEP.pt`` (saved by the previous job, on its own
number of ranks; none for step 0), then reads part of a finite shuffled pass (batches
made inside the shards) and of an endless stream, gathers one checkpoint that rank 0
saves as ``checkpoint-STEP+1.pt``, reads a little more, and dies hard (``os._exit``):
what it read after the checkpoint is lost. The ``last`` job reads the rest of the pass
and exits normally. After a restore, rank 0 also continues the same checkpoint on one
simulated rank (in-process): the reference for the endless stream.

Each rank writes what it saw to ``OUT_DIR/stepSTEP-rankR.json``.
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

import infinibatch_like.iterators as it
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import gather_state, rank_and_world_size, restore_state
from infinibatch_like.distributed.elastic import elastic_state
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.stages.sources import create_source_iterator

CORPUS = [[f"c{chunk:02d}-{line}" for line in range(chunk % 7 + 1)] for chunk in range(30)]
SHARDS = 12
ENDLESS_ITEMS = 36


def read_chunk(chunk: int) -> list[str]:
    return CORPUS[chunk]


def finite_shard(shard: int, num_shards: int) -> it.CheckpointableIterator[list[str]]:
    """One shuffled pass (epochs=1) over the shard's chunks, batched by 3 in the shard."""
    chunks = list(range(shard, len(CORPUS), num_shards))
    items = chunked_dataset_iterator(chunks, read_chunk, buffer_size=4, seed=shard, epochs=1)
    return it.FixedBatchIterator(items, 3)


def endless_shard(shard: int, num_shards: int) -> it.CheckpointableIterator[str]:
    chunks = list(range(shard, len(CORPUS), num_shards))
    items = it.SelectManyIterator(create_source_iterator(chunks, seed=100 + shard), read_chunk)
    return it.BlockwiseShuffleIterator(items, 5, seed=200 + shard)


def pipelines(rank: int, world_size: int) -> tuple[Any, Any]:
    finite = it.MapIterator(ShardedIterator(finite_shard, SHARDS, rank, world_size), tuple)
    endless = ShardedIterator(endless_shard, SHARDS, rank, world_size)
    return finite, endless


def write(out: Path, step: int, rank: int, report: dict[str, Any]) -> None:
    path = out / f"step{step}-rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)


def main(step: int, out: Path, last: bool) -> None:
    dist.init_process_group("gloo")
    rank, world_size = rank_and_world_size()
    finite, endless = pipelines(rank, world_size)
    report: dict[str, Any] = {"world_size": world_size, "shards": endless.shards}
    if step:
        saved = torch.load(out / f"checkpoint-{step}.pt", weights_only=True)
        restore_state(finite, saved["finite"])
        restore_state(endless, saved["endless"])
        report["start"] = {str(shard): count for shard, count in endless.delivered.items()}
        if rank == 0:  # the same checkpoint continued on a single rank
            single = ShardedIterator(endless_shard, SHARDS, 0, 1)
            single.setstate(elastic_state(single, saved["endless"]["ranks"], 0, 1))
            report["single"] = list(islice(single, ENDLESS_ITEMS * 2))
    report["endless"] = list(islice(endless, ENDLESS_ITEMS // world_size))
    if last:
        report["finite"] = list(finite)
        write(out, step, rank, report)
        dist.destroy_process_group()
        return
    report["finite"] = list(islice(finite, 2 + rank))  # uneven progress per rank
    data = {"finite": gather_state(finite), "endless": gather_state(endless)}
    if rank == 0:
        torch.save(data, out / f"checkpoint-{step + 1}.pt")
    dist.barrier()
    report["lost"] = list(islice(finite, 2))
    write(out, step, rank, report)
    dist.barrier()
    os._exit(3)  # killed mid-pass: no clean shutdown


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] == ["last"])
