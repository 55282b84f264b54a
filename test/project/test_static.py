"""The code base stays ruff clean and mypy --strict clean (settings: pyproject.toml, setup.cfg)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from _python import run_python

REPO = Path(__file__).resolve().parents[2]


def _tool(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return run_python(["-m", *args], REPO, timeout)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    command = " ".join(proc.args)
    return f"`{command}` failed with exit code {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.slow
def test_ruff_check() -> None:
    proc = _tool("ruff", "check", ".", timeout=120)
    assert proc.returncode == 0, _explain(proc)


@pytest.mark.slow
def test_mypy_strict() -> None:
    # Without arguments mypy reads setup.cfg: strict mode on the infinibatch_like package.
    proc = _tool("mypy", timeout=280)
    assert proc.returncode == 0, _explain(proc)


@pytest.mark.slow
def test_public_api_types_are_inferred_at_the_call_site() -> None:
    # test/_typed_api.py holds assert_type checks: item types through chunked_dataset_iterator,
    # pad_batch's result by `to` and `with_mask`, padder, ShardedIterator with a lambda.
    proc = _tool("mypy", "test/_typed_api.py", timeout=280)
    assert proc.returncode == 0, _explain(proc)
