"""Many ranks: two corpora mixed by weight on every rank, one checkpoint for the whole job,
an exact resume, and an evaluation pass of the same length on every rank.

Run it with ``torchrun --nproc_per_node=2 tutorials/03_many_ranks.py`` (any number of
processes works; CPU and the gloo backend, no GPU needed). Started with plain ``python``,
it runs as a job of one rank. It needs ``infinibatch_like`` and torch.

The story, top to bottom:

1. join the process group and find this process's rank;
2. write two corpora ("books" and "chat") as gzip chunks on storage all ranks share;
3. give each rank its share of each corpus and mix them 80:20 with
   ``WeightedMultiplexIterator``, then switch to 50:50 mid-training (a curriculum);
4. train a small DDP model; at step 20, gather every rank's data state into one dict that
   rank 0 saves next to the model;
5. "restart": fresh pipelines restore their rank's state and continue exactly;
6. evaluate on held-out chunks whose shares differ in length, with
   ``EqualLengthIterator`` so that every rank runs the same number of steps.

Every claim the comments make is checked with an ``assert``.
"""

# launch: torchrun --nproc_per_node=2   (test/test_tutorials.py reads this line)

from __future__ import annotations

import gzip
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

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

T = TypeVar("T")

# ---------------------------------------------------------------------------------------
# Step 1: the process group. torchrun sets RANK, WORLD_SIZE and the rendezvous address;
# under plain python we make a group of one. rank_and_world_size() reads the group, so it
# is the one call that wires ranks into the data pipeline.
# ---------------------------------------------------------------------------------------

torch.set_num_threads(1)
store = None
if "WORLD_SIZE" in os.environ:
    dist.init_process_group("gloo")
else:
    store = tempfile.mkdtemp(prefix="many_ranks_store_")
    dist.init_process_group("gloo", init_method=f"file://{store}/store", rank=0, world_size=1)
rank, world_size = rank_and_world_size()
assert (rank, world_size) == (dist.get_rank(), dist.get_world_size())


def say(message: str) -> None:
    if rank == 0:
        print(message, flush=True)


def everyone(value: T) -> list[T]:
    """`value` from every rank, in rank order (a collective)."""
    values: list[Any] = [None] * world_size
    dist.all_gather_object(values, value)
    return values


say(f"step 1: {world_size} rank(s), gloo on CPU")

# ---------------------------------------------------------------------------------------
# Step 2: two corpora in gzip chunks, written once by rank 0 into a folder every rank
# reads (on a cluster: shared storage). "books" has long lines, "chat" short ones; the
# held-out chunks of "books" are for evaluation.
# ---------------------------------------------------------------------------------------

rng = random.Random(7)
folder = [tempfile.mkdtemp(prefix="many_ranks_") if rank == 0 else None]
dist.broadcast_object_list(folder, src=0)
workdir = Path(str(folder[0]))


def write_chunks(name: str, lines: list[str], chunks: int) -> list[str]:
    paths = [str(workdir / f"{name}-{index:02d}.txt.gz") for index in range(chunks)]
    if rank == 0:
        for index, path in enumerate(paths):
            with gzip.open(path, "wt", encoding="utf-8") as out:
                out.writelines(line + "\n" for line in lines[index::chunks])
    return paths


books = [f"book{i} " + "word " * rng.randint(20, 60) for i in range(1200)]
chat = [f"chat{i} " + "hi " * rng.randint(1, 8) for i in range(400)]
held_out = [f"eval{i} " + "word " * rng.randint(5, 30) for i in range(101)]
book_chunks = write_chunks("books", books, 12)
chat_chunks = write_chunks("chat", chat, 4)
eval_chunks = write_chunks("eval", held_out, 5)
dist.barrier()  # the files exist before any rank reads them
say(f"step 2: {len(books)} book lines, {len(chat)} chat lines, {len(held_out)} held out")


def read_chunk(path: str) -> Iterator[str]:
    with gzip.open(path, "rt", encoding="utf-8") as chunk:
        return iter(chunk.read().splitlines())


# ---------------------------------------------------------------------------------------
# Step 3: each rank reads its own share of each corpus (num_instances / instance_rank from
# rank_and_world_size), and one WeightedMultiplexIterator mixes them. With the same seed
# every rank draws the same sequence of sources, so all ranks mix alike.
# ---------------------------------------------------------------------------------------


class TrainingData:
    """The pipeline of this rank: two corpora mixed by weight, in batches of 8 lines."""

    def __init__(self) -> None:
        shares = [
            chunked_dataset_iterator(
                chunks,
                read_chunk,
                buffer_size=200,
                seed=seed,
                num_instances=world_size,
                instance_rank=rank,
            )
            for chunks, seed in [(book_chunks, 1), (chat_chunks, 2)]
        ]
        self.mixer = WeightedMultiplexIterator(shares, weights=[0.8, 0.2], seed=3)
        self.batches: CheckpointableIterator[list[str]] = FixedBatchIterator(self.mixer, 8)


data = TrainingData()
first = [next(data.batches) for _ in range(50)]
chat_share = sum(line.startswith("chat") for batch in first for line in batch) / 400
assert 0.1 < chat_share < 0.3, chat_share  # about 20% chat lines
pattern = [[line.startswith("chat") for line in batch] for batch in first]
assert all(other == pattern for other in everyone(pattern)), "ranks mix alike"
say(f"step 3: {chat_share:.0%} of rank 0's lines are chat (weights 0.8 : 0.2)")

# ---------------------------------------------------------------------------------------
# Step 4: train. A stand-in model learns a line's word count from its length in
# characters; DDP averages gradients across ranks at every step. From step 15 the
# mixture is 50:50. At step 20 gather_state collects every rank's data state (a
# collective call) and rank 0 saves it with the model.
# ---------------------------------------------------------------------------------------


def features(batch: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([[len(line) / 100] for line in batch])
    words = torch.tensor([[len(line.split()) / 10] for line in batch])
    return lengths, words


torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(1, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
checkpoint_path = workdir / "checkpoint.pt"
data = TrainingData()
seen_after_checkpoint = []
for step in range(30):
    if step == 15:
        data.mixer.set_weights([0.5, 0.5])  # part of the state from here on
    if step == 20:
        gathered = gather_state(data.batches)
        if rank == 0:
            torch.save(
                {"model": model.module.state_dict(), "data": gathered, "step": step},
                checkpoint_path,
            )
        dist.barrier()  # the file is complete before anyone could read it
    batch = next(data.batches)
    if step >= 20:
        seen_after_checkpoint.append(batch)
    inputs, targets = features(batch)
    loss = nn.functional.mse_loss(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
assert gathered["world_size"] == len(gathered["ranks"]) == world_size
assert everyone(gathered) == [gathered] * world_size  # the same dict on every rank
say(f"step 4: 30 steps trained, checkpoint of step 20 in {checkpoint_path.name}")

# ---------------------------------------------------------------------------------------
# Step 5: after a crash, every rank builds its pipeline again, loads the one checkpoint
# (plain data: weights_only=True loads it) and takes its own part with restore_state.
# The batches are exactly those the interrupted run saw, curriculum included.
# ---------------------------------------------------------------------------------------

saved = torch.load(checkpoint_path, weights_only=True)
resumed = TrainingData()
restore_state(resumed.batches, saved["data"])
assert resumed.mixer.weights == [0.5, 0.5]  # the curriculum's change was restored too
again = [next(resumed.batches) for _ in range(saved["step"], 30)]
assert again == seen_after_checkpoint
say(f"step 5: resumed at step {saved['step']}: {len(again)} batches identical on every rank")

# ---------------------------------------------------------------------------------------
# Step 6: evaluation. One ordered pass over the held-out chunks, each rank a contiguous
# share; the shares differ in length, and a collective per step (here the loss sum)
# would hang on the rank that has more batches. EqualLengthIterator lets the ranks agree
# on the number of steps; ranks that run out yield empty batches (fill=list), which
# last_is_padding flags, so nothing is counted twice.
# ---------------------------------------------------------------------------------------

evaluation = EqualLengthIterator(
    FixedBatchIterator(
        chunked_dataset_iterator(
            eval_chunks,
            read_chunk,
            buffer_size=1,
            train=False,
            shuffle=False,
            num_instances=world_size,
            instance_rank=rank,
        ),
        4,
    ),
    policy="pad",
    fill=list,
)
steps, lines_seen, squared_error, line_count = 0, [], 0.0, 0
with torch.no_grad():
    for batch in evaluation:
        steps += 1
        step_total = torch.zeros(2)  # (squared error, lines) of this step on this rank
        if not evaluation.last_is_padding:
            lines_seen += batch
            inputs, targets = features(batch)
            step_total[0] = nn.functional.mse_loss(model(inputs), targets, reduction="sum")
            step_total[1] = len(batch)
        dist.all_reduce(step_total)  # every rank reaches this the same number of times
        squared_error += step_total[0].item()
        line_count += int(step_total[1].item())
assert len(set(everyone(steps))) == 1, "every rank ran the same number of steps"
assert line_count == len(held_out)
all_lines = [line for lines in everyone(lines_seen) for line in lines]
in_chunk_order = [line for chunk in range(5) for line in held_out[chunk::5]]
assert all_lines == in_chunk_order, "every held-out line once, in order across the ranks"
say(f"step 6: {steps} evaluation steps on every rank, error {squared_error / line_count:.3f};")
say(f"        per rank {everyone(evaluation.counts)}")

# DDP keeps a reference to the process group: release it first, or the group outlives
# destroy_process_group() and its threads can abort the interpreter at exit.
del model, optimizer
dist.barrier()
if rank == 0:
    shutil.rmtree(workdir)
dist.destroy_process_group()
if store is not None:
    shutil.rmtree(store)
