"""End-to-end text pipeline: infinibatch 0.1.1 vs infinibatch_like, measured in one run.

Pipeline (identical for both libraries, same seeds, so both yield the same batches)::

    chunked_dataset_iterator(chunks, read_chunk, buffer_size=100_000, seed=1)  # blockwise shuffle
    -> MapIterator(str.split)                                                  # cheap tokenize
    -> BucketedReadaheadBatchIterator(read_ahead=10_000, key=len,
                                      batch_size=lambda longest: max(1, 2048 // len(longest)),
                                      seed=2)

Measured per library ("items" are corpus lines, counted inside the yielded batches). Times are
process CPU time (robust on a shared machine; the pipeline is single-threaded), with wall-clock
time recorded next to them; the two libraries' runs are interleaved:

* time to first batch (construction + ``next``), median of 3 x ``--reps`` samples;
* throughput in lines/s over the first ``--measure-lines`` lines, best of ``--reps``
  (construction included);
* at the first batch boundary after each of ``--points`` lines (10^4 and 10^6, plus an extra
  point in the middle of a shuffle block): ``getstate()`` latency (median of 1,000 calls),
  ``len(pickle.dumps(state))``, ``len(json.dumps(state))``, whether the state stays unchanged
  when iteration continues and whether its shape (keys, value types) stays the same;
* restore latency at each point: fresh pipeline + ``setstate(state)`` + first batch, median of
  ``--reps``, the number of chunk files this re-reads, and whether the batch equals the one the
  uninterrupted run yielded there (also after a JSON round trip of the state).

``--in-memory`` reads every chunk before timing starts, which takes gzip decompression and file
reading out of the measurements and leaves mostly the two libraries' own work.

Usage: ``python bench/bench_pipeline.py`` (full, about 3 minutes) or ``--quick``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import json
import pickle
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import _util
from _util import Library, Samples, Stopwatch, median, points_label, print_table, ratio, verdict
from corpus import DEFAULT_LINES, build_corpus, read_chunk

BUFFER_SIZE = 100_000
READ_AHEAD = 10_000
TOKENS_PER_BATCH = 2048
GETSTATE_CALLS = 1_000
FIRST_BATCH_SAMPLES_PER_REP = 3

Batch = list[list[str]]


def tokenize(line: str) -> list[str]:
    return line.split()


def batch_size_for(longest: list[str]) -> int:
    return max(1, TOKENS_PER_BATCH // len(longest))


_chunks_read = [0]
_in_memory: dict[str, list[str]] = {}  # filled by --in-memory


def counting_read_chunk(path: str) -> list[str]:
    """``read_chunk`` that counts its calls (to report what a restore re-reads).

    With ``--in-memory`` it returns a copy of the chunk's lines read before timing starts,
    which takes decompression out of the measurement and leaves mostly the libraries' work.
    """
    _chunks_read[0] += 1
    if _in_memory:
        return list(_in_memory[path])
    return read_chunk(path)


def make_pipeline(lib: Library, chunks: list[str]) -> Any:
    """Build the benchmark pipeline with ``lib``'s infinibatch-compatible API."""
    samples = lib.datasets.chunked_dataset_iterator(
        chunks, counting_read_chunk, buffer_size=BUFFER_SIZE, seed=1
    )
    tokens = lib.iterators.MapIterator(samples, tokenize)
    return lib.iterators.BucketedReadaheadBatchIterator(
        tokens, read_ahead=READ_AHEAD, key=len, batch_size=batch_size_for, seed=2
    )


def close(pipeline: Any) -> None:
    closer: Callable[[], None] | None = getattr(pipeline, "close", None)
    if closer is not None:
        closer()


def batch_digest(batch: Batch) -> bytes:
    return hashlib.blake2b(
        "\x1e".join(" ".join(t) for t in batch).encode(), digest_size=16
    ).digest()


def time_first_batch(lib: Library, chunks: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds for construction + first batch."""
    gc.collect()
    watch = Stopwatch()
    pipeline = make_pipeline(lib, chunks)
    next(pipeline)
    elapsed = watch.read()
    close(pipeline)
    return elapsed


def time_throughput(
    lib: Library, chunks: list[str], lines: int
) -> tuple[tuple[float, float], int, int]:
    """Return ((wall, CPU) seconds, lines, batches) to consume ``lines`` lines from a new one."""
    gc.collect()
    watch = Stopwatch()
    pipeline: Iterator[Batch] = make_pipeline(lib, chunks)
    seen = batches = 0
    while seen < lines:
        seen += len(next(pipeline))
        batches += 1
    elapsed = watch.read()
    close(pipeline)
    return elapsed, seen, batches


def state_sizes(state: Any) -> tuple[int, int | None]:
    pickled = len(pickle.dumps(state))
    try:
        as_json: int | None = len(json.dumps(state).encode())
    except (TypeError, ValueError):
        as_json = None
    return pickled, as_json


def snapshot(state: Any) -> bytes:
    """A byte image of a state, to check that later iteration does not change it."""
    try:
        return json.dumps(state, sort_keys=True).encode()
    except (TypeError, ValueError):
        return pickle.dumps(copy.deepcopy(state))


def state_run(lib: Library, chunks: list[str], points: list[int]) -> dict[str, Any]:
    """Iterate once, taking checkpoints at the first batch boundary after each point."""
    before = _chunks_read[0]
    pipeline = make_pipeline(lib, chunks)
    hasher = hashlib.blake2b(digest_size=16)
    seen = 0
    out: dict[str, Any] = {"points": []}
    for point in points:
        while seen < point:
            batch = next(pipeline)
            seen += len(batch)
            hasher.update(batch_digest(batch))
        getstate = pipeline.getstate
        state = getstate()
        image = snapshot(state)
        latencies = []
        for _ in range(GETSTATE_CALLS):
            t0 = time.perf_counter_ns()
            getstate()
            latencies.append(time.perf_counter_ns() - t0)
        pickled, as_json = state_sizes(state)
        state_shape = shape(state)
        next_batch = next(pipeline)
        seen += len(next_batch)
        hasher.update(batch_digest(next_batch))
        out["points"].append(
            {
                "target_lines": point,
                "lines": seen - len(next_batch),
                "getstate_ms_median": median(latencies) / 1e6,
                "pickle_bytes": pickled,
                "json_bytes": as_json,
                "state_unchanged_by_iteration": snapshot(state) == image,
                "shape": state_shape,
                "state": state,
                "next_batch": next_batch,
            }
        )
    out["digest"] = hasher.hexdigest()
    out["chunks_read"] = _chunks_read[0] - before
    close(pipeline)
    return out


def shape(state: Any) -> Any:
    """Keys and value types of a state (lists by type only), to check that it never changes."""
    if isinstance(state, dict):
        return {k: shape(v) for k, v in state.items()}
    return type(state).__name__


def time_restore(
    lib: Library, chunks: list[str], state: Any
) -> tuple[tuple[float, float], Batch, int]:
    """Return ((wall, CPU) seconds, first batch, chunks read) for new pipeline + setstate +
    next."""
    gc.collect()
    before = _chunks_read[0]
    watch = Stopwatch()
    pipeline = make_pipeline(lib, chunks)
    pipeline.setstate(state)
    batch: Batch = next(pipeline)
    elapsed = watch.read()
    close(pipeline)
    return elapsed, batch, _chunks_read[0] - before


def json_restore_ok(lib: Library, chunks: list[str], state: Any, expected: Batch) -> bool | None:
    try:
        round_tripped = json.loads(json.dumps(state))
        pipeline = make_pipeline(lib, chunks)
        pipeline.setstate(round_tripped)
        ok = bool(next(pipeline) == expected)
        close(pipeline)
        return ok
    except Exception:
        return False


def paired(numerators: list[float], denominators: list[float]) -> float:
    """Median of the ratios of measurements taken side by side (robust to machine drift)."""
    return median([n / d for n, d in zip(numerators, denominators, strict=True)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small corpus and fewer lines/repeats (well under a minute)",
    )
    parser.add_argument("--lines", type=int, default=None, help="corpus size in lines")
    parser.add_argument(
        "--measure-lines", type=int, default=None, help="lines consumed per throughput measurement"
    )
    parser.add_argument(
        "--points",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="lines consumed before the two checkpoints compared by the targets "
        "(default 10000 1000000; --quick 10000 200000)",
    )
    parser.add_argument(
        "--extra-point",
        type=int,
        default=None,
        help="one more checkpoint, reported but not judged (default: "
        "HI + buffer_size/2, i.e. in the middle of a shuffle block; 0: none)",
    )
    parser.add_argument("--reps", type=int, default=None, help="repeats per measurement")
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="read every chunk into memory first (no gzip in the timings), to isolate the "
        "libraries' own overhead; needs ~0.2 GB per 10^6 corpus lines",
    )
    parser.add_argument(
        "--libs", nargs="+", default=list(_util.LIBRARIES), choices=list(_util.LIBRARIES)
    )
    args = parser.parse_args(argv)
    quick = args.quick
    corpus_lines = args.lines or (300_000 if quick else DEFAULT_LINES)
    measure_lines = args.measure_lines or (200_000 if quick else 1_000_000)
    lo, hi = sorted(args.points or ([10_000, 200_000] if quick else [10_000, 1_000_000]))
    extra = hi + BUFFER_SIZE // 2 if args.extra_point is None else args.extra_point
    points = [lo, hi] + ([extra] if extra > hi else [])
    reps = args.reps or (2 if quick else 5)

    chunks = build_corpus(corpus_lines)
    if args.in_memory:
        _in_memory.update((c, read_chunk(c)) for c in chunks)
    libs = _util.load_libraries(args.libs)
    if not libs:
        print("no library could be imported", file=sys.stderr)
        return 1
    names = list(libs)
    print(
        f"corpus: {corpus_lines:,} lines in {len(chunks)} chunks; throughput over "
        f"{measure_lines:,} lines; checkpoints at {points}; {reps} repeats; "
        f"libraries: {', '.join(names)}"
        + ("; chunks served from memory" if args.in_memory else ""),
        flush=True,
    )

    first: dict[str, Samples] = {n: Samples() for n in names}
    runs: dict[str, Samples] = {n: Samples() for n in names}
    lines_per_run: dict[str, list[int]] = {n: [] for n in names}
    batches_per_run: dict[str, int] = {}
    for rep in range(reps):
        order = names if rep % 2 == 0 else names[::-1]  # alternate which library goes first
        for _ in range(FIRST_BATCH_SAMPLES_PER_REP):  # cheap and noisy: sample it more often
            for name in order:
                first[name].add(time_first_batch(libs[name], chunks))
        for name in order:
            elapsed, seen, batches = time_throughput(libs[name], chunks, measure_lines)
            runs[name].add(elapsed)
            lines_per_run[name].append(seen)
            batches_per_run[name] = batches
        print(
            f"  rep {rep + 1}/{reps}: "
            + "  ".join(
                f"{n}: first batch {first[n].cpu[-1] * 1e3:.0f} ms, "
                f"{lines_per_run[n][-1] / runs[n].cpu[-1]:,.0f} lines/s (CPU), "
                f"{lines_per_run[n][-1] / runs[n].wall[-1]:,.0f} (wall)"
                for n in names
            ),
            flush=True,
        )

    results: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"  checkpoints and restores: {name}", flush=True)
        run = state_run(libs[name], chunks, points)
        checkpoints = []
        for p in run["points"]:
            times, exact, reread = Samples(), True, 0
            for _ in range(reps):
                elapsed, batch, reread = time_restore(libs[name], chunks, p["state"])
                times.add(elapsed)
                exact = exact and batch == p["next_batch"]
            checkpoints.append(
                {
                    "target_lines": p["target_lines"],
                    "lines": p["lines"],
                    "getstate_ms_median": p["getstate_ms_median"],
                    "pickle_bytes": p["pickle_bytes"],
                    "json_bytes": p["json_bytes"],
                    "state_unchanged_by_iteration": p["state_unchanged_by_iteration"],
                    "restore_ms": times.summary(1e3),
                    "restore_chunks_read": reread,
                    "restore_exact": exact,
                    "restore_exact_after_json_round_trip": json_restore_ok(
                        libs[name], chunks, p["state"], p["next_batch"]
                    ),
                    "shape": p["shape"],
                }
            )
        base = checkpoints[0]["restore_ms"]
        for c in checkpoints:
            c["restore_ratio_vs_first_point"] = ratio(
                c["restore_ms"]["cpu_median"], base["cpu_median"]
            )
            c["restore_ratio_vs_first_point_wall"] = ratio(
                c["restore_ms"]["wall_median"], base["wall_median"]
            )
        n_lines = lines_per_run[name][0]
        results[name] = {
            "first_batch_ms": first[name].summary(1e3),
            "throughput_lines_per_s": {
                "cpu_best": n_lines / min(runs[name].cpu),
                "cpu_median": n_lines / median(runs[name].cpu),
                "wall_best": n_lines / min(runs[name].wall),
                "wall_median": n_lines / median(runs[name].wall),
            },
            "throughput_run_s": runs[name].summary(),
            "lines_in_throughput_run": n_lines,
            "batches_in_throughput_run": batches_per_run[name],
            "output_digest": run["digest"],
            "checkpoints": checkpoints,
        }

    # ---- report -------------------------------------------------------------------------
    ib = results.get("infinibatch")

    def vs_ib(r: dict[str, Any], group: str, key: str) -> float | None:
        return ratio(r[group][key], ib[group][key]) if ib else None

    print_table(
        f"Throughput over {measure_lines:,} lines (best of {reps}) and time to first batch "
        f"(median of {reps * FIRST_BATCH_SAMPLES_PER_REP}); CPU time, wall-clock in the last "
        "columns",
        [
            "library",
            "lines/s",
            "x ib",
            "first batch ms",
            "x ib",
            "wall lines/s",
            "x ib",
            "wall 1st batch ms",
            "x ib",
        ],
        [
            [
                n,
                r["throughput_lines_per_s"]["cpu_best"],
                vs_ib(r, "throughput_lines_per_s", "cpu_best"),
                r["first_batch_ms"]["cpu_median"],
                vs_ib(r, "first_batch_ms", "cpu_median"),
                r["throughput_lines_per_s"]["wall_best"],
                vs_ib(r, "throughput_lines_per_s", "wall_best"),
                r["first_batch_ms"]["wall_median"],
                vs_ib(r, "first_batch_ms", "wall_median"),
            ]
            for n, r in results.items()
        ],
    )
    print_table(
        "Checkpoints at the first batch boundary after N lines "
        f"(restore = new pipeline + setstate + next batch, CPU median of {reps})",
        [
            "library",
            "N",
            "lines",
            "getstate ms",
            "pickle B",
            "json B",
            "restore ms",
            "chunks re-read",
            f"x restore@{points_label(lo)}",
            "wall ms",
            "wall x",
        ],
        [
            [
                n,
                points_label(c["target_lines"]),
                c["lines"],
                c["getstate_ms_median"],
                c["pickle_bytes"],
                c["json_bytes"],
                c["restore_ms"]["cpu_median"],
                c["restore_chunks_read"],
                c["restore_ratio_vs_first_point"],
                c["restore_ms"]["wall_median"],
                c["restore_ratio_vs_first_point_wall"],
            ]
            for n, r in results.items()
            for c in r["checkpoints"]
        ],
    )
    print_table(
        "Correctness checks",
        [
            "library",
            "restore exact",
            "exact after JSON",
            "state frozen",
            "same shape",
            "same output as infinibatch",
        ],
        [
            [
                n,
                all(c["restore_exact"] for c in r["checkpoints"]),
                all(bool(c["restore_exact_after_json_round_trip"]) for c in r["checkpoints"]),
                all(c["state_unchanged_by_iteration"] for c in r["checkpoints"]),
                all(c["shape"] == r["checkpoints"][0]["shape"] for c in r["checkpoints"]),
                r["output_digest"] == ib["output_digest"] if ib else None,
            ]
            for n, r in results.items()
        ],
    )

    summary: dict[str, Any] = {}
    like = results.get("infinibatch_like")
    if like is not None:
        l_lo, l_hi = like["checkpoints"][0], like["checkpoints"][1]
        growth = l_hi["pickle_bytes"] - l_lo["pickle_bytes"]
        summary = {
            "throughput_ratio_like_over_ib": vs_ib(like, "throughput_lines_per_s", "cpu_best"),
            "first_batch_ratio_like_over_ib": vs_ib(like, "first_batch_ms", "cpu_median"),
            "throughput_ratio_like_over_ib_paired_median": paired(
                ib["throughput_run_s"]["cpu_all"], like["throughput_run_s"]["cpu_all"]
            )
            if ib
            else None,
            "first_batch_ratio_like_over_ib_paired_median": paired(
                like["first_batch_ms"]["cpu_all"], ib["first_batch_ms"]["cpu_all"]
            )
            if ib
            else None,
            "throughput_ratio_like_over_ib_wall": vs_ib(
                like, "throughput_lines_per_s", "wall_best"
            ),
            "first_batch_ratio_like_over_ib_wall": vs_ib(like, "first_batch_ms", "wall_median"),
            "getstate_ms": max(c["getstate_ms_median"] for c in like["checkpoints"]),
            "pickle_bytes_max": max(c["pickle_bytes"] for c in like["checkpoints"]),
            "pickle_bytes_growth": growth,
            "restore_ratio_hi_over_lo": l_hi["restore_ratio_vs_first_point"],
            "restore_ratio_hi_over_lo_wall": l_hi["restore_ratio_vs_first_point_wall"],
            "restore_chunks_read_lo_hi": [l_lo["restore_chunks_read"], l_hi["restore_chunks_read"]],
        }
        if growth == 0:
            size_verdict = "PASS"
        elif abs(growth) <= 32:  # pickle stores larger ints in more bytes; the shape is fixed
            size_verdict = f"PASS ({growth:+d} B: wider ints)"
        else:
            size_verdict = f"MISS ({growth:+d} B)"
        lo_s, hi_s = points_label(lo), points_label(hi)
        targets = [
            (
                "throughput ratio like/ib (best)",
                summary["throughput_ratio_like_over_ib"],
                ">= 1.0",
                verdict(summary["throughput_ratio_like_over_ib"], 1.0, True),
            ),
            (
                "  ... median of paired runs",
                summary["throughput_ratio_like_over_ib_paired_median"],
                ">= 1.0",
                verdict(summary["throughput_ratio_like_over_ib_paired_median"], 1.0, True),
            ),
            (
                "first-batch ratio like/ib (medians)",
                summary["first_batch_ratio_like_over_ib"],
                "<= 1.0 (no worse)",
                verdict(summary["first_batch_ratio_like_over_ib"], 1.0, False),
            ),
            (
                "  ... median of paired samples",
                summary["first_batch_ratio_like_over_ib_paired_median"],
                "<= 1.0 (no worse)",
                verdict(summary["first_batch_ratio_like_over_ib_paired_median"], 1.0, False),
            ),
            (
                "getstate latency, ms (median)",
                summary["getstate_ms"],
                "<= 0.1",
                verdict(summary["getstate_ms"], 0.1, False),
            ),
            (
                "pickled state, bytes (max)",
                summary["pickle_bytes_max"],
                "<= 8192",
                verdict(float(summary["pickle_bytes_max"]), 8192, False),
            ),
            (f"pickled size @{hi_s} - @{lo_s}, bytes", growth, "0 (same size)", size_verdict),
            (
                f"restore@{hi_s} / restore@{lo_s}",
                summary["restore_ratio_hi_over_lo"],
                "<= 1.3",
                verdict(summary["restore_ratio_hi_over_lo"], 1.3, False),
            ),
        ]
        print_table(
            "infinibatch_like against its targets",
            ["metric", "value", "target", "verdict"],
            targets,
        )
        summary["verdicts"] = {t[0]: t[3] for t in targets}
    else:
        print("\ninfinibatch_like not measured: no targets to check")

    _util.write_result(
        "bench_pipeline" + ("_in_memory" if args.in_memory else "") + ("_quick" if quick else ""),
        {
            "config": {
                "corpus_lines": corpus_lines,
                "chunks": len(chunks),
                "measure_lines": measure_lines,
                "points": points,
                "reps": reps,
                "buffer_size": BUFFER_SIZE,
                "read_ahead": READ_AHEAD,
                "tokens_per_batch": TOKENS_PER_BATCH,
                "getstate_calls": GETSTATE_CALLS,
                "first_batch_samples": reps * FIRST_BATCH_SAMPLES_PER_REP,
                "quick": quick,
                "in_memory": args.in_memory,
                "primary_clock": "process CPU time",
            },
            "results": results,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
