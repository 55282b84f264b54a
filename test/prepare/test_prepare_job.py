"""The `chunk` job and its output directory: literal output paths, one job per output (a
lock), the job's identity (options and inputs, named when they change), damaged job files,
and what a finished job leaves behind."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_prepare import REPO, _corpus, _tree, _write_lines

from infinibatch_like.__main__ import main
from infinibatch_like.io import read_lines, read_records
from infinibatch_like.prepare import ChunkIndexError, chunk_corpus, load_index, read_index


def _stamps(directory: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file()}


def _interrupt(out: Path) -> None:
    """Make a finished output look like an interrupted job: chunks written, no index."""
    (out / "index.json").unlink()
    (out / "_pieces").mkdir(exist_ok=True)


def _refused(inputs: list[str], out: Path, **options: object) -> str:
    arguments = {"items_per_chunk": 3, "workers": 1, **options}
    with pytest.raises(ValueError, match=r"^chunk: ") as error:
        chunk_corpus(inputs, str(out), **arguments)  # type: ignore[arg-type]
    return str(error.value)


# -- output paths are literal -------------------------------------------------------------


def test_output_path_with_glob_characters_is_used_literally(tmp_path: Path) -> None:
    expected = _corpus(tmp_path / "in")
    inputs = [str(tmp_path / "in" / "part-*")]
    out = tmp_path / "runs[1]" / "chunks"
    index = chunk_corpus(inputs, str(out), items_per_chunk=3, workers=1)
    assert load_index(str(out)) == index
    assert [line for ref in index.chunk_refs for line in read_lines(ref)] == expected
    assert main(["verify", str(out)]) == 0
    stamps = _stamps(out)
    time.sleep(0.01)
    assert chunk_corpus(inputs, str(out), items_per_chunk=3, workers=1) == index
    assert _stamps(out) == stamps
    assert "items_per_chunk: 3 there, 4 now" in _refused(inputs, out, items_per_chunk=4)
    _interrupt(out)
    assert "items_per_chunk: 3 there, 4 now" in _refused(inputs, out, items_per_chunk=4)


def test_input_file_named_with_glob_characters_says_how_to_escape_it(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "part[1].txt", ["a", "b"])
    message = _refused([str(path)], tmp_path / "out")
    assert "glob characters" in message
    assert repr(glob.escape(str(path))) in message
    index = chunk_corpus([glob.escape(str(path))], str(tmp_path / "out"), items_per_chunk=3)
    assert [line for ref in index.chunk_refs for line in read_lines(ref)] == ["a", "b"]


# -- an output inside the input -----------------------------------------------------------


def test_output_inside_a_directory_input_is_not_read_as_input(tmp_path: Path) -> None:
    for name in ("a.bin", "sub/b.bin"):
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_bytes(name.encode())
    out = tmp_path / "in" / "chunks"
    first = chunk_corpus([str(tmp_path / "in")], str(out), items_per_chunk=5, workers=1)
    again = chunk_corpus([str(tmp_path / "in")], str(out), items_per_chunk=5, workers=1)
    assert again == first
    records = [record.name for ref in first.chunk_refs for record in read_records(ref)]
    assert records == ["a.bin", "sub/b.bin"]


def test_output_matched_by_a_recursive_input_glob_is_not_read_as_input(tmp_path: Path) -> None:
    (tmp_path / "in" / "deep").mkdir(parents=True)
    _write_lines(tmp_path / "in" / "a.txt", ["x", "y"])
    _write_lines(tmp_path / "in" / "deep" / "b.txt", ["z"])
    inputs, out = [str(tmp_path / "in" / "**" / "*.txt")], tmp_path / "in" / "chunks"
    first = chunk_corpus(inputs, str(out), items_per_chunk=2, compress="none", workers=1)
    assert chunk_corpus(inputs, str(out), items_per_chunk=2, compress="none") == first
    assert [line for ref in first.chunk_refs for line in read_lines(ref)] == ["x", "y", "z"]


# -- one job at a time --------------------------------------------------------------------


def test_a_second_job_on_an_output_in_use_is_refused_until_the_first_dies(
    tmp_path: Path,
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    for number in range(8):
        _write_lines(inputs / f"f{number}.txt", [f"{number}-{i}" for i in range(500)])
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "infinibatch_like", "chunk", str(inputs / "*.txt"),
        "--out", str(out), "--items-per-chunk", "100", "--workers", "1", "--quiet",
    ]  # fmt: skip
    first = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 60
        while not (out / "job.json").exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        first.send_signal(signal.SIGSTOP)  # it holds the output, and stays put
        assert not (out / "index.json").exists(), "the first job finished too early"
        for items in (100, 50):
            message = _refused([str(inputs / "*.txt")], out, items_per_chunk=items)
            assert f"another chunk job is writing {str(out)!r}" in message
    finally:
        first.kill()  # SIGKILL: the lock goes with the process
        first.wait()
    index = chunk_corpus([str(inputs / "*.txt")], str(out), items_per_chunk=100, workers=1)
    assert len(index) == 4000
    assert main(["verify", str(out)]) == 0


# -- the job's identity -------------------------------------------------------------------


def test_input_edited_in_place_is_named_when_the_job_resumes(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    inputs, out = [str(tmp_path / "in" / "part-*")], tmp_path / "out"
    chunk_corpus(inputs, str(out), items_per_chunk=3, workers=1)
    _interrupt(out)
    edited = tmp_path / "in" / "part-1.txt"
    before = edited.read_bytes()
    time.sleep(0.05)  # past the file system's clock tick
    edited.write_bytes(before.replace(b"line", b"LINE"))  # the same size
    message = _refused(inputs, out)
    assert f"the input {str(edited)!r} changed since the job started" in message
    assert f"{len(before)} bytes" in message
    assert "plan:" not in message


def test_fixed_input_after_a_failed_job_names_what_changed(tmp_path: Path) -> None:
    good = _write_lines(tmp_path / "a.jsonl", ['{"n": 1}', '{"n": 2}'])
    bad = _write_lines(tmp_path / "b.jsonl", ['{"n": 3}', "{oops"])
    inputs, out = [str(tmp_path / "*.jsonl")], tmp_path / "out"
    assert "line 2 of" in _refused(inputs, out)
    _write_lines(bad, ['{"n": 3}', '{"n": 4}'])
    message = _refused(inputs, out)
    assert f"the input {str(bad)!r} changed since the job started" in message
    assert str(good) not in message
    _write_lines(tmp_path / "c.jsonl", ['{"n": 5}'])
    assert f"the input {str(tmp_path / 'c.jsonl')!r} was added" in _refused(inputs, out)


def test_damaged_job_files_are_named(tmp_path: Path) -> None:
    _corpus(tmp_path / "in")
    inputs, out = [str(tmp_path / "in" / "part-*")], tmp_path / "out"
    chunk_corpus(inputs, str(out), items_per_chunk=3, workers=1)
    _interrupt(out)
    manifest = out / "_pieces" / "piece-000002.json"
    manifest.write_text(json.dumps([{"name": "chunk-000002-000000.txt.gz"}]))
    message = _refused(inputs, out)
    assert str(manifest) in message
    assert "is damaged" in message
    manifest.write_text('[{"name": "chunk-0000')  # truncated
    message = _refused(inputs, out)
    assert str(manifest) in message
    assert "is damaged" in message
    manifest.unlink()
    job = out / "job.json"
    job.write_text(job.read_text()[:30])
    message = _refused(inputs, out)
    assert str(job) in message
    assert "is damaged" in message
    job.write_text("[" * 100_000 + "]" * 100_000)
    message = _refused(inputs, out)
    assert str(job) in message
    assert "is damaged" in message


def test_deeply_nested_json_line_is_named(tmp_path: Path) -> None:
    path = _write_lines(tmp_path / "a.jsonl", ['{"n": 1}', "[" * 100_000 + "]" * 100_000])
    message = _refused([str(path)], tmp_path / "out")
    assert f"line 2 of {path}" in message
    assert "nested too deeply" in message


def _edit_job(data: bytes, **fields: object) -> bytes:
    """The index `data` with its job's `fields` set (removed where None)."""
    content = json.loads(data)
    job = {**content["job"], **fields}
    content["job"] = {key: value for key, value in job.items() if value is not None}
    return json.dumps(content).encode()


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda data: b"\xff\xfe" + data, "is not UTF-8"),
        (lambda data: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (lambda data: _edit_job(data, kind=None), "'job' has no 'kind'"),
        (lambda data: _edit_job(data, kind="videos"), "'job' has the 'kind' 'videos'"),
        (lambda data: _edit_job(data, items_per_chunk="3"), "'job' has the 'items_per_chunk' '3'"),
    ],
)
def test_damaged_index_is_refused_naming_the_file_and_field(
    tmp_path: Path, damage: object, expected: str
) -> None:
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    chunk_corpus([str(tmp_path / "in" / "part-*")], str(out), items_per_chunk=3, workers=1)
    path = out / "index.json"
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(ChunkIndexError) as error:
        read_index(str(out))
    assert f"chunk index {path}" in str(error.value)
    assert expected in str(error.value)


# -- what a finished job leaves -----------------------------------------------------------


def test_a_finished_job_leaves_no_temporary_files_nor_piece_manifests(tmp_path: Path) -> None:
    expected = _corpus(tmp_path / "in")
    inputs, out = [str(tmp_path / "in" / "part-*")], tmp_path / "out"
    chunk_corpus(inputs, str(out), items_per_chunk=3, workers=1)
    assert not (out / "_pieces").exists()
    _interrupt(out)
    stale = [  # what a killed writer leaves
        out / ".chunk-000001-000000.txt.gz.0123456789ab.tmp",
        out / "_pieces" / ".piece-000001.json.0123456789ab.tmp",
        out / ".index.json.0123456789ab.tmp",
    ]
    for path in stale:
        path.write_bytes(b"partial")
    (out / "notes.txt").write_text("the user's own file")
    index = chunk_corpus(inputs, str(out), items_per_chunk=3, workers=1)
    assert [line for ref in index.chunk_refs for line in read_lines(ref)] == expected
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("chunk-")) == [
        ".chunk.lock", "index.json", "job.json", "notes.txt"
    ]  # fmt: skip
    chunk_corpus(inputs, str(tmp_path / "fresh"), items_per_chunk=3, workers=1)
    assert _tree(out) == {**_tree(tmp_path / "fresh"), "notes.txt": b"the user's own file"}


# -- symbolic links in a directory input --------------------------------------------------


def test_directory_input_reads_linked_directories_once(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.bin").write_bytes(b"c")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.bin").write_bytes(b"a")
    (tmp_path / "in" / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "in" / "loop").symlink_to(tmp_path / "in", target_is_directory=True)
    index = chunk_corpus([str(tmp_path / "in")], str(tmp_path / "out"), items_per_chunk=5)
    records = [(r.name, r.data) for ref in index.chunk_refs for r in read_records(ref)]
    assert records == [("a.bin", b"a"), ("linked/c.bin", b"c")]
