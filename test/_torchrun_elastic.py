"""One rank of the elastic jobs that test/test_distributed.py launches with torchrun.

Usage: ``torchrun --standalone --nproc_per_node=N test/_torchrun_elastic.py MODE OUT_DIR``

- ``first``: each rank reads part of a finite shuffled pass (batches made inside the
  shards) and of an endless stream, the ranks gather one checkpoint that rank 0 saves,
  read a little more, and the job dies hard (``os._exit``): what they read after the
  checkpoint is lost.
- ``resume`` (on another number of ranks): every rank restores the checkpoint, reads the
  rest of the finite pass and some of the endless stream; rank 0 also restores the same
  checkpoint on one simulated rank (in-process) as the reference for the endless stream.

Each rank writes what it saw to ``OUT_DIR/MODE-rankR.json``.
"""

from __future__ import annotations

import json
import os
import random
import sys
from itertools import islice
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import infinibatch_like.iterators as it
from infinibatch_like.distributed import gather_state, rank_and_world_size, restore_state
from infinibatch_like.elastic import elastic_state
from infinibatch_like.sharded import ShardedIterator
from infinibatch_like.sources import create_source_iterator

CORPUS = [[f"c{chunk:02d}-{line}" for line in range(chunk % 7 + 1)] for chunk in range(30)]
SHARDS = 12
ENDLESS_ITEMS = 60


def read_chunk(chunk: int) -> list[str]:
    return CORPUS[chunk]


def finite_shard(shard: int, num_shards: int) -> it.CheckpointableIterator[list[str]]:
    """One shuffled pass over the shard's chunks, batched by 3 inside the shard."""
    chunks = list(range(shard, len(CORPUS), num_shards))
    random.Random(shard).shuffle(chunks)
    source = create_source_iterator(chunks, train=False, shuffle=False)
    items = it.SelectManyIterator(source, read_chunk)
    return it.FixedBatchIterator(it.BlockwiseShuffleIterator(items, 4, seed=shard), 3)


def endless_shard(shard: int, num_shards: int) -> it.CheckpointableIterator[str]:
    chunks = list(range(shard, len(CORPUS), num_shards))
    items = it.SelectManyIterator(create_source_iterator(chunks, seed=100 + shard), read_chunk)
    return it.BlockwiseShuffleIterator(items, 5, seed=200 + shard)


def pipelines(rank: int, world_size: int) -> tuple[Any, Any]:
    finite = it.MapIterator(ShardedIterator(finite_shard, SHARDS, rank, world_size), tuple)
    endless = ShardedIterator(endless_shard, SHARDS, rank, world_size)
    return finite, endless


def write(out: Path, mode: str, rank: int, report: dict[str, Any]) -> None:
    path = out / f"{mode}-rank{rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(report))
    path.with_suffix(".tmp").replace(path)


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = rank_and_world_size()
    checkpoint = out / "checkpoint.pt"
    finite, endless = pipelines(rank, world_size)
    report: dict[str, Any] = {"world_size": world_size}
    if mode == "first":
        report["finite"] = list(islice(finite, 2 + 2 * rank))  # uneven progress per rank
        report["endless"] = list(islice(endless, 5 + 3 * rank))
        data = {"finite": gather_state(finite), "endless": gather_state(endless)}
        if rank == 0:
            torch.save(data, checkpoint)
        dist.barrier()
        report["lost"] = list(islice(finite, 2))
        write(out, mode, rank, report)
        dist.barrier()
        os._exit(3)  # killed mid-pass: no clean shutdown
    saved = torch.load(checkpoint, weights_only=True)
    restore_state(finite, saved["finite"])
    restore_state(endless, saved["endless"])
    report["shards"] = endless.shards
    report["start"] = {str(shard): count for shard, count in endless.delivered.items()}
    report["finite"] = list(finite)
    report["endless"] = list(islice(endless, ENDLESS_ITEMS))
    if rank == 0:  # the same checkpoint continued on a single rank
        single = ShardedIterator(endless_shard, SHARDS, 0, 1)
        single.setstate(elastic_state(single, saved["endless"]["ranks"], 0, 1))
        report["single"] = list(islice(single, ENDLESS_ITEMS * world_size * 2))
    write(out, mode, rank, report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
