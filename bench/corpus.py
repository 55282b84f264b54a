"""Synthetic gzip-chunked text corpus shared by the benchmarks.

The corpus is a directory of ``chunk-NNNNN.txt.gz`` files, each holding ``chunk_lines`` lines of
space-separated words.  A line's length in words follows ``lognormvariate(3, 0.7)`` (median about
20 words, long tail), and words are drawn from a small fixed vocabulary.  Everything is derived
from ``seed`` with one ``random.Random`` per chunk, so the same arguments give byte-identical
text on every machine.  Built corpora are cached under ``bench/.data/`` (git-ignored) and reused.

Run ``python bench/corpus.py --lines 2000000`` to build (or locate) a corpus and print its stats.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import shutil
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
DEFAULT_CACHE = BENCH_DIR / ".data"
DEFAULT_LINES = 2_000_000
DEFAULT_CHUNK_LINES = 10_000
DEFAULT_SEED = 0
VOCAB_SIZE = 2_000
MAX_WORDS = 1_000  # clamp for the log-normal tail; essentially never reached

_DONE_MARKER = "COMPLETE"


def make_vocabulary(size: int = VOCAB_SIZE, seed: int = DEFAULT_SEED) -> list[str]:
    """Return ``size`` distinct lowercase pseudo-words of 2 to 9 letters."""
    rng = random.Random(f"vocab-{seed}")
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: set[str] = set()
    ordered: list[str] = []
    while len(ordered) < size:
        word = "".join(rng.choices(letters, k=rng.randint(2, 9)))
        if word not in words:
            words.add(word)
            ordered.append(word)
    return ordered


def chunk_text(chunk_index: int, num_lines: int, vocab: list[str], seed: int) -> str:
    """Deterministically generate the text (newline-terminated lines) of one chunk."""
    rng = random.Random(seed * 1_000_003 + chunk_index)
    lognorm = rng.lognormvariate
    choices = rng.choices
    out: list[str] = []
    for _ in range(num_lines):
        n_words = min(MAX_WORDS, max(1, int(lognorm(3.0, 0.7))))
        out.append(" ".join(choices(vocab, k=n_words)))
    out.append("")
    return "\n".join(out)


def corpus_dir(
    lines: int = DEFAULT_LINES,
    chunk_lines: int = DEFAULT_CHUNK_LINES,
    seed: int = DEFAULT_SEED,
    cache: Path = DEFAULT_CACHE,
) -> Path:
    """Directory in which the corpus with these parameters is (or would be) cached."""
    return cache / f"corpus-l{lines}-c{chunk_lines}-s{seed}"


def build_corpus(
    lines: int = DEFAULT_LINES,
    chunk_lines: int = DEFAULT_CHUNK_LINES,
    seed: int = DEFAULT_SEED,
    cache: Path = DEFAULT_CACHE,
    verbose: bool = True,
) -> list[str]:
    """Build the corpus if it is not cached yet and return the sorted list of chunk paths.

    The last chunk is shorter when ``lines`` is not a multiple of ``chunk_lines``.
    """
    if lines <= 0 or chunk_lines <= 0:
        raise ValueError(
            f"build_corpus: lines and chunk_lines must be > 0, got {lines}, {chunk_lines}"
        )
    target = corpus_dir(lines, chunk_lines, seed, cache)
    if not (target / _DONE_MARKER).exists():
        if verbose:
            print(
                f"[corpus] building {lines:,} lines in chunks of {chunk_lines:,} "
                f"under {target} ...",
                file=sys.stderr,
                flush=True,
            )
        started = time.perf_counter()
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        vocab = make_vocabulary(seed=seed)
        num_chunks = (lines + chunk_lines - 1) // chunk_lines
        for index in range(num_chunks):
            count = min(chunk_lines, lines - index * chunk_lines)
            data = chunk_text(index, count, vocab, seed).encode("utf-8")
            # mtime=0 keeps the .gz bytes reproducible too
            with (
                open(tmp / f"chunk-{index:05d}.txt.gz", "wb") as raw,
                gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) as gz,
            ):
                gz.write(data)
        (tmp / _DONE_MARKER).write_text(f"{lines} {chunk_lines} {seed}\n")
        if target.exists():  # a concurrent builder won; keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.rename(target)
        if verbose:
            print(
                f"[corpus] built in {time.perf_counter() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    return sorted(str(p) for p in target.glob("chunk-*.txt.gz"))


def read_chunk(path: str) -> list[str]:
    """Return the lines of one chunk file (gzip-decompressed, UTF-8, without line ends)."""
    with gzip.open(path, "rb") as f:
        return f.read().decode("utf-8").splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=DEFAULT_LINES)
    parser.add_argument("--chunk-lines", type=int, default=DEFAULT_CHUNK_LINES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    chunks = build_corpus(args.lines, args.chunk_lines, args.seed, args.cache)
    started = time.perf_counter()
    first = read_chunk(chunks[0])
    read_s = time.perf_counter() - started
    words = [len(line.split()) for line in first]
    size = sum(os.path.getsize(c) for c in chunks)
    print(f"corpus: {corpus_dir(args.lines, args.chunk_lines, args.seed, args.cache)}")
    print(f"chunks: {len(chunks)}  compressed: {size / 2**20:.1f} MiB")
    print(
        f"chunk 0: {len(first)} lines, mean {sum(words) / len(words):.1f} words/line, "
        f"max {max(words)}, read_chunk {read_s * 1e3:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
