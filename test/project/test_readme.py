"""The README's "Two commands" section and the CI entry point (.ci/run) agree."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEMO_COMMAND = "pip install -e . && python -m infinibatch_like demo"


def two_commands() -> list[str]:
    """The commands in the fenced blocks of the README's "Two commands" section, in order."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Two commands[ \t]*\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert section is not None, 'README.md has no "## Two commands" section'
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section.group(1), re.M | re.S)
    return [
        line.strip()
        for block in blocks
        for line in block.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def test_readme_has_exactly_two_commands() -> None:
    commands = two_commands()
    assert len(commands) == 2, commands
    assert commands[0] == DEMO_COMMAND
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    test_command = two_commands()[1]
    ci_lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f".ci/run does not run {test_command!r}"


def test_ci_runs_the_test_command_in_a_virtual_environment_it_creates() -> None:
    """Nothing installed on the machine by hand can make CI pass: the README's test command
    runs in a venv made by the same script, with the caller's PYTHONPATH dropped."""
    lines = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    test_line = lines.index(two_commands()[1])
    creates = [i for i, line in enumerate(lines) if re.match(r"python3? -m venv ", line)]
    activates = [i for i, line in enumerate(lines) if re.match(r"source .*/bin/activate", line)]
    assert creates, "CI does not create a virtual environment"
    assert activates, "CI does not activate a virtual environment"
    assert creates[0] < activates[0] < test_line
    assert "unset PYTHONPATH" in lines[activates[0] : test_line]


def test_ci_script_is_strict_bash() -> None:
    script = (REPO / ".ci" / "run").read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    if os.name == "posix":
        assert os.access(REPO / ".ci" / "run", os.X_OK), ".ci/run is not executable"


@pytest.mark.parametrize("target", ["docs/index.md", "docs/concepts.md", "docs/migrating.md"])
def test_readme_links_docs(target: str) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert f"({target})" in readme
    assert (REPO / target).is_file()
