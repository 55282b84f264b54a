"""Concurrent byte ranges against a per-request rate cap, and the local cache's second epoch.

A real S3 API (moto's server) runs in a child process behind proxies (`test/_throttle.py`,
in the same child) that send each answer no faster than a rate of ``--rates`` (30 MB/s
first: what an object store gives one request) and count GET requests and body bytes.

1. Ranges: one object of ``--size-mib`` is read whole through `open_chunk`, as one request
   (``ranges_in_flight=0``, a range as large as the object) and with k ranges of
   ``--range-mib`` in flight, for each k of ``--ks``; the table gives MB/s, the speed-up
   over one request and the bytes the proxy sent over the object's size. Target: >= 4x
   with 8 in flight, bytes <= 1.05x.
2. Cache: a data set of ``--objects`` objects read twice through `read_lines` with a cache
   directory (``FetchOptions(cache_dir=...)``), through the first proxy: GETs per epoch,
   with a cache that holds the data set and with one that holds half of it. Target: 0
   GETs in the second epoch of the first.

Each cap of ``--rates`` is measured (30 MB/s, and 4 MB/s, where 8 requests in flight stay
under what moto's server, the proxy and the client can move on a small machine), and the
same reads without a cap, which show that ceiling: on a machine where it is below 8 x 30
MB/s, the 30 MB/s figure shows the ceiling rather than the ranges.

Run: ``python bench/bench_ranges.py [--size-mib 64] [--rates 30e6 4e6] [--ks 1 2 4 8 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from _util import REPO_ROOT, print_table, ratio, verdict, write_result

from infinibatch_like.io import FetchOptions, open_chunk, read_lines

_SERVE = """
import json, logging, sys
logging.getLogger("werkzeug").setLevel(logging.WARNING)
sys.path.insert(0, {test!r})
from _s3 import S3Server
from _throttle import ThrottlingProxy
server = S3Server()
proxies = [ThrottlingProxy(server.endpoint, rate=rate) for rate in {rates!r}]
print(server.endpoint, *(proxy.endpoint for proxy in proxies), flush=True)
for line in sys.stdin:  # "counts" (and reset them), until the parent closes our stdin
    counts = {{"gets": sum(p.gets() for p in proxies),
               "bytes": sum(p.bytes_sent() for p in proxies)}}
    print(json.dumps(counts), flush=True)
    for proxy in proxies:
        proxy.reset()
"""


class Store:
    """moto's server and a throttling proxy per rate (None: no cap), in a child process;
    `proxies` maps each rate to its proxy's endpoint."""

    def __init__(self, rates: list[float | None]) -> None:
        code = _SERVE.format(test=str(REPO_ROOT / "test"), rates=rates)
        self.process = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.server, *endpoints = self.process.stdout.readline().split()
        self.proxies = dict(zip(rates, endpoints, strict=True))
        sys.path.insert(0, str(REPO_ROOT / "test"))
        from _s3 import CREDENTIALS

        os.environ.update(CREDENTIALS)
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.server)
        self.client.create_bucket(Bucket="bench")

    def put(self, key: str, data: bytes) -> str:
        self.client.put_object(Bucket="bench", Key=key, Body=data)
        return f"s3://bench/{key}"

    def counts(self) -> dict[str, int]:
        """GETs and bytes the proxy sent since the last call."""
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write("counts\n")
        self.process.stdin.flush()
        counts: dict[str, int] = json.loads(self.process.stdout.readline())
        return counts

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


@contextmanager
def store(rates: list[float | None]) -> Iterator[Store]:
    running = Store(rates)
    try:
        yield running
    finally:
        running.close()


def read_whole(ref: str, options: dict[str, Any]) -> tuple[float, int]:
    """Seconds to read `ref` whole, and its length."""
    started = time.perf_counter()
    length = 0
    with open_chunk(ref, storage_options=options) as stream:
        while block := stream.read(1 << 22):
            length += len(block)
    return time.perf_counter() - started, length


def bench_ranges(running: Store, ref: str, size: int, rate: float | None,
                 args: argparse.Namespace) -> dict[str, Any]:
    """The object `ref` of `size` bytes read through the proxy capped at `rate`, in one
    request and with each k of ``args.ks`` ranges in flight."""
    range_size = args.range_mib << 20
    settings = {0: FetchOptions(ranges_in_flight=0)}  # one request: a range of the object
    settings.update(
        {k: FetchOptions(ranges_in_flight=k, range_size=range_size, ranges_from_size=0)
         for k in args.ks}
    )
    results: dict[str, Any] = {}
    running.counts()
    for k, fetch in settings.items():
        options = {"endpoint_url": running.proxies[rate], "infinibatch_like": fetch,
                   "default_block_size": size if k == 0 else 5 << 20}
        times = []
        for _ in range(args.reps):
            seconds, length = read_whole(ref, options)
            assert length == size
            times.append(seconds)
        counts = running.counts()
        results[str(k)] = {"seconds": times, "gets": counts["gets"] / args.reps,
                           "bytes_over_size": counts["bytes"] / args.reps / size}
    single = min(results["0"]["seconds"])
    rows = []
    for k in settings:
        best = min(results[str(k)]["seconds"])
        speedup = ratio(single, best)
        results[str(k)]["speedup"] = speedup
        results[str(k)]["mb_per_s"] = size / best / 1e6
        rows.append([
            "1 request" if k == 0 else k, size / best / 1e6, speedup,
            verdict(speedup, 4.0, True) if k == 8 and rate is not None else "",
            results[str(k)]["gets"], results[str(k)]["bytes_over_size"],
        ])
    cap = "no cap (the CPU ceiling)" if rate is None else f"capped at {rate / 1e6:g} MB/s"
    print_table(
        f"{size >> 20} MiB object, each request {cap}, ranges of {args.range_mib} MiB; "
        f"best of {args.reps}",
        ["ranges in flight", "MB/s", "speed-up", "8: >= 4x", "GETs", "bytes / size"],
        rows,
    )
    return results


def bench_cache(running: Store, args: argparse.Namespace) -> dict[str, Any]:
    size = args.object_mib << 20
    line = b"x" * 99 + b"\n"
    refs = [running.put(f"set/{i}.txt", line * (size // 100)) for i in range(args.objects)]
    total = args.objects * (size // 100) * 100
    results: dict[str, Any] = {}
    rows = []
    for label, limit in (("holds the data set", 2 * total), ("holds half", total // 2)):
        with tempfile.TemporaryDirectory(prefix="bench-cache-") as directory:
            fetch = {"cache_dir": directory, "cache_size": limit}
            options = {"endpoint_url": running.proxies[args.rates[0]],
                       "infinibatch_like": fetch}
            running.counts()
            epochs = []
            for _ in range(2):
                started = time.perf_counter()
                lines = sum(1 for ref in refs for _ in read_lines(ref, storage_options=options))
                assert lines == args.objects * (size // 100)
                epochs.append({"seconds": time.perf_counter() - started, **running.counts()})
        results[label] = epochs
        rows.append([label, epochs[0]["gets"], epochs[1]["gets"],
                     epochs[1]["bytes"] / total, epochs[0]["seconds"], epochs[1]["seconds"],
                     verdict(1.0 if epochs[1]["gets"] == 0 else 0.0, 1.0, True)
                     if limit > total else ""])
    print_table(
        f"{args.objects} objects of {args.object_mib} MiB read twice through the cache",
        ["cache", "epoch 1 GETs", "epoch 2 GETs", "epoch 2 bytes / data", "epoch 1 s",
         "epoch 2 s", "no GET"],
        rows,
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", type=float, nargs="+", default=[30e6, 4e6],
        help="bytes/s per request, each measured (the first also for the cache)",
    )
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--range-mib", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--object-mib", type=int, default=8)
    args = parser.parse_args(argv)
    rates: list[float | None] = [*args.rates, None]
    with store(rates) as running:
        size = args.size_mib << 20
        ref = running.put("big.bin", os.urandom(size))
        ranges = {str(rate): bench_ranges(running, ref, size, rate, args) for rate in rates}
        cache = bench_cache(running, args)
    write_result("ranges", {"args": vars(args), "ranges": ranges, "cache": cache})
    return 0


if __name__ == "__main__":
    sys.exit(main())
