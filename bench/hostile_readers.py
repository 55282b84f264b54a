"""Hostile chunks against the readers: decompression bombs, huge lines, bad bytes, deep JSON.

Each family is built at run time and read with `read_lines` / `read_jsonl`, as a pipeline's
``read_chunk_fn`` would; the table gives what it costs and what the reader answers:

- bombs: a chunk of each compression that expands to ``--bomb-mib`` MiB of 64-byte lines;
  the peak RSS growth of a fresh process reading its first 1,000 lines;
- long lines: one line of each of ``--line-mib`` MiB in a .gz chunk against the same bytes
  as 1 KiB lines (the ratio stays near 1 when splitting is linear), and a chunk without
  line endings, refused once a line passes `max_line_length`;
- bad bytes around the 4 MiB block boundary (the offset the error names against the true
  one), and a JSON line nested 100,000 deep (the error and the records around it).

    python bench/hostile_readers.py                        # about 2 minutes on 2 cores
    python bench/hostile_readers.py --bomb-mib 1024 --line-mib 16 64 256
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any

from _util import REPO_ROOT, print_table, write_result

from infinibatch_like.io import ChunkFormatError, open_output, read_jsonl, read_lines, readers

BOMB_READER = """
import resource, sys
from functools import partial
from itertools import islice
from infinibatch_like.io import read_lines
lines = read_lines(sys.argv[1])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert len(list(islice(lines, 1000))) == 1000
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
"""
MIB = 1 << 20


def write_repeated(path: Path, piece: bytes, total: int) -> int:
    """`piece` repeated up to `total` bytes into `path` (compressed by its suffix), streamed;
    the stored size."""
    with open_output(path) as out:
        for _ in range(total // len(piece)):
            out.write(piece)
    return path.stat().st_size


def bombs(root: Path, mib: int) -> list[list[Any]]:
    rows = []
    piece = (b"0" * 63 + b"\n") * (MIB // 64)
    for suffix in (".zst", ".gz", ".bz2", ".xz"):
        path = root / f"bomb.txt{suffix}"
        stored = write_repeated(path, piece, mib * MIB)
        started = time.perf_counter()
        grown_kib = int(subprocess.run(
            [sys.executable, "-c", BOMB_READER, str(path)], capture_output=True, text=True,
            check=True, env={"PYTHONPATH": str(REPO_ROOT)},
        ).stdout)
        rows.append([f"bomb {suffix}: {stored / 1e3:,.0f} KB -> {mib} MiB",
                     f"+{grown_kib / 1024:.1f} MB peak RSS", time.perf_counter() - started])
        path.unlink()
    return rows


def timed(function: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def characters(path: Path) -> int:
    return sum(map(len, read_lines(path, max_line_length=None)))


def long_lines(root: Path, sizes: list[int]) -> list[list[Any]]:
    rows = []
    for mib in sizes:
        one = root / "one.txt.gz"
        with open_output(one) as out:  # one line of `mib` MiB, then a short one
            for _ in range(mib):
                out.write(b"x" * MIB)
            out.write(b"\nend\n")
        short = root / "short.txt.gz"
        write_repeated(short, b"x" * 1023 + b"\n", mib * MIB)
        long_s, _ = timed(partial(characters, one))
        short_s, _ = timed(partial(characters, short))
        rows.append([f"one {mib} MiB line (.gz) vs 1 KiB lines", f"x{long_s / short_s:.2f}",
                     long_s])
    endless = root / "endless.bin.gz"
    write_repeated(endless, b"y" * MIB, 1024 * MIB)
    seconds, error = timed(lambda: _error_of(lambda: list(read_lines(endless))))
    rows.append(["1 GiB without line endings", _short(error), seconds])
    return rows


def bad_bytes(root: Path) -> list[list[Any]]:
    rows = []
    block = readers.BLOCK_SIZE
    for shift, bad, index in [(-1, b"\xff", 0), (0, b"\xff", 0), (1, b"\xff", 0),
                              (-1, b"\xe2\x82x", 0), (-1, "\u20ac".encode() + b"\xff", 3)]:
        at = block + shift
        path = root / "bad.jsonl"
        path.write_bytes(b"1\n" * (at // 2) + b" " * (at % 2) + bad + b"\n2\n")
        records = read_jsonl(path)
        before = len(list(islice(records, at // 2)))
        seconds, error = timed(lambda records=records: _error_of(lambda: next(records)))
        found = re.search(r"at byte (\d+)", error)
        offset = int(found[1]) - at if found else None
        rows.append([f"{bad!r} at block boundary {shift:+d}",
                     f"offset {offset:+} (true {index:+}); records: {before}/{at // 2} "
                     f"before, {list(records)} after", seconds])
    path = root / "deep.jsonl"
    path.write_bytes(b"1\n" * 7 + b"[" * 100_000 + b"]" * 100_000 + b"\n2\n")
    records = read_jsonl(path)
    before = list(islice(records, 7))
    seconds, error = timed(lambda: _error_of(lambda: next(records)))
    rows.append(["JSON nested 100,000 deep",
                 f"{_short(error)}; records: {len(before)}/7 before, {list(records)} after",
                 seconds])
    return rows


def _error_of(call: Any) -> str:
    try:
        call()
    except ChunkFormatError as error:
        return str(error)
    return "no error"


def _short(message: str) -> str:
    """`message` without the chunk's folder, the cause's details and the hint."""
    return message.rsplit("/", 1)[-1].split(";")[0].split(" (")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bomb-mib", type=int, default=256)
    parser.add_argument("--line-mib", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hostile-readers-") as scratch:
        root = Path(scratch)
        rows = bombs(root, args.bomb_mib) + long_lines(root, args.line_mib) + bad_bytes(root)
    print_table("hostile chunks against the readers", ["input", "outcome", "seconds"], rows)
    write_result("hostile_readers", {"rows": [[str(cell) for cell in row] for row in rows],
                                     "args": vars(args)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
