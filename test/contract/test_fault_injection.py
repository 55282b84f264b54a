"""Fault injection in the suite: a real training loop killed and restarted loses nothing;
hostile input that the library holds against, each case bounded in time and memory.

A few campaigns of ``bench/fault_harness.py`` (``bench/fault_injection.py`` runs 50+ kills
and prints the table of the docs): the loop of ``bench/fault_loop.py`` with the full
pipeline (chunk read-ahead over gzip chunks, weighted mixing, process/thread prefetch,
parallel map, bucketing) is killed, restarted from its last checkpoint, and finally runs
to the end; its consumed stream must equal an uninterrupted run's, with no stall and no
process, /dev/shm entry, file descriptor or thread left behind.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the harness reads /proc")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_harness as harness  # noqa: E402
import hostile_input as hostile  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return harness.make_corpus(tmp_path_factory.mktemp("fault-corpus"))


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    campaign = harness.Campaign(tmp_path_factory.mktemp("reference"), corpus, harness.Config())
    batches = harness.reference_stream(campaign)
    assert len(batches) == campaign.batches
    return batches


CAMPAIGNS = [
    ("loop SIGKILL", harness.Config("fork", "process", "nested"), 2),
    ("worker SIGKILL", harness.Config("forkserver", "process", "flat"), 2),
    ("SIGTERM", harness.Config("fork", "thread", "flat"), 2),
    ("SIGINT", harness.Config("spawn", "process", "nested"), 1),
    ("torn checkpoint", harness.Config("fork", "thread", "flat"), 2),
]


@pytest.mark.parametrize(
    ("kind", "config", "kills"),
    CAMPAIGNS,
    ids=[f"{kind}-{config.start_method}-{config.nesting}" for kind, config, _ in CAMPAIGNS],
)
def test_killed_and_restarted_loop_consumes_the_uninterrupted_stream(
    kind: str,
    config: harness.Config,
    kills: int,
    corpus: Path,
    reference: list[str],
    tmp_path: Path,
) -> None:
    campaign = harness.Campaign(tmp_path, corpus, config)
    # Kills at steps, so that every one lands however fast the machine (timed kills, also
    # during start-up, are the script's: bench/fault_injection.py).
    outcome = harness.run_campaign(
        campaign, kind, kills, reference, random.Random(kind), timed=False
    )
    assert outcome.failures == []
    assert outcome.kills == kills, f"only {outcome.kills} of {kills} kills landed"
    assert outcome.runs == kills + 1
    assert (outcome.lost, outcome.duplicated, outcome.stalls) == (0, 0, 0)
    assert outcome.same_order
    assert outcome.leaks == []


def test_compare_counts_lost_duplicated_and_order() -> None:
    reference = ['[["a", 1], ["b", 2]]', '[["c", 3]]', '[["d", 4]]']
    assert harness.compare(reference, reference) == (0, 0, True)
    assert harness.compare(reference, reference[:2]) == (1, 0, False)
    assert harness.compare(reference, [*reference[:2], reference[1], reference[2]]) == (0, 1, False)
    assert harness.compare(reference, [reference[1], reference[0], reference[2]]) == (0, 0, False)


def test_a_process_left_behind_is_reported_and_stopped() -> None:
    token = "test-leftover"
    env = {**os.environ, harness.MARKER: token}
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    started = time.monotonic()
    try:
        leaks = harness._leftover_processes(token, grace=0.5)
    finally:
        process.kill()
        process.wait()
    assert len(leaks) == 1
    assert f"process {process.pid}" in leaks[0]
    assert "outlived its run" in leaks[0]
    assert process.returncode == -9  # the harness killed it
    assert time.monotonic() - started < 5


def test_a_run_past_its_deadline_is_a_stall(corpus: Path, tmp_path: Path) -> None:
    campaign = harness.Campaign(tmp_path, corpus, harness.Config(), deadline_s=0.2)
    result = harness.run_once(campaign, None)
    assert result.stalled
    assert result.returncode == -9


def test_restart_with_damaged_checkpoints_resumes_from_an_intact_one_or_refuses(
    corpus: Path, reference: list[str], tmp_path: Path
) -> None:
    campaign = harness.Campaign(tmp_path, corpus, harness.Config("fork", "thread", "flat"))
    assert harness.run_once(campaign, None).returncode == 0
    newest, older = (tmp_path / "ckpt-56.json"), (tmp_path / "ckpt-49.json")
    assert sorted(tmp_path.glob("ckpt-*.json")) == [older, newest]
    newest.write_bytes(newest.read_bytes()[:50])  # torn by a crash
    result = harness.run_once(campaign, None)
    assert result.returncode == 0, result.stderr
    assert f"DamagedCheckpointWarning: load_checkpoint: loaded {older} (step 49)" in result.stderr
    assert campaign.consumed() == reference

    for path in tmp_path.glob("ckpt-*.json"):
        path.write_bytes(path.read_bytes()[:50])
    result = harness.run_once(campaign, None)
    assert result.returncode == 1  # not a silent restart from step 0
    assert "CheckpointFileError: load_checkpoint: none of the 2 checkpoint files" in result.stderr
    assert campaign.consumed() == reference


def test_a_full_disk_run_is_judged_by_what_it_leaves_and_what_it_says(tmp_path: Path) -> None:
    for name in ("consumed.log", "stderr.txt", "ckpt-7.json", "ckpt-14.json"):
        (tmp_path / name).write_text("")
    assert harness._files_left(tmp_path) == []
    (tmp_path / ".ckpt-21.json.0123abcd.tmp").write_text("")
    assert harness._files_left(tmp_path) == [
        "left in the run's directory after the failed save: ['.ckpt-21.json.0123abcd.tmp']"
    ]
    named = "OSError: [Errno 27] File too large: '/run/.ckpt-21.json.0123abcd.tmp'"
    assert harness._disk_full_error(f"Traceback ...\n{named}\n") == []
    assert harness._disk_full_error("OSError: [Errno 27] File too large\n") == [
        "the full-disk error does not name the checkpoint file: OSError: [Errno 27] File too large"
    ]
    assert harness._disk_full_error("KeyError: 'x'")[0].startswith("the run did not fail of")


def test_the_loop_is_told_when_its_disk_fills() -> None:
    assert harness.Kill(harness.DISK_FULL, at_step=21).arguments() == ["--disk-full-at=21"]
    assert harness.Kill("SIGTERM", at_step=21).arguments() == []


# -- hostile input (bench/hostile_input.py): every case, each bounded in time and memory ----

# The one case left to bench/hostile_input.py: two chunk jobs racing for one output, over
# 8 rounds (about 30 s on a loaded machine); the lock itself is tested in test_prepare_job.
BENCH_ONLY = {"two-chunk-runs-one-output"}
HOLDING = [case.name for case in hostile.cases.CASES if case.name not in BENCH_ONLY]


@pytest.mark.parametrize("name", HOLDING)
def test_hostile_input_case_holds_within_its_bounds(name: str, tmp_path: Path) -> None:
    verdict = hostile.run_case(hostile.cases.BY_NAME[name], tmp_path)
    assert verdict.passed, verdict.detail
    assert verdict.seconds <= verdict.max_s
    assert 0 < verdict.peak_mib <= verdict.max_mib


@pytest.mark.parametrize(
    ("output", "code", "timed_out", "peak", "verdict"),
    [
        ('{"passed": true, "detail": "refused: ValueError"}\n', 0, False, 50.0,
         (True, "refused: ValueError")),
        ('{"passed": true, "detail": "read"}\n', 0, False, 900.0,
         (False, "peak RSS 900 MiB over 200 MiB: read")),
        ("", -9, True, 61.0, (False, "no answer within 10 s (killed; peak 61 MiB)")),
        ('{"passed": false, "detail": "accepted without an error"}\n', 0, False, 30.0,
         (False, "accepted without an error")),
        ("Traceback ...\nMemoryError\n", 1, False, 30.0,
         (False, "the case crashed (exit 1): Traceback ...\nMemoryError\n")),
    ],
    ids=["held", "over-memory", "timed-out", "failed", "crashed"],
)
def test_hostile_input_verdicts(
    output: str, code: int, timed_out: bool, peak: float, verdict: tuple[bool, str]
) -> None:
    case = hostile.cases.Case("family", "case", lambda scratch: "", max_s=10, max_mib=200)
    assert hostile._judge(case, output, code, timed_out, 1.0, peak) == verdict


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_fan_out_consumer_killed_and_restarted_consumes_the_uninterrupted_stream(
    method: str, corpus: Path, reference: list[str], tmp_path: Path
) -> None:
    config = harness.Config(method, "process", "nested" if method == "spawn" else "flat")
    campaign = harness.FanOutCampaign(tmp_path, corpus, config)
    outcome = harness.run_fanout_campaign(campaign, 2, reference, random.Random(method))
    assert outcome.failures == []
    assert outcome.kills == 2
    assert outcome.runs == 1 + campaign.consumers + 2  # the owner, the consumers, restarts
    assert (outcome.lost, outcome.duplicated, outcome.stalls) == (0, 0, 0)
    assert outcome.same_order
    assert outcome.leaks == []
    for index in range(campaign.consumers):  # each consumer: every batch, once, in order
        assert campaign.consumed(index) == reference


def test_a_fan_out_consumer_killed_while_mapping_arrays_leaves_no_segment(
    corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = harness.Config("fork", "process", "flat", arrays=True)
    reference = harness.reference_stream(
        harness.Campaign(tmp_path_factory.mktemp("reference-arrays"), corpus, config)
    )
    campaign = harness.FanOutCampaign(tmp_path_factory.mktemp("fanout-arrays"), corpus, config)
    outcome = harness.run_fanout_campaign(campaign, 2, reference, random.Random(1))
    assert outcome.failures == []
    assert outcome.kills == 2
    assert (outcome.lost, outcome.duplicated, outcome.stalls) == (0, 0, 0)
    assert outcome.leaks == []  # /dev/shm, the resource tracker, processes
    for index in range(campaign.consumers):
        assert campaign.consumed(index) == reference


@pytest.mark.parametrize("kind", [harness.FANOUT_OWNER_KIND, harness.FANOUT_BOTH_KIND])
def test_consumers_of_a_fan_out_owner_killed_and_restarted_consume_the_uninterrupted_stream(
    kind: str, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    config = harness.Config("fork", "process", "flat", arrays=True)
    reference = harness.reference_stream(
        harness.Campaign(tmp_path_factory.mktemp("reference-arrays"), corpus, config)
    )
    campaign = harness.FanOutCampaign(tmp_path_factory.mktemp("fanout-owner"), corpus, config)
    outcome = harness.run_fanout_campaign(campaign, 2, reference, random.Random(2), kind)
    assert outcome.failures == []
    assert outcome.kills == 2
    restarted = 2 * (1 + (kind == harness.FANOUT_BOTH_KIND))  # owners, and the victim
    assert outcome.runs == 1 + campaign.consumers + restarted
    assert (outcome.lost, outcome.duplicated, outcome.stalls) == (0, 0, 0)
    assert outcome.leaks == []  # /dev/shm, any complaint of a resource tracker, processes
    for index in range(campaign.consumers):  # each re-attached and restored its own state
        assert campaign.consumed(index) == reference
    assert campaign.attaches(campaign.victim) == 1 + 2  # to each owner


def test_a_killed_owners_tracker_report_of_its_cleanup_is_not_a_complaint() -> None:
    cleanup = (
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: "
        "resource_tracker: There appear to be 4 leaked shared_memory objects to clean up "
        "at shutdown\n  warnings.warn('resource_tracker: There appear to be %d '"
    )
    missing = (
        "resource_tracker.py:267: UserWarning: resource_tracker: '/ibl_1_ab_t2_b3': [Errno 2] "
        "No such file or directory: '/ibl_1_ab_t2_b3'\n  warnings.warn('resource_tracker: "
        "%r: %s' % (name, e))"
    )
    assert harness._without_tracker_cleanup(f"before\n{cleanup}\nafter") == "before\nafter"
    assert "resource_tracker" in harness._without_tracker_cleanup(f"{cleanup}\n{missing}")


def test_a_segment_named_after_a_process_of_the_run_is_a_leak() -> None:
    name = f"ibl_{os.getpid()}_feedbeef_b0"
    Path("/dev/shm", name).write_bytes(b"x")
    try:
        assert harness._segments_of({os.getpid()}) == [
            f"/dev/shm/{name} created by process {os.getpid()} of the run and not removed"
        ]
        assert harness._segments_of({os.getpid() + 1}) == []
    finally:
        Path("/dev/shm", name).unlink()
