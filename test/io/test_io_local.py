"""infinibatch_like.io on local files and memory:// URLs: listing, readers (bad and long lines,
decompression bombs), compression, record files, atomic output, errors naming the chunk,
missing extras."""

from __future__ import annotations

import functools
import glob
import gzip
import io
import json
import os
import pickle
import random
import re
import subprocess
import sys
import threading
import time
import zlib
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like._core.extras import MissingExtraError
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
from infinibatch_like.io._lines import LineSplitter, line_blocks
from infinibatch_like.io._store import Store
from infinibatch_like.io.streams import open_stream
from infinibatch_like.stages.bad_records import SkipPolicy, skip_ledgers

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


def expected_lines(data: bytes, limit: int | None) -> list[str | tuple[int, str]]:
    """What `read_lines` gives for `data`, line by line: a str, or (line number, what is
    wrong) for a bad line: the first bad byte (as an offset) or a line longer than `limit`."""
    out: list[str | tuple[int, str]] = []
    parts = data.split(b"\n")
    start = 0
    for number, part in enumerate(parts, 1):
        ended = number < len(parts)
        if not ended and not part:
            break
        content = part[:-1] if ended and part.endswith(b"\r") else part
        try:
            line = content.decode()
        except UnicodeDecodeError as error:
            good = len(content[: error.start].decode())
            too_long = limit is not None and good > limit
            out.append((number, "too long" if too_long else f"byte {start + error.start}"))
        else:
            out.append(line if limit is None or len(line) <= limit else (number, "too long"))
        start += len(part) + 1
    return out


@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(
        [b"a", b"\xc3\xa9", b"\n", b"\r", b"\r\n", b"\xff", b"\xe2\x82", "\u20ac".encode()]
    ), max_size=40),
    block=st.integers(1, 9),
    limit=st.one_of(st.none(), st.integers(1, 6)),
)
def test_read_lines_with_bad_lines_equals_a_line_by_line_reference(
    pieces: list[bytes], block: int, limit: int | None, tmp_path_factory
) -> None:
    """Bad bytes and long lines anywhere, blocks cut anywhere: each bad line is reported at
    its first bad byte or as too long, in its place, and every other line is delivered."""
    data = b"".join(pieces)
    path = write(tmp_path_factory.mktemp("bad") / "c.txt", data)
    got: list[str | ChunkFormatError] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readers, "BLOCK_SIZE", block)
        lines = read_lines(path, max_line_length=limit)
        while True:
            try:
                got.append(next(lines))
            except StopIteration:
                break
            except ChunkFormatError as error:
                got.append(error)

    def described(item: str | ChunkFormatError) -> str | tuple[int, str]:
        if isinstance(item, str):
            return item
        found = re.search(r"line (\d+): (?:not valid utf-8 text at (byte \d+)|longer)", str(item))
        assert found, item
        return int(found[1]), found[2] or "too long"

    assert [described(item) for item in got] == expected_lines(data, limit)


@settings(max_examples=100, deadline=None)
@given(
    pieces=st.lists(st.sampled_from([b"a", b"\xff", b"\n", b"\r", b"\r\n", b" "]), max_size=40),
    block=st.integers(1, 9),
)
def test_raw_line_splitter_splits_bytes_as_the_text_splitter_splits_text(
    pieces: list[bytes], block: int
) -> None:
    """The chunking tool's splitter (bytes) and the readers' (text) are one: same lines,
    "\\r\\n" and "\\n" removed, a lone "\\r" kept, blocks cut anywhere."""
    data = b"".join(pieces)
    parts = data.split(b"\n")
    expected = [part.removesuffix(b"\r") for part in parts[:-1]] + [parts[-1]] * bool(parts[-1])

    def lines(splitter: LineSplitter[Any]) -> list[Any]:
        return [line for lines in line_blocks(io.BytesIO(data), splitter, block) for line in lines]

    assert lines(LineSplitter.raw("c")) == expected
    assert lines(LineSplitter.text("c", "latin-1", "strict", None)) == [
        line.decode("latin-1") for line in expected
    ]


def test_read_lines_other_encoding_and_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "c.txt", "zwölf\nélan\n".encode("utf-16"))
    assert list(read_lines(path, encoding="utf-16")) == ["zwölf", "élan"]
    bad = write(tmp_path / "bad.txt.gz", b"good\nbad \xff here\n")
    with pytest.raises(ChunkFormatError,
                       match=r"bad\.txt\.gz, line 2: not valid utf-8 text at byte 9"):
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


BOMB_READER = """
import resource, sys
from itertools import islice
from infinibatch_like.io import read_lines

def peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

lines = read_lines(sys.argv[1])
before = peak()
assert list(islice(lines, 1000)) == ["0" * 63] * 1000
print(peak() - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss is in KiB on Linux only")
@pytest.mark.parametrize("suffix", [".zst", ".gz"])
def test_decompression_bomb_is_read_in_bounded_memory(tmp_path: Path, suffix: str) -> None:
    """256 MiB of lines in a chunk of 25 KB (.zst) or 1.7 MB (.gz): reading the first lines
    costs a few MB, not the whole expansion."""
    path = tmp_path / f"bomb.txt{suffix}"
    piece = (b"0" * 63 + b"\n") * (1 << 14)  # 1 MiB
    with open_output(path) as out:
        for _ in range(256):
            out.write(piece)
    assert path.stat().st_size < 4 << 20  # a ratio above 64
    result = subprocess.run(
        [sys.executable, "-c", BOMB_READER, str(path)],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
    )
    grown = int(result.stdout)
    assert grown < 48 << 20, f"reading 1,000 lines of {suffix} grew the peak RSS by {grown:,} B"


def test_a_long_line_is_read_in_linear_time(tmp_path: Path) -> None:
    """A line of n blocks costs about n blocks' work, not n**2: a 16 MiB line of 256 blocks
    takes a few times as long as the same bytes as 1 KiB lines (best of 3 each, interleaved),
    where re-splitting the pending line at each block took 140 times as long."""
    size = 16 << 20
    long = write(tmp_path / "long.txt", b"x" * size + b"\n")
    short = write(tmp_path / "short.txt", (b"x" * 1023 + b"\n") * (size >> 10))
    times: dict[str, list[float]] = {long: [], short: []}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readers, "BLOCK_SIZE", 1 << 16)
        for _ in range(3):
            for path in times:
                started = time.perf_counter()
                assert sum(map(len, read_lines(path))) == size - (0 if path == long else size >> 10)
                times[path].append(time.perf_counter() - started)
    ratio = min(times[long]) / min(times[short])
    assert ratio < 12, f"a 16 MiB line took {ratio:.1f} times as long as 1 KiB lines"


@pytest.mark.parametrize("block", [1 << 22, 7])
def test_a_line_longer_than_the_limit_is_refused_naming_chunk_line_and_limit(
    tmp_path: Path, block: int
) -> None:
    data = b"short\n" + b"y" * 100 + b"\r\nafter\n" + b"z" * 101 + b"\nend"
    path = write(tmp_path / "long.txt.gz", data)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(readers, "BLOCK_SIZE", block)
        lines = read_lines(path, max_line_length=100)
        assert next(lines) == "short"
        assert next(lines) == "y" * 100  # at the limit: accepted
        assert next(lines) == "after"
        with pytest.raises(
            ChunkFormatError,
            match=r"long\.txt\.gz, line 4: longer than max_line_length=100 characters",
        ):
            next(lines)
        assert list(lines) == ["end"]  # the reader goes on after the long line
        assert list(read_lines(path, max_line_length=None))[3] == "z" * 101
    with pytest.raises(ValueError, match="read_lines: max_line_length must be >= 1, got 0"):
        read_lines(path, max_line_length=0)
    with pytest.raises(TypeError, match=r"read_jsonl: max_line_length must be an int, got 1\.5"):
        read_jsonl(path, max_line_length=1.5)  # type: ignore[arg-type]


def test_a_line_without_end_is_refused_once_it_passes_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file without line endings (e.g. binary data read by mistake) is refused after
    `max_line_length` characters, not after reading all of it into memory."""
    path = write(tmp_path / "blob.bin", b"a\n" + b"b" * 100_000)
    opened: list[Any] = []

    def recording_open_stream(ref: str, store: Store) -> Any:
        opened.append(open_stream(ref, store))
        return opened[-1]

    monkeypatch.setattr(readers, "BLOCK_SIZE", 64)
    monkeypatch.setattr(readers, "open_stream", recording_open_stream)
    lines = read_lines(path, max_line_length=300)
    assert next(lines) == "a"
    with pytest.raises(ChunkFormatError, match=r"blob\.bin, line 2: longer than "
                       r"max_line_length=300"):
        next(lines)
    assert opened[0].tell() <= 2 + 300 + 64
    assert list(lines) == []


BAD_BYTES = [  # (bytes from the block boundary, bytes with an error, index of the bad byte)
    (-1, b"\xff", 0),
    (0, b"\xff", 0),
    (1, b"\xff", 0),
    (-1, b"\xe2\x82x", 0),  # a sequence cut by the boundary, then not continued
    (-2, b"\xe2\x82x", 0),
    (-1, "\u20ac".encode() + b"\xff", 3),  # a valid sequence cut by the boundary, then a bad byte
    (-2, "\u20ac".encode() + b"\xff", 3),
]


@pytest.mark.parametrize("block", [None, 8])
@pytest.mark.parametrize(("shift", "bad", "index"), BAD_BYTES)
def test_invalid_text_is_named_at_its_exact_byte_and_line_around_block_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int | None, shift: int,
    bad: bytes, index: int,
) -> None:
    if block is not None:
        monkeypatch.setattr(readers, "BLOCK_SIZE", block)
    at = readers.BLOCK_SIZE + shift
    head = b"ab\n" * (at // 3) + b"a" * (at % 3)
    path = write(tmp_path / "bad.txt", head + bad + b" rest\nlast\n")
    lines = read_lines(path)
    assert list(islice(lines, at // 3)) == ["ab"] * (at // 3)  # every line before it
    with pytest.raises(
        ChunkFormatError,
        match=rf"bad\.txt, line {at // 3 + 1}: not valid utf-8 text at byte {at + index} of "
        r"its decompressed data \(invalid",
    ):
        next(lines)
    assert list(lines) == ["last"]  # and every line after it


def jsonl(rows: list[Any]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


BAD_RECORDS = {  # a line of each kind of bad record, and the start of its error
    "bad byte": (b'{"id": "\xff"}\n', "not valid utf-8 text at byte"),
    "not JSON": (b'{"id": \n', "not valid JSON"),
    "nested": (b"[" * 100_000 + b"]" * 100_000 + b"\n", "JSON nested too deeply to parse"),
}


@pytest.mark.parametrize("kind", list(BAD_RECORDS))
def test_read_jsonl_delivers_the_records_around_a_bad_one(tmp_path: Path, kind: str) -> None:
    line, cause = BAD_RECORDS[kind]
    rows = [{"id": i} for i in range(1101)]
    path = write(tmp_path / "bad.jsonl.gz", jsonl(rows[:1000]) + line + jsonl(rows[1000:]))
    records = read_jsonl(path)
    assert list(islice(records, 1000)) == rows[:1000]
    with pytest.raises(ChunkFormatError, match=rf"bad\.jsonl\.gz, line 1001: {cause}") as caught:
        next(records)
    message = str(caught.value)
    assert "on_error=SkipPolicy(" in message
    assert len(message) < 500
    assert list(records) == rows[1000:]


@pytest.mark.parametrize("read_ahead_chunks", [0, 1])
@pytest.mark.parametrize("kind", list(BAD_RECORDS))
def test_skip_policy_skips_only_the_bad_record_of_a_jsonl_chunk(
    tmp_path: Path, kind: str, read_ahead_chunks: int
) -> None:
    line, cause = BAD_RECORDS[kind]
    rows = [{"id": i} for i in range(1101)]
    refs = [
        write(tmp_path / "a.jsonl.zst", jsonl(rows[:1000]) + line + jsonl(rows[1000:1001])),
        write(tmp_path / "b.jsonl", jsonl(rows[1001:])),
    ]

    def build() -> Any:
        return chunked_dataset_iterator(
            refs, read_jsonl, 100, train=False, shuffle=False,
            read_ahead_chunks=read_ahead_chunks, on_error=SkipPolicy(max_skips=1),
        )

    pipeline = build()
    assert list(pipeline) == rows
    [ledger] = skip_ledgers(pipeline).values()
    assert (ledger.records, ledger.chunks) == (1, 0)
    [entry] = ledger.last
    assert (entry["chunk"], entry["position"], entry["error"]) == (
        repr(refs[0]), 1000, "ChunkFormatError"
    )
    assert f"line 1001: {cause}" in entry["message"]
    for point in (1000, 1001):  # restored before and after the bad record: skipped once
        first = build()
        head = list(islice(first, point))
        again = build()
        again.setstate(json.loads(json.dumps(first.getstate())))
        assert head + list(again) == rows
        assert skip_ledgers(again) == skip_ledgers(pipeline)


def test_zstd_data_cut_anywhere_is_refused_unless_cut_between_frames(tmp_path: Path) -> None:
    import zstandard

    texts = [b"ab\n" * 5000, bytes(random.Random(1).randrange(32, 127) for _ in range(300)),
             b"\n" * 200_000, b"last line\n"]
    frames = [
        zstandard.ZstdCompressor(write_checksum=True).compress(texts[0]),
        zstandard.ZstdCompressor(level=1, write_content_size=False).compress(texts[1]),
        (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"skip!",
        zstandard.ZstdCompressor(write_checksum=True, write_content_size=False).compress(texts[2]),
        zstandard.ZstdCompressor().compress(texts[3]),
    ]
    data = b"".join(frames)
    ends = {sum(map(len, frames[:i])): b"".join(texts[: i - (i > 2)]) for i in range(6)}
    path = tmp_path / "c.txt.zst"
    for cut in range(len(data) + 1):
        path.write_bytes(data[:cut])
        if cut in ends:
            with open_chunk(path) as stream:
                assert stream.read() == ends[cut]
        else:
            with pytest.raises(ChunkFormatError, match="corrupt or truncated zstd"), \
                    open_chunk(path) as stream:
                stream.read()
