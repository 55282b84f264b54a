"""Latency hidden by chunk read-ahead: a store answering every request 50 ms late, against
local disk.

The corpus (gzip chunks) is read by the same pipeline, ``chunked_dataset_iterator(refs,
read_lines, buffer_size, seed, read_ahead_chunks=k)``, once from local disk and once from a
real S3 API (moto's server, in a child process) behind a proxy that delays each answer by
``--delay`` seconds (`test/_s3.py`), and through the same proxy without the delay. The
target: with enough read-ahead the delayed pipeline is at most 10 % slower than the local
one. "delayed / remote" isolates the latency (1.0: fully hidden); "CPU delayed / local"
shows what the HTTP client stack (s3fs, aiobotocore, aiohttp) costs this process. Runs
alternate; the table reports median wall times (latency is wall time) for each k.
``--transform`` adds a cheap tokenizer, as a training pipeline has.

Run: ``python bench/bench_io_latency.py [--lines N] [--reps N] [--ks 0 4 8 16]``.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path
from typing import Any

from _util import REPO_ROOT, Samples, Stopwatch, print_table, ratio, verdict, write_result
from corpus import build_corpus

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import read_lines, retry_counts

TARGET = 1.10
_SERVE = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.WARNING)
sys.path.insert(0, {test!r})
from _s3 import FaultyProxy, S3Server
server = S3Server()
proxy = FaultyProxy(server.endpoint, delay={delay!r})
direct = FaultyProxy(server.endpoint)  # the same path without the delay
print(server.endpoint, proxy.endpoint, direct.endpoint, flush=True)
sys.stdin.read()  # serve until the parent closes our stdin
"""


def start_store(delay: float) -> tuple[subprocess.Popen[str], str, str, str]:
    """moto's server and two proxies in front of it, one delaying each answer by `delay`,
    in a child process: (process, server, delaying proxy, plain proxy)."""
    code = _SERVE.format(test=str(REPO_ROOT / "test"), delay=delay)
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    server, proxy, direct = process.stdout.readline().split()
    return process, server, proxy, direct


def upload(server: str, chunks: list[str]) -> list[str]:
    sys.path.insert(0, str(REPO_ROOT / "test"))
    import boto3
    from _s3 import CREDENTIALS

    client = boto3.client(
        "s3",
        endpoint_url=server,
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    )
    client.create_bucket(Bucket="corpus")
    for chunk in chunks:
        client.upload_file(chunk, "corpus", Path(chunk).name)
    os.environ.update(CREDENTIALS)
    return [f"s3://corpus/{Path(chunk).name}" for chunk in chunks]


def tokenize(line: str) -> list[int]:
    """A cheap stand-in for a tokenizer (a few microseconds per line)."""
    return [len(word) for word in line.split()]


def run(refs: list[str], reader: Any, k: int, items: int, transform: Any) -> tuple[float, float]:
    watch = Stopwatch()
    pipeline = chunked_dataset_iterator(
        refs, reader, 10_000, seed=1, read_ahead_chunks=k, transform=transform
    )
    for _ in islice(pipeline, items):
        pass
    pipeline.close()
    return watch.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.05)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 4, 8, 16])
    parser.add_argument(
        "--transform", action="store_true", help="tokenize each line (a few us of work)"
    )
    args = parser.parse_args(argv)
    chunks = build_corpus(args.lines)
    transform = tokenize if args.transform else None
    process, server, proxy, direct = start_store(args.delay)
    try:
        refs = upload(server, chunks)
        stores = {
            "local": (chunks, read_lines),
            "remote, no delay": (refs, _reader(direct)),
            "remote, delayed": (refs, _reader(proxy)),
        }
        for paths, reader in stores.values():  # warm-up: connections, imports, page cache
            run(paths, reader, max(args.ks), args.lines, transform)
        samples = {(where, k): Samples() for k in args.ks for where in stores}
        for _ in range(args.reps):
            for k in args.ks:
                for where, (paths, reader) in stores.items():
                    samples[where, k].add(run(paths, reader, k, args.lines, transform))
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=30)
    rows, results = [], {}
    for k in args.ks:
        wall = {where: samples[where, k].summary()["wall_median"] for where in stores}
        cpu = {where: samples[where, k].summary()["cpu_median"] for where in stores}
        slowdown = ratio(wall["remote, delayed"], wall["local"])
        rows.append([
            k,
            wall["local"] * 1e3,
            wall["remote, no delay"] * 1e3,
            wall["remote, delayed"] * 1e3,
            slowdown,
            verdict(slowdown, TARGET, False),
            ratio(wall["remote, delayed"], wall["remote, no delay"]),
            ratio(cpu["remote, delayed"], cpu["local"]),
        ])
        results[str(k)] = {
            **{where: samples[where, k].summary() for where in stores},
            "delayed_over_local": slowdown,
        }
    print_table(
        f"{args.lines:,} lines in {len(chunks)} gzip chunks"
        f"{', tokenized' if transform else ''}; the delayed store answers "
        f"{args.delay * 1e3:.0f} ms late; median wall of {args.reps}",
        ["read_ahead_chunks", "local ms", "remote ms", "delayed ms", "delayed / local",
         "<= 1.10", "delayed / remote", "CPU delayed / local"],
        rows,
    )
    print(f"retries: {retry_counts() or 'none'}")
    name = "io_latency_tokenized" if transform else "io_latency"
    write_result(
        name,
        {"lines": args.lines, "delay": args.delay, "transform": bool(transform),
         "results": results, "retries": retry_counts()},
    )
    return 0


def _reader(endpoint: str) -> Any:
    return functools.partial(read_lines, storage_options={"endpoint_url": endpoint})

if __name__ == "__main__":
    sys.exit(main())
