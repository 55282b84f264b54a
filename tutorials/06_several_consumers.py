"""One preprocessing pipeline feeding three models, checkpointed and resumed together.

Run it with ``python tutorials/06_several_consumers.py`` (needs torch; a few seconds).

A hyper-parameter sweep usually reads and preprocesses the same data once per model. Here
three small models, which differ only in their learning rate, train side by side on one
pipeline through a `FanOut` in ``"replicate"`` mode: every model sees every batch, in the
same order, and the chunks are read and encoded once.

The story, top to bottom:

1. a tiny text corpus in gzip chunks and a pipeline of padded character batches;
2. ``FanOut(pipeline, 3)``: three consumers, one per model, each trained by a thread;
3. every CHECKPOINT_EVERY steps the three threads meet (a barrier) and one file holds the
   three models, their optimizers and the fan-out's single state;
4. a run stops at step STOP_AT (as a preempted job would); a new run rebuilds everything,
   restores the file and trains to the end: its losses are exactly those of a run that
   was never interrupted, for every model, and the corpus was read once per run, not
   once per model.

Every claim is checked with an ``assert``.
"""

from __future__ import annotations

import gzip
import random
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from infinibatch_like import FanOut
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.iterators import (
    BucketedReadaheadBatchIterator,
    CheckpointableIterator,
    MapIterator,
)
from infinibatch_like.torch import PaddedTensors, padder

LEARNING_RATES = (0.003, 0.01, 0.03)  # the sweep: one model per learning rate
STEPS = 30
CHECKPOINT_EVERY = 10
STOP_AT = 20  # the first run stops here, right after its checkpoint
TOKENS = 400

# ---------------------------------------------------------------------------------------
# Step 1: the corpus and the preprocessing, written once for the three models.
# ---------------------------------------------------------------------------------------

WORDS = ["red", "old", "cat", "river", "model", "sees", "builds", "the", "a", "storm"]
CHUNKS_READ: Counter[str] = Counter()  # reads of each chunk: at most one a run, whatever the models


def write_corpus(directory: Path, lines: int = 400, chunks: int = 4) -> list[str]:
    rng = random.Random(3)
    sentences = [" ".join(rng.choices(WORDS, k=rng.randint(3, 9))) + "." for _ in range(lines)]
    paths = []
    for index in range(chunks):
        path = directory / f"part-{index}.txt.gz"
        with gzip.open(path, "wt", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in sentences[index::chunks])
        paths.append(str(path))
    return paths


def read_chunk(path: str) -> list[str]:
    CHUNKS_READ[path] += 1
    with gzip.open(path, "rt", encoding="utf-8") as chunk:
        return chunk.read().splitlines()


PAD = 0
ALPHABET = " .abcdefghijklmnopqrstuvwxyz"
VOCABULARY_SIZE = len(ALPHABET) + 1


def encode(line: str) -> list[int]:
    return [ALPHABET.index(char) + 1 for char in line]


def capacity(longest: list[int]) -> int:
    return max(1, TOKENS // len(longest))


def make_pipeline(chunk_paths: list[str]) -> CheckpointableIterator[PaddedTensors]:
    lines = chunked_dataset_iterator(chunk_paths, read_chunk, buffer_size=100, seed=1)
    batches = BucketedReadaheadBatchIterator(
        MapIterator(lines, encode), read_ahead=50, key=len, batch_size=capacity, seed=2
    )
    return MapIterator(batches, padder(to="torch", pad_value=PAD))


# ---------------------------------------------------------------------------------------
# Step 2: three models, one consumer each.
# ---------------------------------------------------------------------------------------


class CharModel(torch.nn.Module):
    """Embedding and linear: predicts each next character from the current one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY_SIZE, 16, padding_idx=PAD)
        self.out = torch.nn.Linear(16, VOCABULARY_SIZE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.embed(ids))
        return logits


def seeded_model() -> CharModel:
    torch.manual_seed(0)
    return CharModel()


def train_step(model: CharModel, optimizer: torch.optim.Optimizer, batch: PaddedTensors) -> float:
    ids, _, mask = batch
    assert mask is not None
    targets = ids[:, 1:].masked_fill(~mask[:, 1:], -100)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCABULARY_SIZE), targets.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


# ---------------------------------------------------------------------------------------
# Step 3: the training run: one thread per model, one checkpoint for all.
# ---------------------------------------------------------------------------------------


def run(chunk_paths: list[str], checkpoint_file: Path, stop_at: int = STEPS) -> list[list[float]]:
    """Train the three models up to step `stop_at`, resuming from `checkpoint_file` if it
    exists; their losses, one list per model."""
    models = [seeded_model() for _ in LEARNING_RATES]  # the same start for each rate
    optimizers = [
        torch.optim.SGD(model.parameters(), lr=rate)
        for model, rate in zip(models, LEARNING_RATES, strict=True)
    ]
    fan = FanOut(make_pipeline(chunk_paths), len(models), max_lag=4)
    start = 0
    if checkpoint_file.exists():
        saved = torch.load(checkpoint_file, weights_only=True)  # plain data and tensors
        for model, optimizer, state in zip(models, optimizers, saved["models"], strict=True):
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        fan.setstate(saved["data"])  # every consumer to its position
        start = saved["step"]
    consumers = [fan.consumer(index) for index in range(len(models))]

    def save(step: int) -> None:  # called by one thread while all three wait
        states = [
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            for model, optimizer in zip(models, optimizers, strict=True)
        ]
        torch.save({"step": step, "models": states, "data": fan.getstate()}, checkpoint_file)

    losses: list[list[float]] = [[] for _ in models]
    meeting = threading.Barrier(len(models))

    def train(index: int) -> None:
        for step in range(start + 1, stop_at + 1):
            batch = next(consumers[index])
            losses[index].append(train_step(models[index], optimizers[index], batch))
            if step % CHECKPOINT_EVERY == 0:
                if meeting.wait() == 0:  # every model has trained on `step` batches
                    save(step)
                meeting.wait()

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    fan.close()
    return losses


# ---------------------------------------------------------------------------------------
# Step 4: an uninterrupted sweep, then one stopped at STOP_AT and resumed.
# ---------------------------------------------------------------------------------------


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        chunk_paths = write_corpus(directory)

        CHUNKS_READ.clear()
        reference = run(chunk_paths, directory / "reference.pt")
        # How many chunks the run starts depends on how far ahead the pipeline was when it
        # stopped; none is read twice (three pipelines would read each three times).
        reads_one_run = sum(CHUNKS_READ.values())
        assert reads_one_run > 0
        assert max(CHUNKS_READ.values()) == 1, CHUNKS_READ

        checkpoint = directory / "sweep.pt"
        first = run(chunk_paths, checkpoint, stop_at=STOP_AT)
        resumed = run(chunk_paths, checkpoint)
        runs = zip(LEARNING_RATES, reference, first, resumed, strict=True)
        for rate, whole, before, after in runs:
            assert before + after == whole, f"lr={rate}: the resumed losses differ"
            print(f"lr={rate}: losses {whole[0]:.3f} -> {whole[-1]:.3f}, resumed exactly")
        assert reference[0] != reference[2]  # the models did learn differently
        print(
            f"one pipeline fed {len(LEARNING_RATES)} models; {reads_one_run} chunks read once each "
            "in a run; every model resumed exactly at step "
            f"{STOP_AT}"
        )


if __name__ == "__main__":
    main()
