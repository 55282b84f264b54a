"""infinibatch_like.io against a real S3 API: moto's server on loopback, through s3fs and
boto3 as a user would use them (endpoint from AWS_ENDPOINT_URL or storage_options), with
faults injected on the wire by a proxy (test/_s3.py)."""

from __future__ import annotations

import functools
import gzip
import json
import logging
import random
import urllib.request
from itertools import islice

import pytest
from _s3 import FAST, FaultyProxy
from conftest import S3Bucket

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import (
    ChunkAccessError,
    ChunkFormatError,
    ChunkNotFoundError,
    ChunkReadError,
    Record,
    list_chunks,
    open_chunk,
    open_output,
    read_jsonl,
    read_lines,
    read_records,
    readers,
    retry_counts,
    write_records,
)

pytestmark = pytest.mark.usefixtures("fresh_storage_counts")


def lines_of(seed: int, count: int) -> list[str]:
    """Lines that gzip poorly (so that a chunk spans several range requests)."""
    rng = random.Random(seed)
    return [f"{seed}:{number}:{rng.getrandbits(160):040x}" for number in range(count)]


def text(lines: list[str]) -> bytes:
    return "".join(line + "\n" for line in lines).encode()


def test_list_chunks_is_sorted_and_keeps_the_protocol(s3: S3Bucket) -> None:
    keys = ["corpus/b/2.txt.gz", "corpus/a/10.txt.gz", "corpus/a/9.txt.gz", "corpus/c.txt.gz"]
    for key in random.Random(0).sample(keys, len(keys)):
        s3.put(key, gzip.compress(b"x\n"))
    s3.put("corpus/a/notes.md", b"not a chunk")
    assert list_chunks(s3.url("corpus/**/*.txt.gz")) == sorted(s3.url(key) for key in keys)
    assert list_chunks(s3.url("corpus/a/*.gz")) == [s3.url("corpus/a/10.txt.gz"), s3.url(
        "corpus/a/9.txt.gz")]
    s3.put("corpus/a/0.txt.gz", gzip.compress(b"y\n"))  # a listing is never a stale cache
    assert list_chunks(s3.url("corpus/a/*.gz"))[0] == s3.url("corpus/a/0.txt.gz")
    with pytest.raises(ChunkNotFoundError, match=rf"no file matches the pattern 's3://{s3.name}"):
        list_chunks(s3.url("corpus/*.zst"))


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_lines_jsonl_and_records_written_and_read_on_s3(s3: S3Bucket, suffix: str) -> None:
    rows = [{"id": i, "text": line} for i, line in enumerate(lines_of(1, 300))]
    with open_output(s3.url(f"rows.jsonl{suffix}")) as out:
        out.write(text([json.dumps(row) for row in rows]))
    assert list(read_jsonl(s3.url(f"rows.jsonl{suffix}"))) == rows
    with open_output(s3.url(f"lines.txt{suffix}")) as out:
        out.write(b"one\r\ntwo\n\nthree")
    assert list(read_lines(s3.url(f"lines.txt{suffix}"))) == ["one", "two", "", "three"]
    records = [Record(f"img/{i}.png", bytes([i]) * i) for i in range(20)]
    with open_output(s3.url(f"packed.rec{suffix}")) as out:
        write_records(out, records)
    assert list(read_records(s3.url(f"packed.rec{suffix}"))) == records


def test_open_output_to_s3_leaves_nothing_on_an_exception(s3: S3Bucket) -> None:
    def fail_while_writing() -> None:
        with open_output(s3.url("out.txt.gz")) as out:
            out.write(b"half")
            raise KeyboardInterrupt  # even an interrupt stores nothing

    with pytest.raises(KeyboardInterrupt):
        fail_while_writing()
    assert s3.client.list_objects_v2(Bucket=s3.name).get("KeyCount") == 0


@pytest.mark.parametrize("read_ahead_chunks", [0, 3])
def test_chunked_dataset_iterator_over_s3_resumes_exactly(
    s3: S3Bucket, read_ahead_chunks: int
) -> None:
    for index in range(6):
        s3.put(f"train/{index:02d}.txt.zst", b"")  # replaced below, through open_output
        with open_output(s3.url(f"train/{index:02d}.txt.zst")) as out:
            out.write(text(lines_of(index, 40)))
    refs = list_chunks(s3.url("train/*.zst"))

    def build():  # a fresh pipeline, as after a restart
        return chunked_dataset_iterator(
            refs, read_lines, buffer_size=25, seed=7, read_ahead_chunks=read_ahead_chunks
        )

    first = build()
    list(islice(first, 111))
    state = json.loads(json.dumps(first.getstate()))
    expected = list(islice(first, 300))
    resumed = build()
    resumed.setstate(state)
    assert list(islice(resumed, 300)) == expected
    assert set(expected) <= {line for index in range(6) for line in lines_of(index, 40)}


def test_object_deleted_mid_run_is_named(s3: S3Bucket) -> None:
    refs = [s3.put(f"eval/{i}.txt", text(lines_of(i, 5))) for i in range(3)]
    pipeline = chunked_dataset_iterator(refs, read_lines, 1, train=False, shuffle=False)
    assert list(islice(pipeline, 5)) == lines_of(0, 5)
    s3.client.delete_object(Bucket=s3.name, Key="eval/1.txt")
    with pytest.raises(ChunkNotFoundError, match=rf"s3://{s3.name}/eval/1\.txt: no such file"):
        next(pipeline)
    assert retry_counts() == {}  # a missing object is not retried


def test_slow_down_answers_are_retried_and_counted(
    s3: S3Bucket, s3_proxy: FaultyProxy, caplog: pytest.LogCaptureFixture
) -> None:
    url = s3.put("hot.txt.gz", gzip.compress(text(lines_of(3, 1000))))
    s3_proxy.inject("slow_down", 3, "GET", "hot.txt")
    options = {"endpoint_url": s3_proxy.endpoint}
    with caplog.at_level(logging.WARNING, logger="infinibatch_like.io"):
        assert list(read_lines(url, storage_options=options, retry=FAST)) == lines_of(3, 1000)
    assert s3_proxy.injected["slow_down"] == 3
    assert retry_counts() == {"SlowDown": 3}
    retries = [r.getMessage() for r in caplog.records if r.name == "infinibatch_like.io"]
    assert len(retries) == 3
    assert all("retrying reading bytes 0-" in r for r in retries)
    assert all(f" of s3://{s3.name}/hot.txt.gz (try " in r for r in retries)


def test_listing_is_retried_too(s3: S3Bucket, s3_proxy: FaultyProxy) -> None:
    s3.put("l/1.txt", b"1\n")
    s3_proxy.inject("slow_down", 2, "GET", "list-type")
    options = {"endpoint_url": s3_proxy.endpoint}
    assert list_chunks(s3.url("l/*.txt"), storage_options=options, retry=FAST) == [s3.url(
        "l/1.txt")]
    assert retry_counts() == {"SlowDown": 2}


def test_retries_end_with_an_error_naming_the_chunk_and_cause(
    s3: S3Bucket, s3_proxy: FaultyProxy
) -> None:
    url = s3.put("always-busy.txt", b"x\n")
    s3_proxy.inject("slow_down", 100, "GET", "always-busy")
    options = {"endpoint_url": s3_proxy.endpoint}
    failed = rf"reading bytes 0-1 of {url} failed after 4 tries; .*SlowDown"
    with pytest.raises(ChunkReadError, match=failed):
        list(read_lines(url, storage_options=options, retry=FAST))
    assert s3_proxy.injected["slow_down"] == 4
    assert retry_counts() == {"SlowDown": 3}


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_connection_reset_mid_stream_loses_and_repeats_nothing(
    s3: S3Bucket, s3_proxy: FaultyProxy, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = lines_of(4, 60000)
    data = text(expected)
    url = s3.put(f"big.txt{suffix}", gzip.compress(data, 1) if suffix else data)
    monkeypatch.setattr(readers, "BLOCK_SIZE", 1 << 16)
    options = {"endpoint_url": s3_proxy.endpoint, "default_block_size": 1 << 17}
    lines = read_lines(url, storage_options=options, retry=FAST)
    head = list(islice(lines, 3000))  # lines delivered before the failure
    s3_proxy.inject("reset", 2, "GET", "big.txt")  # the next two range answers are cut
    rest = list(lines)
    assert head + rest == expected
    assert s3_proxy.injected["reset"] == 2
    assert sum(retry_counts().values()) == 2
    ranges = [path for method, path in s3_proxy.requests if method == "GET"]
    assert len(ranges) < 40  # re-opened at the same byte, not re-read from the start


def moto_auth(s3: S3Bucket, unchecked_requests: bytes) -> None:
    """Set how many requests moto serves before it checks credentials (its server API)."""
    request = urllib.request.Request(
        f"{s3.server.endpoint}/moto-api/reset-auth",
        data=unchecked_requests,
        headers={"Content-Type": "text/plain"},
        method="POST",
    )
    urllib.request.urlopen(request).close()


def test_wrong_credentials_fail_at_once_naming_the_object(
    s3: S3Bucket, s3_proxy: FaultyProxy
) -> None:
    url = s3.put("secret.txt", b"x\n")
    moto_auth(s3, b"0")  # moto now checks credentials (IAM), from the next request
    try:
        options = {"endpoint_url": s3_proxy.endpoint, "key": "wrong", "secret": "wrong"}
        with pytest.raises(ChunkAccessError, match=rf"{url}: access denied while opening it"):
            list(read_lines(url, storage_options=options, retry=FAST))
    finally:
        moto_auth(s3, b"inf")
    assert len(s3_proxy.requests) == 1  # not retried
    assert retry_counts() == {}


def test_corrupt_and_unsupported_chunks_on_s3(s3: S3Bucket, s3_proxy: FaultyProxy) -> None:
    url = s3.put("broken.txt.gz", gzip.compress(text(lines_of(5, 500)))[:-100])
    with pytest.raises(ChunkFormatError, match=rf"{url}: corrupt or truncated gzip data"):
        list(read_lines(url))
    options = {"endpoint_url": s3_proxy.endpoint}
    with pytest.raises(ValueError, match=r"chunk\.txt\.lz4: the compression suffix '\.lz4'"):
        read_lines(s3.url("chunk.txt.lz4"), storage_options=options)
    with pytest.raises(ValueError, match=r"chunk\.txt\.lz4: the compression suffix '\.lz4'"):
        open_chunk(s3.url("chunk.txt.lz4"), storage_options=options)
    assert s3_proxy.requests == []  # refused before any request


def test_storage_options_bound_with_partial_reach_the_store(
    s3: S3Bucket, s3_proxy: FaultyProxy
) -> None:
    refs = [s3.put(f"p/{i}.txt", text(lines_of(i, 3))) for i in range(2)]
    reader = functools.partial(read_lines, storage_options={"endpoint_url": s3_proxy.endpoint})
    pipeline = chunked_dataset_iterator(refs, reader, 1, train=False, shuffle=False)
    assert list(pipeline) == lines_of(0, 3) + lines_of(1, 3)
    assert {path for _, path in s3_proxy.requests} >= {f"/{s3.name}/p/0.txt"}


def test_an_object_replaced_mid_stream_is_not_spliced(
    s3: S3Bucket, s3_proxy: FaultyProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3.put("moving.txt", text(lines_of(6, 30000)))
    monkeypatch.setattr(readers, "BLOCK_SIZE", 1 << 16)
    options = {"endpoint_url": s3_proxy.endpoint, "default_block_size": 1 << 17}
    lines = read_lines(url, storage_options=options, retry=FAST)
    assert list(islice(lines, 1000)) == lines_of(6, 1000)
    s3.put("moving.txt", text(lines_of(7, 30000)))  # a new version: another ETag
    s3_proxy.inject("reset", 1, "GET", "moving.txt")  # the next range request fails
    with pytest.raises(ChunkReadError, match=rf"{url} changed while it was being read"):
        list(lines)


def test_a_missing_bucket_is_named_as_such(s3: S3Bucket) -> None:
    missing = f"{s3.name}-absent"
    for call in (
        lambda: list_chunks(f"s3://{missing}/corpus/*.txt.gz"),
        lambda: list_chunks(f"s3://{missing}/corpus/a.txt"),
        lambda: open_chunk(f"s3://{missing}/corpus/a.txt"),
    ):
        with pytest.raises(ChunkNotFoundError) as error:
            call()
        assert f"s3://{missing}/corpus/" in str(error.value)
        assert "bucket" in str(error.value)
        assert "does not exist" in str(error.value)
    with pytest.raises(ChunkNotFoundError) as error:  # the bucket exists: no such claim
        list_chunks(s3.url("corpus/*.txt.gz"))
    assert "does not exist" not in str(error.value)


def test_listing_an_s3_prefix_hints_at_its_objects(s3: S3Bucket) -> None:
    s3.put("corpus/a.txt", b"x\n")
    with pytest.raises(ChunkNotFoundError, match=r"is a directory: list its files with 's3://"):
        list_chunks(s3.url("corpus"))
