"""Reading a saved checkpoint and describing its pipeline state: stages and positions.

A state is a tree of dicts, each stage's dict naming its class under ``"stage"`` and
holding its position fields and its sources' states. `describe_state` prints that tree,
one stage a line, with the fields that say where the stage is (positions, counts, seeds)
and without the fingerprints of its arguments.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

_HIDDEN = frozenset({"stage", "fingerprint"})


def load_checkpoint(path: str) -> tuple[str, Any]:
    """(a description of the file's format, its content): a JSON file, or a torch
    checkpoint (``torch.load(weights_only=True)``, needs torch).

    Raises:
        ValueError: for a file that is neither, naming it.
    """
    with open(path, "rb") as file:
        data = file.read()
    try:
        return "JSON", json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    try:
        import torch
    except ModuleNotFoundError:
        raise ValueError(
            f"inspect: {path} is not JSON, and reading it as a torch checkpoint needs torch, "
            "which is not installed"
        ) from None
    try:
        content = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        raise ValueError(
            f"inspect: {path} is neither JSON nor a torch checkpoint ({type(error).__name__}: "
            f"{error})"
        ) from None
    return "torch checkpoint", content


def find_states(content: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """The pipeline states in a checkpoint's content: (key path, state) for the content
    itself if it is a state, else for each state found in its dicts and lists (e.g.
    ``{"model": ..., "data": state}``), outermost first."""
    if isinstance(content, dict) and isinstance(content.get("stage"), str):
        yield where or "(top level)", content
        return
    if isinstance(content, dict):
        items: Any = content.items()
    elif isinstance(content, (list, tuple)):
        items = enumerate(content)
    else:
        return
    for key, value in items:
        yield from find_states(value, f"{where}[{key!r}]")


def describe_state(state: dict[str, Any]) -> list[str]:
    """The lines that show `state`: a stage per line, indented under its consumer."""
    lines: list[str] = []
    _describe(state, "", 0, lines)
    return lines


def _describe(state: dict[str, Any], label: str, depth: int, lines: list[str]) -> None:
    fields, children = [], []
    for key, value in state.items():
        if key in _HIDDEN:
            continue
        nested = list(_stages_in(value, key))
        if nested:
            children.extend(nested)
        else:
            fields.append(f"{key}={_short(value)}")
    head = f"{'  ' * depth}{label}{state['stage']}"
    lines.append(f"{head}  {' '.join(fields)}".rstrip())
    for child_label, child in children:
        _describe(child, f"{child_label}: ", depth + 1, lines)


def _stages_in(value: Any, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(value, dict) and isinstance(value.get("stage"), str):
        yield key, value
    elif isinstance(value, list):
        for position, item in enumerate(value):
            yield from _stages_in(item, f"{key}[{position}]")


def _short(value: Any, most: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= most else f"{text[: most - 15]}... ({len(text)} chars)"


def inspect_lines(path: str) -> list[str]:
    """The report of ``inspect PATH``: the file, its size, and each state it holds.

    Raises:
        ValueError: for a file without a pipeline state, naming it.
    """
    kind, content = load_checkpoint(path)
    states = list(find_states(content))
    if not states:
        raise ValueError(
            f"inspect: {path} ({kind}) holds no pipeline state (a dict with a 'stage' key, "
            "at the top or nested in dicts and lists)"
        )
    lines = [f"{path}: {kind}, {os.path.getsize(path):,} bytes"]
    for where, state in states:
        size = len(json.dumps(state).encode("utf-8"))
        lines.append(f"state at {where}: {size:,} bytes as JSON")
        lines.extend("  " + line for line in describe_state(state))
    return lines
