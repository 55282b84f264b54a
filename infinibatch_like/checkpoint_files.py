"""Checkpoint files: a pipeline's state saved atomically as JSON, and loaded back safely.

``save_checkpoint(path, state)`` writes ``{"format", "version", "fingerprint", "state"}``
as JSON through `infinibatch_like.io.open_output`: local paths through a temporary file in
the same directory, fsync, rename and an fsync of the directory; URLs (``s3://``,
``memory://``, any fsspec protocol) with a single upload of the whole file. A reader
therefore sees the previous checkpoint or the new one, never a part.
``load_checkpoint(path)`` refuses an empty, truncated or foreign file with a
`CheckpointFileError` naming the path and what is wrong.

Keeping the last k checkpoints: give a path with ``{step}`` in its file name, such as
``"ckpt/data-{step}.json"``, with ``step=`` and ``keep=k``; after the new file is
written, only it and the files of the k - 1 highest other steps are kept. ``load_checkpoint`` of the
same pattern loads the file with the highest step.

Checkpoint:
    The file holds the state exactly as given (the pipeline's ``getstate()`` with any keys
    of your own), plus a 16-hex digest of every stage's ``fingerprint`` in it, so that an
    edited or spliced file is refused at load; restoring it into a pipeline built
    differently is refused by ``setstate``, naming the stage and the argument.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import Any

from ._base import State

FORMAT = "infinibatch_like.checkpoint"
"""The value of the ``"format"`` field of every checkpoint file."""
VERSION = 1
"""The version of the file layout written by `save_checkpoint`."""
STEP_FIELD = "{step}"

_PREVIEW = 60


class CheckpointFileError(ValueError):
    """A checkpoint file is missing, empty, truncated, damaged or not a checkpoint."""


def save_checkpoint(
    path: str | os.PathLike[str],
    state: State,
    *,
    step: int | None = None,
    keep: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> str:
    """Write `state` (e.g. ``pipeline.getstate()``) to `path`, atomically, as JSON.

    Args:
        path: a local path or an fsspec URL. With ``{step}`` in its file name (e.g.
            ``"ckpt/data-{step}.json"``), the file of `step` is written.
        state: plain data (a dict with str keys; lists, str, int, float, bool, None), such
            as a pipeline's ``getstate()``, possibly with keys of your own.
        step: the training step, required by (and only allowed with) a ``{step}`` path.
        keep: with a ``{step}`` path, keep only `keep` files (>= 1): this one and those of
            the ``keep - 1`` highest other steps; None keeps every file.
        storage_options: passed to fsspec for URLs (credentials, endpoints).

    Returns:
        The path or URL written.

    Raises:
        TypeError: if `state` is not a dict, holds something other than plain data, or
            `step`/`keep` is not an int.
        ValueError: for `step`/`keep` without ``{step}`` in the path or the reverse, a
            negative step or ``keep < 1``.
        OSError: from the file system (e.g. `infinibatch_like.io.ChunkAccessError` for a
            refused upload); the previous file, if any, is left intact.
    """
    target = _resolve_target(os.fspath(path), step, keep)
    if not isinstance(state, dict):
        raise TypeError(f"save_checkpoint: state must be a dict, got {type(state).__name__}")
    document = {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": pipeline_fingerprint(state),
        "state": state,
    }
    try:
        data = json.dumps(document, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"save_checkpoint({target!r}): the state is not plain data (dicts with str keys, "
            f"lists, str, int, finite float, bool, None): {error}"
        ) from error
    _write_atomically(target, data, storage_options)
    if keep is not None:
        others = [old for _, old in _steps(os.fspath(path), storage_options) if old != target]
        for old in others[: len(others) - (keep - 1)]:
            _remove(old, storage_options)
    return target


def load_checkpoint(
    path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None
) -> State:
    """Read a state written by `save_checkpoint`.

    Args:
        path: the path or URL given to `save_checkpoint`; with ``{step}`` in its file
            name, the existing file with the highest step is read.
        storage_options: passed to fsspec for URLs.

    Returns:
        The state, ready for ``pipeline.setstate(...)``.

    Raises:
        CheckpointFileError: (a ValueError) naming the file, if it does not exist (or no
            file matches a ``{step}`` path), is empty, is truncated or not JSON, is not a
            checkpoint of this library, is of a newer format version, or its state's
            stage fingerprints differ from the fingerprint recorded with it.
    """
    pattern = os.fspath(path)
    if _has_step_field("load_checkpoint", pattern):
        found = _steps(pattern, storage_options)
        if not found:
            raise CheckpointFileError(f"load_checkpoint: no checkpoint file matches {pattern!r}")
        source = found[-1][1]
    else:
        source = pattern
    try:
        data = _read(source, storage_options)
    except FileNotFoundError as error:  # io.ChunkNotFoundError
        raise CheckpointFileError(f"{source}: no such checkpoint file") from error
    return _parse(source, data)


def pipeline_fingerprint(state: Any) -> str:
    """A short digest of the ``"fingerprint"`` fields of every stage state in `state`.

    Two pipelines built with the same stream-deciding arguments have the same digest;
    stages without such arguments contribute nothing.
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


def _parse(source: str, data: bytes) -> State:
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
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        found = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise CheckpointFileError(
            f'{source}: not a checkpoint file of infinibatch_like (expected "format": '
            f"{FORMAT!r}, found {found!r})"
        )
    version = document.get("version")
    if type(version) is not int or not 1 <= version <= VERSION:
        raise CheckpointFileError(
            f"{source}: checkpoint format version {version!r} is not supported (this "
            f"version of infinibatch_like reads versions 1 to {VERSION})"
        )
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
    return state


def _resolve_target(path: str, step: int | None, keep: int | None) -> str:
    for name, value in (("step", step), ("keep", keep)):
        if value is not None and (type(value) is not int):
            raise TypeError(f"save_checkpoint: {name} must be an int, got {value!r}")
    has_field = _has_step_field("save_checkpoint", path)
    if has_field and step is None:
        raise ValueError(f"save_checkpoint: the path {path!r} has {STEP_FIELD}; give step=")
    if not has_field and (step is not None or keep is not None):
        given = "step" if step is not None else "keep"
        raise ValueError(
            f"save_checkpoint: {given}= needs a path with {STEP_FIELD} in its file name "
            f"(e.g. 'ckpt/data-{{step}}.json'), got {path!r}"
        )
    if step is not None and step < 0:
        raise ValueError(f"save_checkpoint: step must be >= 0, got {step}")
    if keep is not None and keep < 1:
        raise ValueError(f"save_checkpoint: keep must be >= 1, got {keep}")
    return path.replace(STEP_FIELD, str(step)) if has_field else path


def _has_step_field(owner: str, path: str) -> bool:
    """Whether the file name of `path` has ``{step}``; a ValueError if a directory has it."""
    has_field = STEP_FIELD in _name_of(path)
    if STEP_FIELD in path and not has_field:
        raise ValueError(
            f"{owner}: {STEP_FIELD} must be in the file name of the path, not in a "
            f"directory: {path!r}"
        )
    return has_field


def _name_of(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]


def _step_matcher(pattern: str) -> re.Pattern[str]:
    before, after = _name_of(pattern).split(STEP_FIELD, 1)
    return re.compile(re.escape(before) + r"(\d+)" + re.escape(after))


def _steps(pattern: str, storage_options: Mapping[str, Any] | None) -> list[tuple[int, str]]:
    """(step, path) of the existing files matching the ``{step}`` pattern, by step."""
    matcher = _step_matcher(pattern)
    name = _name_of(pattern)
    directory = pattern[: len(pattern) - len(name)]
    found = []
    for entry in _list_names(directory, storage_options):
        match = matcher.fullmatch(entry)
        if match:
            found.append((int(match.group(1)), directory + entry))
    return sorted(found)


# Storage: `infinibatch_like.io` (local paths and fsspec URLs), imported on first use so
# that importing the package does not load it.


def _write_atomically(
    target: str, data: bytes, storage_options: Mapping[str, Any] | None
) -> None:
    from .io import open_output

    with open_output(target, storage_options=storage_options) as file:
        file.write(data)


def _read(source: str, storage_options: Mapping[str, Any] | None) -> bytes:
    from .io import open_chunk

    with open_chunk(source, storage_options=storage_options) as file:
        return file.read()


def _list_names(directory: str, storage_options: Mapping[str, Any] | None) -> list[str]:
    from .io import list_chunks

    try:
        found = list_chunks(directory + "*", storage_options=storage_options)
    except FileNotFoundError:  # io.ChunkNotFoundError: no file matches
        return []
    return [_name_of(path) for path in found]


def _remove(path: str, storage_options: Mapping[str, Any] | None) -> None:
    from .io._storage import filesystem, is_url

    if is_url(path):
        fs, inner = filesystem(path, storage_options)
        fs.rm_file(inner)
    else:
        os.unlink(path)
