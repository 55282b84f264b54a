"""Fault injection: kill the training loop of `fault_loop.py`, restart it, compare streams.

A campaign runs the loop with one configuration (start method, prefetch mode, nesting of
the background stages), kills it `kills` times with one kind of fault, restarting it from
its last checkpoint each time, then lets it finish. Its consumed log is compared with an
uninterrupted run's: items lost, items duplicated, order. After every run the harness
checks that no process of the run (found by an environment marker that children
inherit), no /dev/shm entry that its processes mapped (resource tracker reports of leaked
semaphores or segments included) and, for runs that finish, no file descriptor, thread or
child process of the loop outlives it; a run that does not end within its deadline is a
stall (and is killed). Linux only (/proc).

Faults: SIGKILL of the loop; SIGKILL of one of its worker processes (the loop then gets
a WorkerError and dies of it); SIGTERM (the loop's handler stops it: a preemption);
SIGINT (KeyboardInterrupt); a torn checkpoint (SIGKILL of the loop, then the newest of
its two checkpoint files cut in half, as a crash of the file system may leave it: the
restart resumes from the older one); a disk that fills up at a checkpoint save
(``RLIMIT_FSIZE``: the save must fail with an error naming the checkpoint file, leave no
temporary file and keep the previous checkpoints). Half the kills land at a random step
after the last checkpoint, half at a random time in the first second (worker start-up,
restore); the disk fills at a random step after the last checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _proc import command_of, parent_of

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
LOOP = BENCH_DIR / "fault_loop.py"
MARKER = "FAULT_INJECTION_RUN"
DISK_FULL = "disk full at save"
KINDS = ("loop SIGKILL", "worker SIGKILL", "SIGTERM", "SIGINT", "torn checkpoint", DISK_FULL)
RUN_FILES = ("consumed.log", "stderr.txt", "finished.json", "singletons-started")
"""What a run may leave in its directory, besides its checkpoints (``ckpt-N.json``)."""
GRACE_S = 8.0
"""How long the processes of a run may take to go after the loop has exited (seconds)."""
_SIGNALS = {
    "loop SIGKILL": signal.SIGKILL,
    "SIGTERM": signal.SIGTERM,
    "SIGINT": signal.SIGINT,
    "torn checkpoint": signal.SIGKILL,  # then the newest checkpoint file loses its tail
}
_SINGLETONS = ("resource_tracker", "forkserver")


@dataclass(frozen=True)
class Config:
    """How the loop's pipeline runs its background stages."""

    start_method: str = "fork"
    prefetch_mode: str = "process"
    nesting: str = "flat"
    arrays: bool = False
    """Items carry a numpy array that worker processes send through shared memory."""

    @property
    def layout(self) -> str:
        arrays = " (+arrays)" if self.arrays else ""
        if self.nesting == "flat":
            return f"prefetch({self.prefetch_mode}) -> map{arrays}"
        return f"map inside prefetch({self.prefetch_mode}){arrays}"


@dataclass
class Outcome:
    """What one campaign found."""

    config: Config
    kind: str
    runs: int = 0
    kills: int = 0
    """Runs that the fault ended (a worker killed after it produced all that the run
    needed does not end it)."""
    lost: int = 0
    duplicated: int = 0
    same_order: bool = True
    stalls: int = 0
    leaks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (
            not self.lost
            and not self.duplicated
            and self.same_order
            and not self.stalls
            and not self.leaks
            and not self.failures
        )


def make_corpus(directory: Path) -> Path:
    """Two small gzip-chunked data sets of unique lines of 0.2 to 1.4 kB (large enough that
    the pipes between the processes hold only a few dozen of them, so that a killed worker
    is missed before the run ends)."""
    for name, chunks in (("a", 6), ("b", 4)):
        (directory / name).mkdir(parents=True, exist_ok=True)
        for chunk in range(chunks):
            lines = [
                f"{name}{chunk}-{i} " + "w" * (200 + (i * 37 + chunk * 11) % 1200)
                for i in range(50)
            ]
            with gzip.open(directory / name / f"chunk-{chunk}.txt.gz", "wt") as file:
                file.write("\n".join(lines) + "\n")
    return directory


@dataclass
class Campaign:
    """The loop's arguments and where it runs."""

    workdir: Path
    corpus: Path
    config: Config
    batches: int = 60
    every: int = 7
    deadline_s: float = 60.0

    def command(self) -> list[str]:
        return [
            sys.executable,
            str(LOOP),
            str(self.workdir),
            str(self.corpus),
            f"--batches={self.batches}",
            f"--every={self.every}",
            f"--start-method={self.config.start_method}",
            f"--prefetch-mode={self.config.prefetch_mode}",
            f"--nesting={self.config.nesting}",
            *(["--arrays"] if self.config.arrays else []),
        ]

    def consumed(self) -> list[str]:
        return (self.workdir / "consumed.log").read_text().splitlines()

    def checkpointed_step(self) -> int:
        steps = [int(p.stem.split("-")[1]) for p in self.workdir.glob("ckpt-*.json")]
        return max(steps, default=0)


@dataclass
class Kill:
    kind: str
    at_step: int | None = None
    at_time: float | None = None

    def arguments(self) -> list[str]:
        """The loop's arguments that deliver this fault (a full disk is set up by the loop)."""
        return [f"--disk-full-at={self.at_step}"] if self.kind == DISK_FULL else []


@dataclass
class RunResult:
    returncode: int | None
    killed: bool
    stalled: bool
    leaks: list[str]
    stderr: str
    failures: list[str] = field(default_factory=list)


def run_once(campaign: Campaign, kill: Kill | None) -> RunResult:
    """Run the loop once, deliver `kill` when it is due, check what the run leaves."""
    campaign.workdir.mkdir(parents=True, exist_ok=True)
    for leftover in ("finished.json", "singletons-started"):
        (campaign.workdir / leftover).unlink(missing_ok=True)
    token = uuid.uuid4().hex
    env = {**os.environ, MARKER: token, "PYTHONPATH": str(REPO_ROOT)}
    shm_used: set[str] = set()
    err_path = campaign.workdir / "stderr.txt"
    with open(err_path, "wb") as err:
        process = subprocess.Popen(
            campaign.command() + (kill.arguments() if kill is not None else []),
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=_default_sigint,
        )
    started = time.monotonic()
    killed = kill is not None and kill.kind == DISK_FULL  # armed from the start
    stalled = False
    polls = 0
    while process.poll() is None:
        elapsed = time.monotonic() - started
        polls += 1
        if polls % 10 == 0:
            shm_used |= _shm_mapped(_marked_processes(token))
        if elapsed > campaign.deadline_s:
            stalled = True
            process.kill()
            process.wait()
            break
        if kill is not None and not killed and _due(kill, campaign, elapsed):
            killed = _deliver(kill, process.pid, token, campaign.workdir)
        time.sleep(0.01)
    if killed and kill is not None and kill.kind == "torn checkpoint":
        _tear_newest_checkpoint(campaign)
    leaks = _leftover_processes(token) + _shm_left(shm_used)
    stderr = err_path.read_text()
    if "leaked" in stderr:  # multiprocessing's resource tracker found unreleased resources
        leaks.append(f"the resource tracker reports leaks: {stderr[stderr.index('leaked') - 80 :]}")
    if process.returncode == 0:
        leaks += _loop_leaks(campaign.workdir / "finished.json")
    failures = []
    if kill is not None and kill.kind == DISK_FULL and process.returncode != 0:
        leaks += _files_left(campaign.workdir)
        failures += _disk_full_error(stderr)
    return RunResult(process.returncode, killed, stalled, leaks, stderr, failures)


def _files_left(workdir: Path) -> list[str]:
    """Files in the run's directory other than its own and its checkpoints."""
    left = [
        name
        for name in sorted(os.listdir(workdir))
        if name not in RUN_FILES and not (name.startswith("ckpt-") and name.endswith(".json"))
    ]
    return [f"left in the run's directory after the failed save: {left}"] if left else []


def _disk_full_error(stderr: str) -> list[str]:
    """What is wrong with the error of a run whose disk filled up at a save."""
    lines = [line for line in stderr.splitlines() if "File too large" in line]
    if not lines:
        return [f"the run did not fail of the full disk:\n{stderr[-1500:]}"]
    if not any("ckpt-" in line for line in lines):
        return [f"the full-disk error does not name the checkpoint file: {lines[-1]}"]
    return []


def _tear_newest_checkpoint(campaign: Campaign) -> None:
    """Cut the newest checkpoint file in half, as a crash of the file system may, when an
    older one is kept (the restart must then resume from that one, with a warning)."""
    files = sorted(campaign.workdir.glob("ckpt-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    if len(files) >= 2:
        files[-1].write_bytes(files[-1].read_bytes()[: files[-1].stat().st_size // 2])


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C acts as in a terminal, even when this harness runs
    as a background job of a shell (which starts it ignoring SIGINT, a disposition that
    exec keeps and Python then keeps too)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _due(kill: Kill, campaign: Campaign, elapsed: float) -> bool:
    if kill.at_time is not None:
        return elapsed >= kill.at_time
    assert kill.at_step is not None
    log = campaign.workdir / "consumed.log"
    try:
        return log.read_bytes().count(b"\n") >= kill.at_step
    except FileNotFoundError:
        return False


def _deliver(kill: Kill, pid: int, token: str, workdir: Path) -> bool:
    if kill.kind != "worker SIGKILL":
        os.kill(pid, _SIGNALS[kill.kind])
        return True
    if not (workdir / "singletons-started").exists():
        return False  # a child now may be the resource tracker between its fork and exec
    workers = [p for p in _marked_processes(token) if p != pid and not _is_singleton(p, pid)]
    if not workers:
        return False  # not started yet: try again at the next poll
    try:
        os.kill(random.choice(workers), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _marked_processes(token: str) -> list[int]:
    needle = f"{MARKER}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as file:
                    if needle in file.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _is_singleton(pid: int, loop: int) -> bool:
    """Whether `pid` is one of multiprocessing's own helpers started by the loop (the
    fork server's workers are its children and share its command line)."""
    command = command_of(pid, 1000)
    return parent_of(pid) == loop and any(name in command for name in _SINGLETONS)


def _leftover_processes(token: str, grace: float = GRACE_S) -> list[str]:
    deadline = time.monotonic() + grace
    while (left := [p for p in _marked_processes(token) if not _is_zombie(p)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    leaks = []
    for pid in left:
        leaks.append(f"process {pid} ({command_of(pid)}) outlived its run by {grace} s")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return leaks


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _shm_mapped(pids: Sequence[int]) -> set[str]:
    """The /dev/shm entries (shared memory, named semaphores) that `pids` have mapped."""
    used = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as file:
                used.update(line.split()[-1] for line in file if "/dev/shm/" in line)
        except OSError:
            continue
    return {path.removesuffix(" (deleted)") for path in used}


def _shm_left(used: set[str]) -> list[str]:
    """Entries that processes of the run mapped and that still exist after it.

    Only what the run's own processes were seen mapping (sampled every 0.1 s) counts:
    other programs on the machine create and remove entries of their own meanwhile.
    """
    return [
        f"{path} used by the run and not removed" for path in sorted(used) if os.path.exists(path)
    ]


def _segments_of(pids: set[int]) -> list[str]:
    """The library's shared-memory segments in /dev/shm that processes `pids` created
    (their names start with ``ibl_<pid>_``), whether or not anyone mapped them."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return [
        f"/dev/shm/{name} created by process {name.split('_')[1]} of the run and not removed"
        for name in sorted(names)
        if name.startswith("ibl_") and name.split("_")[1] in {str(pid) for pid in pids}
    ]


def _loop_leaks(finished: Path) -> list[str]:
    """File descriptors, threads and children the loop still had after closing its pipeline.

    Children are told apart by pid alone: a helper started just before the first snapshot
    (the resource tracker) may still show its parent's command line there, before its exec.
    """
    if not finished.exists():
        return ["the loop exited 0 without writing finished.json"]
    report = json.loads(finished.read_text())
    before, after = report["before"], report["after"]
    leaks = [
        f"the loop's {what} after close(): {sorted(set(after[what]) - set(before[what]))} "
        "were not there before the pipeline was built"
        for what in ("fds", "threads")
        if set(after[what]) - set(before[what])
    ]
    pids_before = {child.split(" ", 1)[0] for child in before["children"]}
    new_children = [
        child for child in after["children"] if child.split(" ", 1)[0] not in pids_before
    ]
    if new_children:
        leaks.append(
            f"the loop's children after close(): {sorted(new_children)} "
            "were not there before the pipeline was built"
        )
    return leaks


def compare(reference: Sequence[str], got: Sequence[str]) -> tuple[int, int, bool]:
    """(items lost, items duplicated, same order) of the consumed batches `got`."""
    expected = collections.Counter(_items(reference))
    received = collections.Counter(_items(got))
    lost = sum((expected - received).values())
    duplicated = sum((received - expected).values())
    return lost, duplicated, list(got) == list(reference)


def _items(batches: Sequence[str]) -> list[str]:
    return [json.dumps(item) for line in batches for item in json.loads(line)]


def reference_stream(campaign: Campaign) -> list[str]:
    """The batches of an uninterrupted run (which must also be clean)."""
    result = run_once(campaign, None)
    if result.returncode != 0 or result.leaks or result.stalled:
        raise RuntimeError(
            f"the uninterrupted run failed: returncode {result.returncode}, leaks "
            f"{result.leaks}, stalled {result.stalled}\n{result.stderr[-3000:]}"
        )
    return campaign.consumed()


def run_campaign(
    campaign: Campaign,
    kind: str,
    kills: int,
    reference: Sequence[str],
    rng: random.Random,
    timed: bool = True,
) -> Outcome:
    """Kill the loop `kills` times with `kind`, restarting it each time; compare its log.

    With `timed`, half the kills land at a random time after the start (start-up
    included), which on a fast machine may come after the loop finished: then fewer kills
    land. Without it every kill lands at a step, so that all of them land."""
    outcome = Outcome(campaign.config, kind)
    attempts = 0
    while outcome.kills < kills and attempts < 3 * kills:
        attempts += 1
        kill = _plan(kind, campaign, rng, timed)
        result = run_once(campaign, kill)
        _record(outcome, result)
        if result.returncode == 0:
            break  # it finished before the kill was due
    if not (campaign.workdir / "finished.json").exists():
        result = run_once(campaign, None)
        _record(outcome, result)
        if result.returncode != 0:
            outcome.failures.append(
                f"the last run exited with {result.returncode}:\n{result.stderr[-3000:]}"
            )
    outcome.lost, outcome.duplicated, outcome.same_order = compare(reference, campaign.consumed())
    return outcome


LAST_KILL_BEFORE_END = 25
"""Kills land at least this many batches before the end: the pipeline's buffers hold up to
about 20 batches, so a worker killed later may not be missed before the run ends."""


def _plan(kind: str, campaign: Campaign, rng: random.Random, timed: bool) -> Kill:
    if timed and kind != DISK_FULL and rng.random() < 0.5:
        return Kill(kind, at_time=rng.uniform(0.05, 1.0))
    step = campaign.checkpointed_step() + rng.randint(1, 2 * campaign.every)
    return Kill(kind, at_step=min(campaign.batches - LAST_KILL_BEFORE_END, step))


def _record(outcome: Outcome, result: RunResult) -> None:
    outcome.runs += 1
    outcome.failures += result.failures
    interrupted = result.killed and result.returncode != 0
    outcome.kills += interrupted
    outcome.stalls += result.stalled
    outcome.leaks += result.leaks
    if result.killed and not interrupted and outcome.kind != "worker SIGKILL":
        # a worker may die after producing all that the run needs; the loop may not
        outcome.failures.append(f"the loop finished despite {outcome.kind}")


# -- fan-out: a consumer process, the owner, or both SIGKILLed and restarted ---------------

FANOUT_LOOP = BENCH_DIR / "fault_fanout_loop.py"
FANOUT_KIND = "fan-out consumer SIGKILL"
FANOUT_OWNER_KIND = "fan-out owner SIGKILL"
FANOUT_BOTH_KIND = "fan-out owner+consumer SIGKILL"
FANOUT_KINDS = (FANOUT_KIND, FANOUT_OWNER_KIND, FANOUT_BOTH_KIND)
FANOUT_LAST_KILL_BEFORE_END = 12
"""Kills land at least this many batches before the victim's end, so that no consumer
(at most ``max_lag`` plus a prefetch ahead of the others) has finished: a consumer that
finished does not attach to a restarted owner."""
TRACKER_CLEANUP = "leaked shared_memory objects to clean up at shutdown"
"""What the resource tracker of an owner killed with SIGKILL says as it unlinks the
segments that the owner registered with it (and nobody else could unlink)."""


@dataclass
class FanOutCampaign:
    """An owner serving the loop's pipeline (`fault_fanout_loop.py`) to `consumers`
    consumer processes, each training on `batches` batches; consumer `victim` is the one
    killed (kind `FANOUT_KIND` or `FANOUT_BOTH_KIND`), and the one whose progress decides
    when a kill lands."""

    workdir: Path
    corpus: Path
    config: Config
    consumers: int = 2
    victim: int = 1
    batches: int = 60
    every: int = 7
    deadline_s: float = 90.0

    def owner_command(self) -> list[str]:
        return [
            *(sys.executable, str(FANOUT_LOOP), "owner", str(self.workdir), str(self.corpus)),
            f"--consumers={self.consumers}",
            f"--start-method={self.config.start_method}",
            f"--prefetch-mode={self.config.prefetch_mode}",
            f"--nesting={self.config.nesting}",
            *(["--arrays"] if self.config.arrays else []),
        ]

    def consumer_command(self, index: int) -> list[str]:
        return [
            *(sys.executable, str(FANOUT_LOOP), "consumer", str(self.workdir), str(index)),
            f"--batches={self.batches}",
            f"--every={self.every}",
        ]

    def consumed(self, index: int) -> list[str]:
        return (self.workdir / f"consumer-{index}" / "consumed.log").read_text().splitlines()

    def lines(self, index: int) -> int:
        try:
            return len(self.consumed(index))
        except FileNotFoundError:
            return 0

    def attaches(self, index: int) -> int:
        """How many times consumer `index` attached to an owner."""
        try:
            return (self.workdir / f"consumer-{index}" / "attached.log").read_text().count("\n")
        except FileNotFoundError:
            return 0

    def checkpointed_step(self, index: int) -> int:
        files = (self.workdir / f"consumer-{index}").glob("ckpt-*.json")
        return max((int(p.stem.split("-")[1]) for p in files), default=0)


def run_fanout_campaign(
    campaign: FanOutCampaign,
    kills: int,
    reference: Sequence[str],
    rng: random.Random,
    kind: str = FANOUT_KIND,
) -> Outcome:
    """Start the owner and the consumers, SIGKILL the victim consumer, the owner, or both
    (`kind`) `kills` times, each at a step of the victim after its last checkpoint, and
    restart what was killed: a consumer restores its own latest checkpoint; consumers
    whose owner died re-attach to the restarted owner and restore theirs
    (`fault_fanout_loop.py`). Then compare every consumer's consumed log with
    `reference` (the uninterrupted loop's batches) and look for processes and /dev/shm
    entries left behind (those its processes were seen mapping, and any segment named
    after one of them) and for anything a resource tracker reports (leaks it cleaned
    up, names it could not unlink), except the cleanup that the tracker of a killed
    owner reports (`TRACKER_CLEANUP`: the segments it registered, that only it unlinks)."""
    if kind not in FANOUT_KINDS:
        raise ValueError(f"run_fanout_campaign: kind must be one of {FANOUT_KINDS}, got {kind!r}")
    campaign.workdir.mkdir(parents=True, exist_ok=True)
    outcome = Outcome(campaign.config, kind)
    token = uuid.uuid4().hex
    env = {**os.environ, MARKER: token, "PYTHONPATH": str(REPO_ROOT)}
    logs = open(campaign.workdir / "stderr.txt", "wb")  # noqa: SIM115 - closed below
    owners: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(command: list[str]) -> subprocess.Popen[bytes]:
        outcome.runs += 1
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=logs)

    def start_owner() -> subprocess.Popen[bytes]:
        """An owner, with a log of its own: its resource tracker writes there."""
        outcome.runs += 1
        log = campaign.workdir / f"owner-{len(owners)}.stderr.txt"
        with open(log, "wb") as errors:
            process = subprocess.Popen(
                campaign.owner_command(), env=env, stdout=subprocess.DEVNULL, stderr=errors
            )
        owners.append((process, log))
        return process

    shm_used: set[str] = set()
    pids: set[int] = set()
    started = time.monotonic()
    attached = 1
    owner = start_owner()
    consumers = [start(campaign.consumer_command(i)) for i in range(campaign.consumers)]
    try:
        for _ in range(kills):
            index = campaign.victim
            victim = consumers[index]
            at_step = min(
                campaign.batches - FANOUT_LAST_KILL_BEFORE_END,
                campaign.checkpointed_step(index) + rng.randint(1, 2 * campaign.every),
            )
            while (
                campaign.lines(index) < at_step or campaign.attaches(index) < attached
            ) and victim.poll() is None:
                marked = _marked_processes(token)
                pids.update(marked)
                shm_used |= _shm_mapped(marked)
                if time.monotonic() - started > campaign.deadline_s:
                    break
                time.sleep(0.01)
            if victim.poll() is not None or owner.poll() is not None:
                outcome.failures.append(f"consumer {campaign.victim} or the owner ended early")
                break
            killed = {
                FANOUT_KIND: [victim],
                FANOUT_OWNER_KIND: [owner],
                FANOUT_BOTH_KIND: [owner, victim],
            }[kind]
            for process in killed:  # at once
                process.kill()
            for process in killed:
                process.wait()
            outcome.kills += 1
            attached = campaign.attaches(campaign.victim) + 1  # the next kill waits for it
            if owner in killed:
                owner = start_owner()
            if victim in killed:
                consumers[campaign.victim] = start(campaign.consumer_command(campaign.victim))
        for process in [*consumers, owner]:
            left = campaign.deadline_s - (time.monotonic() - started)
            try:
                process.wait(max(0.1, left))
            except subprocess.TimeoutExpired:
                outcome.stalls += 1
                process.kill()
                process.wait()
            if process.returncode not in (0, None) and process is not owner:
                outcome.failures.append(f"a consumer exited with {process.returncode}")
        if owner.returncode != 0:
            outcome.failures.append(f"the owner exited with {owner.returncode}")
    finally:
        for process in [*consumers, *(o for o, _ in owners)]:
            if process.poll() is None:
                process.kill()
                process.wait()
        logs.close()
    pids.update(process.pid for process in [*consumers, *(o for o, _ in owners)])
    outcome.leaks += _leftover_processes(token) + _shm_left(shm_used) + _segments_of(pids)
    stderr = (campaign.workdir / "stderr.txt").read_text()
    reports = [stderr] + [
        _without_tracker_cleanup(log.read_text()) if process.returncode == -signal.SIGKILL
        else log.read_text()
        for process, log in owners
    ]
    for report in reports:
        if "resource_tracker" in report:  # leaks it cleaned up, or names it could not unlink
            at = report.index("resource_tracker")
            outcome.leaks.append(
                f"the resource tracker reports: {report[max(0, at - 300) :][:1500]}"
            )
    if outcome.failures:
        outcome.failures.append("\n".join(reports)[-3000:])
    for index in range(campaign.consumers):
        got = campaign.consumed(index)
        lost, duplicated, same_order = compare(reference[: campaign.batches], got)
        outcome.lost += lost
        outcome.duplicated += duplicated
        outcome.same_order &= same_order
    return outcome


def _without_tracker_cleanup(stderr: str) -> str:
    """The log of an owner killed with SIGKILL, less its resource tracker's report of the
    segments it unlinked for it (`TRACKER_CLEANUP`, and the line of source it quotes)."""
    lines = stderr.splitlines()
    kept = []
    for number, line in enumerate(lines):
        quoted = number > 0 and TRACKER_CLEANUP in lines[number - 1]
        if TRACKER_CLEANUP not in line and not (quoted and "warnings.warn(" in line):
            kept.append(line)
    return "\n".join(kept)
