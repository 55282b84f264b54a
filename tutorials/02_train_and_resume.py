"""Train a small PyTorch model, kill the process mid-run, resume it exactly.

Run it with ``python tutorials/02_train_and_resume.py`` (needs torch; part 6 also uses
torchdata's ``StatefulDataLoader`` if it is installed). It takes a few seconds on a CPU.

The story, top to bottom:

1. a tiny text corpus in gzip chunks;
2. the data pipeline: randomized lines, encoded as character ids, in bucketed batches of
   about TOKENS characters, padded into tensors by ``pad_batch``;
3. a character-level language model and a training loop that calls ``next()`` on the
   pipeline and, every CHECKPOINT_EVERY steps, saves model, optimizer and data state in
   one ``torch.save`` file;
4. the training run is started in a child process that dies abruptly (``os._exit``, no
   cleanup, no last save) at step CRASH_AT, a few steps after its last checkpoint;
5. a new run rebuilds everything, loads the checkpoint with
   ``torch.load(..., weights_only=True)`` and continues: its batches and its losses are
   exactly those of a run that was never interrupted;
6. the same resume through DataLoader workers: ``CheckpointableDataset`` and torchdata's
   ``StatefulDataLoader(num_workers=2)``.

Every claim is checked with an ``assert``.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.iterators import (
    BucketedReadaheadBatchIterator,
    CheckpointableIterator,
    MapIterator,
)
from infinibatch_like.torch import CheckpointableDataset, PaddedTensors, padder

STEPS = 40  # length of the whole training run
CHECKPOINT_EVERY = 10  # save model + optimizer + data every 10 steps
CRASH_AT = 23  # the first run dies right after step 23: steps 21-23 are lost
TOKENS = 480  # characters per batch, padding included

# ---------------------------------------------------------------------------------------
# Step 1: a corpus in gzip chunks (made up sentences; real corpora have thousands of chunks).
# ---------------------------------------------------------------------------------------

WORDS = {
    "adjective": ["small", "quiet", "red", "old", "clever", "bright", "heavy"],
    "noun": ["cat", "river", "engine", "garden", "teacher", "model", "window", "storm"],
    "verb": ["sees", "follows", "builds", "likes", "moves", "paints", "answers"],
}


def write_corpus(directory: Path, lines: int = 600, chunks: int = 6) -> list[str]:
    """Write `lines` sentences, dealt round-robin into `chunks` gzip files; their paths."""
    rng = random.Random(5)

    def phrase() -> str:
        return f"the {rng.choice(WORDS['adjective'])} {rng.choice(WORDS['noun'])}"

    sentences = [
        f"{phrase()} {rng.choice(WORDS['verb'])} {phrase()}" + (" again." if i % 3 else ".")
        for i in range(lines)
    ]
    paths = []
    for index in range(chunks):
        path = directory / f"part-{index:02d}.txt.gz"
        with gzip.open(path, "wt", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in sentences[index::chunks])
        paths.append(str(path))
    return paths


def read_chunk(path: str) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as chunk:
        return chunk.read().splitlines()


# ---------------------------------------------------------------------------------------
# Step 2: the data pipeline.
#
# Characters become ids (0 is padding, 1 and 2 mark the start and the end of a line).
# Lines of similar length are batched together, about TOKENS characters per batch, and
# pad_batch turns each batch into tensors: values (batch, longest), lengths and a mask.
# ---------------------------------------------------------------------------------------

PAD, BOS, EOS = 0, 1, 2
ALPHABET = " .abcdefghijklmnopqrstuvwxyz"
CHAR_IDS = {char: index + 3 for index, char in enumerate(ALPHABET)}
VOCABULARY_SIZE = len(ALPHABET) + 3


def encode(line: str) -> list[int]:
    return [BOS, *(CHAR_IDS[char] for char in line), EOS]


def batch_capacity(longest: list[int]) -> int:
    """How many lines fit in TOKENS when every line is padded to `longest`."""
    return max(1, TOKENS // len(longest))


def make_id_batches(
    chunk_paths: list[str], instance_rank: int = 0, num_instances: int = 1
) -> CheckpointableIterator[list[list[int]]]:
    """Infinite, shuffled batches of encoded lines of similar length."""
    lines = chunked_dataset_iterator(
        chunk_paths,
        read_chunk,
        buffer_size=200,
        seed=1,
        num_instances=num_instances,
        instance_rank=instance_rank,
    )
    return BucketedReadaheadBatchIterator(
        MapIterator(lines, encode), read_ahead=64, key=len, batch_size=batch_capacity, seed=2
    )


# The collation step: pad_batch with fixed options, as a picklable function (DataLoader
# workers may need to pickle it) that type checkers know returns PaddedTensors.
to_tensors = padder(to="torch", pad_value=PAD)


def make_pipeline(chunk_paths: list[str]) -> CheckpointableIterator[PaddedTensors]:
    """The pipeline of the training loop: padded tensors, ready for the model."""
    return MapIterator(make_id_batches(chunk_paths), to_tensors)


# ---------------------------------------------------------------------------------------
# Step 3: a model and a training loop with checkpoints.
# ---------------------------------------------------------------------------------------


class CharModel(torch.nn.Module):
    """Embedding, GRU, linear: predicts each next character of a line."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCABULARY_SIZE, dim, padding_idx=PAD)
        self.gru = torch.nn.GRU(dim, dim, batch_first=True)
        self.out = torch.nn.Linear(dim, VOCABULARY_SIZE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.gru(self.embed(ids))
        logits: torch.Tensor = self.out(hidden)
        return logits


class Step(NamedTuple):
    """What one training step saw and computed: the evidence we compare across runs."""

    step: int
    batch: str  # a fingerprint of the batch tensor
    loss: float


def fingerprint(batch: PaddedTensors) -> str:
    return hashlib.sha256(batch.values.numpy().tobytes() + bytes(batch.values.shape)).hexdigest()


def train_step(model: CharModel, optimizer: torch.optim.Optimizer, batch: PaddedTensors) -> float:
    ids, _, mask = batch
    assert mask is not None
    inputs, targets = ids[:, :-1], ids[:, 1:].masked_fill(~mask[:, 1:], -100)  # -100: ignored
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, VOCABULARY_SIZE), targets.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def train(chunk_paths: list[str], run_dir: Path, crash_at: int | None = None) -> list[Step]:
    """Train for STEPS steps, resuming from ``run_dir/checkpoint.pt`` if it exists."""
    torch.manual_seed(0)
    model = CharModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    pipeline = make_pipeline(chunk_paths)
    checkpoint_file = run_dir / "checkpoint.pt"
    step = 0
    if checkpoint_file.exists():
        # The safe loader: the data state is plain data, like the tensors around it.
        checkpoint = torch.load(checkpoint_file, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        pipeline.setstate(checkpoint["data"])
        step = checkpoint["step"]
    history = []
    with pipeline, open(run_dir / "steps.jsonl", "a", encoding="utf-8") as log:
        while step < STEPS:
            batch = next(pipeline)
            loss = train_step(model, optimizer, batch)
            step += 1
            history.append(Step(step, fingerprint(batch), loss))
            log.write(json.dumps(history[-1]._asdict()) + "\n")
            log.flush()
            if step % CHECKPOINT_EVERY == 0:
                checkpoint = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": pipeline.getstate(),  # taken after this step's batch
                    "step": step,
                }
                # Write, then rename: a crash during the save leaves the old checkpoint.
                torch.save(checkpoint, run_dir / "checkpoint.tmp")
                os.replace(run_dir / "checkpoint.tmp", checkpoint_file)
            if step == crash_at:
                os._exit(17)  # like a preemption: no cleanup, no final checkpoint
    return history


# ---------------------------------------------------------------------------------------
# Step 6 helpers: the same pipeline through DataLoader workers.
# ---------------------------------------------------------------------------------------


def loader_batches(loader: Any, count: int) -> list[str]:
    batches: Iterator[PaddedTensors] = iter(loader)
    return [fingerprint(batch) for batch in islice(batches, count)]


def dataloader_demo(chunk_paths: list[str], workdir: Path) -> None:
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        print("step 6: skipped (pip install torchdata==0.11.0 to run it)")
        return

    def loader() -> Any:
        # Each worker builds its own pipeline: reader = rank * 2 + worker id, of 2 * world.
        dataset = CheckpointableDataset(functools.partial(make_id_batches, chunk_paths))
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2, collate_fn=to_tensors)

    uninterrupted = loader_batches(loader(), 12)

    interrupted = loader()
    assert loader_batches(interrupted, 7) == uninterrupted[:7]
    # The loader's state holds each worker's pipeline state; it too loads safely.
    torch.save({"data": interrupted.state_dict()}, workdir / "loader.pt")
    resumed = loader()
    resumed.load_state_dict(torch.load(workdir / "loader.pt", weights_only=True)["data"])
    assert loader_batches(resumed, 5) == uninterrupted[7:]
    print("step 6: StatefulDataLoader with 2 workers resumed after 7 batches, identically")


# ---------------------------------------------------------------------------------------
# Steps 4 and 5: crash, resume, compare.
# ---------------------------------------------------------------------------------------


def main() -> None:
    torch.set_num_threads(1)  # small model, and bit-for-bit reproducible on one thread
    scratch = tempfile.TemporaryDirectory(prefix="train_and_resume_")
    workdir = Path(scratch.name)
    chunk_paths = write_corpus(workdir)
    print(f"step 1: corpus of {len(chunk_paths)} gzip chunks in {workdir}")

    # The reference: one run that is never interrupted.
    (workdir / "reference").mkdir()
    reference = train(chunk_paths, workdir / "reference")
    print(f"step 3: uninterrupted run, loss {reference[0].loss:.3f} -> {reference[-1].loss:.3f}")

    # Step 4: the same training in a separate process that dies at step CRASH_AT.
    run_dir = workdir / "run"
    run_dir.mkdir()
    crashed = subprocess.run(
        [
            sys.executable,
            __file__,
            "--crash-at",
            str(CRASH_AT),
            "--run-dir",
            str(run_dir),
            *chunk_paths,
        ],
        check=False,
    )
    assert crashed.returncode == 17, f"the run was meant to crash, got {crashed.returncode}"
    log_lines = (run_dir / "steps.jsonl").read_text(encoding="utf-8").splitlines()
    before_crash = [Step(**json.loads(line)) for line in log_lines]
    saved_step = torch.load(run_dir / "checkpoint.pt", weights_only=True)["step"]
    assert [s.step for s in before_crash] == list(range(1, CRASH_AT + 1))
    assert saved_step == (CRASH_AT // CHECKPOINT_EVERY) * CHECKPOINT_EVERY
    assert before_crash == reference[:CRASH_AT]
    print(f"step 4: the run died after step {CRASH_AT}; its last checkpoint is step {saved_step}")

    # Step 5: a new process would run exactly this: rebuild, load, continue.
    resumed = train(chunk_paths, run_dir)
    assert [s.step for s in resumed] == list(range(saved_step + 1, STEPS + 1))
    # The steps after the checkpoint see exactly the uninterrupted run's batches, and the
    # model, restored with its optimizer, computes exactly the same losses.
    assert [s.batch for s in resumed] == [s.batch for s in reference[saved_step:]]
    assert [s.loss for s in resumed] == [s.loss for s in reference[saved_step:]]
    print(
        f"step 5: resumed at step {saved_step + 1}; steps {saved_step + 1}-{STEPS} have the "
        "same batches and bit-identical losses as the uninterrupted run"
    )
    for s, r in zip(resumed[:3], reference[saved_step:], strict=False):
        print(
            f"  step {s.step}: batch {s.batch[:12]} loss {s.loss:.6f} (uninterrupted {r.loss:.6f})"
        )

    dataloader_demo(chunk_paths, workdir)
    scratch.cleanup()
    print("train and resume: all checks passed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crash-at", type=int, help="(internal) the child run: die here")
    parser.add_argument("--run-dir", type=Path, help="(internal) the child run's directory")
    parser.add_argument("chunks", nargs="*", help="(internal) the child run's chunk files")
    arguments = parser.parse_args()
    if arguments.crash_at is None:
        main()
    else:
        torch.set_num_threads(1)
        train(arguments.chunks, arguments.run_dir, crash_at=arguments.crash_at)
        sys.exit("the run was meant to crash before it finished")
