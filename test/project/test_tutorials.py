"""Every tutorial runs as a script, and the CLI demo shows an exact resume."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from _python import run_python

import infinibatch_like.__main__ as demo_module
from infinibatch_like.__main__ import main
from infinibatch_like.iterators import CheckpointableIterator

REPO = Path(__file__).resolve().parents[2]
TUTORIALS = sorted((REPO / "tutorials").glob("*.py"))
TIMEOUT_S = 240


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the Python interpreter of this test session on `args`, importing this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return run_python(args, cwd, TIMEOUT_S, env)


def _launch(script: Path) -> list[str]:
    """The interpreter arguments that run `script`: through torchrun if its source has a
    line ``# launch: torchrun --nproc_per_node=N``, else directly."""
    marker = re.search(r"^# launch: torchrun (--nproc_per_node=\d+)", script.read_text(), re.M)
    if marker is None:
        return [str(script)]
    return ["-m", "torch.distributed.run", "--standalone", marker.group(1), str(script)]


def _report(proc: subprocess.CompletedProcess[str]) -> str:
    streams = f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    return f"exit code {proc.returncode}\n{streams}"


def test_there_are_tutorials() -> None:
    assert TUTORIALS, f"no tutorials found in {REPO / 'tutorials'}"


@pytest.mark.slow
@pytest.mark.parametrize("script", TUTORIALS, ids=lambda path: path.name)
def test_tutorial_runs(script: Path, tmp_path: Path) -> None:
    proc = _run(_launch(script), cwd=tmp_path)
    assert proc.returncode == 0, _report(proc)


@pytest.mark.slow
def test_demo_module_reports_identical_continuation(tmp_path: Path) -> None:
    proc = _run(["-m", "infinibatch_like", "demo"], cwd=tmp_path)
    assert proc.returncode == 0, _report(proc)
    assert "IDENTICAL" in proc.stdout, _report(proc)
    assert "DIFFERENT" not in proc.stdout, _report(proc)


def test_demo_main_with_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workdir = tmp_path / "chunks"
    assert main(["demo", "--lines", "400", "--seed", "5", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL" in out
    assert "bytes of JSON" in out
    assert sorted(path.name for path in workdir.iterdir())[0].endswith(".txt.gz")


def test_demo_main_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as no_command:
        main([])
    assert no_command.value.code == 2
    with pytest.raises(SystemExit) as bad_lines:
        main(["demo", "--lines", "0"])
    assert bad_lines.value.code == 2
    assert "--lines" in capsys.readouterr().err


def test_demo_fails_when_the_restore_is_lost(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pipeline whose setstate() is ignored restarts from the beginning: the demo must
    # notice that the continuation differs and exit with 1.
    build = demo_module.build_pipeline

    def forgetful(chunk_paths: list[str], seed: int) -> CheckpointableIterator[list[str]]:
        pipeline = build(chunk_paths, seed)
        monkeypatch.setattr(pipeline, "setstate", lambda state: None)
        return pipeline

    monkeypatch.setattr(demo_module, "build_pipeline", forgetful)
    assert main(["demo", "--lines", "300", "--workdir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out
    assert "IDENTICAL" not in out
