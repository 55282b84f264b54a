"""The layout of a checkpoint file: encoding a state into it, and decoding and verifying it.

A file is one JSON document: ``{"format", "version", "step" (if saved with one),
"fingerprint", "checksum", "state"}``. ``"checksum"`` is the SHA-256 of the rest of the
document in a canonical form (keys sorted, no spaces; the state is written in that form),
so that any change to it, an edited position as much as a damaged byte, is refused at
load. ``"fingerprint"`` is a digest of the stages' stream-deciding arguments
(`pipeline_fingerprint`): two files of pipelines built alike have the same one. Version 1
files (no checksum, no step) still load, checked by their fingerprint only.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from .._core.protocol import State

FORMAT = "infinibatch_like.checkpoint"
"""The value of the ``"format"`` field of every checkpoint file."""
VERSION = 2
"""The version of the file layout written by `save_checkpoint` (2 added ``"checksum"``
and ``"step"``; version 1 files are still read)."""

_PREVIEW = 60
_PLAIN_SCALARS = (str, int, float, bool, type(None))
_LEAVES = frozenset({str, int, bool, type(None)})
"""Types of values that are plain data whatever they hold (checked without a path)."""


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, empty, truncated, damaged, edited or not a checkpoint;
    the message names the file."""


def pipeline_fingerprint(state: Any) -> str:
    """A short digest of the ``"fingerprint"`` fields of every stage state in `state`.

    Two pipelines built with the same stream-deciding arguments have the same digest;
    stages without such arguments contribute nothing. It says nothing of positions: use it
    to tell whether a state fits a pipeline, not whether a state is intact.
    """
    fields: list[Any] = []
    _collect_fingerprints(state, fields)
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _collect_fingerprints(value: Any, into: list[Any]) -> None:
    if isinstance(value, dict):
        if isinstance(value.get("stage"), str) and "fingerprint" in value:
            into.append([value["stage"], value["fingerprint"]])
        for item in value.values():
            _collect_fingerprints(item, into)
    elif isinstance(value, list):
        for item in value:
            _collect_fingerprints(item, into)


def encode(owner: str, state: State, step: int | None) -> bytes:
    """The bytes of the checkpoint file of `state` (saved at `step`, if not None).

    Raises:
        TypeError: if `state` is not plain data, naming where within it.
        ValueError: if it is nested too deeply to be written as JSON.
    """
    problem = not_plain(state)
    if problem is not None:
        raise TypeError(
            f"{owner}: {problem}; a state must be plain data (dicts with str keys, lists, "
            "str, int, finite float, bool, None), which JSON gives back unchanged"
        )
    header: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    if step is not None:
        header["step"] = step
    header["fingerprint"] = pipeline_fingerprint(state)
    try:
        state_text = _canonical(state)
    except RecursionError:
        raise ValueError(f"{owner}: the state is nested too deeply to be written as JSON") from None
    header["checksum"] = _checksum(header, state_text)
    head = json.dumps(header, separators=(",", ":"))
    return f'{head[:-1]},"state":{state_text}}}'.encode()


def not_plain(state: Any) -> str | None:
    """Where and how `state` is not plain data (e.g. ``"state['a'][0] is a tuple"``), or
    None if it is. Iterative: any depth, one pass."""
    pending: list[tuple[str, Any]] = [("state", state)]
    while pending:
        where, value = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    return (
                        f"{where} has the key {key!r} ({type(key).__name__}), which JSON "
                        f"would turn into the string {json.dumps(str(key))}"
                    )
                if type(item) not in _LEAVES:
                    pending.append((f"{where}[{key!r}]", item))
        elif isinstance(value, list):
            pending.extend(
                (f"{where}[{index}]", item)
                for index, item in enumerate(value)
                if type(item) not in _LEAVES
            )
        elif not isinstance(value, _PLAIN_SCALARS):
            hint = ", which JSON would turn into a list" if isinstance(value, tuple) else ""
            return f"{where} is a {type(value).__name__}{hint}"
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{where} is {value!r}, which JSON cannot hold"
    return None


def decode(source: str, data: bytes) -> tuple[State, int | None]:
    """(the state, the step it was saved at or None) of the file `source` holding `data`.

    Raises:
        CheckpointFileError: naming `source`, for anything but an intact checkpoint file.
    """
    document = _document(source, data)
    version = document.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise CheckpointFileError(
            f"{source}: checkpoint format version {version!r} is not supported (this "
            f"version of infinibatch_like reads versions 1 to {VERSION})"
        )
    if version >= 2:
        _verify_checksum(source, document)
    state = document.get("state")
    if not isinstance(state, dict):
        raise CheckpointFileError(
            f'{source}: the checkpoint\'s "state" must be a dict, got {type(state).__name__}'
        )
    recorded = document.get("fingerprint")
    actual = pipeline_fingerprint(state)
    if recorded != actual:
        raise CheckpointFileError(
            f"{source}: the stage fingerprints in the state (digest {actual}) differ from the "
            f"pipeline fingerprint recorded with it ({recorded!r}); the file was edited or "
            "damaged"
        )
    step = document.get("step")
    if step is not None and (type(step) is not int or step < 0):
        raise CheckpointFileError(f'{source}: the checkpoint\'s "step" is {step!r}')
    return state, step


def _document(source: str, data: bytes) -> dict[str, Any]:
    if not data.strip():
        raise CheckpointFileError(f"{source}: the checkpoint file is empty")
    try:
        document = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        head = data[:_PREVIEW]
        raise CheckpointFileError(
            f"{source}: not a complete JSON document ({len(data)} bytes, starting {head!r}); "
            f"the file is truncated or not a checkpoint: {error}"
        ) from None
    except RecursionError:
        raise CheckpointFileError(
            f"{source}: the JSON document ({len(data)} bytes) is nested too deeply to read; "
            "it is not a checkpoint written by save_checkpoint"
        ) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise CheckpointFileError(
            f'{source}: not a checkpoint file of infinibatch_like (expected "format": '
            f"{FORMAT!r}, found {found!r})"
        )
    return document


def _verify_checksum(source: str, document: dict[str, Any]) -> None:
    header = dict(document)
    recorded = header.pop("checksum", None)
    try:
        actual = _checksum(header, _canonical(header.pop("state", None)))
    except (ValueError, RecursionError):  # NaN or Infinity, which save_checkpoint refuses
        actual = "(none: the file holds values JSON does not allow)"
    if recorded != actual:
        raise CheckpointFileError(
            f"{source}: the checkpoint's content does not match its checksum (recorded "
            f"{recorded!r}, computed {actual!r}): the file was edited or damaged after it "
            "was saved"
        )


def _canonical(value: Any) -> str:
    """`value` as JSON in the canonical form that checksums cover: keys sorted, no spaces."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _checksum(header: dict[str, Any], state_text: str) -> str:
    """The checksum of a file: of its fields but ``"checksum"`` (`header`) and of its state
    (`state_text`, canonical)."""
    text = _canonical(header) + "\n" + state_text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
