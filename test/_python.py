"""Running this test session's Python interpreter in a child process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def run_python(
    args: list[str], cwd: Path, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` in `cwd` with `env` (None: this process's environment); its output
    captured as text, its exit status left to the caller to check."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
