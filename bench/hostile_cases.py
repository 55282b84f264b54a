"""The attacks of `hostile_input.py`: one function per case, each run alone in a child process.

A case builds its hostile input in its scratch directory (its ``$TMPDIR``, a stand-in
for a shared ``/tmp``, is another directory), attacks one surface of the library, and
returns what happened when the library held (a clear error naming the cause, nothing lost,
nothing outside the target touched) or raises `Failed` saying what went wrong. Time and
memory are bounded by the runner (`Case.max_s`, `Case.max_mib`: the child's peak RSS).

    python bench/hostile_cases.py CASE SCRATCH   # one case; prints {"passed", "detail"}
"""

from __future__ import annotations

import functools
import json
import logging
import multiprocessing
import os
import resource
import stat
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/x.py` puts only bench/ on sys.path
    sys.path.insert(1, str(REPO_ROOT))

import infinibatch_like.iterators as it  # noqa: E402
from infinibatch_like import load_checkpoint, save_checkpoint  # noqa: E402
from infinibatch_like.io import list_chunks, open_output, read_jsonl, read_lines  # noqa: E402


class Failed(Exception):
    """The library did not hold: the message says how."""


@dataclass(frozen=True)
class Case:
    family: str
    name: str
    run: Callable[[Path], str]
    max_s: float = 30.0
    max_mib: float = 200.0
    """Peak RSS of the child process (``VmHWM``: the interpreter and its imports included;
    processes that it starts are not counted)."""


def expect_error(
    call: Callable[[], Any], kinds: tuple[type[BaseException], ...], *names: str
) -> str:
    """Run `call`; it must raise one of `kinds` whose message (notes included) holds every
    one of `names`. A RecursionError, KeyError or the like is a failure, not an answer."""
    try:
        call()
    except kinds as error:
        text = " ".join([str(error), *getattr(error, "__notes__", [])])
        missing = [name for name in names if name not in text]
        if missing:
            raise Failed(f"{type(error).__name__} does not name {missing}: {text[:300]}") from None
        return f"refused: {type(error).__name__}: {text[:160]}"
    except Exception as error:
        raise Failed(f"raised {type(error).__name__}: {str(error)[:300]}") from None
    raise Failed("accepted without an error")


def answered(
    call: Callable[[], Any], kinds: tuple[type[BaseException], ...], *names: str
) -> str | Failed:
    """`expect_error`'s answer, or its `Failed` (for a case that checks more after it)."""
    try:
        return expect_error(call, kinds, *names)
    except Failed as failure:
        return failure


def kind_of(path: Path) -> str:
    mode = path.lstat().st_mode
    for kind, test in (("FIFO", stat.S_ISFIFO), ("char device", stat.S_ISCHR)):
        if test(mode):
            return kind
    return "directory" if stat.S_ISDIR(mode) else "regular file"


def leftovers(directory: Path, expected: set[str]) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name not in expected)


# -- decompression bombs and huge lines ----------------------------------------------------

LINE = b"x" * 1023 + b"\n"
MIB = 1024 * 1024


def write_bomb(path: Path, mib: int) -> None:
    """`mib` MiB of 1 KiB lines, compressed from the suffix, written 1 MiB at a time."""
    block = LINE * 1024
    with open(path, "wb") as file:
        if path.suffix == ".zst":
            import zstandard

            writer = zstandard.ZstdCompressor(level=3).stream_writer(file)
            for _ in range(mib):
                writer.write(block)
            writer.close()
        else:
            compressor = zlib.compressobj(1, zlib.DEFLATED, 31)
            for _ in range(mib):
                file.write(compressor.compress(block))
            file.write(compressor.flush())


def bomb(suffix: str) -> Callable[[Path], str]:
    def run(scratch: Path) -> str:
        path = scratch / f"bomb.txt{suffix}"
        write_bomb(path, 1024)
        lines = list(islice(read_lines(str(path)), 1000))
        if lines != [LINE[:-1].decode()] * 1000:
            raise Failed("the first 1,000 lines are wrong")
        return f"first 1,000 lines of a 1 GiB {suffix} ({path.stat().st_size:,} B) read"

    return run


def huge_line(scratch: Path) -> str:
    """One 64 MiB line against the same bytes as 1 KiB lines: linear, within 3x."""
    size = 64 * MIB
    long_path, short_path = scratch / "long.txt.gz", scratch / "short.txt.gz"
    for path, data in ((long_path, b"y" * size + b"\n"), (short_path, LINE * (size // 1024))):
        compressor = zlib.compressobj(1, zlib.DEFLATED, 31)
        path.write_bytes(compressor.compress(data) + compressor.flush())
        del data
    timings = {}
    for path in (short_path, long_path):
        start = time.perf_counter()
        count = sum(1 for _ in read_lines(str(path)))
        timings[path.name] = time.perf_counter() - start, count
    (short_s, _), (long_s, count) = timings["short.txt.gz"], timings["long.txt.gz"]
    if count != 1:
        raise Failed(f"the 64 MiB line came out as {count} lines")
    if long_s > 3 * short_s + 0.5:
        raise Failed(f"one 64 MiB line took {long_s:.2f} s; as 1 KiB lines {short_s:.2f} s")
    return f"64 MiB line {long_s:.2f} s, as 1 KiB lines {short_s:.2f} s"


# -- symlink loops -------------------------------------------------------------------------


def symlink_loops(scratch: Path) -> str:
    root = scratch / "root"
    (root / "a").mkdir(parents=True)
    (root / "b" / "deeper").mkdir(parents=True)
    (root / "a" / "x.txt").write_text("x\n")
    (root / "b" / "y.txt").write_text("y\n")
    (root / "a" / "loop").symlink_to("..")
    (root / "b" / "deeper" / "loop").symlink_to("../..")
    refs = list_chunks(f"{root}/**/*.txt")
    expected = [str(root / "a" / "x.txt"), str(root / "b" / "y.txt")]
    if refs != expected:
        raise Failed(f"{len(refs)} refs for 2 files: {refs[:4]}...")
    return "2 refs for 2 files under two symlink loops"


def run_tool(*arguments: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "infinibatch_like", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def chunk_symlinked_input(scratch: Path) -> str:
    """A directory input holding a symlinked directory: its files are read, or the input
    is refused naming the link; never left out silently."""
    elsewhere = scratch / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "two.txt").write_text("two")
    inputs = scratch / "inputs"
    inputs.mkdir()
    (inputs / "one.txt").write_text("one")
    (inputs / "linked").symlink_to(elsewhere)
    done = run_tool("chunk", str(inputs), "--out", str(scratch / "out"), "--items-per-chunk",
                    "10", "--workers", "1", "--quiet")
    if done.returncode != 0:
        if "linked" not in done.stderr or "Traceback" in done.stderr:
            raise Failed(f"refused without naming the link: {done.stderr[-300:]}")
        return f"refused: {done.stderr.strip()[-160:]}"
    from infinibatch_like.prepare import load_index

    items = sum(chunk.items for chunk in load_index(str(scratch / "out")).chunks)
    if items != 2:
        raise Failed(f"{items} of the 2 files chunked: the symlinked directory was left out")
    return "both files chunked"


# -- concurrent jobs -----------------------------------------------------------------------


def two_chunk_jobs(scratch: Path) -> str:
    """Two jobs with different options started together on one output, 8 times over: the
    race (both jobs checking the output before either claims it) is not met every time."""
    source = scratch / "in.txt"
    source.write_text("".join(f"line {i}\n" for i in range(20_000)))
    details = [_two_chunk_jobs(source, scratch / f"out-{round}") for round in range(8)]
    return details[-1]


def _two_chunk_jobs(source: Path, out: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "infinibatch_like", "chunk", str(source), "--out", str(out),
             "--items-per-chunk", size, "--workers", "1", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for size in ("100", "70")
    ]
    results = [(job.wait(120), job.communicate()[1]) for job in jobs]
    codes = [code for code, _ in results]
    if codes.count(0) != 1:
        raise Failed(f"exit codes {codes}: one job must own the output, the other be refused")
    refused = next(err for code, err in results if code != 0)
    if "Traceback" in refused or str(out) not in refused:
        raise Failed(f"the refused job does not name the output: {refused[-300:]}")
    verify = run_tool("verify", str(out))
    if verify.returncode != 0:
        raise Failed(f"verify after the two jobs: {verify.stdout[-300:]}{verify.stderr[-300:]}")
    return f"one job refused ({refused.strip()[-120:]}); verify clean"


def _save_many(pattern: str, parity: int, errors: Any) -> None:
    for step in range(parity, 400, 2):
        try:
            save_checkpoint(pattern, {"step": step}, step=step, keep=2)
        except Exception as error:
            errors.put(f"step {step}: {type(error).__name__}: {error}")


def two_savers(scratch: Path) -> str:
    """Two processes saving with keep=2 to one pattern (even and odd steps)."""
    pattern = str(scratch / "ckpt" / "ckpt-{step}.json")
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    savers = [context.Process(target=_save_many, args=(pattern, p, errors)) for p in (0, 1)]
    for saver in savers:
        saver.start()
    for saver in savers:
        saver.join(120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        raise Failed(f"{len(failures)} of 400 saves failed, e.g. {failures[0]}")
    names = sorted(os.listdir(scratch / "ckpt"))
    stray = [name for name in names if not name.endswith(".json")]
    if stray:
        raise Failed(f"left behind: {stray}")
    if load_checkpoint(pattern) != {"step": 399}:
        raise Failed(f"the latest checkpoint is not step 399: {names}")
    return f"400 saves, no error; {len(names)} files left: {names}"


def literal_brackets_keep(scratch: Path) -> str:
    directory = scratch / "exp[1]"
    pattern = str(directory / "data-{step}.json")
    for step in range(5):
        save_checkpoint(pattern, {"step": step}, step=step, keep=2)
    names = sorted(os.listdir(directory))
    if names != ["data-3.json", "data-4.json"]:
        raise Failed(f"keep=2 under 'exp[1]' left {names}")
    if load_checkpoint(pattern) != {"step": 4}:
        raise Failed("load_checkpoint did not find step 4")
    return "2 files kept, the latest loaded"


# -- full disk (RLIMIT_FSIZE) --------------------------------------------------------------


def limited_file_size(limit: int) -> Any:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    return functools.partial(resource.setrlimit, resource.RLIMIT_FSIZE, (soft, hard))


def full_disk_save(scratch: Path) -> str:
    target = scratch / "ckpt.json"
    save_checkpoint(str(target), {"small": 1})
    before = target.read_bytes()
    restore = limited_file_size(64 * 1024)
    try:
        answer = answered(
            lambda: save_checkpoint(str(target), {"big": "z" * MIB}), (OSError,), "ckpt.json"
        )
    finally:
        restore()
    problems = [] if isinstance(answer, str) else [str(answer)]
    if target.read_bytes() != before:
        problems.append("the previous checkpoint was changed")
    left = leftovers(scratch, {"ckpt.json"})
    if left:
        problems.append(f"left behind after the failed save: {left}")
    if problems:
        raise Failed("; ".join(problems))
    return str(answer)


def full_disk_output(scratch: Path) -> str:
    target = scratch / "out" / "part.txt"

    def write() -> None:
        with open_output(str(target)) as file:
            file.write(b"z" * MIB)

    restore = limited_file_size(64 * 1024)
    try:
        answer = answered(write, (OSError,), "part.txt")
    finally:
        restore()
    problems = [] if isinstance(answer, str) else [str(answer)]
    left = leftovers(target.parent, set()) if target.parent.exists() else []
    if left:
        problems.append(f"left behind after the failed write: {left}")
    if problems:
        raise Failed("; ".join(problems))
    return str(answer)


# -- special files as targets --------------------------------------------------------------


def special_target(kind: str, writer: str) -> Callable[[Path], str]:
    def run(scratch: Path) -> str:
        target = scratch / "target"
        if kind == "FIFO":
            os.mkfifo(target)
        else:  # a copy of /dev/null's device node (root only)
            os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))

        def write() -> None:
            if writer == "save_checkpoint":
                save_checkpoint(str(target), {"a": 1})
            else:
                with open_output(str(target)) as file:
                    file.write(b"data")

        detail = expect_error(write, (OSError, ValueError), str(target))
        if kind_of(target) != kind:
            raise Failed(f"the {kind} was replaced by a {kind_of(target)}")
        return detail

    return run


def can_make_devices() -> bool:
    return os.geteuid() == 0


# -- deep JSON -----------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def deep_checkpoint(scratch: Path) -> str:
    path = scratch / "deep.json"
    path.write_text(DEEP)
    return expect_error(lambda: load_checkpoint(str(path)), (ValueError,), "deep.json")


def deep_jsonl(scratch: Path) -> str:
    path = scratch / "deep.jsonl"
    path.write_text("".join(f'{{"n": {i}}}\n' for i in range(7)) + DEEP + "\n")
    records: list[Any] = []
    from infinibatch_like.io import ChunkFormatError

    detail = expect_error(lambda: records.extend(read_jsonl(str(path))), (ChunkFormatError,),
                          "deep.jsonl", "8")
    if records != [{"n": i} for i in range(7)]:
        raise Failed(f"{len(records)} of the 7 records before the deep line were delivered")
    return detail


def deep_inspect(scratch: Path) -> str:
    path = scratch / "deep.json"
    path.write_text(DEEP)
    done = run_tool("inspect", str(path))
    if done.returncode == 0 or "Traceback" in done.stderr or "deep.json" not in done.stderr:
        raise Failed(f"inspect exit {done.returncode}: {done.stderr[-300:]}")
    return f"refused: {done.stderr.strip()[-160:]}"


# -- planted files in a shared TMPDIR ------------------------------------------------------


def wait_for(gate: Path, item: int) -> int:
    while item == 2 and not gate.exists():
        time.sleep(0.01)
    return item


def planted_stack_files(scratch: Path) -> str:
    """A directory and a symlink planted at the names a watchdog's workers could use."""
    from infinibatch_like.background.lifecycle import worker_pids
    from infinibatch_like.background.watchdog import Watchdog

    gate, victim = scratch / "gate", scratch / "victim.txt"
    victim.write_text("keep")
    shared = Path(os.environ["TMPDIR"])
    reports: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reports.append(record.getMessage())
            if len(reports) == 3:
                gate.touch()

    source = it.MapIterator(it.NativeCheckpointableIterator([1, 2, 3]),
                            functools.partial(wait_for, gate))
    prefetched = it.PrefetchIterator(source, 4)
    next(prefetched)
    (pid,) = worker_pids()
    (shared / f"infinibatch_like-stacks-{pid}.txt").mkdir()
    (shared / f"{pid}.txt").symlink_to(victim)
    logging.getLogger("infinibatch_like").addHandler(Count(logging.WARNING))
    deadline = threading.Timer(15, gate.touch)  # no reports: the case fails, never hangs
    deadline.daemon = True
    deadline.start()
    with Watchdog(prefetched, timeout_s=0.3) as watched:
        rest = list(watched)
    deadline.cancel()
    for planted in shared.iterdir():
        planted.unlink() if planted.is_symlink() else planted.rmdir()
    if rest != [2, 3] or len(reports) < 3:
        raise Failed(f"{len(reports)} stall reports instead of 3")
    if not all(f"Worker process {pid}:\n" in report for report in reports):
        raise Failed("a report lacks the worker's stacks")
    if victim.read_text() != "keep":
        raise Failed("the symlink's target was written")
    return "3 stall reports with the worker's stacks"


# -- huge arguments ------------------------------------------------------------------------


def retry_many_resets(scratch: Path) -> str:
    from infinibatch_like.io import RetryPolicy
    from infinibatch_like.io.retry import call_with_retries

    logging.getLogger("infinibatch_like.io").setLevel(logging.ERROR)
    failures = iter(range(1100))

    def action() -> str:
        if next(failures, None) is not None:
            raise ConnectionResetError("reset")
        return "done"

    policy = RetryPolicy(tries=10**9, first_delay=0, max_delay=0)
    if call_with_retries(action, "s3://b/k", "reading", policy) != "done":
        raise Failed("no result")
    wide = RetryPolicy(tries=3, first_delay=0.1, max_delay=2.0)
    waits = [wide.delay(n) for n in (1100, 10**30)]
    if not all(1.0 <= wait <= 2.0 for wait in waits):
        raise Failed(f"waits {waits} outside [1, 2]")
    return "1,100 resets retried; delay(10**30) capped"


def _shard(shard: int, num_shards: int) -> it.CheckpointableIterator[int]:
    return it.NativeCheckpointableIterator(list(range(shard, 80, num_shards)))


def resize_huge(arguments: dict[str, int]) -> Callable[[Path], str]:
    def run(scratch: Path) -> str:
        from torchdata.stateful_dataloader import StatefulDataLoader

        from infinibatch_like.distributed.sharded import ShardedIterator
        from infinibatch_like.torch import CheckpointableDataset, resize_loader_state

        dataset = CheckpointableDataset(functools.partial(ShardedIterator, _shard, 8))
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0)
        list(islice(iter(loader), 3))
        state = loader.state_dict()
        start = time.perf_counter()
        detail = expect_error(lambda: resize_loader_state(state, **arguments), (ValueError,),
                              "readers", "8 shards")
        if time.perf_counter() - start > 2:
            raise Failed(f"refused after {time.perf_counter() - start:.1f} s")
        return detail

    return run


# -- worker processes ----------------------------------------------------------------------


def lock_at_5(x: int) -> Any:
    return threading.Lock() if x == 5 else x


def unpicklable_output(method: str) -> Callable[[Path], str]:
    def run(scratch: Path) -> str:
        got: list[Any] = []
        source = it.NativeCheckpointableIterator(list(range(12)))
        with it.ParallelMapIterator(source, lock_at_5, 2, 2, start_method=method) as pipeline:
            detail = expect_error(lambda: got.extend(pipeline), (TypeError,), "item 5")
            state = pipeline.getstate()
        if got != [0, 1, 2, 3, 4] or state["replay"] != 5:
            raise Failed(f"delivered {got}, the state points at {state['replay']}")
        return detail

    return run


CASES = [
    Case("decompression bomb", "zst-1GiB", bomb(".zst"), 30, 250),
    Case("decompression bomb", "gz-1GiB", bomb(".gz"), 30, 250),
    Case("huge line", "gz-64MiB-line", huge_line, 60, 600),
    Case("symlink loop", "list_chunks-two-loops", symlink_loops, 10),
    Case("symlink loop", "chunk-symlinked-input-dir", chunk_symlinked_input, 60),
    Case("concurrent jobs", "two-chunk-runs-one-output", two_chunk_jobs, 120),
    Case("concurrent jobs", "two-savers-keep-2", two_savers, 120),
    Case("concurrent jobs", "keep-2-literal-brackets", literal_brackets_keep, 10),
    Case("full disk", "save_checkpoint-RLIMIT_FSIZE", full_disk_save, 10),
    Case("full disk", "open_output-RLIMIT_FSIZE", full_disk_output, 10),
    Case("special file", "save_checkpoint-FIFO", special_target("FIFO", "save_checkpoint"), 10),
    Case("special file", "open_output-FIFO", special_target("FIFO", "open_output"), 10),
    Case("special file", "save_checkpoint-char-device",
         special_target("char device", "save_checkpoint"), 10),
    Case("deep JSON", "load_checkpoint-100k-deep", deep_checkpoint, 10),
    Case("deep JSON", "read_jsonl-100k-deep-line", deep_jsonl, 10),
    Case("deep JSON", "inspect-100k-deep", deep_inspect, 30),
    Case("planted TMPDIR", "watchdog-stack-files", planted_stack_files, 30),
    Case("huge argument", "RetryPolicy-1100-resets", retry_many_resets, 10),
    Case("huge argument", "resize-num_workers-1e9", resize_huge({"num_workers": 10**9}), 60, 800),
    Case("huge argument", "resize-world_size-1e9",
         resize_huge({"num_workers": 0, "world_size": 10**9}), 60, 800),
    Case("worker process", "unpicklable-output-fork", unpicklable_output("fork"), 30),
    Case("worker process", "unpicklable-output-spawn", unpicklable_output("spawn"), 60),
]
BY_NAME = {case.name: case for case in CASES}


def main() -> None:
    name, scratch = sys.argv[1], Path(sys.argv[2])
    case = BY_NAME[name]
    if case.name.endswith("char-device") and not can_make_devices():
        print(json.dumps({"passed": True, "detail": "skipped: needs root to make a device"}))
        return
    try:
        detail, passed = case.run(scratch), True
    except Failed as failure:
        detail, passed = str(failure), False
    print(json.dumps({"passed": passed, "detail": detail, "peak_mib": peak_mib(os.getpid())}))


def peak_mib(pid: int) -> float:
    """The peak RSS of process `pid` so far (``VmHWM``, Linux), in MiB; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


if __name__ == "__main__":
    main()
