"""Hostile input, shared machines and concurrent jobs: every case of `hostile_cases.py`, each
in a child process bounded in time and memory, and the table of what held.

Families: decompression bombs (.zst, .gz), huge lines, symlink loops in listings and
inputs, concurrent jobs (two ``chunk`` runs on one output, two savers with ``keep=2``),
full disks (``RLIMIT_FSIZE``) under `save_checkpoint` and `open_output`, special files
(a FIFO, a device) as targets, deep JSON, files planted in a shared ``$TMPDIR``, huge
arguments, items that a worker process cannot pickle. A case passes when the library
answers as it promises (a clear error naming the cause, or the right result; nothing
lost; nothing outside the target touched) within the case's time and peak RSS (the
child's ``VmHWM``, which a fork does not carry over), and leaves nothing in its
``$TMPDIR``. Writes ``bench/results/hostile_input.json``; exits 1 if a case
fails.

    python bench/hostile_input.py                      # every case: about 1 to 2 minutes
    python bench/hostile_input.py --families "deep JSON" "full disk"
    python bench/hostile_input.py --list
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import hostile_cases as cases
from _util import RESULTS_DIR, machine_info

CASES_SCRIPT = Path(cases.__file__).resolve()


@dataclasses.dataclass
class Verdict:
    family: str
    case: str
    passed: bool
    seconds: float
    peak_mib: float
    max_s: float
    max_mib: float
    detail: str


def run_case(case: cases.Case, scratch: Path) -> Verdict:
    """Run `case` alone in a child process, killed past `case.max_s`; its verdict."""
    work, shared_tmp = scratch / "work", scratch / "tmp"
    work.mkdir(parents=True)
    shared_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(shared_tmp), "PYTHONPATH": str(cases.REPO_ROOT)}
    out_path = scratch / "output.txt"
    started = time.monotonic()
    with open(out_path, "w") as out:
        child = subprocess.Popen(
            [sys.executable, str(CASES_SCRIPT), case.name, str(work)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # so that a timeout kills its helpers too
        )
        timed_out, peak_mib = False, 0.0
        while child.poll() is None:
            peak_mib = max(peak_mib, cases.peak_mib(child.pid))  # a killed child's last word
            if time.monotonic() - started > case.max_s:
                timed_out = True
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                break
            time.sleep(0.02)
    seconds = time.monotonic() - started
    output = out_path.read_text(errors="replace")
    peak_mib = max(peak_mib, _reported_peak(output))
    passed, detail = _judge(case, output, child.returncode, timed_out, seconds, peak_mib)
    left = sorted(os.listdir(shared_tmp))
    if passed and left:
        passed, detail = False, f"left in TMPDIR: {left[:5]}"
    return Verdict(case.family, case.name, passed, seconds, peak_mib, case.max_s, case.max_mib,
                   detail)


def _reported_peak(output: str) -> float:
    """The peak RSS that the case reported on its last line, else 0."""
    try:
        return float(json.loads(output.strip().splitlines()[-1])["peak_mib"])
    except (IndexError, ValueError, KeyError, TypeError):
        return 0.0


def _judge(
    case: cases.Case, output: str, code: int, timed_out: bool, seconds: float, peak: float
) -> tuple[bool, str]:
    if timed_out:
        return False, f"no answer within {case.max_s:.0f} s (killed; peak {peak:.0f} MiB)"
    last = output.strip().splitlines()[-1:] if output.strip() else []
    try:
        report = json.loads(last[0]) if last else None
    except json.JSONDecodeError:
        report = None
    if code != 0 or not isinstance(report, dict):
        return False, f"the case crashed (exit {code}): {output[-400:]}"
    if not report["passed"]:
        return False, report["detail"]
    if peak > case.max_mib:
        return False, f"peak RSS {peak:.0f} MiB over {case.max_mib:.0f} MiB: {report['detail']}"
    return True, report["detail"]


HEADER = "| family | case | verdict | seconds | peak RSS MiB | bounds | what happened |"


def row(v: Verdict) -> str:
    detail = v.detail.replace("|", "/").replace("\n", " ")[:140]
    cells = (v.family, v.case, "pass" if v.passed else "**FAIL**", f"{v.seconds:.1f}",
             f"{v.peak_mib:.0f}", f"{v.max_s:.0f} s, {v.max_mib:.0f} MiB", detail)
    return "| " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", help="only these families")
    parser.add_argument("--cases", nargs="+", help="only these cases")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    chosen = [
        case
        for case in cases.CASES
        if (not args.families or case.family in args.families)
        and (not args.cases or case.name in args.cases)
    ]
    if args.list:
        for case in cases.CASES:
            print(f"{case.family:20} {case.name}")
        return 0
    verdicts = []
    print(HEADER)
    print("|" + "---|" * 7)
    with tempfile.TemporaryDirectory(prefix="hostile-input-") as root:
        for number, case in enumerate(chosen):
            verdict = run_case(case, Path(root) / f"case-{number}")
            verdicts.append(verdict)
            print(row(verdict), flush=True)
    failed = [v.case for v in verdicts if not v.passed]
    print(f"\n{len(verdicts) - len(failed)} of {len(verdicts)} cases held; failed: {failed}")
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / "hostile_input.json").write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "arguments": vars(args),
                "cases": [dataclasses.asdict(v) for v in verdicts],
            },
            indent=1,
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
