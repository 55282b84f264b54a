"""Command line: ``python -m infinibatch_like COMMAND`` (console script ``infinibatch-like``).

Commands: ``demo`` (below), and the data-preparation tools ``chunk``, ``verify`` and
``inspect`` (`infinibatch_like.prepare.cli`).

The demo proves the library's main promise on a small synthetic corpus: a pipeline
checkpointed mid-stream and restored into a *fresh* pipeline continues with exactly the
batches an uninterrupted run yields. Exit code 0 means identical, 1 means it differed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
import tempfile
from collections.abc import Sequence
from itertools import islice
from pathlib import Path

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import read_lines
from infinibatch_like.iterators import BucketedReadaheadBatchIterator, CheckpointableIterator
from infinibatch_like.prepare import cli as prepare_cli

TOKENS = 2000  # characters per batch: batch size = TOKENS // length of its longest line
NUM_CHUNKS = 8
BUFFER_SIZE = 500  # blockwise shuffle buffer of chunked_dataset_iterator
READ_AHEAD = 300  # items sorted by length together before cutting batches
BEFORE, AFTER = 20, 15  # batches taken before the checkpoint, and compared after it
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qua", "bri", "stel")


def make_corpus(num_lines: int, seed: int) -> list[str]:
    """Deterministic lines of 1 to ~60 words, mostly short (like real text), numbered."""
    rng = random.Random(seed)
    lines = []
    for number in range(num_lines):
        num_words = 1 + min(59, int(rng.expovariate(1 / 12)))
        words = ("".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(num_words))
        lines.append(f"{number:06d} " + " ".join(words))
    return lines


def write_chunks(lines: Sequence[str], directory: Path) -> list[str]:
    """Split ``lines`` into ``NUM_CHUNKS`` gzip text files; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    num_chunks = min(NUM_CHUNKS, len(lines))
    paths = []
    for index in range(num_chunks):
        path = directory / f"corpus.{index:03d}.txt.gz"
        with gzip.open(path, "wt", encoding="utf-8") as out:
            out.writelines(line + "\n" for line in lines[index::num_chunks])
        paths.append(str(path))
    return paths


def build_pipeline(chunk_paths: list[str], seed: int) -> CheckpointableIterator[list[str]]:
    """Randomized, infinite reading of the chunks, then length-bucketed dynamic batches."""
    lines = chunked_dataset_iterator(chunk_paths, read_lines, buffer_size=BUFFER_SIZE, seed=seed)
    return BucketedReadaheadBatchIterator(
        lines,
        read_ahead=READ_AHEAD,
        key=len,
        batch_size=lambda longest: max(1, TOKENS // len(longest)),
        seed=seed + 1,
    )


def run_demo(num_lines: int, seed: int, workdir: Path) -> int:
    """Run the demo with chunks under ``workdir``; print a report; return the exit code."""
    corpus = make_corpus(num_lines, seed)
    chunk_paths = write_chunks(corpus, workdir)
    print("infinibatch_like demo: exact resume of a bucketed, shuffled stream")
    print(f"  corpus      {len(corpus)} lines in {len(chunk_paths)} gzip chunks under {workdir}")
    print(f"  pipeline    chunked_dataset_iterator(buffer_size={BUFFER_SIZE}, seed={seed})")
    print(f"              -> BucketedReadaheadBatchIterator(read_ahead={READ_AHEAD}, key=len,")
    print(f"                 batch_size=max(1, {TOKENS} // len(longest)), seed={seed + 1})")

    with build_pipeline(chunk_paths, seed) as uninterrupted:
        reference = list(islice(uninterrupted, BEFORE + AFTER))
    print(f"  run 1       {len(reference)} batches without interruption")

    with build_pipeline(chunk_paths, seed) as first:
        before = list(islice(first, BEFORE))
        checkpoint = json.dumps(first.getstate(), sort_keys=True)
    print(
        f"  run 2       {len(before)} batches, then getstate(): "
        f"{len(checkpoint.encode('utf-8'))} bytes of JSON"
    )

    with build_pipeline(chunk_paths, seed) as fresh:
        fresh.setstate(json.loads(checkpoint))
        after = list(islice(fresh, AFTER))
    print(f"  run 3       fresh pipeline, setstate(json.loads(...)), {len(after)} batches")

    sizes = ", ".join(str(len(batch)) for batch in after[:8])
    print(
        f"  resumed     batch sizes {sizes}, ...; first line {after[0][0][:40]!r}"
        if after
        else "  resumed     no batches"
    )
    expected = reference[BEFORE:]
    if before == reference[:BEFORE] and after == expected and len(after) == AFTER:
        num_items = sum(len(batch) for batch in after)
        print(
            f"  result      IDENTICAL: the continuation matches the uninterrupted run "
            f"({len(after)} batches, {num_items} lines)"
        )
        return 0
    if before != reference[:BEFORE]:
        print("  result      DIFFERENT: the same seed gave two different streams")
    else:
        mismatch = next(
            (i for i, (a, b) in enumerate(zip(after, expected, strict=False)) if a != b), None
        )
        where = len(after) if mismatch is None else mismatch
        print(
            f"  result      DIFFERENT: the continuation diverges at batch {where} after "
            "the checkpoint"
        )
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit code."""
    parser = argparse.ArgumentParser(
        prog="infinibatch-like", description="Checkpointable data loading: tools and a demo."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="checkpoint a pipeline mid-stream and show an exact resume",
        description="Checkpoint a shuffled, bucketed pipeline over a small synthetic corpus "
        "mid-stream, restore the state into a fresh pipeline, and compare its batches with "
        "an uninterrupted run. Exit code 0: identical, 1: they differ.",
    )
    demo.add_argument(
        "--lines", type=prepare_cli.at_least(1), default=3000, help="corpus size (default 3000)"
    )
    demo.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    demo.add_argument(
        "--workdir", type=Path, default=None, help="where to write the chunks (default: a temp dir)"
    )
    prepare_cli.add_commands(commands)
    arguments = sys.argv[1:] if argv is None else list(argv)
    prepare_cli.suggest_options(commands.choices, arguments)
    args = parser.parse_args(arguments)
    if args.command != "demo":
        return prepare_cli.run(args)
    if args.workdir is not None:
        return run_demo(args.lines, args.seed, args.workdir)
    with tempfile.TemporaryDirectory(prefix="infinibatch_like_demo_") as tmp:
        return run_demo(args.lines, args.seed, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
