"""Parquet and Arrow IPC files as chunks: a chunk per row group (record batch), rows or
batches with projection and filters, exact and cheap restores, on disk and on S3."""

from __future__ import annotations

import functools
import io
import itertools
import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from _profiles import examples
from _s3 import FAST, FaultyProxy
from conftest import S3Bucket
from fsspec.implementations.memory import MemoryFileSystem
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import (
    ChunkFormatError,
    ChunkNotFoundError,
    ChunkReadError,
    TableChunk,
    list_arrow_chunks,
    list_parquet_chunks,
    read_arrow,
    read_parquet,
    retry_counts,
)
from infinibatch_like.prepare.balancing import balanced_shards
from infinibatch_like.stages.bad_records import SkipPolicy
from infinibatch_like.testing import assert_checkpointable, check_resume

GROUP = 50


def table_of(start: int, rows: int, text_bytes: int = 20) -> pa.Table:
    ids = list(range(start, start + rows))
    return pa.table(
        {
            "id": ids,
            "text": [f"{i:06d}" + random.Random(i).randbytes(text_bytes // 2).hex() for i in ids],
            "lang": ["en" if i % 3 else "fr" for i in ids],
        }
    )


def parquet_bytes(table: pa.Table, group: int = GROUP) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=group)
    return sink.getvalue()


def arrow_bytes(table: pa.Table, group: int = GROUP) -> bytes:
    sink = io.BytesIO()
    with ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=group):
            writer.write_batch(batch)
    return sink.getvalue()


FORMATS = {
    "parquet": (parquet_bytes, list_parquet_chunks, read_parquet),
    "arrow": (arrow_bytes, list_arrow_chunks, read_arrow),
}


@pytest.fixture(params=sorted(FORMATS))
def fmt(request: pytest.FixtureRequest) -> tuple[Callable[..., bytes], Any, Any]:
    return FORMATS[request.param]


def hub_dataset(tmp_path: Path, write: Callable[..., bytes], sizes: tuple[int, ...]) -> str:
    """``data/train-0000k-of-0000n.*`` files of `sizes` rows (ids continue across files)."""
    (tmp_path / "data").mkdir()
    start = 0
    for k, rows in enumerate(sizes):
        name = tmp_path / "data" / f"train-{k:05d}-of-{len(sizes):05d}.bin"
        name.write_bytes(write(table_of(start, rows)))
        start += rows
    return str(tmp_path / "data" / "train-*.bin")


def test_listing_gives_a_chunk_per_row_group_with_its_rows(fmt: Any, tmp_path: Path) -> None:
    write, list_fn, _ = fmt
    pattern = hub_dataset(tmp_path, write, (120, 0, 50))
    chunks = list_fn(pattern)
    files = sorted(str(p) for p in (tmp_path / "data").iterdir())
    assert chunks == [
        TableChunk(files[0], 0, 50),
        TableChunk(files[0], 1, 50),
        TableChunk(files[0], 2, 20),
        TableChunk(files[2], 0, 50),
    ]  # the empty file has no chunk
    assert list_fn([files[2], files[0], files[2]]) == chunks  # a list: merged, sorted
    shards = balanced_shards([(chunk, chunk.rows) for chunk in chunks], 2)
    assert sorted(sum(c.rows for c in shard) for shard in shards) == [70, 100]


@pytest.mark.parametrize("batch_rows", [None, 7])
def test_rows_are_the_row_groups_rows(fmt: Any, tmp_path: Path, batch_rows: int | None) -> None:
    write, list_fn, read = fmt
    chunks = list_fn(hub_dataset(tmp_path, write, (120,)))
    got = [item for chunk in chunks for item in read(chunk, batch_rows=batch_rows)]
    if batch_rows is None:
        assert got == table_of(0, 120).to_pylist()
    else:
        assert [batch.num_rows for batch in got] == [7] * 7 + [1] + [7] * 7 + [1] + [7] * 2 + [6]
        assert pa.Table.from_batches(got).to_pylist() == table_of(0, 120).to_pylist()


@pytest.mark.parametrize(
    "filter",
    [[("lang", "==", "fr"), ("id", ">=", 10)], pc.field("lang") == "fr", ("id", "in", [3, 6, 99])],
)
def test_columns_and_filters(fmt: Any, tmp_path: Path, filter: Any) -> None:
    write, list_fn, read = fmt
    chunks = list_fn(hub_dataset(tmp_path, write, (100,)))
    got = [row for chunk in chunks for row in read(chunk, columns=["id"], filter=filter)]
    rows = table_of(0, 100).to_pylist()
    if isinstance(filter, list):
        expected = [r for r in rows if r["lang"] == "fr" and r["id"] >= 10]
    elif isinstance(filter, tuple):
        expected = [r for r in rows if r["id"] in (3, 6, 99)]
    else:
        expected = [r for r in rows if r["lang"] == "fr"]
    assert got == [{"id": r["id"]} for r in expected]


def test_feather_files_compressed_and_dictionary_encoded_are_arrow_chunks(tmp_path: Path) -> None:
    table = table_of(0, 100).append_column("tag", pa.array(["x", "y"] * 50).dictionary_encode())
    feather.write_feather(table, tmp_path / "t.feather", chunksize=30)  # lz4 by default
    chunks = list_arrow_chunks(str(tmp_path / "*.feather"))
    assert [chunk.rows for chunk in chunks] == [30, 30, 30, 10]
    rows = [row for chunk in chunks for row in read_arrow(chunk, columns=["id", "tag"])]
    assert rows == [{"id": i, "tag": "xy"[i % 2]} for i in range(100)]


def test_bad_arguments_are_refused_at_once(fmt: Any, tmp_path: Path) -> None:
    write, list_fn, read = fmt
    chunk = list_fn(hub_dataset(tmp_path, write, (10,)))[0]
    with pytest.raises(TypeError, match="chunk must be a TableChunk"):
        read("data/x.parquet")
    with pytest.raises(TypeError, match="must be a non-empty list of column names, got 'id'"):
        read(chunk, columns="id")
    with pytest.raises(ValueError, match="the operator '~'; use one of =="):
        read(chunk, filter=[("id", "~", 3)])
    with pytest.raises(TypeError, match="'in' needs a list of values"):
        read(chunk, filter=[("id", "in", 3)])
    with pytest.raises(ValueError, match="batch_rows must be >= 1, got 0"):
        read(chunk, batch_rows=0)


def test_damage_is_named(fmt: Any, tmp_path: Path) -> None:
    write, list_fn, read = fmt
    pattern = hub_dataset(tmp_path, write, (100,))
    chunk = list_fn(pattern)[1]
    with pytest.raises(
        ChunkFormatError, match=r"train-00000-of-00001.bin \((row group|record batch) 1\).*"
    ):
        next(read(chunk, columns=["nope"]))
    Path(chunk.path).write_bytes(write(table_of(0, 90)))  # the file changed since listed
    with pytest.raises(ChunkFormatError, match="holds 40 rows, 50 when it was listed"):
        next(read(chunk))
    Path(chunk.path).write_bytes(b"not a columnar file at all, but long enough")
    with pytest.raises(ChunkFormatError, match=r"train-00000-of-00001\.bin"):
        list_fn(pattern)
    with pytest.raises(ChunkNotFoundError, match="no file matches"):
        list_fn(str(tmp_path / "nothing-*.parquet"))
    with pytest.raises(ValueError, match="_chunks: patterns is empty"):
        list_fn([])


def test_chunk_lists_of_other_row_groups_fingerprint_differently(fmt: Any, tmp_path: Path) -> None:
    write, list_fn, read = fmt
    chunks = list_fn(hub_dataset(tmp_path, write, (100,)))
    other = [chunks[1], chunks[0]]  # same length, same type: only the values differ

    def build(refs: list[TableChunk]) -> Any:
        return chunked_dataset_iterator(refs, read, buffer_size=10, seed=1, shuffle=False)

    state = build(chunks).getstate()
    with pytest.raises(ValueError, match=r"source_items|iterable"):
        build(other).setstate(state)


@pytest.mark.parametrize("batch_rows", [None, 8])
def test_chunked_dataset_of_row_groups_is_checkpointable(
    fmt: Any, tmp_path: Path, batch_rows: int | None
) -> None:
    write, list_fn, read = fmt
    chunks = list_fn(hub_dataset(tmp_path, write, (70, 45)))
    reader = functools.partial(read, columns=["id", "text"], batch_rows=batch_rows)

    def build() -> Any:
        return chunked_dataset_iterator(chunks, reader, buffer_size=16, seed=3)

    same = (lambda a, b: a.equals(b)) if batch_rows else None
    if batch_rows is None:  # record batches are not plain data in a shuffle buffer's state
        assert_checkpointable(build, max_items=90, restore_points=[0, 1, 49, 50, 51, 89])
    check_resume(build, max_items=150, restore_points=6, same=same)


@pytest.mark.parametrize(("read_ahead", "on_error"), [(2, "raise"), (0, SkipPolicy(max_skips=1))])
def test_row_groups_resume_with_read_ahead_and_a_skip_policy(
    tmp_path: Path, read_ahead: int, on_error: Any
) -> None:
    chunks = list_parquet_chunks(hub_dataset(tmp_path, parquet_bytes, (70, 45)))
    reader = functools.partial(read_parquet, columns=["id"], filter=[("lang", "==", "en")])

    def build() -> Any:
        return chunked_dataset_iterator(
            chunks, reader, buffer_size=16, seed=3, read_ahead_chunks=read_ahead,
            on_error=on_error,
        )  # fmt: skip

    check_resume(build, max_items=120, restore_points=5, check_torch=False)


class CountingMemory(MemoryFileSystem):
    """An in-memory file system that records every byte range fetched by ``cat_file``."""

    protocol = "countingmem"
    fetched: ClassVar[list[tuple[str, int, int]]] = []

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        data = super().cat_file(path, start=start, end=end, **kw)
        CountingMemory.fetched.append((path, start or 0, (start or 0) + len(data)))
        return data


@pytest.fixture
def counting_store() -> Iterator[type[CountingMemory]]:
    fsspec.register_implementation("countingmem", CountingMemory, clobber=True)
    CountingMemory.fetched = []
    yield CountingMemory
    CountingMemory.store.clear()


def test_restore_inside_a_row_group_reads_that_row_group_only(
    counting_store: type[CountingMemory],
) -> None:
    data = parquet_bytes(table_of(0, 200, text_bytes=2000))  # row groups of 100 KB
    with fsspec.open("countingmem://d/train.parquet", "wb") as file:
        file.write(data)
    chunks = list_parquet_chunks("countingmem://d/*.parquet")
    metadata = pq.read_metadata(io.BytesIO(data))
    spans = []  # the bytes of each row group
    for group in range(metadata.num_row_groups):
        columns = [metadata.row_group(group).column(c) for c in range(3)]
        first = min(c.dictionary_page_offset or c.data_page_offset for c in columns)
        spans.append((first, first + sum(c.total_compressed_size for c in columns)))

    def build() -> Any:
        return chunked_dataset_iterator(
            chunks, read_parquet, buffer_size=1, train=False, shuffle=False
        )

    original = build()
    expected = list(itertools.islice(original, 200))
    state = build()
    list(itertools.islice(state, 160))  # inside row group 3, at row 10 of it
    saved = json.loads(json.dumps(state.getstate()))
    assert len(json.dumps(saved)) < 600
    counting_store.fetched = []
    restored = build()
    restored.setstate(saved)
    assert list(restored) == expected[160:]
    fetched = [(a, b) for _, a, b in counting_store.fetched]
    assert sum(b - a for a, b in fetched) >= spans[3][1] - spans[3][0]  # group 3's columns
    assert all(a >= spans[3][0] for a, b in fetched), (spans, fetched)  # nothing before


def test_a_files_footer_is_read_once_for_all_its_row_groups(
    counting_store: type[CountingMemory],
) -> None:
    data = parquet_bytes(table_of(0, 200))
    with fsspec.open("countingmem://once/t.parquet", "wb") as file:
        file.write(data)
    chunks = list_parquet_chunks("countingmem://once/*.parquet")
    assert len(chunks) == 4
    for _ in range(2):
        assert sum(1 for chunk in chunks for _ in read_parquet(chunk)) == 200
    tail_reads = [r for r in counting_store.fetched if (r[1], r[2]) == (len(data) - 8, len(data))]
    assert len(tail_reads) == 1  # by the listing
    changed = table_of(0, 200, text_bytes=30)  # the same rows, other texts, another size
    with fsspec.open("countingmem://once/t.parquet", "wb") as file:
        file.write(parquet_bytes(changed))
    assert list(read_parquet(chunks[0])) == changed.slice(0, 50).to_pylist()  # not stale


@pytest.mark.parametrize(
    "filter",
    [None, pc.field("lang") == "fr", [("lang", "==", "fr")]],
    ids=["none", "expr", "tuples"],
)
def test_a_filter_fetches_its_columns_and_not_the_others(
    counting_store: type[CountingMemory], filter: Any
) -> None:
    data = parquet_bytes(table_of(0, 200, text_bytes=2000))
    with fsspec.open("countingmem://f/t.parquet", "wb") as file:
        file.write(data)
    metadata = pq.read_metadata(io.BytesIO(data))

    def column_span(group: int, column: int) -> tuple[int, int]:
        chunk = metadata.row_group(group).column(column)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        return start, start + chunk.total_compressed_size

    counting_store.fetched = []
    rows = [
        row
        for chunk in list_parquet_chunks("countingmem://f/*.parquet")
        for row in read_parquet(chunk, columns=["id"], filter=filter)
    ]
    assert rows == [{"id": i} for i in range(200) if filter is None or i % 3 == 0]
    fetched = {(a, b) for _, a, b in counting_store.fetched}
    for group in range(metadata.num_row_groups):
        assert column_span(group, 0) in fetched  # id
        assert (column_span(group, 2) in fetched) == (filter is not None)  # lang
        text_start, text_end = column_span(group, 1)
        assert not any(a < text_end and text_start < b for a, b in fetched)  # never text


def test_projection_fetches_only_the_projected_columns_from_s3(
    s3: S3Bucket, s3_proxy: FaultyProxy
) -> None:
    big = table_of(0, 400, text_bytes=2000)
    data = parquet_bytes(big, group=100)
    url = s3.put("data/train-00000-of-00001.parquet", data)
    options = {"endpoint_url": s3_proxy.endpoint}
    chunks = list_parquet_chunks("s3://" + s3.name + "/data/*.parquet", storage_options=options)
    assert [c.rows for c in chunks] == [100] * 4
    assert chunks[0].path == url
    metadata = pq.read_metadata(io.BytesIO(data))
    id_bytes = sum(metadata.row_group(g).column(0).total_compressed_size for g in range(4))

    def served_reading(columns: list[str] | None) -> int:
        s3_proxy.served.clear()
        rows = [
            r for c in chunks for r in read_parquet(c, columns=columns, storage_options=options)
        ]
        assert rows == big.select(columns or big.column_names).to_pylist()
        return sum(size for method, _, size in s3_proxy.served if method == "GET")

    everything, ids = served_reading(None), served_reading(["id"])
    assert everything > 600_000  # the text column: 400 rows of 2 KB of hex digits
    assert ids == id_bytes, (ids, id_bytes, everything)  # the listing read the footer


def test_arrow_projection_fetches_only_the_projected_columns_from_s3(
    s3: S3Bucket, s3_proxy: FaultyProxy
) -> None:
    big = table_of(0, 400, text_bytes=2000)
    s3.put("data/part.arrow", arrow_bytes(big, group=100))
    options = {"endpoint_url": s3_proxy.endpoint}
    s3_proxy.served.clear()
    chunks = list_arrow_chunks(f"s3://{s3.name}/data/*.arrow", storage_options=options)
    listing = sum(size for method, _, size in s3_proxy.served if method == "GET")
    assert [c.rows for c in chunks] == [100] * 4
    assert listing < 5_000
    s3_proxy.served.clear()
    rows = [r for c in chunks for r in read_arrow(c, columns=["id"], storage_options=options)]
    assert rows == [{"id": i} for i in range(400)]
    assert sum(size for method, _, size in s3_proxy.served if method == "GET") < 40_000


def test_s3_range_reads_are_retried_each_on_its_own(s3: S3Bucket, s3_proxy: FaultyProxy) -> None:
    s3.put("t/a.parquet", parquet_bytes(table_of(0, 100)))
    options = {"endpoint_url": s3_proxy.endpoint}
    chunks = list_parquet_chunks(f"s3://{s3.name}/t/*.parquet", storage_options=options)
    s3_proxy.inject("slow_down", 2, path_part="a.parquet")
    s3_proxy.inject("reset", 1, path_part="a.parquet")
    reader = functools.partial(read_parquet, storage_options=options, retry=FAST)

    def build() -> Any:
        return chunked_dataset_iterator(chunks, reader, buffer_size=10, seed=5)

    check_resume(build, max_items=60, restore_points=2, check_torch=False)
    assert retry_counts().get("SlowDown") == 2
    assert sum(retry_counts().values()) == 3


@settings(max_examples=examples(0.25))
@given(
    sizes=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    group=st.integers(1, 12),
    batch_rows=st.one_of(st.none(), st.integers(1, 9)),
    skips=st.lists(st.integers(0, 12), max_size=4),
)
def test_skipping_equals_taking(
    sizes: list[int], group: int, batch_rows: int | None, skips: list[int]
) -> None:
    """skip(n) passes over exactly the items that n next() calls would return."""
    store = MemoryFileSystem()
    start = 0
    for k, rows in enumerate(sizes):
        store.pipe(f"/prop/f{k}.parquet", parquet_bytes(table_of(start, rows), group))
        start += rows
    for chunk in list_parquet_chunks("memory://prop/*.parquet"):
        taken = list(read_parquet(chunk, batch_rows=batch_rows))
        skipping = read_parquet(chunk, batch_rows=batch_rows)
        position = 0
        for count in skips:
            skipped = skipping.skip(count)  # type: ignore[attr-defined]
            assert skipped == min(count, len(taken) - position)
            position += skipped
            if position < len(taken):
                got = next(skipping)
                same = got.equals(taken[position]) if batch_rows else got == taken[position]
                assert same
                position += 1
    store.store.clear()


def test_a_missing_pyarrow_names_the_arrow_extra(tmp_path: Path) -> None:
    script = (
        "import sys\n"
        "sys.modules['pyarrow'] = None\n"
        "from infinibatch_like.io import list_parquet_chunks\n"
        "try:\n"
        f"    list_parquet_chunks({str(tmp_path)!r} + '/*.parquet')\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "list_parquet_chunks needs the package 'pyarrow'" in out.stdout
    assert "pip install 'infinibatch_like[arrow]'" in out.stdout


class ShrinkingMemory(MemoryFileSystem):
    """A memory file system whose objects lose their last byte after their size is told."""

    protocol = "shrinkingmem"

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kw: Any
    ) -> Any:
        return super().cat_file(path, start=start, end=end, **kw)[:-1]


def test_an_object_shorter_than_its_size_is_named_not_misread() -> None:
    fsspec.register_implementation("shrinkingmem", ShrinkingMemory, clobber=True)
    with fsspec.open("shrinkingmem://s/t.parquet", "wb") as file:
        file.write(parquet_bytes(table_of(0, 10)))
    try:
        changed = r"shrinkingmem://s/t\.parquet changed while it was being read: bytes \d+-\d+ "
        with pytest.raises(ChunkReadError, match=changed + "came back as"):
            list_parquet_chunks("shrinkingmem://s/*.parquet")
    finally:
        ShrinkingMemory.store.clear()


def test_a_missing_object_is_named(s3: S3Bucket) -> None:
    url = s3.put("t/a.parquet", parquet_bytes(table_of(0, 10)))
    (chunk,) = list_parquet_chunks(url)
    s3.client.delete_object(Bucket=s3.name, Key="t/a.parquet")
    with pytest.raises(ChunkNotFoundError, match=r"t/a\.parquet: no such file or object"):
        next(read_parquet(chunk))
