"""A chunking job's own files in its output: listed by name (the output path is literal,
never a pattern), JSON read back with damage named, the lock that gives the output to one
job at a time, and the clean-up of what interrupted writes left.

The lock: a local output holds ``.chunk.lock``, locked with ``flock`` while a job runs. The
operating system drops the lock when the process ends, however it ends (SIGKILL included),
so a lock is never stale; the empty file stays. Object stores have no such lock: a URL
output is not locked, and two jobs must not be started on one URL output together (a job
started after another wrote its ``job.json`` is still refused if its options differ).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from typing import Any

from ..io._store import Store
from ..io.output import output_in
from ..io.streams import open_stream
from ._refs import base_name, is_url, join_ref

LOCK_NAME = ".chunk.lock"
_TEMPORARY = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
"""The name `open_output` gives a file while it writes it."""


def file_names(location: str, store: Store) -> list[str]:
    """The names of the files directly in the directory (or URL prefix) `location`,
    sorted; none if it does not exist."""
    if not is_url(location):
        try:
            with os.scandir(location) as entries:
                return sorted(entry.name for entry in entries if entry.is_file())
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, path = store.filesystem(location)

    def listing() -> list[str]:
        fs.invalidate_cache(path)
        try:
            found = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(base_name(info["name"]) for info in found if info["type"] == "file")

    return store.call(listing, location, "listing")


def load_json(data: bytes | str, what: str) -> Any:
    """The JSON value in `data`.

    Raises:
        ValueError: ``"WHAT is not UTF-8 text (...)"``, ``"WHAT is not valid JSON (...)"``
            or ``"WHAT is nested too deeply to parse"``.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return json.loads(text)
    except UnicodeDecodeError as error:
        raise ValueError(f"{what} is not UTF-8 text ({error})") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} is not valid JSON ({error})") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to parse") from None


def read_bytes(ref: str, store: Store) -> bytes:
    """The content of the file or object `ref`."""
    with open_stream(ref, store) as stream:
        data: bytes = stream.read()
    return data


def write_json(ref: str, value: Any, store: Store) -> None:
    """Write `value` as JSON to `ref` (atomically)."""
    with output_in(ref, store) as output:
        output.write(json.dumps(value, indent=1).encode("utf-8"))


@contextlib.contextmanager
def output_lock(out: str, owner: str) -> Iterator[None]:
    """Hold the lock of the local output directory `out` (created if needed); nothing for a
    URL (see the module).

    Raises:
        ValueError: naming `out` if another job holds it.
    """
    if is_url(out):
        yield
        return
    os.makedirs(out, exist_ok=True)
    descriptor = os.open(os.path.join(out, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(
                f"{owner}: another chunk job is writing {out!r} (it holds "
                f"{os.path.join(out, LOCK_NAME)}); wait for it to end, or choose another "
                "output directory"
            ) from None
        yield
    finally:
        os.close(descriptor)  # drops the lock


def clean_up(out: str, pieces_dir: str, store: Store) -> None:
    """Remove the piece manifests of a finished job and the temporary files that killed
    writes left in `out` (the caller holds its lock)."""
    pieces = join_ref(out, pieces_dir)
    if is_url(out):
        for name in file_names(pieces, store):
            store.remove(join_ref(pieces, name))
        return
    for directory in (out, pieces):
        for name in file_names(directory, store):
            if directory == pieces or _TEMPORARY.match(name):
                store.remove(os.path.join(directory, name))
    with contextlib.suppress(FileNotFoundError, OSError):
        os.rmdir(pieces)
