"""One rank of a finite DDP training epoch over unequal shares (launched by test_distributed.py).

Usage: ``torchrun --standalone --nproc_per_node=N test/_torchrun_ddp_padding.py MODE OUT_DIR``

Every rank trains a tiny model under DistributedDataParallel (gloo, CPU) for one pass
over its share of a corpus; rank r has more batches than rank r - 1. The shares go
through an `EqualLengthIterator` whose `fill` makes a one-item batch of the right
structure, collated by `pad_batch` like the real ones; a padding step still runs forward
and backward, with its loss weighted 0. Each rank writes, to ``OUT_DIR/MODE-rankR.json``,
the batches it trained on (None for a padding step), its counts and the final weights.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import EqualLengthIterator, rank_and_world_size
from infinibatch_like.iterators import FixedBatchIterator, MapIterator
from infinibatch_like.torch import PaddedTensors, padder

BATCH_SIZE = 2
PAD = 0


def corpus(world_size: int) -> list[list[list[int]]]:
    """Chunks of token lists; rank r's contiguous share holds 2 * (r + 1) batches."""
    chunks = []
    for rank in range(world_size):
        items = 2 * (rank + 1) * BATCH_SIZE
        chunks.append([[1 + (rank + i) % 7] * (1 + i % 3) for i in range(items)])
    return chunks


class TinyModel(nn.Module):
    """Predicts the length of a token list from the mean of its token embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4, padding_idx=PAD)
        self.head = nn.Linear(4, 1)

    def forward(self, batch: PaddedTensors) -> torch.Tensor:
        embedded = self.embed(batch.values) * batch.mask.unsqueeze(-1)
        mean = embedded.sum(1) / batch.lengths.clamp(min=1).unsqueeze(-1)
        prediction: torch.Tensor = self.head(mean).squeeze(-1)
        return prediction


def loss_of(model: nn.Module, batch: PaddedTensors) -> torch.Tensor:
    return ((model(batch) - batch.lengths.float()) ** 2).mean()


def main(mode: str, out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world_size = rank_and_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = nn.parallel.DistributedDataParallel(TinyModel())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    chunks = corpus(world_size)
    share = chunked_dataset_iterator(
        chunks,
        list,
        buffer_size=1,
        train=False,
        shuffle=False,
        num_instances=world_size,
        instance_rank=rank,
    )
    batches = EqualLengthIterator(FixedBatchIterator(share, BATCH_SIZE), fill=lambda: [[PAD]])
    collated = MapIterator(batches, padder(to="torch", pad_value=PAD))
    trained: list[list[list[int]] | None] = []
    for batch in collated:
        weight = 0.0 if batches.last_is_padding else 1.0
        optimizer.zero_grad()
        (loss_of(model, batch) * weight).backward()  # DDP averages the gradients of all ranks
        optimizer.step()
        values, lengths = batch.values.tolist(), batch.lengths.tolist()
        rows = [row[:length] for row, length in zip(values, lengths, strict=True)]
        trained.append(None if batches.last_is_padding else rows)
    result = {
        "trained": trained,
        "counts": batches.counts,
        "weights": {name: value.tolist() for name, value in model.module.state_dict().items()},
    }
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(result))
    collated.close()
    del model, optimizer  # before destroy_process_group: DDP holds the group
    dist.destroy_process_group()
    # Cyclic garbage may still hold gloo's work objects: freed at interpreter finalization
    # they abort the process ("terminate called without an active exception", 2 runs in 5
    # on a loaded machine); freed now, they do not (8 in 8).
    gc.collect()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
