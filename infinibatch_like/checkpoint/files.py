"""Checkpoint files: a pipeline's state saved atomically as JSON, and loaded back safely.

``save_checkpoint(path, state)`` writes the state, with a checksum of the whole file and
a digest of its stages' fingerprints (see `infinibatch_like.checkpoint.format`), as JSON
through `infinibatch_like.io.open_output`: local paths through a temporary file in the
same directory, fsync, rename and an fsync of the directory; URLs (``s3://``,
``memory://``, any fsspec protocol) with a single upload of the whole file. A reader
therefore sees the previous checkpoint or the new one, never a part.
``load_checkpoint(path)`` refuses an empty, truncated, edited or foreign file with a
`CheckpointFileError` naming the path and what is wrong, and a missing one with
`CheckpointNotFoundError` (also a `FileNotFoundError`): the first run of a job.

Keeping the last k checkpoints: give a path with ``{step}`` in its file name, such as
``"ckpt/data-{step}.json"``, with ``step=`` and ``keep=k``; after the new file is
written, only it and the files of the k - 1 highest other steps are kept. ``load_checkpoint`` of the
same pattern loads the file with the highest step that is intact: a newer file that is
refused (damaged, truncated by a crash of the file system) is named in a
`DamagedCheckpointWarning`, and `load_checkpoint_info` tells which file and step were loaded.

Checkpoint:
    The file holds the state exactly as given (the pipeline's ``getstate()`` with any keys
    of your own), the step it was saved at, a 16-hex digest of every stage's
    ``fingerprint`` in it, and a SHA-256 checksum of all of it, so that an edited, damaged
    or spliced file is refused at load; restoring it into a pipeline built differently is
    refused by ``setstate``, naming the stage and the argument.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from dataclasses import dataclass

from .._core.protocol import State
from ..io import ChunkFormatError
from ..io._store import StorageOptions, Store
from ..io.listing import find_files
from ..io.output import output_in
from ..io.retry import RetryPolicy
from ..io.streams import open_stream
from .format import FORMAT, VERSION, CheckpointFileError, pipeline_fingerprint
from .format import decode as _decode
from .format import encode as _encode

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointFileError",
    "CheckpointNotFoundError",
    "DamagedCheckpointWarning",
    "LoadedCheckpoint",
    "load_checkpoint",
    "load_checkpoint_info",
    "pipeline_fingerprint",
    "save_checkpoint",
]

STEP_FIELD = "{step}"
_REASONS_SHOWN = 5


class CheckpointNotFoundError(CheckpointFileError, FileNotFoundError):
    """No checkpoint file exists at the path, or none matches the ``{step}`` pattern: the
    first run of a job. Catch it as ``FileNotFoundError`` to start fresh; a damaged file
    raises `CheckpointFileError`, which is not one."""


class DamagedCheckpointWarning(UserWarning):
    """``load_checkpoint`` of a ``{step}`` pattern refused newer files and loaded an older,
    intact one; the message names each refused file and the file loaded."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """The state, file and step that `load_checkpoint_info` read."""

    state: State
    """The state, ready for ``pipeline.setstate(...)``."""
    path: str
    """The file read: the one given, or the newest intact file of a ``{step}`` pattern."""
    step: int | None
    """The step of that file (from its name, for a pattern; else as saved, or None)."""
    refused: tuple[tuple[str, str], ...] = ()
    """(file, why) of the newer files of a ``{step}`` pattern that were refused, newest
    first; empty if the newest file was loaded."""


def save_checkpoint(
    path: str | os.PathLike[str],
    state: State,
    *,
    step: int | None = None,
    keep: int | None = None,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> str:
    """Write `state` (e.g. ``pipeline.getstate()``) to `path`, atomically, as JSON.

    Args:
        path: a local path or an fsspec URL. With ``{step}`` in its file name (e.g.
            ``"ckpt/data-{step}.json"``), the file of `step` is written; the rest of the
            path is literal (``exp[1]/`` is a directory of that name, not a glob).
        state: plain data (a dict with str keys; lists, str, int, finite float, bool,
            None), such as a pipeline's ``getstate()``, possibly with keys of your own.
        step: the training step, required by (and only allowed with) a ``{step}`` path;
            recorded in the file.
        keep: with a ``{step}`` path, keep only `keep` files (>= 1): this one and those of
            the ``keep - 1`` highest other steps; None keeps every file. Files that another
            process removed first are no error.
        storage_options: passed to fsspec for URLs (credentials, endpoints).
        retry: the retry policy of transient failures of the store (uploads, listings and
            removals; `DEFAULT_RETRY` if None).

    Returns:
        The path or URL written.

    Raises:
        TypeError: if `state` is not a dict or holds something that JSON would not give
            back unchanged (a non-str key, a tuple, an object, NaN), naming where within the
            state; or if `step`/`keep` is not an int.
        ValueError: for `step`/`keep` without ``{step}`` in the path or the reverse, a
            negative step or ``keep < 1``.
        FileExistsError: if a local `path` exists and is not a regular file (a device
            such as ``/dev/null``, a FIFO, a directory); it is left as it is.
        OSError: from the file system (e.g. `infinibatch_like.io.ChunkAccessError` for a
            refused upload, or a full disk); the previous file, if any, is left intact and
            no temporary file is left behind.
    """
    target = _resolve_target(os.fspath(path), step, keep)
    if not isinstance(state, dict):
        raise TypeError(f"save_checkpoint: state must be a dict, got {type(state).__name__}")
    data = _encode(f"save_checkpoint({target!r})", state, step)
    store = Store.of(storage_options, retry)
    with output_in(target, store) as file:
        file.write(data)
    if keep is not None:
        others = [old for _, old in _steps(os.fspath(path), store) if old != target]
        for old in others[: len(others) - (keep - 1)]:
            store.remove(old)
    return target


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
) -> State:
    """Read a state written by `save_checkpoint`.

    A job's first run and its restarts::

        try:
            pipeline.setstate(load_checkpoint("ckpt/data-{step}.json"))
        except FileNotFoundError:  # no checkpoint yet: start from the beginning
            pass

    Args:
        path: the path or URL given to `save_checkpoint`; with ``{step}`` in its file
            name, the intact file with the highest step is read (see `load_checkpoint_info`
            to know which).
        storage_options: passed to fsspec for URLs.
        retry: the retry policy of transient failures of the store (`DEFAULT_RETRY` if
            None).

    Returns:
        The state, ready for ``pipeline.setstate(...)``.

    Warns:
        DamagedCheckpointWarning: if newer files of a ``{step}`` pattern were refused and
            an older one loaded, naming each.

    Raises:
        CheckpointNotFoundError: (a FileNotFoundError and a CheckpointFileError) if the
            file does not exist, or no file matches a ``{step}`` pattern.
        CheckpointFileError: (a ValueError) naming the file, if it is empty, truncated or
            not JSON, not a checkpoint of this library, of a newer format version, or its
            content does not match its checksum (edited or damaged); for a ``{step}``
            pattern, if every matching file is refused, naming each.
    """
    return _load(os.fspath(path), Store.of(storage_options, retry), fallback=True).state


def load_checkpoint_info(
    path: str | os.PathLike[str],
    *,
    storage_options: StorageOptions | None = None,
    retry: RetryPolicy | None = None,
    fallback: bool = True,
) -> LoadedCheckpoint:
    """`load_checkpoint`, telling which file and step were read and which were refused.

    Args:
        path: as for `load_checkpoint`.
        storage_options: passed to fsspec for URLs.
        retry: the retry policy of transient failures of the store (`DEFAULT_RETRY` if
            None).
        fallback: with a ``{step}`` pattern, whether a refused newest file makes the next
            older file be tried (with a `DamagedCheckpointWarning`); False raises the
            newest file's error instead.

    Returns:
        The state, the file read, its step and the refused newer files.

    Raises:
        CheckpointNotFoundError, CheckpointFileError: as `load_checkpoint`.
    """
    return _load(os.fspath(path), Store.of(storage_options, retry), fallback=fallback)


def _load(
    pattern: str, store: Store, *, fallback: bool
) -> LoadedCheckpoint:
    if not _has_step_field("load_checkpoint", pattern):
        state, step = _load_file(pattern, None, store)
        return LoadedCheckpoint(state, pattern, step)
    found = _steps(pattern, store)
    if not found:
        raise CheckpointNotFoundError(f"load_checkpoint: no checkpoint file matches {pattern!r}")
    refused: list[tuple[str, str]] = []
    for step, source in reversed(found):
        try:
            state, _ = _load_file(source, step, store)
        except CheckpointFileError as error:
            if not fallback:
                raise
            refused.append((source, str(error)))
            continue
        if refused:
            warnings.warn(
                DamagedCheckpointWarning(
                    f"load_checkpoint: loaded {source} (step {step}), the newest intact "
                    f"checkpoint file of {pattern!r}; refused newer: {_reasons(refused)}"
                ),
                stacklevel=3,
            )
        return LoadedCheckpoint(state, source, step, tuple(refused))
    raise CheckpointFileError(
        f"load_checkpoint: none of the {len(found)} checkpoint files of {pattern!r} is "
        f"intact: {_reasons(refused)}"
    )


def _reasons(refused: list[tuple[str, str]]) -> str:
    shown = "; ".join(reason for _, reason in refused[:_REASONS_SHOWN])
    more = len(refused) - _REASONS_SHOWN
    return shown + (f"; and {more} more" if more > 0 else "")


def _load_file(
    source: str, step: int | None, store: Store
) -> tuple[State, int | None]:
    """(state, step) of the checkpoint file `source`; `step` is that of its name, if any."""
    state, recorded = _decode(source, _read(source, store))
    if step is not None and recorded is not None and recorded != step:
        raise CheckpointFileError(
            f"{source}: the file name says step {step}, the checkpoint was saved at step "
            f"{recorded} (a renamed or copied file)"
        )
    return state, step if step is not None else recorded


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


def _steps(pattern: str, store: Store) -> list[tuple[int, str]]:
    """(step, path) of the existing files matching the ``{step}`` pattern, by step."""
    matcher = _step_matcher(pattern)
    name = _name_of(pattern)
    directory = pattern[: len(pattern) - len(name)]
    found: list[tuple[int, str]] = []
    for entry in _list_names(directory, store):
        match = matcher.fullmatch(entry)
        if match:
            found.append((int(match.group(1)), directory + entry))
    return sorted(found)


def _read(source: str, store: Store) -> bytes:
    try:
        with open_stream(source, store) as file:
            return file.read()
    except FileNotFoundError as error:  # io.ChunkNotFoundError
        raise CheckpointNotFoundError(f"{source}: no such checkpoint file") from error
    except ChunkFormatError as error:  # e.g. a truncated .gz
        raise CheckpointFileError(f"{source}: {error}") from None


def _list_names(directory: str, store: Store) -> list[str]:
    try:
        found = find_files(glob.escape(directory) + "*", store)
    except FileNotFoundError:  # io.ChunkNotFoundError: no file matches
        return []
    return [_name_of(path) for path in found]
