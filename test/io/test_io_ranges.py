"""Concurrent byte ranges (infinibatch_like/io/_ranges.py, FetchOptions): exact bytes in
order, at most k ranges in flight, each retried on its own, threads stopped on close and
on collection; against moto's server behind a per-request rate cap (test/_throttle.py)."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import random
import threading
import time
import traceback
from collections.abc import Iterator
from typing import BinaryIO, cast

import pytest
from _profiles import examples
from _s3 import FAST, FaultyProxy
from _throttle import ThrottlingProxy
from _waiting import wait_until
from conftest import S3Bucket
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.io import (
    ChunkReadError,
    FetchOptions,
    RetryPolicy,
    open_chunk,
    read_lines,
    retry_counts,
    storage_counts,
)
from infinibatch_like.io._cancellable import LoopFetch, RequestCancelled
from infinibatch_like.io._ranges import THREAD_NAME, RangeReader

pytestmark = pytest.mark.usefixtures("fresh_storage_counts")


def range_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


class FakeStore:
    """``fetch(start, end)`` of `data`, recording the ranges and the most at once."""

    def __init__(self, data: bytes, delay: float = 0.0) -> None:
        self.data, self.delay = data, delay
        self.ranges: list[tuple[int, int]] = []
        self.active = self.most_active = 0
        self._lock = threading.Lock()

    def fetch(self, start: int, end: int) -> bytes:
        with self._lock:
            self.ranges.append((start, end))
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            time.sleep(self.delay)
            return self.data[start:end]
        finally:
            with self._lock:
                self.active -= 1


def reader(store: FakeStore, range_size: int, in_flight: int, **kwargs: object) -> RangeReader:
    return RangeReader(
        store.fetch,
        "s3://b/object",
        len(store.data),
        range_size=range_size,
        in_flight=in_flight,
        policy=FAST,
        expired=lambda error: None,
        **kwargs,  # type: ignore[arg-type]
    )


@settings(max_examples=examples(0.6))
@given(
    size=st.integers(0, 5000),
    range_size=st.integers(1, 700),
    in_flight=st.integers(0, 6),
    read_size=st.integers(1, 900),
)
def test_ranges_deliver_the_exact_bytes_in_order_and_partition_the_object(
    size: int, range_size: int, in_flight: int, read_size: int
) -> None:
    data = random.Random(size).randbytes(size)
    store = FakeStore(data)
    with reader(store, range_size, in_flight) as stream:
        pieces = iter(lambda: stream.read(read_size), b"")
        assert b"".join(pieces) == data
    assert sorted(store.ranges) == [
        (start, min(start + range_size, size)) for start in range(0, size, range_size)
    ]
    assert store.most_active <= max(1, in_flight)
    assert range_threads() == []


def test_at_most_k_ranges_are_buffered_however_slow_the_reader() -> None:
    store = FakeStore(bytes(100 * 64))
    stream = reader(store, 64, 4)
    stream.read(10)
    assert wait_until(lambda: len(store.ranges) >= 1 + 4)
    time.sleep(0.1)  # the threads would run far ahead if nothing held them back
    assert len(store.ranges) == 1 + 4  # the one being read and 4 ahead
    assert len(stream.read(1000)) == 54  # the rest of the first range
    assert len(stream.read(1000)) == 64  # the second one
    assert wait_until(lambda: len(store.ranges) >= 2 + 4)
    time.sleep(0.05)
    assert len(store.ranges) == 2 + 4
    stream.close()
    assert range_threads() == []


def test_an_error_in_a_thread_reaches_the_reader_with_its_traceback() -> None:
    def fetch(start: int, end: int) -> bytes:
        if start >= 300:
            raise_deep_in_the_store(start)
        return bytes(end - start)

    stream = RangeReader(
        fetch, "s3://b/k", 1000, range_size=100, in_flight=3, policy=FAST,
        expired=lambda error: None,
    )
    assert [stream.read(1000) for _ in range(3)] == [bytes(100)] * 3
    with pytest.raises(ChunkReadError, match=r"reading bytes 300-399 of s3://b/k failed: "
                       r"KeyError: 'no range at 300'") as error:
        stream.read(1)
    cause = error.value.__cause__
    assert isinstance(cause, KeyError)
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert frames[-2:] == ["fetch", "raise_deep_in_the_store"]
    assert any(THREAD_NAME in note for note in error.value.__notes__)
    with pytest.raises(ChunkReadError):  # and it stays failed
        stream.read(1)
    stream.close()
    assert range_threads() == []


def raise_deep_in_the_store(start: int) -> None:
    raise KeyError(f"no range at {start}")


def test_close_and_collection_stop_the_threads_promptly() -> None:
    store = FakeStore(bytes(1 << 16), delay=0.02)
    stream = reader(store, 1 << 10, 8)
    stream.read(1)
    assert len(range_threads()) == 8
    stream.close()
    assert range_threads() == []
    assert len(store.ranges) <= 1 + 8  # it waited for the requests in flight, not the object
    stream.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        stream.read(1)

    dropped = reader(store, 1 << 10, 8)
    dropped.read(1)
    assert len(range_threads()) == 8
    del dropped
    gc.collect()
    assert range_threads() == []


def read_in_a_thread(stream: RangeReader) -> tuple[threading.Thread, list[BaseException]]:
    """A thread reading a byte of `stream`, and the list that gets its ChunkReadError."""
    failures: list[BaseException] = []

    def read() -> None:
        try:
            stream.read(1)
        except ChunkReadError as error:
            failures.append(error)

    reading = threading.Thread(target=read)
    reading.start()
    return reading, failures


def test_close_ends_a_retry_backoff_at_once() -> None:
    def fetch(start: int, end: int) -> bytes:
        raise ConnectionResetError("reset by peer")

    stream = RangeReader(
        fetch, "s3://b/k", 1000, range_size=100, in_flight=2,
        policy=RetryPolicy(tries=5, first_delay=30.0, max_delay=30.0),
        expired=lambda error: None,
    )
    reading, failures = read_in_a_thread(stream)
    time.sleep(0.2)
    started = time.perf_counter()
    stream.close()
    assert time.perf_counter() - started < 5.0  # not the 15-30 s of the backoff
    assert range_threads() == []
    reading.join(5.0)
    assert "was given up: its reader was closed" in str(failures[0])


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread (as an fsspec async file system's)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5.0)
    loop.close()


@pytest.mark.parametrize("in_flight", [0, 3])
def test_close_cancels_the_requests_in_flight_and_waits_for_their_cleanup(
    loop: asyncio.AbstractEventLoop, in_flight: int
) -> None:
    started: list[int] = []
    cleaned: list[int] = []

    async def request(start: int, end: int) -> bytes:
        started.append(start)
        try:
            await asyncio.sleep(60)  # a server that sends nothing for a minute
            return bytes(end - start)
        finally:
            await asyncio.sleep(0.05)  # closing its connection takes a moment
            cleaned.append(start)

    fetch = LoopFetch(loop, request)
    stream = RangeReader(
        fetch, "s3://b/k", 1000, range_size=100, in_flight=in_flight, policy=FAST,
        expired=lambda error: None, cancel=fetch.cancel,
    )
    reading, failures = read_in_a_thread(stream)
    requests = [0, 100, 200][: max(1, in_flight)]
    deadline = time.monotonic() + 10
    while sorted(started) != requests and time.monotonic() < deadline:
        time.sleep(0.01)
    started_closing = time.perf_counter()
    stream.close()
    assert time.perf_counter() - started_closing < 2.0  # not the minute of the requests
    assert range_threads() == []
    reading.join(2.0)
    assert not reading.is_alive()
    assert range_threads() == []  # the reader woken by the close started none again
    assert str(failures[0]) == "reading bytes 0-99 of s3://b/k was given up: its reader was closed"
    assert sorted(cleaned) == requests  # every request ended its cleanup
    with pytest.raises(RequestCancelled, match="its reader was closed"):
        fetch(300, 400)  # and no request starts after


def test_a_request_on_a_closed_event_loop_fails_rather_than_wait_forever() -> None:
    async def request(start: int, end: int) -> bytes:
        return bytes(end - start)

    stopped = asyncio.new_event_loop()  # no thread runs it; it is closed during the request
    threading.Timer(0.3, stopped.close).start()
    with pytest.raises(RuntimeError, match="its event loop was closed during the request"):
        LoopFetch(stopped, request)(0, 10)
    with pytest.raises(RuntimeError, match="Event loop is closed"):
        LoopFetch(stopped, request)(0, 10)


def big_text(size: int, seed: int = 0) -> bytes:
    """Lines of random hex, about `size` bytes."""
    rng = random.Random(seed)
    lines = [f"{seed}:{n}:{rng.getrandbits(400):0100x}\n" for n in range(size // 110 + 1)]
    return "".join(lines).encode()


def test_ranges_in_flight_are_answered_at_once_under_a_per_request_rate_cap(
    s3: S3Bucket,
) -> None:
    """The speed-up this buys (about 5x here at 8 in flight) is measured by
    bench/bench_ranges.py; the test checks what produces it: the answers overlap."""
    data = big_text(3 << 19)
    url = s3.put("big.txt", data)
    range_size = 1 << 17
    ranges = -(-len(data) // range_size)
    with ThrottlingProxy(s3.server.endpoint, rate=None) as proxy:
        for in_flight in (0, 8):
            fetch = FetchOptions(
                ranges_in_flight=in_flight, range_size=range_size, ranges_from_size=1 << 20
            )
            options = {"endpoint_url": proxy.endpoint, "infinibatch_like": fetch}
            proxy.reset()
            proxy.rate = 3e5 if in_flight else None  # a range's answer takes 0.44 s
            with open_chunk(url, storage_options=options) as stream:
                assert stream.read() == data
            assert proxy.gets("big.txt") == (ranges if in_flight else 1)
            assert proxy.bytes_sent("big.txt") == len(data)  # nothing fetched twice
            assert proxy.most_answering() == max(in_flight, 1)


@pytest.mark.parametrize("end", ["close", "drop"])
def test_closing_or_dropping_a_stream_cancels_its_requests_in_flight(
    s3: S3Bucket, end: str
) -> None:
    data = big_text(1 << 20, seed=5)
    url = s3.put("slow.txt", data)
    fetch = {"ranges_in_flight": 3, "range_size": 1 << 16, "ranges_from_size": 0}
    with ThrottlingProxy(s3.server.endpoint, rate=None, step=2048) as proxy:
        options = {"endpoint_url": proxy.endpoint, "infinibatch_like": fetch}
        stream = open_chunk(url, storage_options=options)
        assert stream.read(1000) == data[:1000]  # ranges 0-3 fetched at full speed
        assert wait_until(lambda: proxy.answering() == 0, 10.0)
        proxy.rate = 8000  # from now on a range takes 8 s
        assert stream.read(1 << 16) == data[1000 : 1000 + (1 << 16)]  # more are requested
        assert wait_until(lambda: proxy.answering() > 0, 10.0)
        started = time.perf_counter()
        if end == "close":
            stream.close()
        else:
            del stream
            gc.collect()
        assert range_threads() == []  # at once, not after the requests in flight
        assert time.perf_counter() - started < 2.0
        # their connections are closed: the server's answers stop at their next write
        assert wait_until(lambda: proxy.answering() == 0, 2.0)


def test_storage_counts_requests_and_bytes(s3: S3Bucket) -> None:
    data = big_text(1 << 20)
    url = s3.put("counted.txt", data)
    options = {"infinibatch_like": {"ranges_in_flight": 4, "range_size": "100K",
                                    "ranges_from_size": "500K"}}
    assert b"".join(open_chunk(url, storage_options=options)) == data
    ranges = -(-len(data) // 102400)
    assert storage_counts() == {"requests": ranges, "bytes": len(data), "cache_hits": 0,
                                "cache_misses": 0, "cache_evicted": 0}


def test_a_failed_range_is_retried_on_its_own(s3: S3Bucket, s3_proxy: FaultyProxy) -> None:
    data = big_text(1 << 20, seed=1)
    url = s3.put("flaky.txt", data)
    options = {"endpoint_url": s3_proxy.endpoint,
               "infinibatch_like": {"ranges_in_flight": 4, "range_size": 1 << 17,
                                    "ranges_from_size": 0}}
    stream = open_chunk(url, storage_options=options, retry=FAST)
    head = stream.read(300_000)
    s3_proxy.inject("reset", 1, "GET", "flaky.txt")  # one answer cut in its middle
    s3_proxy.inject("slow_down", 1, "GET", "flaky.txt")
    assert head + stream.read() == data
    stream.close()
    ranges = -(-len(data) // (1 << 17))
    gets = [path for method, path in s3_proxy.requests if method == "GET"]
    assert len(gets) == ranges + 2  # each failure repeats its range only
    assert sum(retry_counts().values()) == 2
    assert storage_counts()["requests"] == ranges + 2


def test_an_object_replaced_during_a_ranged_read_is_named(s3: S3Bucket) -> None:
    data = big_text(1 << 20, seed=2)
    url = s3.put("moving.txt", data)
    options = {"infinibatch_like": {"ranges_in_flight": 2, "range_size": 1 << 16,
                                    "ranges_from_size": 0}}
    stream = open_chunk(url, storage_options=options, retry=FAST)
    assert stream.read(1000) == data[:1000]
    s3.put("moving.txt", big_text(1 << 20, seed=3))  # another ETag
    with pytest.raises(ChunkReadError, match=rf"{url} changed while it was being read"):
        stream.read()
    stream.close()
    assert retry_counts() == {}  # a changed object is not retried


def test_fetch_options_are_checked_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"unknown field\(s\) 'ranges'; known: cache_dir"):
        open_chunk("s3://b/k", storage_options={"infinibatch_like": {"ranges": 8}})
    with pytest.raises(ValueError, match=r"FetchOptions: ranges_in_flight must be an int >= 0"):
        FetchOptions(ranges_in_flight=-1)
    with pytest.raises(ValueError, match=r"FetchOptions: range_size must be a number of bytes"):
        FetchOptions(range_size="eight megabytes")  # type: ignore[arg-type]
    assert FetchOptions(range_size="8M").range_size == 8 << 20  # type: ignore[arg-type]
    monkeypatch.setenv("INFINIBATCH_LIKE_CACHE_SIZE", "1.5G")
    monkeypatch.setenv("INFINIBATCH_LIKE_RANGES_IN_FLIGHT", "16")
    options = FetchOptions.from_environment()
    assert (options.cache_size, options.ranges_in_flight) == (3 << 29, 16)
    monkeypatch.setenv("INFINIBATCH_LIKE_RANGE_SIZE", "lots")
    with pytest.raises(ValueError, match=r"INFINIBATCH_LIKE_RANGE_SIZE must be a number"):
        FetchOptions.from_environment()


def test_fetch_options_travel_in_a_partial_to_a_reader(s3: S3Bucket) -> None:
    data = big_text(200_000, seed=4)
    url = s3.put("p.txt", data)
    fetch = {"ranges_in_flight": 3, "range_size": 50_000, "ranges_from_size": 0}
    reader_fn = functools.partial(read_lines, storage_options={"infinibatch_like": fetch})
    assert "\n".join(reader_fn(url)) + "\n" == data.decode()
    assert storage_counts()["requests"] == -(-len(data) // 50_000)


def read_in_a_forked_child(stream: BinaryIO, size: int) -> str:
    """What a forked child's two reads of `size` bytes of `stream` gave: their error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its copy of the stream has no threads
        try:
            stream.read(size)
            stream.read(size)
            os.write(write_end, b"read without an error")
        except ChunkReadError as error:
            os.write(write_end, str(error).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        message = answer.read().decode()
    os.waitpid(pid, 0)
    return message


def test_a_stream_read_in_a_forked_child_fails_at_once_rather_than_hang() -> None:
    stream = reader(FakeStore(bytes(10_000)), 100, 4)
    assert stream.read(50) == bytes(50)
    assert read_in_a_forked_child(cast(BinaryIO, stream), 100) == (
        f"s3://b/object: this stream was opened in process {os.getpid()} and cannot be read "
        "in a forked child; open the chunk again in this process"
    )
    assert stream.read(100) == bytes(50)  # the parent's goes on
    stream.close()


def test_an_s3_stream_read_one_range_at_a_time_in_a_forked_child_fails_at_once(
    s3: S3Bucket,
) -> None:
    data = big_text(1 << 18, seed=6)
    url = s3.put("forked.txt", data)
    options = {"default_block_size": 1 << 14, "infinibatch_like": {"ranges_in_flight": 0}}
    stream = open_chunk(url, storage_options=options, retry=FAST)
    assert stream.read(100) == data[:100]  # the first block of 16 KiB
    assert read_in_a_forked_child(stream, 1 << 18) == (
        f"reading bytes 16384-32767 of {url} failed: RuntimeError: its event loop runs in "
        f"process {os.getpid()}, not in this forked child: open the object again in this "
        "process"
    )
    assert stream.read() == data[100:]  # the parent's goes on
    stream.close()
