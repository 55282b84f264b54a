"""infinibatch_like.io on local files and memory:// URLs: listing, readers, compression,
record files, atomic output, errors naming the chunk, missing extras."""

from __future__ import annotations

import functools
import glob
import gzip
import json
import os
import pickle
import re
import sys
import threading
import zlib
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like._extras import MissingExtraError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.io import (
    ChunkFormatError,
    ChunkNotFoundError,
    Record,
    _compression,
    list_chunks,
    open_chunk,
    open_output,
    read_jsonl,
    read_lines,
    read_records,
    readers,
    write_records,
)

SUFFIXES = ["", ".gz", ".zst", ".bz2", ".xz"]


def write(path: Path | str, data: bytes) -> str:
    with open_output(path) as out:
        out.write(data)
    return str(path)


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_round_trip_through_each_compression(tmp_path: Path, suffix: str) -> None:
    data = "first\r\nsecond\n\nthird é\rstill third\nlast".encode()
    path = write(tmp_path / f"chunk.txt{suffix}", data)
    with open_chunk(path) as stream:
        assert stream.read() == data
    assert list(read_lines(path)) == ["first", "second", "", "third é\rstill third", "last"]
    if suffix:
        assert Path(path).read_bytes() != data  # really compressed


@pytest.mark.parametrize("suffix", [s for s in SUFFIXES if s])
def test_iterating_a_compressed_chunk_reads_blocks_not_bytes(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from infinibatch_like.io import streams

    lines = [f"line {i}" for i in range(20_000)]
    path = write(tmp_path / f"chunk.txt{suffix}", "".join(f"{x}\n" for x in lines).encode())
    calls: list[int] = []
    readinto = streams._Decompressed.readinto
    read = streams._Decompressed.read

    def counted_readinto(self: Any, buffer: Any) -> int:
        calls.append(1)
        return readinto(self, buffer)

    def counted_read(self: Any, size: int | None = -1) -> bytes:
        calls.append(1)
        return read(self, size)

    monkeypatch.setattr(streams._Decompressed, "readinto", counted_readinto)
    monkeypatch.setattr(streams._Decompressed, "read", counted_read)
    with open_chunk(path) as stream:
        assert [line.decode().rstrip("\n") for line in stream] == lines
    assert len(calls) < 10  # 170 KB in blocks, not a call per byte


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (b"", []),
        (b"\n", [""]),
        (b"a\n", ["a"]),
        (b"a", ["a"]),
        (b"a\r\n\r\n", ["a", ""]),
        (b"a\r", ["a\r"]),
        (b"a\x0cb\x1cc\xe2\x80\xa8d\n", ["a\x0cb\x1cc\u2028d"]),  # no str.splitlines breaks
    ],
)
def test_line_endings(tmp_path: Path, data: bytes, lines: list[str]) -> None:
    assert list(read_lines(write(tmp_path / "c.txt", data))) == lines


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(["a", "é", "\n", "\r", " ", "€"]), max_size=60),
    block=st.integers(1, 9),
)
def test_read_lines_equals_reference_split(text: str, block: int, tmp_path_factory) -> None:
    """Any text, cut into blocks of any size (even inside a UTF-8 character or a \\r\\n)."""
    data = text.encode()
    path = write(tmp_path_factory.mktemp("lines") / "c.txt.gz", data)
    expected = text.replace("\r\n", "\n").split("\n")
    if expected[-1] == "":
        expected.pop()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readers, "BLOCK_SIZE", block)
        assert list(read_lines(path)) == expected


def test_read_lines_other_encoding_and_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "c.txt", "zwölf\nélan\n".encode("utf-16"))
    assert list(read_lines(path, encoding="utf-16")) == ["zwölf", "élan"]
    bad = write(tmp_path / "bad.txt.gz", b"good\nbad \xff here\n")
    with pytest.raises(ChunkFormatError, match=r"bad\.txt\.gz: not valid utf-8 text at byte 9"):
        list(read_lines(bad))
    assert list(read_lines(bad, errors="replace")) == ["good", "bad \ufffd here"]
    with pytest.raises(LookupError, match="no-such-codec"):
        read_lines(bad, encoding="no-such-codec")


def test_read_jsonl_skips_blank_lines_and_names_a_bad_line(tmp_path: Path) -> None:
    rows = [{"id": i, "text": "x" * i} for i in range(50)]
    body = "\n".join(json.dumps(row) for row in rows[:30]) + "\n  \n\n"
    body += "\n".join(json.dumps(row) for row in rows[30:]) + "\n"
    path = write(tmp_path / "rows.jsonl.zst", body.encode())
    assert list(read_jsonl(path)) == rows
    bad = write(tmp_path / "bad.jsonl.gz", (body + '{"id": 50,\n' + json.dumps(rows[0])).encode())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readers, "BLOCK_SIZE", 100)  # the bad line is in a later block
        lines = read_jsonl(bad)
        assert list(islice(lines, 50)) == rows  # every good row before it is delivered
        with pytest.raises(ChunkFormatError, match=r"bad\.jsonl\.gz, line 53: not valid JSON"):
            next(lines)


@settings(max_examples=50, deadline=None)
@given(
    records=st.lists(
        st.tuples(st.text(max_size=20), st.binary(max_size=300)), max_size=12
    ),
    suffix=st.sampled_from(["", ".gz", ".zst"]),
)
def test_record_round_trip(records: list[tuple[str, bytes]], suffix: str, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("rec") / f"chunk.rec{suffix}"
    with open_output(path) as out:
        assert write_records(out, records) == len(records)
    assert list(read_records(path)) == [Record(name, data) for name, data in records]


def test_records_truncated_anywhere_or_foreign_are_named(tmp_path: Path) -> None:
    whole = tmp_path / "whole.rec"
    with open_output(whole) as out:
        write_records(out, [Record("a.jpg", b"\x00" * 30), Record("dir/b.png", b"xyz")])
    data = whole.read_bytes()
    for cut in range(len(data)):
        path = tmp_path / f"cut{cut}.rec"
        path.write_bytes(data[:cut])
        with pytest.raises(ChunkFormatError, match=rf"cut{cut}\.rec: (truncated|not a record)"):
            list(read_records(path))
    (tmp_path / "tail.rec").write_bytes(data + b"!")
    with pytest.raises(ChunkFormatError, match=r"tail\.rec: damaged record file: data after"):
        list(read_records(tmp_path / "tail.rec"))
    foreign = write(tmp_path / "lines.txt.gz", b"hello\n")
    with pytest.raises(ChunkFormatError, match=r"lines\.txt\.gz: not a record file"):
        list(read_records(foreign))


def test_write_records_refuses_bad_records(tmp_path: Path) -> None:
    with open_output(tmp_path / "x.rec") as out:
        with pytest.raises(TypeError, match=r"record 1 must be \(str, bytes\), got \(str, str\)"):
            write_records(out, [("a", b""), ("b", "text")])  # type: ignore[list-item]
        with pytest.raises(TypeError, match="record 0 must be a Record or a"):
            write_records(out, [b"data"])  # type: ignore[list-item]


def test_open_output_is_atomic(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "out.txt.gz"
    write(target, b"old\n")
    def fail_while_writing() -> None:
        with open_output(target) as out:
            out.write(b"new, half written")
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_while_writing()
    assert list(read_lines(target)) == ["old"]
    assert sorted(os.listdir(target.parent)) == ["out.txt.gz"]  # no temporary file left
    write(target, b"new\n")
    assert list(read_lines(target)) == ["new"]
    assert sorted(os.listdir(target.parent)) == ["out.txt.gz"]


def test_gzip_output_is_deterministic(tmp_path: Path) -> None:
    data = b"same data\n" * 1000
    first, second = write(tmp_path / "1.gz", data), write(tmp_path / "2.gz", data)
    assert Path(first).read_bytes() == Path(second).read_bytes()
    assert gzip.decompress(Path(first).read_bytes()) == data  # any gzip reader reads it


def test_unsupported_suffix_is_refused_before_any_io(tmp_path: Path) -> None:
    path = tmp_path / "no" / "such.lz4"
    calls = [lambda: open_chunk(path), lambda: read_lines(path), lambda: read_jsonl(path)]
    for call in [*calls, lambda: read_records(path), open_output(path).__enter__]:
        with pytest.raises(ValueError, match=r"no/such\.lz4: the compression suffix '\.lz4'"):
            call()
    assert not (tmp_path / "no").exists()


def test_missing_chunk_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "gone.txt.gz"
    with pytest.raises(ChunkNotFoundError, match=r"gone\.txt\.gz: no such file or object"):
        list(read_lines(missing))
    assert isinstance(ChunkNotFoundError("x"), FileNotFoundError)


@pytest.mark.parametrize(
    ("suffix", "damage", "codec"),
    [
        (".gz", lambda d: d[: len(d) // 2], "gzip"),
        (".gz", lambda d: b"not gzip at all", "gzip"),
        (".gz", lambda d: d[:30] + bytes(b ^ 0x55 for b in d[30:60]) + d[60:], "gzip"),
        (".zst", lambda d: d[: len(d) // 2], "zstd"),
        (".zst", lambda d: b"\x28\xb5\x2f\xfd garbage", "zstd"),
        (".bz2", lambda d: d[: len(d) // 2], "bzip2"),
        (".xz", lambda d: d[:-8], "xz"),
    ],
)
def test_corrupt_compressed_chunk_is_named(tmp_path: Path, suffix, damage, codec) -> None:
    data = "".join(f"line {i} {i * 7919 % 1000}\n" for i in range(3000)).encode()
    path = Path(write(tmp_path / f"c.txt{suffix}", data))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ChunkFormatError, match=rf"c\.txt\{suffix}: corrupt or truncated {codec}"):
        list(read_lines(path))


def test_list_chunks_local(tmp_path: Path) -> None:
    for name in ["b/2.gz", "a/10.gz", "a/9.gz", "a/x.txt"]:
        write(tmp_path / name, b"x\n")
    (tmp_path / "c.gz").mkdir()
    assert list_chunks(tmp_path / "**" / "*.gz") == [
        str(tmp_path / name) for name in ["a/10.gz", "a/9.gz", "b/2.gz"]
    ]
    with pytest.raises(ChunkNotFoundError, match=r"no file matches the pattern '.*\*\.zst'"):
        list_chunks(str(tmp_path / "*.zst"))


def _listing_in_thread(pattern: str) -> list[str]:
    """`list_chunks(pattern)`, failing the test if it gives no answer within 10 s."""
    found: list[list[str]] = []
    worker = threading.Thread(target=lambda: found.append(list_chunks(pattern)), daemon=True)
    worker.start()
    worker.join(10)
    assert found, f"list_chunks({pattern!r}) gave no answer within 10 s"
    return found[0]


def test_recursive_listing_survives_symlink_loops_listing_each_file_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write(root / "a.txt", b"a\n")
    write(root / "sub" / "b.txt", b"b\n")
    (root / "sub" / "up").symlink_to(root, target_is_directory=True)
    assert list_chunks(f"{root}/**/*.txt") == [f"{root}/a.txt", f"{root}/sub/b.txt"]
    (root / "sideways").symlink_to(root / "sub", target_is_directory=True)
    (root / "sub" / "self").symlink_to(root / "sub", target_is_directory=True)
    assert _listing_in_thread(f"{root}/**/*.txt") == [f"{root}/a.txt", f"{root}/sub/b.txt"]


def test_recursive_listing_enters_a_symlinked_directory_once(tmp_path: Path) -> None:
    write(tmp_path / "elsewhere" / "c.txt", b"c\n")
    root = tmp_path / "root"
    write(root / "a.txt", b"a\n")
    (root / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "linked_again").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "dangling").symlink_to(tmp_path / "gone", target_is_directory=True)
    assert list_chunks(f"{root}/**/*.txt") == [f"{root}/a.txt", f"{root}/linked/c.txt"]
    assert list_chunks(f"{root}/**") == [f"{root}/a.txt", f"{root}/linked/c.txt"]


def test_recursive_listing_keeps_glob_semantics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ["x.txt", "d/y.txt", "d/e/z.txt", "d/.hidden/h.txt", ".top.txt", "d/w.gz"]:
        write(tmp_path / name, b"x\n")
    monkeypatch.chdir(tmp_path)
    for pattern in ["**/*.txt", "d/**/*.txt", "**/e/*.txt", "d/**", "**/.*.txt", "*/**/z.txt"]:
        for where in (str(tmp_path / pattern), pattern):
            expected = sorted(p for p in glob.glob(where, recursive=True) if os.path.isfile(p))
            assert expected
            assert list_chunks(where) == expected, where


def test_literal_name_with_glob_characters_says_how_to_escape_it(tmp_path: Path) -> None:
    path = write(tmp_path / "part[1].txt", b"x\n")
    with pytest.raises(ChunkNotFoundError) as error:
        list_chunks(path)
    message = str(error.value)
    assert "glob characters" in message
    assert repr(glob.escape(path)) in message
    assert list_chunks(glob.escape(path)) == [path]


def test_listing_a_directory_hints_at_its_files(tmp_path: Path) -> None:
    write(tmp_path / "data" / "a.txt", b"x\n")
    with pytest.raises(ChunkNotFoundError) as error:
        list_chunks(tmp_path / "data")
    assert f"is a directory: list its files with '{tmp_path / 'data'}/*'" in str(error.value)


def test_memory_urls_keep_their_protocol() -> None:
    for name in ["3", "1", "2"]:
        write(f"memory://io-test/{name}.jsonl.gz", f'{{"n": {name}}}\n'.encode())
    refs = list_chunks("memory://io-test/*.jsonl.gz")
    assert refs == [f"memory:///io-test/{n}.jsonl.gz" for n in "123"]
    assert [row for ref in refs for row in read_jsonl(ref)] == [{"n": 1}, {"n": 2}, {"n": 3}]
    with pytest.raises(ChunkNotFoundError, match="memory://io-test/none"):
        list(read_lines("memory://io-test/none.gz"))


@pytest.mark.parametrize("read_ahead_chunks", [0, 2])
def test_readers_as_read_chunk_fn_resume_exactly(tmp_path: Path, read_ahead_chunks: int) -> None:
    refs = [write(tmp_path / f"{i}.txt.zst", f"{i}-a\n{i}-b\n{i}-c\n".encode()) for i in range(5)]
    reader = functools.partial(read_lines, storage_options={"unused": True})
    reader = pickle.loads(pickle.dumps(reader))  # as sent to a spawn worker

    def build():
        return chunked_dataset_iterator(
            refs, reader, buffer_size=4, seed=3, read_ahead_chunks=read_ahead_chunks
        )

    first = build()
    head = list(islice(first, 7))
    state = first.getstate()
    tail = list(islice(first, 20))
    again = build()
    again.setstate(json.loads(json.dumps(state)))
    assert list(islice(again, 20)) == tail
    assert sorted(set(head + tail)) == sorted(f"{i}-{c}" for i in range(5) for c in "abc")


def test_error_in_a_pipeline_names_the_chunk_once(tmp_path: Path) -> None:
    refs = [write(tmp_path / "ok.txt", b"a\nb\n"), str(tmp_path / "missing.txt")]
    pipeline = chunked_dataset_iterator(refs, read_lines, 1, train=False, shuffle=False)
    assert list(islice(pipeline, 2)) == ["a", "b"]
    with pytest.raises(ChunkNotFoundError, match=r"missing\.txt: no such file") as caught:
        next(pipeline)
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1  # the pipeline's note, with the position
    assert "missing.txt" in notes[0]


@pytest.mark.parametrize(
    ("module", "extra", "call"),
    [
        ("zstandard", "zstd", lambda p: list(read_lines(p / "x.txt.zst"))),
        ("fsspec", "remote", lambda p: list(read_lines("memory://x/y.txt"))),
        ("fsspec", "remote", lambda p: list_chunks("s3://bucket/*.gz")),
        ("s3fs", "remote", lambda p: list(read_lines("s3://bucket/y.txt"))),
    ],
)
def test_missing_extra_is_named(tmp_path: Path, monkeypatch, module, extra, call) -> None:
    (tmp_path / "x.txt.zst").write_bytes(b"")
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    if module == "s3fs":  # fsspec keeps the classes it has imported: forget them
        monkeypatch.setattr(sys.modules["fsspec.registry"], "registry", {})
    with pytest.raises(MissingExtraError, match=rf"infinibatch_like\[{extra}\]") as caught:
        call(tmp_path)
    assert repr(module) in str(caught.value)


@pytest.mark.parametrize(
    ("blocked", "chosen"),
    [((), "isal.igzip"), (("isal.igzip",), "zlib_ng.gzip_ng"),
     (("isal.igzip", "zlib_ng.gzip_ng"), "gzip")],
)
def test_fastest_gzip_is_used(tmp_path: Path, monkeypatch, blocked, chosen) -> None:
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)
    assert _compression._gzip_module().__name__ == chosen
    data = b"".join(b"%d\n" % i for i in range(10000))
    path = write(tmp_path / "c.gz", data)
    assert zlib.decompress(Path(path).read_bytes(), 31) == data
    assert list(read_lines(path)) == [str(i) for i in range(10000)]


def _special_targets(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Existing targets that are not regular files: (path, how the refusal names it)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    directory = tmp_path / "directory.txt"
    directory.mkdir()
    link = tmp_path / "link-to-fifo"
    link.symlink_to(fifo)
    return {"fifo": (fifo, "a FIFO"), "dir": (directory, "a directory"), "link": (link, "a FIFO")}


@pytest.mark.parametrize("kind", ["fifo", "dir", "link"])
def test_open_output_refuses_a_target_that_is_not_a_regular_file(
    tmp_path: Path, kind: str
) -> None:
    target, described = _special_targets(tmp_path)[kind]
    before = sorted(os.listdir(tmp_path))
    message = f"{target}: exists and is {described}, not a regular file"
    with pytest.raises(FileExistsError, match=re.escape(message)):
        write(target, b"data\n")
    assert sorted(os.listdir(tmp_path)) == before  # nothing replaced, no temporary file
    assert (tmp_path / "fifo").is_fifo()
    assert (tmp_path / "directory.txt").is_dir()
    assert (tmp_path / "link-to-fifo").is_symlink()


_FULL_DISK = """
import os, resource, signal, sys
from infinibatch_like.io import open_output
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
for target, size in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        with open_output(target) as out:
            out.write(os.urandom(int(size)))
    except OSError as error:
        print(type(error).__name__, error.errno, error.filename == target)
    else:
        print("written")
"""


def test_open_output_leaves_no_temporary_file_on_a_full_disk(tmp_path: Path) -> None:
    import subprocess

    out, staging = tmp_path / "out", tmp_path / "staging"
    staging.mkdir()
    targets = [
        (out / "small-write.bin", 8192),  # fails when the buffer is flushed at the end
        (out / "large-write.bin", 4 << 20),  # fails inside the with block
        (out / "compressed.bin.gz", 4 << 20),
        ("memory://full-disk/staged.bin", 8192),  # the local staging file fills the disk
    ]
    argv = [str(part) for target in targets for part in target]
    result = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TMPDIR": str(staging)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n") == ["OSError 27 True"] * len(targets) + [""]
    assert os.listdir(out) == []
    assert os.listdir(staging) == []
