"""Sequence packing and token-budget mixing: throughput, padding, mixing error, resumes.

1. Packing throughput (tokens per second of CPU time) and padding fraction of
   `PackingIterator` (``concat`` and ``best_fit``) against plain reference packers written
   here (a generator that cuts the concatenated documents; a best-fit generator over a
   bounded list of open sequences), all producing the same fields (tokens, segment ids,
   positions, loss mask, cu_seqlens), on a log-normal corpus (median 300 tokens, sigma 1),
   interleaved repetitions, best CPU time. The packer is also run with a checkpoint
   (``getstate`` + JSON) after every sequence and a restore every 100: its padding must
   equal the run without checkpoints.
2. Token-budget mixing: three sources of mean lengths 40, 400 and 4,000 tokens, weights
   1:1:1, 10 M tokens mixed, packed (concat, seq_len 4096) and split into windows of 1 M
   tokens (aligned, and sliding every 100 k): the largest gap between a source's share of
   a window and 1/3, in percentage points, for `TokenBudgetMultiplexIterator` (exact and
   random) and for `WeightedMultiplexIterator` counting items; uniform lengths (0.5x to
   1.5x the mean) and log-normal ones (sigma 0.5, a heavy tail).
3. ``--resume-check``: 1,000 random checkpoints x the next 50 packed sequences, restored into
   fresh packers from a JSON round trip, for both strategies (the suite runs 200).

Run ``python bench/bench_packing.py [--quick] [--resume-check]``; results go to
``bench/results/packing.json``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from functools import partial
from itertools import islice
from typing import Any

import numpy as np
from _util import Samples, Stopwatch, print_table, write_result

from infinibatch_like import PackingIterator, TokenBudgetMultiplexIterator
from infinibatch_like.iterators import NativeCheckpointableIterator, WeightedMultiplexIterator

Packed = dict[str, Any]


def lognormal_corpus(tokens: int, median: int, sigma: float, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    sizes = np.maximum(1, rng.lognormal(np.log(median), sigma, tokens // median * 2)).astype(int)
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), tokens)) + 1]
    return [rng.integers(1, 50_000, size) for size in sizes]


def assembled(pieces: list[Any], seq_len: int) -> Packed:
    """One sequence's fields from its pieces (the reference packers' output)."""
    lengths = [len(piece) for piece in pieces]
    fill = sum(lengths)
    tokens = np.zeros(seq_len, dtype=np.int64)
    tokens[:fill] = np.concatenate(pieces)
    segment_ids = np.zeros(seq_len, dtype=np.int32)
    segment_ids[:fill] = np.repeat(np.arange(1, len(pieces) + 1, dtype=np.int32), lengths)
    if fill < seq_len:
        lengths.append(seq_len - fill)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.arange(seq_len, dtype=np.int32) - np.repeat(bounds[:-1], lengths)
    return {
        "tokens": tokens,
        "segment_ids": segment_ids,
        "positions": positions,
        "loss_mask": segment_ids > 0,
        "cu_seqlens": bounds,
    }


def reference_concat(docs: list[Any], seq_len: int) -> Iterator[Packed]:
    pieces: list[Any] = []
    room = seq_len
    for doc in docs:
        start = 0
        while start < len(doc):
            take = min(room, len(doc) - start)
            pieces.append(doc[start : start + take])
            start += take
            room -= take
            if not room:
                yield assembled(pieces, seq_len)
                pieces, room = [], seq_len
    if pieces:
        yield assembled(pieces, seq_len)


def reference_best_fit(docs: list[Any], seq_len: int, window: int) -> Iterator[Packed]:
    open_: list[list[Any]] = []  # [room, pieces], oldest first
    for doc in docs:
        start = 0
        while len(doc) - start >= seq_len:
            yield assembled([doc[start : start + seq_len]], seq_len)
            start += seq_len
        size = len(doc) - start
        if not size:
            continue
        best = None
        for entry in open_:
            if entry[0] >= size and (best is None or entry[0] < best[0]):
                best = entry
        if best is None:
            if len(open_) == window:
                yield assembled(open_.pop(0)[1], seq_len)
            best = [seq_len, []]
            open_.append(best)
        best[1].append(doc[start:])
        best[0] -= size
        if not best[0]:
            open_.remove(best)
            yield assembled(best[1], seq_len)
    for entry in open_:
        yield assembled(entry[1], seq_len)


def packer(docs: list[Any], seq_len: int, window: int | None) -> PackingIterator:
    kwargs: dict[str, Any] = {"strategy": "best_fit", "window": window} if window else {}
    return PackingIterator(NativeCheckpointableIterator(docs), seq_len, **kwargs)


def checkpointed(docs: list[Any], seq_len: int, window: int | None) -> Iterator[Packed]:
    """The packer with a JSON checkpoint after every sequence and a restore every 100."""
    pipeline = packer(docs, seq_len, window)
    for count, sequence in enumerate(pipeline, 1):
        state = json.loads(json.dumps(pipeline.getstate()))
        if count % 100 == 0:
            pipeline = packer(docs, seq_len, window)
            pipeline.setstate(state)
        yield sequence


def padding(sequences: Iterator[Packed]) -> tuple[float, int]:
    real = total = count = 0
    for sequence in sequences:
        real += int(sequence["loss_mask"].sum())
        total += len(sequence["tokens"])
        count += 1
    return 1 - real / total, count


def run_packing(docs: list[Any], seq_len: int, window: int, repeats: int) -> dict[str, Any]:
    tokens = sum(len(doc) for doc in docs)
    runs: dict[str, Callable[[], Iterator[Packed]]] = {
        "reference concat": lambda: reference_concat(docs, seq_len),
        "PackingIterator concat": lambda: packer(docs, seq_len, None),
        f"reference best_fit (window {window})": lambda: reference_best_fit(docs, seq_len, window),
        f"PackingIterator best_fit (window {window})": lambda: packer(docs, seq_len, window),
    }
    samples = {name: Samples() for name in runs}
    pads: dict[str, float] = {}
    for _ in range(repeats):
        for name, build in runs.items():
            watch = Stopwatch()
            pads[name], _ = padding(build())
            samples[name].add(watch.read())
    for name, window_ in (("concat", None), (f"best_fit (window {window})", window)):
        pads[f"PackingIterator {name}, checkpoint every sequence"], _ = padding(
            checkpointed(docs, seq_len, window_)
        )
    rows, result = [], {}
    for name, sample in samples.items():
        rate = tokens / min(sample.cpu)
        reference = (
            "reference concat"
            if "concat" in name
            else next(key for key in runs if key.startswith("reference best_fit"))
        )
        relative = rate / (tokens / min(samples[reference].cpu))
        rows.append([name, rate / 1e6, relative, 100 * pads[name]])
        result[name] = {"tokens_per_s": rate, "vs_reference": relative, "padding": pads[name]}
    for name, pad in pads.items():
        if "checkpoint" in name:
            rows.append([name, None, None, 100 * pad])
            result[name] = {"padding": pad}
    print_table(
        f"Packing {tokens:,} tokens into {seq_len}-token sequences (log-normal, median 300)",
        ["packer", "M tokens/s (CPU)", "x reference", "padding %"],
        rows,
    )
    return result


def tagged_sources(means: list[int], tokens: int, heavy: bool, seed: int) -> list[list[Any]]:
    rng = np.random.default_rng(seed)
    sources = []
    for index, mean in enumerate(means):
        count = tokens // mean + 10
        if heavy:
            sizes = np.maximum(1, rng.lognormal(np.log(mean) - 0.125, 0.5, count)).astype(int)
        else:
            sizes = rng.integers(mean // 2, mean * 3 // 2 + 1, count)
        sources.append([np.full(size, index, dtype=np.int8) for size in sizes])
    return sources


def window_errors(tokens: Any, window: int, step: int) -> float:
    cumulative = np.stack([np.concatenate([[0], np.cumsum(tokens == s)]) for s in range(3)])
    starts = np.arange(0, len(tokens) - window + 1, step)
    shares = (cumulative[:, starts + window] - cumulative[:, starts]) / window
    return float(np.max(np.abs(shares - 1 / 3)))


def run_mixing(total: int, window: int) -> dict[str, Any]:
    means = [40, 400, 4000]
    rows, result = [], {}
    for heavy in (False, True):
        sources = tagged_sources(means, total, heavy, seed=3)
        longest = max(len(doc) for doc in sources[2])
        streams = [NativeCheckpointableIterator(s) for s in sources]
        mixers: dict[str, Callable[[list[Any]], Iterator[Any]]] = {
            "TokenBudgetMultiplexIterator exact": partial(
                TokenBudgetMultiplexIterator, weights=[1, 1, 1]
            ),
            "TokenBudgetMultiplexIterator random": partial(
                TokenBudgetMultiplexIterator, weights=[1, 1, 1], exact=False
            ),
            "WeightedMultiplexIterator (items)": partial(
                WeightedMultiplexIterator, weights=[1, 1, 1], exact=True
            ),
        }
        for name, build in mixers.items():
            for stream in streams:
                stream.setstate(None)
            packed = PackingIterator(build(streams), 4096, pad_id=9)
            tokens = np.concatenate([s["tokens"] for s in islice(packed, total // 4096)])
            aligned = window_errors(tokens, window, window)
            sliding = window_errors(tokens, window, window // 10)
            lengths = "log-normal" if heavy else "uniform"
            rows.append([name, lengths, longest, 100 * aligned, 100 * sliding])
            result[f"{name}, {lengths}"] = {
                "aligned": aligned,
                "sliding": sliding,
                "longest": longest,
            }
    print_table(
        f"Token shares after packing, {total:,} tokens, windows of {window:,} tokens, target 1/3 "
        "each (largest gap, percentage points)",
        ["mixer", "lengths", "longest doc", "aligned windows", "sliding windows"],
        rows,
    )
    return result


def resume_check(docs: list[Any], points: int, after: int) -> dict[str, Any]:
    result = {}
    for name, window in (("concat", None), ("best_fit", 4)):
        pipeline = packer(docs, 64, window)
        states, reference = [], []
        for sequence in pipeline:
            states.append(json.dumps(pipeline.getstate()))
            reference.append(sequence["tokens"].tobytes() + sequence["cu_seqlens"].tobytes())
        watch = Stopwatch()
        failures = 0
        for point in random.Random(1).sample(range(len(reference)), points):
            fresh = packer(docs, 64, window)
            fresh.setstate(json.loads(states[point]))
            got = [s["tokens"].tobytes() + s["cu_seqlens"].tobytes() for s in islice(fresh, after)]
            failures += got != reference[point + 1 : point + 1 + after]
        wall, _ = watch.read()
        result[name] = {"points": points, "failures": failures, "seconds": wall}
        print(
            f"resume check {name}: {points} checkpoints x {after} sequences, {failures} "
            f"mismatches, {wall:.1f} s"
        )
    return result


def state_size() -> int:
    rng = np.random.default_rng(4)
    docs = [rng.integers(2, 50000, size) for size in rng.integers(4200, 8000, 600)]
    pipeline = PackingIterator(
        NativeCheckpointableIterator(docs), 8192, strategy="best_fit", window=128
    )
    largest = 0
    for _ in pipeline:
        state = pipeline.getstate()
        del state["source"]
        largest = max(largest, len(json.dumps(state)))
    print(
        f"\nlargest PackingIterator state (seq_len 8192, window 128, source's state left "
        f"out): {largest:,} bytes of JSON"
    )
    return largest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 M tokens, fewer repeats")
    parser.add_argument("--resume-check", action="store_true", help="1,000 checkpoints x 50")
    args = parser.parse_args()
    tokens = 2_000_000 if args.quick else 10_000_000
    docs = lognormal_corpus(tokens, 300, 1.0, seed=1)
    payload: dict[str, Any] = {
        "packing": run_packing(docs, 2048, 8, 2 if args.quick else 4),
        "mixing": run_mixing(tokens, tokens // 10),
        "state_bytes": state_size(),
    }
    if args.resume_check:
        payload["resume_check"] = resume_check(lognormal_corpus(400_000, 40, 1.0, 2), 1000, 50)
    write_result("packing-quick" if args.quick else "packing", payload)


if __name__ == "__main__":
    main()
