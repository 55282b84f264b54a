"""The local cache of remote objects (infinibatch_like/io/_cache.py): no GET for a second
epoch, eviction when it is smaller than the data, a changed object never served stale,
and safety under processes reading at once and under SIGKILL in the middle of a write;
against moto's server behind a proxy that counts requests (test/_throttle.py)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _profiles import examples
from _throttle import ThrottlingProxy
from conftest import S3Bucket
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import (
    FetchOptions,
    open_chunk,
    read_lines,
    storage_counts,
)
from infinibatch_like.io._cache import PREFIX, TMP, ChunkCache

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("fresh_storage_counts")


@pytest.fixture
def proxy(s3: S3Bucket) -> Iterator[ThrottlingProxy]:
    with ThrottlingProxy(s3.server.endpoint, rate=None) as counting:
        yield counting


def lines(seed: int, count: int) -> list[str]:
    return [f"{seed}:{n}:{hashlib.sha256(b'%d/%d' % (seed, n)).hexdigest()}" for n in range(count)]


def text(seed: int, count: int) -> bytes:
    return "".join(line + "\n" for line in lines(seed, count)).encode()


def cached_files(directory: Path) -> dict[str, int]:
    """The cache's finished entries and their sizes."""
    return {
        path.name: path.stat().st_size
        for path in directory.iterdir()
        if path.name.startswith(PREFIX) and TMP not in path.name
    }


def options(proxy: ThrottlingProxy, cache: Path, **fetch: Any) -> dict[str, Any]:
    fields = {"cache_dir": str(cache), "ranges_in_flight": 4, "range_size": 20_000,
              "ranges_from_size": 50_000, **fetch}
    return {"endpoint_url": proxy.endpoint, "infinibatch_like": fields}


def test_a_second_epoch_over_a_cached_dataset_makes_no_get(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path
) -> None:
    counts = [300, 1200, 2000, 50]  # below and above the size of concurrent ranges
    refs = [s3.put(f"train/{i}.txt", text(i, n)) for i, n in enumerate(counts)]
    expected = sorted(line for i, n in enumerate(counts) for line in lines(i, n))
    reader = lambda ref: read_lines(ref, storage_options=options(proxy, tmp_path))  # noqa: E731

    def epoch() -> list[str]:
        return sorted(chunked_dataset_iterator(refs, reader, 100, train=False, shuffle=False))

    assert epoch() == expected
    first_gets = proxy.gets("/train/")
    assert proxy.bytes_sent("/train/") == sum(len(text(i, n)) for i, n in enumerate(counts))
    assert len(cached_files(tmp_path)) == len(refs)
    assert storage_counts()["cache_misses"] == len(refs)
    proxy.reset()
    assert epoch() == expected
    assert proxy.gets() == 0  # every byte from the cache
    assert proxy.requests("HEAD") == len(refs)  # the ETag of each object, checked
    assert storage_counts()["cache_hits"] == len(refs)
    assert storage_counts()["requests"] == first_gets


def test_a_cache_smaller_than_the_data_evicts_and_stays_exact(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path
) -> None:
    refs = [s3.put(f"d/{i}.txt", text(i, 700)) for i in range(6)]  # about 60 KB each
    size = len(text(0, 700))
    limit = int(2.5 * size)
    for _ in range(2):
        for index, ref in enumerate(refs):
            got = list(read_lines(ref, storage_options=options(proxy, tmp_path,
                                                                cache_size=limit)))
            assert got == lines(index, 700)
            assert sum(cached_files(tmp_path).values()) <= limit
    assert len(cached_files(tmp_path)) == 2
    assert storage_counts()["cache_evicted"] == 12 - 2
    assert proxy.gets() > 0  # read in order, an LRU cache of 2 never holds the next one
    # the most recently used stay: the last two objects are read without a GET
    proxy.reset()
    for index in (4, 5):
        assert list(read_lines(refs[index], storage_options=options(proxy, tmp_path,
                                                                     cache_size=limit))) \
            == lines(index, 700)
    assert proxy.gets() == 0


def test_an_object_larger_than_the_cache_is_read_without_it(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path
) -> None:
    ref = s3.put("huge.txt", text(1, 3000))
    for _ in range(2):
        found = read_lines(ref, storage_options=options(proxy, tmp_path, cache_size=1000))
        assert list(found) == lines(1, 3000)
    assert list(tmp_path.iterdir()) == []  # not even a temporary file


def test_a_changed_object_is_not_served_stale(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path
) -> None:
    ref = s3.put("v.txt", text(1, 100))
    assert list(read_lines(ref, storage_options=options(proxy, tmp_path))) == lines(1, 100)
    s3.put("v.txt", text(2, 100))  # a new version, same size
    assert list(read_lines(ref, storage_options=options(proxy, tmp_path))) == lines(2, 100)
    assert storage_counts()["cache_misses"] == 2
    assert len(cached_files(tmp_path)) == 2  # the old version goes when it is least used


def test_the_cache_is_configured_by_environment_variables(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFINIBATCH_LIKE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("INFINIBATCH_LIKE_CACHE_SIZE", "10M")
    ref = s3.put("e.txt", text(3, 100))
    storage = {"endpoint_url": proxy.endpoint}
    for _ in range(2):
        assert list(read_lines(ref, storage_options=storage)) == lines(3, 100)
    assert proxy.gets() == 1
    assert len(cached_files(tmp_path / "cache")) == 1
    given = {**storage, "infinibatch_like": FetchOptions()}  # the option wins: no cache
    assert list(read_lines(ref, storage_options=given)) == lines(3, 100)
    assert proxy.gets() == 2


def test_an_unusable_cache_directory_is_warned_about_and_reads_go_on(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    ref = s3.put("w.txt", text(4, 100))
    with caplog.at_level(logging.WARNING, logger="infinibatch_like.io"):
        got = list(read_lines(ref, storage_options=options(proxy, blocker / "cache")))
    assert got == lines(4, 100)
    assert any(f"the chunk cache in {blocker / 'cache'} cannot be written" in r.getMessage()
               for r in caplog.records)


_READ = """
import hashlib, json, sys, time
from infinibatch_like.io import open_chunk, storage_counts
storage = json.loads(sys.argv[1])
sys.stdin.readline()  # wait for the go, so that processes read at once
for ref in sys.argv[2:]:
    with open_chunk(ref, storage_options=storage) as stream:
        digest = hashlib.sha256()
        while True:
            block = stream.read(1 << 14)
            if not block:
                break
            digest.update(block)
            print("reading", flush=True)
    print(json.dumps([ref, digest.hexdigest()]), flush=True)
print(json.dumps(storage_counts()), flush=True)
"""


def read_in_children(storage: dict[str, Any], refs: list[str], count: int = 1) -> list[
        subprocess.Popen[str]]:
    """`count` processes that read `refs` through `storage` (all started at once)."""
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _READ, json.dumps(storage), *refs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=environment,
        )
        for _ in range(count)
    ]
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    return children


def test_two_processes_reading_a_dataset_at_once_share_the_cache(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path
) -> None:
    data = {f"s/{i}.txt": text(i, 400 + 500 * i) for i in range(4)}
    refs = [s3.put(key, value) for key, value in data.items()]
    digests = {s3.url(key): hashlib.sha256(value).hexdigest() for key, value in data.items()}
    storage = options(proxy, tmp_path)
    for child in read_in_children(storage, refs, count=2):
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        results = [json.loads(line) for line in out.splitlines() if line != "reading"]
        assert dict(results[:-1]) == digests  # exact, in both
    for key, value in data.items():  # fetched once, or once by each process
        ranges = -(-len(value) // 20_000) if len(value) >= 50_000 else 1
        assert proxy.gets(key) in (ranges, 2 * ranges)
        assert proxy.bytes_sent(key) in (len(value), 2 * len(value))
    assert len(cached_files(tmp_path)) == len(refs)
    proxy.reset()
    for ref in refs:  # the next epoch: from the cache
        with open_chunk(ref, storage_options=storage) as stream:
            assert hashlib.sha256(stream.read()).hexdigest() == digests[ref]
    assert proxy.gets() == 0


def test_a_writer_killed_mid_object_leaves_no_partial_entry(
    s3: S3Bucket, tmp_path: Path
) -> None:
    data = text(9, 4000)  # about 360 KB, sent at 400 KB/s per request
    ref = s3.put("k.txt", data)
    with ThrottlingProxy(s3.server.endpoint, rate=4e5) as slow:
        storage = options(slow, tmp_path, ranges_in_flight=1)
        (child,) = read_in_children(storage, [ref])
        assert child.stdout is not None
        assert child.stdout.readline() == "reading\n"  # its temporary file is half written
        temporaries = [p for p in tmp_path.iterdir() if TMP in p.name]
        assert len(temporaries) == 1
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        assert cached_files(tmp_path) == {}  # never a partial entry
    with ThrottlingProxy(s3.server.endpoint, rate=None) as fast:
        with open_chunk(ref, storage_options=options(fast, tmp_path)) as stream:
            assert stream.read() == data
        assert [p for p in tmp_path.iterdir() if TMP in p.name] == []  # the dead one's: gone
        assert list(cached_files(tmp_path).values()) == [len(data)]
        fast.reset()
        with open_chunk(ref, storage_options=options(fast, tmp_path)) as stream:
            assert stream.read() == data
        assert fast.gets() == 0


def test_an_object_not_read_to_its_end_is_not_kept(
    s3: S3Bucket, proxy: ThrottlingProxy, tmp_path: Path
) -> None:
    ref = s3.put("half.txt", text(5, 2000))
    stream = open_chunk(ref, storage_options=options(proxy, tmp_path, ranges_in_flight=1))
    assert stream.read(100) == text(5, 2000)[:100]
    stream.close()
    dropped = open_chunk(ref, storage_options=options(proxy, tmp_path))
    dropped.read(100)
    del dropped  # collected without close
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(PREFIX)] == []
    assert storage_counts()["cache_misses"] == 2


@settings(max_examples=examples(0.4))
@given(
    limit=st.integers(1, 400),
    reads=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 150)), max_size=25),
)
def test_the_cache_stays_under_its_limit_and_serves_exact_bytes(
    limit: int, reads: list[tuple[int, int]]
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        cache = ChunkCache(directory, limit)
        for key, size in reads:
            data = bytes([key]) * size
            path = cache.path(f"s3://b/{key}", f'"etag-{key}"', size)
            cached = cache.open(path, size)
            if cached is not None:
                with cached:
                    assert cached.read() == data
                continue
            writer = cache.writer(path, size)
            if writer is None:
                assert size > limit
                continue
            writer.write(data[: size // 2])
            writer.write(data[size // 2 :])
            writer.commit()
            assert sum(cached_files(Path(directory)).values()) <= limit
            assert cached_files(Path(directory)).get(os.path.basename(path)) == size
        assert not [name for name in os.listdir(directory) if TMP in name]
