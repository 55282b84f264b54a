"""Reading a saved checkpoint and describing its pipeline state: stages and positions.

A state is a tree of dicts, each stage's dict naming its class under ``"stage"`` and
holding its position fields and its sources' states. `describe_state` prints that tree,
one stage a line, with the fields that say where the stage is (positions, counts, seeds)
and without the fingerprints of its arguments.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from typing import Any

from ..io import open_chunk
from .format import FORMAT, CheckpointFileError, decode

_HIDDEN = frozenset({"stage", "fingerprint"})


def read_content(path: str) -> tuple[str, Any, bytes]:
    """(a description of the file's format, its content, its bytes) of a local path or
    URL (``s3://...``): a JSON file, or a torch checkpoint
    (``torch.load(weights_only=True)``, needs torch).

    Raises:
        ValueError: for a file that is neither, or JSON nested too deeply, naming it.
        OSError: from the file system or store, naming the file.
    """
    with open_chunk(path) as file:
        data = file.read()
    try:
        return "JSON", json.loads(data), data
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass
    except RecursionError:
        raise ValueError(
            f"{path}: the JSON document ({len(data):,} bytes) is nested too deeply to read"
        ) from None
    try:
        import torch
    except ModuleNotFoundError:
        raise ValueError(
            f"inspect: {path} is not JSON, and reading it as a torch checkpoint needs torch, "
            "which is not installed"
        ) from None
    try:
        content = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as error:
        raise ValueError(
            f"inspect: {path} is neither JSON nor a torch checkpoint ({type(error).__name__}: "
            f"{error})"
        ) from None
    return "torch checkpoint", content, data


def checkpoint_file_line(path: str, content: Any, data: bytes) -> str | None:
    """What `load_checkpoint` says of a checkpoint file (`content` parsed from `data`): its
    version, step and a verified checksum, or why it refuses the file; None for other
    content."""
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        return None
    try:
        _, step = decode(path, data)
    except CheckpointFileError as error:
        return f"checkpoint file: refused by load_checkpoint: {error}"
    checked = "checksum verified" if content.get("version", 1) >= 2 else "no checksum"
    at_step = "" if step is None else f", step {step}"
    return f"checkpoint file: format version {content.get('version')}{at_step}, {checked}"


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


def _describe(node: dict[str, Any], label: str, depth: int, lines: list[str]) -> None:
    """`node`: a stage's state (``stage  field=value ...``) or an entry of a list that
    holds stages, such as a shard of a sharded state (``label: field=value ...``)."""
    fields, children = [], []
    for key, value in node.items():
        if key in _HIDDEN:
            continue
        nested = list(_stages_in(value, key))
        if nested:
            children.extend(nested)
        else:
            fields.append(f"{key}={_short(value)}")
    if _is_stage(node):
        line = f"{label}{node['stage']}  {' '.join(fields)}"
    else:
        line = f"{label}{' '.join(fields)}"
    lines.append(f"{'  ' * depth}{line}".rstrip())
    for child_label, child in children:
        _describe(child, f"{child_label}: ", depth + 1, lines)


def _stages_in(value: Any, key: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(label, node) of the stage states in `value`; a list holding stages within dicts
    (e.g. ``{"shard": 0, "source": <state>}`` entries) gives each of its dicts."""
    if _is_stage(value):
        yield key, value
    elif isinstance(value, list):
        entries = any(isinstance(item, dict) and _holds_stage(item) for item in value)
        for position, item in enumerate(value):
            if entries and isinstance(item, dict):
                yield f"{key}[{position}]", item
            else:
                yield from _stages_in(item, f"{key}[{position}]")


def _is_stage(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("stage"), str)


def _holds_stage(value: Any) -> bool:
    if _is_stage(value):
        return True
    if isinstance(value, dict):
        return any(_holds_stage(item) for item in value.values())
    if isinstance(value, list):
        return any(_holds_stage(item) for item in value)
    return False


def _short(value: Any, most: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= most else f"{text[: most - 15]}... ({len(text)} chars)"


def inspect_lines(path: str) -> list[str]:
    """The report of ``inspect PATH`` (a local path or URL): the file, its size (of its
    content, decompressed for a ``.gz`` name and the like), what `load_checkpoint` says of a
    checkpoint file, and each state it holds.

    Raises:
        ValueError: for a file without a pipeline state, naming it.
        OSError: from the file system or store, naming the file.
    """
    kind, content, data = read_content(path)
    states = list(find_states(content))
    if not states:
        raise ValueError(
            f"inspect: {path} ({kind}) holds no pipeline state (a dict with a 'stage' key, "
            "at the top or nested in dicts and lists)"
        )
    lines = [f"{path}: {kind}, {len(data):,} bytes"]
    verdict = checkpoint_file_line(path, content, data)
    if verdict is not None:
        lines.append(verdict)
    for where, state in states:
        size = len(json.dumps(state).encode("utf-8"))
        lines.append(f"state at {where}: {size:,} bytes as JSON")
        lines.extend("  " + line for line in describe_state(state))
    return lines
