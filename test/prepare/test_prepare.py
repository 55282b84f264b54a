"""The chunking tool: output, determinism, resuming, Dask, verify, and every bad input."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like.__main__ import main
from infinibatch_like.io import (
    ChunkReadError,
    RetryPolicy,
    read_jsonl,
    read_lines,
    read_records,
    read_webdataset,
    reset_retry_counts,
    retry_counts,
)
from infinibatch_like.prepare import (
    ChunkIndexError,
    chunk_corpus,
    load_index,
    read_index,
    verify_chunks,
)
from infinibatch_like.prepare.checks import BadLines
from infinibatch_like.prepare.plan import (
    Job,
    Piece,
    directory_files,
    file_pieces,
    line_pieces,
    source_of,
)
from infinibatch_like.prepare.writer import _chunk_payloads, _cut
from infinibatch_like.stages.bad_records import SkipPolicy

REPO = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(tries=3, first_delay=0.01, max_delay=0.05)


def _write_lines(path: Path, lines: list[str], *, newline_at_end: bool = True) -> Path:
    data = "\n".join(lines) + ("\n" if newline_at_end and lines else "")
    if path.suffix == ".gz":
        with gzip.GzipFile(path, "wb", mtime=0) as out:
            out.write(data.encode("utf-8"))
    else:
        path.write_text(data, encoding="utf-8")
    return path


def _corpus(directory: Path, sizes: tuple[int, ...] = (7, 0, 12, 5)) -> list[str]:
    """Text files of `sizes` lines (alternately gzip and plain); their lines in order."""
    directory.mkdir(parents=True, exist_ok=True)
    expected = []
    for number, size in enumerate(sizes):
        lines = [f"file{number} line{i} " + "x" * (i % 4) for i in range(size)]
        suffix = ".txt.gz" if number % 2 == 0 else ".txt"
        _write_lines(directory / f"part-{number}{suffix}", lines, newline_at_end=number != 2)
        expected.extend(lines)
    return expected


def _tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not path.name.startswith(".")  # a killed write's temporary
    }


def test_lines_become_chunks_read_back_in_order(tmp_path: Path) -> None:
    expected = _corpus(tmp_path / "in")
    index = chunk_corpus(
        [str(tmp_path / "in" / "part-*")], str(tmp_path / "out"), items_per_chunk=3, workers=1
    )
    assert len(index) == len(expected) == 24
    # chunks never straddle inputs, and an input's chunks differ by one item at most:
    # 7 -> 3+2+2, 0 -> none, 12 -> 3*4, 5 -> 3+2
    assert [chunk.items for chunk in index.chunks] == [3, 2, 2, 3, 3, 3, 3, 3, 2]
    assert all(ref.endswith(".txt.gz") for ref in index.chunk_refs)
    assert [line for ref in index.chunk_refs for line in read_lines(ref)] == expected
    loaded = load_index(str(tmp_path / "out"))
    assert loaded == index
    assert loaded.job["items_per_chunk"] == 3
    assert loaded.job["compress"] == "gz"


def _even(items: int, per_chunk: int) -> list[int]:
    """ceil(items / per_chunk) sizes differing by at most one, the larger ones first."""
    count = -(-items // per_chunk)
    return [items // count + (number < items % count) for number in range(count)]


@settings(max_examples=60, deadline=None)
@given(items=st.integers(0, 60), per_chunk=st.integers(1, 12), gzipped=st.booleans())
def test_each_input_is_cut_into_chunks_of_nearly_equal_sizes(
    tmp_path_factory: pytest.TempPathFactory, items: int, per_chunk: int, gzipped: bool
) -> None:
    lines = [f"line {i}" for i in range(items)]
    path = _write_lines(
        tmp_path_factory.mktemp("even") / f"in.txt{'.gz' if gzipped else ''}", lines
    )
    job = Job("lines", (str(path),), per_chunk, "none", 1 << 20, "")
    (piece,) = line_pieces([source_of(str(path), None)], 1 << 20)
    chunks = list(_chunk_payloads(job, piece, BadLines(None, str(path)), None))
    assert [number for number, _, _ in chunks] == list(range(len(chunks)))
    assert [count for _, _, count in chunks] == _even(items, per_chunk)
    assert [line for _, payload, _ in chunks for line in payload.decode().split("\n")[:-1]] == lines


def test_json_lines_chunk_sizes_count_only_the_records(tmp_path: Path) -> None:
    records = [json.dumps({"id": i}) for i in range(7)]
    with_blanks = [line for record in records for line in (record, "", " \t")]
    index = chunk_corpus(
        [str(_write_lines(tmp_path / "a.jsonl", with_blanks))], str(tmp_path / "out"),
        items_per_chunk=3, workers=1,
    )  # fmt: skip
    assert [chunk.items for chunk in index.chunks] == [3, 2, 2]
    assert [json.dumps(r) for ref in index.chunk_refs for r in read_jsonl(ref)] == records


@pytest.mark.parametrize(
    ("kind", "reader", "lines"),
    [
        ("txt", read_lines, ["first", "", "a \r inside", " spaced ", "last"]),
        ("jsonl", read_jsonl, ['{"id": 1}', "", ' {"text": "a\\r\\nb"}', "\t", '{"id": 2}']),
    ],
)
def test_crlf_input_gives_the_same_records_through_every_reader_path(
    tmp_path: Path, kind: str, reader: Any, lines: list[str]
) -> None:
    """Lines ending in "\\r\\n" give the records the reader gives for the file itself,
    whether it is read whole (compressed), in byte ranges, or chunked and read back; the
    chunks are those of the same lines ending in "\\n" (a line's own lone "\\r" is kept).
    """
    crlf = "\r\n".join(lines).encode()
    plain = tmp_path / f"crlf.{kind}"
    plain.write_bytes(crlf)
    packed = tmp_path / f"crlf.{kind}.gz"
    packed.write_bytes(gzip.compress(crlf))
    unix = tmp_path / f"lf.{kind}"
    unix.write_bytes("\n".join(lines).encode())
    expected = list(reader(str(unix)))
    assert list(reader(str(plain))) == list(reader(str(packed))) == expected
    runs = {
        "ranges": chunk_corpus([str(plain)], str(tmp_path / "ranges"), items_per_chunk=2,
                               split_bytes=8, workers=1),
        "whole": chunk_corpus([str(packed)], str(tmp_path / "whole"), items_per_chunk=2,
                              workers=1),
        "lf": chunk_corpus([str(unix)], str(tmp_path / "lf"), items_per_chunk=2, workers=1),
    }  # fmt: skip
    for name, index in runs.items():
        assert [item for ref in index.chunk_refs for item in reader(ref)] == expected, name
        assert all(not found for _, found in verify_chunks(index)), name
    assert [c.sha256 for c in runs["whole"].chunks] == [c.sha256 for c in runs["lf"].chunks]


def test_jsonl_to_zstd_chunks(tmp_path: Path) -> None:
    records = [{"id": i, "text": "é" * i} for i in range(10)]
    source = tmp_path / "data.jsonl.gz"
    _write_lines(source, [json.dumps(record) for record in records])
    index = chunk_corpus([str(source)], str(tmp_path / "out"), items_per_chunk=4, compress="zst")
    assert index.kind == "jsonl"
    assert all(ref.endswith(".jsonl.zst") for ref in index.chunk_refs)
    assert [item for ref in index.chunk_refs for item in read_jsonl(ref)] == records


def test_directory_of_small_files_is_packed_as_records(tmp_path: Path) -> None:
    root = tmp_path / "images"
    files = {"a.bin": b"\x00\x01", "sub/b.bin": b"", "sub/deeper/c.jpg": b"\xff" * 100}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    index = chunk_corpus([str(root)], str(tmp_path / "out"), items_per_chunk=2, compress="none")
    assert index.kind == "files"
    assert [chunk.items for chunk in index.chunks] == [2, 1]
    records = [record for ref in index.chunk_refs for record in read_records(ref)]
    assert [(record.name, record.data) for record in records] == sorted(files.items())


@pytest.mark.parametrize(("files", "per_chunk"), [(7, 3), (9, 4), (4, 4), (1, 5), (10, 1)])
def test_directory_files_are_packed_in_chunks_of_nearly_equal_sizes(
    tmp_path: Path, files: int, per_chunk: int
) -> None:
    for number in range(files):
        (tmp_path / f"f{number:02d}.bin").write_bytes(b"x" * number)
    names = directory_files(str(tmp_path))
    sized = [(name, (tmp_path / name).stat().st_size) for name in names]
    pieces = file_pieces(str(tmp_path), sized, per_chunk)
    assert [len(piece.names) for piece in pieces] == _even(files, per_chunk)
    assert [name for piece in pieces for name in piece.names] == [
        f"f{number:02d}.bin" for number in range(files)
    ]


def test_output_is_byte_identical_whatever_the_workers(tmp_path: Path) -> None:
    _corpus(tmp_path / "in", sizes=(40, 3, 25, 31))
    big = _write_lines(tmp_path / "in" / "big.txt", [f"big {i}" for i in range(500)])
    inputs = [str(tmp_path / "in" / "part-*"), str(big)]
    trees = []
    for workers, name in ((1, "one"), (2, "two")):
        chunk_corpus(
            inputs, str(tmp_path / name), items_per_chunk=6, workers=workers, split_bytes=700
        )
        trees.append(_tree(tmp_path / name))
    assert trees[0] == trees[1]
    index = load_index(str(tmp_path / "one"))
    # the big plain file is cut in byte ranges, every line in exactly one of them
    assert [line for ref in index.chunk_refs for line in read_lines(ref)][-500:] == [
        f"big {i}" for i in range(500)
    ]
    assert index.job["plan"] != ""


def test_finished_job_is_not_redone(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    args = ([str(tmp_path / "in" / "part-*")], str(tmp_path / "out"))
    first = chunk_corpus(*args, items_per_chunk=3, workers=1)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("*") if p.is_file()}
    time.sleep(0.01)
    assert chunk_corpus(*args, items_per_chunk=3, workers=1) == first
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_killed_job_resumes_without_rewriting_finished_chunks(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    for number in range(24):
        _write_lines(inputs / f"f{number:02d}.txt.gz", [f"{number}-{i}" * 20 for i in range(2000)])
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "infinibatch_like", "chunk", str(inputs / "*.txt.gz"),
        "--out", str(out), "--items-per-chunk", "500", "--workers", "1", "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    job = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(list((out / "_pieces").glob("*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert not (out / "index.json").exists(), "the job finished before it could be killed"
    before = {
        path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in out.glob("chunk-*")
    }
    assert before
    index = chunk_corpus([str(inputs / "*.txt.gz")], str(out), items_per_chunk=500, workers=1)
    after = {
        path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in out.glob("chunk-*")
    }
    assert {name: after[name] for name in before} == before  # not written again
    assert len(index.chunks) == len(after) == 96
    assert len(index) == 48_000
    chunk_corpus(
        [str(inputs / "*.txt.gz")], str(tmp_path / "fresh"), items_per_chunk=500, workers=1
    )
    assert _tree(out) == _tree(tmp_path / "fresh")
    assert main(["verify", str(out)]) == 0


def test_dask_cluster_writes_the_same_bytes(tmp_path: Path) -> None:
    distributed = pytest.importorskip("dask.distributed")
    _corpus(tmp_path / "in", sizes=(9, 4, 13))
    inputs = [str(tmp_path / "in" / "part-*")]
    chunk_corpus(inputs, str(tmp_path / "local"), items_per_chunk=4, workers=1)
    with distributed.LocalCluster(
        n_workers=2, processes=False, threads_per_worker=1, dashboard_address=None,
        protocol="tcp", host="127.0.0.1",
    ) as cluster, distributed.Client(cluster) as client:  # fmt: skip
        chunk_corpus(inputs, str(tmp_path / "api"), items_per_chunk=4, client=client)
        assert main([
            "chunk", *inputs, "--out", str(tmp_path / "cli"), "--items-per-chunk", "4",
            "--scheduler", cluster.scheduler_address, "--quiet",
        ]) == 0  # fmt: skip
    assert _tree(tmp_path / "api") == _tree(tmp_path / "local") == _tree(tmp_path / "cli")


# -- bad inputs --------------------------------------------------------------------------


def _chunk_error(tmp_path: Path, inputs: list[str], **kwargs: object) -> str:
    options = {"items_per_chunk": 3, "workers": 1, **kwargs}
    with pytest.raises(ValueError, match=r"^chunk: ") as error:
        chunk_corpus(inputs, str(tmp_path / "out"), **options)  # type: ignore[arg-type]
    return str(error.value)


def test_missing_input(tmp_path: Path) -> None:
    message = _chunk_error(tmp_path, [str(tmp_path / "nope.txt")])
    assert not (tmp_path / "out").exists()
    assert "input" in message
    assert "nope.txt" in message
    assert "does not exist" in message


def test_empty_glob(tmp_path: Path) -> None:
    message = _chunk_error(tmp_path, [str(tmp_path / "*.jsonl")])
    assert "*.jsonl" in message
    assert "matches no file" in message


def test_unsupported_suffix(tmp_path: Path) -> None:
    (tmp_path / "table.parquet").write_bytes(b"PAR1")
    message = _chunk_error(tmp_path, [str(tmp_path / "table.parquet")])
    assert "table.parquet" in message
    assert "unsupported suffix '.parquet'" in message
    assert "--format lines" in message


def test_unsupported_compression_suffix(tmp_path: Path) -> None:
    (tmp_path / "text.txt.lz4").write_bytes(b"x")
    message = _chunk_error(tmp_path, [str(tmp_path / "text.txt.lz4")], input_format="lines")
    assert "text.txt.lz4" in message
    assert "'.lz4'" in message


def test_mixed_input_kinds(tmp_path: Path) -> None:
    _write_lines(tmp_path / "a.txt", ["x"])
    _write_lines(tmp_path / "b.jsonl", ["{}"])
    message = _chunk_error(tmp_path, [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")])
    assert "mix text lines" in message
    assert "a.txt" in message
    assert "b.jsonl" in message


def test_line_that_is_not_json(tmp_path: Path) -> None:
    _write_lines(tmp_path / "a.jsonl", ['{"a": 1}', "{oops", "{}"])
    message = _chunk_error(tmp_path, [str(tmp_path / "a.jsonl")])
    assert "line 2 of" in message
    assert "a.jsonl" in message
    assert "not JSON" in message


def test_line_that_is_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"fine\nalso fine\nbad \xff here\n")
    message = _chunk_error(tmp_path, [str(tmp_path / "a.txt")], items_per_chunk=5)
    assert "line 3 of" in message
    assert "a.txt is not UTF-8 text (invalid start byte at byte 4 of the line)" in message


def test_directory_input_must_be_alone(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir()
    _write_lines(tmp_path / "a.txt", ["x"])
    message = _chunk_error(tmp_path, [str(tmp_path / "files"), str(tmp_path / "a.txt")])
    assert "a directory input" in message
    assert "must be the only input" in message


@pytest.mark.parametrize("value", [0, -3])
def test_items_per_chunk_must_be_positive(tmp_path: Path, value: int) -> None:
    _write_lines(tmp_path / "a.txt", ["x"])
    message = _chunk_error(tmp_path, [str(tmp_path / "a.txt")], items_per_chunk=value)
    assert "items_per_chunk" in message
    assert str(value) in message


def test_cli_rejects_items_per_chunk_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["chunk", "x.txt", "--out", str(tmp_path), "--items-per-chunk", "0"])
    assert exit_.value.code == 2
    assert "--items-per-chunk: must be at least 1, got 0" in capsys.readouterr().err


def test_cli_reports_bad_input_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["chunk", str(tmp_path / "gone.txt"), "--out", str(tmp_path / "o"),
                 "--items-per-chunk", "2"])  # fmt: skip
    assert code == 2
    assert "infinibatch-like chunk: error:" in capsys.readouterr().err


def test_scheduler_without_dask_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "dask.distributed", None)
    _write_lines(tmp_path / "a.txt", ["x"])
    args = [str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"), "--items-per-chunk", "2"]
    assert main(["chunk", *args, "--scheduler", "tcp://127.0.0.1:1"]) == 2
    assert "pip install 'infinibatch_like[dask]'" in capsys.readouterr().err


def test_verify_without_an_index_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(tmp_path)]) == 1
    assert "no chunk index at" in capsys.readouterr().out


def test_output_holding_another_job_is_refused(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "part-*")]
    chunk_corpus(inputs, str(tmp_path / "out"), items_per_chunk=3, workers=1)
    message = _chunk_error(tmp_path, inputs, items_per_chunk=4)
    assert "holds the chunks of a different job" in message
    assert "items_per_chunk: 3 there, 4 now" in message
    (tmp_path / "out" / "index.json").unlink()  # an unfinished job: job.json decides
    message = _chunk_error(tmp_path, inputs, compress="zst")
    assert "compress: 'gz' there, 'zst' now" in message


def test_changed_input_is_another_job(tmp_path: Path) -> None:
    _write_lines(tmp_path / "a.txt", ["x", "y"])
    chunk_corpus([str(tmp_path / "a.txt")], str(tmp_path / "out"), items_per_chunk=3)
    _write_lines(tmp_path / "a.txt", ["x", "y", "z"])
    message = _chunk_error(tmp_path, [str(tmp_path / "a.txt")])
    changed = f"the input {str(tmp_path / 'a.txt')!r} changed since the job started (4 bytes"
    assert changed in message
    assert "; 6 bytes, mtime_ns " in message


def test_output_of_the_earlier_chunk_layout_is_refused(tmp_path: Path) -> None:
    # an unfinished job of a version that cut full chunks and a short remainder: finishing
    # it with chunks of other sizes would mix two layouts under one index
    _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "part-*")]
    chunk_corpus(inputs, str(tmp_path / "out"), items_per_chunk=3, workers=1)
    (tmp_path / "out" / "index.json").unlink()
    recorded = json.loads((tmp_path / "out" / "job.json").read_text())
    del recorded["chunk_sizes"]
    (tmp_path / "out" / "job.json").write_text(json.dumps(recorded))
    message = _chunk_error(tmp_path, inputs)
    assert "holds the chunks of a different job (chunk_sizes: None there, 'even' now)" in message


@pytest.mark.parametrize(
    ("blocks", "sizes", "what"),
    [
        ([[b"a", b"b"], [b"c"]], [2], "more"),
        ([[b"a"], []], [1, 1], "fewer"),
        ([[b"a"]], [], "more"),
    ],
)
def test_an_input_that_changes_between_its_two_reads_is_refused(
    blocks: list[list[bytes]], sizes: list[int], what: str
) -> None:
    piece = Piece(0, "in.txt")
    with pytest.raises(
        ValueError,
        match=rf"chunk: in.txt changed while it was read: \d+ items counted, then {what}",
    ):
        list(_cut(blocks, sizes, piece))


# -- load_index and verify ----------------------------------------------------------------


@pytest.fixture
def chunked(tmp_path: Path) -> Path:
    _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "part-*")]
    chunk_corpus(inputs, str(tmp_path / "out"), items_per_chunk=3, workers=1)
    return tmp_path / "out"


def test_load_index_refuses_missing_and_unlisted_chunks(chunked: Path) -> None:
    chunks = sorted(chunked.glob("chunk-*"))
    chunks[1].rename(chunked / "chunk-999999-000000.txt.gz")
    with pytest.raises(ChunkIndexError) as error:
        load_index(str(chunked))
    assert "does not match the chunk files" in str(error.value)
    assert f"1 missing ({chunks[1].name})" in str(error.value)
    assert "1 not in the index (chunk-999999-000000.txt.gz)" in str(error.value)


def test_load_index_refuses_a_chunk_of_another_size(chunked: Path) -> None:
    chunk = sorted(chunked.glob("chunk-*"))[2]
    chunk.write_bytes(chunk.read_bytes() + b"\0")
    with pytest.raises(ChunkIndexError, match=rf"{chunk.name} has \d+ bytes, the index says"):
        load_index(str(chunked))


def test_load_index_without_an_index(tmp_path: Path) -> None:
    with pytest.raises(ChunkIndexError, match=r"no chunk index at .*index\.json.* chunk INPUT"):
        load_index(str(tmp_path))


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda data: "{not json", "is not valid JSON"),
        (lambda data: json.dumps({**data, "version": 99}), "format version 99"),
        (lambda data: json.dumps({**data, "format": "x"}), "is not a chunk index"),
        (lambda data: json.dumps({**data, "items": 1}), "it says 1 items, its chunks hold 24"),
        (lambda data: json.dumps({**data, "chunks": [{"name": "a"}]}), "is damaged"),
    ],
)
def test_damaged_index_is_refused(chunked: Path, edit: object, expected: str) -> None:
    path = chunked / "index.json"
    path.write_text(edit(json.loads(path.read_text())))  # type: ignore[operator]
    with pytest.raises(ChunkIndexError, match=expected):
        read_index(str(chunked))


def test_verify_reports_each_bad_chunk(chunked: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(chunked)]) == 0
    assert "OK, 9 chunks, 24 items" in capsys.readouterr().out
    chunks = sorted(chunked.glob("chunk-*"))
    chunks[0].unlink()
    data = gzip.decompress(chunks[1].read_bytes())
    chunks[1].write_bytes(gzip.compress(data.replace(b"line", b"LINE"), mtime=0))
    chunks[2].write_bytes(chunks[2].read_bytes()[:-9])  # truncated gzip
    fourth = gzip.decompress(chunks[3].read_bytes())
    chunks[3].write_bytes(gzip.compress(fourth + b"extra\n", mtime=0))
    (chunked / "chunk-000009-000000.txt.gz").write_bytes(b"")
    assert main(["verify", str(chunked)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{chunks[0].name}: missing (listed in the index, no such file)" in out
    assert any(line.startswith(f"{chunks[1].name}: content SHA-256 ") for line in out)
    assert any(line.startswith(f"{chunks[2].name}: unreadable: ") for line in out)
    assert f"{chunks[3].name}: 4 items, the index says 3" in out
    unlisted = "chunk-000009-000000.txt.gz: not listed in index.json"
    assert any(line.startswith(unlisted) for line in out)
    assert out[-1].endswith("problem(s) in 9 chunks")


# -- inspect ------------------------------------------------------------------------------


def _state() -> dict[str, object]:
    from infinibatch_like.datasets import chunked_dataset_iterator
    from infinibatch_like.iterators import FixedBatchIterator

    batches = FixedBatchIterator(
        chunked_dataset_iterator(["a", "b"], lambda c: [c + "1", c + "2"], 3, seed=1), 2
    )
    next(batches)
    return batches.getstate()


def test_inspect_json_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(_state()))
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: JSON, {path.stat().st_size:,} bytes"
    assert out[1].startswith("state at (top level): ")
    assert out[2] == "  FixedBatchIterator"
    assert out[3].startswith("    source: BlockwiseShuffleIterator  seed=2 draws=0")
    assert out[5] == (
        "        source: InfinitePermutationSourceIterator  seed=1 position=0 draws=0 "
        "generator=null"
    )


def test_inspect_torch_checkpoint_with_nested_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "ckpt.pt"
    torch.save({"model": {"w": torch.zeros(2)}, "data": _state(), "step": 7}, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{path}: torch checkpoint, ")
    assert out[1].startswith("state at ['data']: ")
    assert out[2] == "  FixedBatchIterator"


def test_inspect_refuses_a_file_without_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "other.json"
    path.write_text('{"model": 1}')
    assert main(["inspect", str(path)]) == 2
    assert "holds no pipeline state" in capsys.readouterr().err
    (tmp_path / "junk.bin").write_bytes(b"\x80\x03junk")
    assert main(["inspect", str(tmp_path / "junk.bin")]) == 2
    assert "neither JSON nor a torch checkpoint" in capsys.readouterr().err


def test_s3_to_s3_resumes_and_matches_a_local_run(tmp_path: Path, s3: Any) -> None:
    expected = _corpus(tmp_path / "in", sizes=(8, 5))
    for path in sorted((tmp_path / "in").iterdir()):
        s3.put(f"raw/{path.name}", path.read_bytes())
    out = s3.url("chunks")
    index = chunk_corpus([s3.url("raw/part-*")], out, items_per_chunk=3, workers=1)
    assert index.chunk_refs[0] == s3.url("chunks/chunk-000000-000000.txt.gz")
    keys = s3.client.list_objects_v2(Bucket=s3.name, Prefix="chunks/")["Contents"]
    assert not [item["Key"] for item in keys if "_pieces" in item["Key"]]  # removed at the end
    assert [line for ref in load_index(out).chunk_refs for line in read_lines(ref)] == expected
    local = chunk_corpus(
        [str(tmp_path / "in" / "part-*")], str(tmp_path / "out"), items_per_chunk=3, workers=1
    )
    assert [(c.name, c.items, c.size, c.sha256) for c in index.chunks] == [
        (c.name, c.items, c.size, c.sha256) for c in local.chunks
    ]
    # an interrupted job: the index and one piece's manifest gone, a chunk of it left
    s3.client.delete_object(Bucket=s3.name, Key="chunks/index.json")
    s3.client.delete_object(Bucket=s3.name, Key="chunks/_pieces/piece-000001.json")
    assert chunk_corpus([s3.url("raw/part-*")], out, items_per_chunk=3, workers=1) == index
    assert main(["verify", out]) == 0



def test_chunk_corpus_and_load_index_retry_store_faults_by_the_given_policy(
    tmp_path: Path, s3: Any, s3_proxy: Any
) -> None:
    """Every request of a job (listing, lookup, read, upload) and of `load_index` is
    retried after a transient fault, as often as `retry` says."""
    expected = _corpus(tmp_path / "in", sizes=(8,))
    s3.put("raw/part-0.txt.gz", (tmp_path / "in" / "part-0.txt.gz").read_bytes())
    options = {"endpoint_url": s3_proxy.endpoint}
    out = s3.url("chunks")
    reset_retry_counts()
    faults = [  # listing, reading, uploading, sizing, indexing, cleaning up
        ("GET", "list-type"),
        ("GET", "raw/part-0"),
        ("PUT", "chunks/chunk-"),
        ("HEAD", "chunks/chunk-"),
        ("PUT", "index.json"),
        ("DELETE", "_pieces"),
    ]
    for method, path in faults:
        s3_proxy.inject("slow_down", 1, method, path)
    index = chunk_corpus(
        [s3.url("raw/part-*")], out, items_per_chunk=3, workers=1, storage_options=options,
        retry=FAST,
    )
    assert s3_proxy.injected["slow_down"] == len(faults)
    assert retry_counts() == {"SlowDown": 5, "503": 1}  # a HEAD answer has no error body
    s3_proxy.inject("slow_down", 1, "GET", "list-type")
    s3_proxy.inject("slow_down", 1, "GET", "index.json")
    assert load_index(out, storage_options=options, retry=FAST) == index
    assert retry_counts() == {"SlowDown": 7, "503": 1}
    assert [line for ref in index.chunk_refs for line in read_lines(ref)] == expected
    s3_proxy.inject("slow_down", 1, "GET", "index.json")
    with pytest.raises(ChunkReadError, match=r"chunks/index\.json failed after 1 tries"):
        load_index(out, storage_options=options, retry=RetryPolicy(tries=1))

def test_progress_bar_shows_bytes_items_and_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "part-*")]
    chunk_corpus(inputs, str(tmp_path / "out"), items_per_chunk=3, workers=1, show_progress=True)
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()[-1]
    size = sum(path.stat().st_size for path in (tmp_path / "in").iterdir())
    assert bar.startswith("chunk: 100%")
    assert f"{size}/{size}" in bar
    assert "B/s" in bar
    assert bar.endswith("24 items]")


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(
        st.text(st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",))),
        max_size=30,
    ),
    final_newline=st.booleans(),
    split_bytes=st.integers(1, 80),
    size=st.integers(1, 6),
)
def test_byte_ranges_hold_every_line_once(
    tmp_path_factory: pytest.TempPathFactory,
    lines: list[str],
    final_newline: bool,
    split_bytes: int,
    size: int,
) -> None:
    path = tmp_path_factory.mktemp("ranges") / "input.txt"
    path.write_bytes(("\n".join(lines) + ("\n" if final_newline else "")).encode("utf-8"))
    job = Job("lines", (str(path),), size, "none", split_bytes, "")
    found = []
    for piece in line_pieces([source_of(str(path), None)], split_bytes):
        for _, payload, items in _chunk_payloads(job, piece, BadLines(None, str(path)), None):
            assert 1 <= items <= size
            found.extend(payload.decode("utf-8").split("\n")[:-1])
    assert found == list(read_lines(str(path)))


# -- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "chunk", "verify", "inspect"])
def test_every_command_explains_itself_and_each_argument(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "-h"])
    assert exit_.value.code == 0
    usage, description, *sections = capsys.readouterr().out.split("\n\n")
    assert usage.startswith(f"usage: infinibatch-like {command} ")
    assert description[0].isupper(), description  # a sentence, not the first section
    assert description.rstrip().endswith(".")
    lines = "\n\n".join(sections).splitlines()
    for number, line in enumerate(lines):
        if line.startswith("  ") and not line.startswith("   "):  # an argument's first line
            helped = len(line.split()) > (1 if not line.lstrip().startswith("-") else 2)
            follows = number + 1 < len(lines) and lines[number + 1].startswith(" " * 8)
            assert helped or follows, f"{command} -h: no help for {line.strip()!r}"


@pytest.mark.parametrize(
    ("typed", "meant"), [("--output", "--out"), ("--items-per-chunks", "--items-per-chunk")]
)
def test_a_misspelled_flag_gets_a_suggestion(
    typed: str, meant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = {"--out": "o", "--items-per-chunk": "2"}
    del arguments[meant]
    flags = [part for flag, value in {**arguments, typed: "3"}.items() for part in (flag, value)]
    with pytest.raises(SystemExit) as exit_:
        main(["chunk", "a.txt", *flags])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert f"unrecognized argument {typed}: did you mean {meant}?" in error


def _bad_jsonl(path: Path) -> Path:
    """JSON lines with a line that is not JSON (line 2) and one that is not UTF-8 (line 4)."""
    path.write_bytes(b'{"n": 0}\n{oops\n{"n": 2}\n"\xff"\n{"n": 4}\n{"n": 5}\n')
    return path


def test_chunk_skips_bad_lines_within_its_budget_and_reports_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, out = _bad_jsonl(tmp_path / "a.jsonl"), tmp_path / "out"
    arguments = ["chunk", str(path), "--out", str(out), "--items-per-chunk", "2", "--quiet"]
    assert main([*arguments, "--skip-bad-lines", "2"]) == 0
    assert "4 items, 2 bad lines skipped (first: line 2 of" in capsys.readouterr().out
    index = load_index(str(out))
    assert [row for ref in index.chunk_refs for row in read_jsonl(ref)] == [
        {"n": 0}, {"n": 2}, {"n": 4}, {"n": 5}
    ]  # fmt: skip
    assert index.skipped == 2
    assert index.skip_examples[0].startswith(f"line 2 of {path} is not JSON")
    assert index.skip_examples[1].startswith(f"line 4 of {path} is not JSON")
    assert main(["verify", str(out)]) == 0
    assert main([*arguments, "--skip-bad-lines", "3"]) == 2
    assert "on_error: {'max_skips': 2, 'per_items': None} there" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "refusal"),
    [
        (["--skip-bad-lines", "1"], "more than 1 bad lines in all of"),
        (["--skip-bad-lines", "1", "--skip-window", "5"], "more than 1 bad lines in lines 1-5"),
        (["--skip-bad-lines", "1", "--skip-window", "3"], None),
        (["--skip-window", "3"], "--skip-window needs --skip-bad-lines"),
    ],
)
def test_chunk_refuses_bad_lines_beyond_its_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], refusal: str | None
) -> None:
    path, out = _bad_jsonl(tmp_path / "a.jsonl"), tmp_path / "out"
    code = main(["chunk", str(path), "--out", str(out), "--items-per-chunk", "2", *options])
    assert code == (0 if refusal is None else 2)
    if refusal is not None:
        assert refusal in capsys.readouterr().err
        assert not (out / "index.json").exists()


def test_skipped_text_lines_are_those_that_are_not_utf8(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"one\nbad \xff\nthree\n")
    index = chunk_corpus(
        [str(tmp_path / "a.txt")], str(tmp_path / "out"), items_per_chunk=5,
        on_error=SkipPolicy(max_skips=1),
    )  # fmt: skip
    assert [line for ref in index.chunk_refs for line in read_lines(ref)] == ["one", "three"]
    assert index.skip_examples == (
        f"line 2 of {tmp_path / 'a.txt'} is not UTF-8 text (invalid start byte at byte 4 of the "
        "line)",
    )


def test_a_missing_bucket_is_named_by_chunk_verify_and_load_index(
    tmp_path: Path, s3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = f"{s3.name}-absent"
    assert main(["verify", f"s3://{missing}/chunks"]) == 1
    no_index = f"no chunk index at s3://{missing}/chunks/index.json: the bucket {missing!r}"
    assert f"{no_index} does not exist" in capsys.readouterr().out
    with pytest.raises(ChunkIndexError, match=f"the bucket {missing!r} does not exist"):
        load_index(f"s3://{missing}/chunks")
    _write_lines(tmp_path / "a.txt", ["x"])
    for inputs, out, expected in (
        (
            [f"s3://{missing}/raw/*.txt"],
            str(tmp_path / "out"),
            f"no file matches the pattern 's3://{missing}/raw/*.txt': the bucket {missing!r} "
            "does not exist",
        ),
        (
            [str(tmp_path / "a.txt")],
            f"s3://{missing}/chunks",
            f"s3://{missing}/chunks/job.json: its bucket does not exist",
        ),
    ):
        code = main(["chunk", *inputs, "--out", out, "--items-per-chunk", "2", "--quiet"])
        assert code == 2
        assert expected in capsys.readouterr().err


def _images(root: Path, count: int) -> dict[str, dict[str, bytes]]:
    """A directory of WebDataset-style files: per sample an image, a caption, metadata."""
    samples: dict[str, dict[str, bytes]] = {}
    for number in range(count):
        key = f"{'cats' if number % 2 else 'dogs'}/{number:03d}"
        files = {"jpg": bytes([number]) * (number + 1), "txt": f"a photo {number}".encode()}
        if number % 3 == 0:
            files["meta.json"] = json.dumps({"n": number}).encode()
        samples[key] = files
        for extension, data in files.items():
            path = root / f"{key}.{extension}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return samples


@pytest.mark.parametrize("compress", ["none", "gz", "zst"])
def test_directory_of_files_becomes_webdataset_shards(tmp_path: Path, compress: str) -> None:
    samples = _images(tmp_path / "images", 11)
    out = str(tmp_path / "shards")
    index = chunk_corpus(
        [str(tmp_path / "images")], out, items_per_chunk=4, input_format="wds", compress=compress
    )
    assert index.kind == "wds"
    suffix = ".tar" + {"none": "", "gz": ".gz", "zst": ".zst"}[compress]
    assert all(ref.endswith(suffix) for ref in index.chunk_refs)
    assert [chunk.items for chunk in index.chunks] == [4, 4, 3]
    read = [sample for ref in index.chunk_refs for sample in read_webdataset(ref)]
    expected = [{"__key__": key, **dict(sorted(samples[key].items()))} for key in sorted(samples)]
    assert read == expected
    assert all(not found for _, found in verify_chunks(load_index(out)))


def test_webdataset_shards_are_byte_identical_whatever_the_workers(tmp_path: Path) -> None:
    _images(tmp_path / "images", 9)
    trees = []
    for workers, name in ((1, "one"), (2, "two")):
        chunk_corpus(
            [str(tmp_path / "images")], str(tmp_path / name), items_per_chunk=2,
            input_format="wds", workers=workers,
        )  # fmt: skip
        trees.append(_tree(tmp_path / name))
    assert trees[0] == trees[1]


def test_webdataset_format_from_the_command_line_and_its_refusals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _images(tmp_path / "images", 5)
    out = str(tmp_path / "shards")
    args = ["chunk", str(tmp_path / "images"), "--out", out, "--items-per-chunk", "3"]
    assert main([*args, "--format", "wds", "--quiet"]) == 0
    assert f"{out}: 2 chunks, 5 items, index.json written" in capsys.readouterr().out
    assert load_index(out).kind == "wds"
    (tmp_path / "images" / "README").write_bytes(b"no extension")
    assert main([*args[:3], str(tmp_path / "other"), *args[4:], "--format", "wds"]) == 2
    assert "the file 'README' in" in capsys.readouterr().err
    lines = _write_lines(tmp_path / "lines.txt", ["a", "b"])
    with pytest.raises(ValueError, match="writes WebDataset shards from a directory of files"):
        chunk_corpus([str(lines)], str(tmp_path / "o"), items_per_chunk=2, input_format="wds")
