"""Walking local directory trees without loops, and recursive (``**``) globs built on it.

`walk_files` follows symbolic links to directories, as ``glob``'s ``**`` does, but enters
each directory (by device and inode) once: a link back to an ancestor (a loop) is not
followed, and a directory reached by several links is listed under one path. Directories
reached without a link come first, then the linked ones in the order of their paths, so
the answer is the same on every run.
"""

from __future__ import annotations

import fnmatch
import functools
import heapq
import os
from collections.abc import Callable, Iterator

Parts = tuple[str, ...]
"""A path relative to the walk's root, as its components."""


def walk_files(root: str, descend: Callable[[Parts], bool] = lambda parts: True) -> Iterator[Parts]:
    """The files under directory `root` (each directory entered once; see the module), as
    their components relative to `root`, in no particular order. Subdirectories for which
    `descend` is false are not entered; entries that vanish or cannot be read are left out.
    """
    visited: set[tuple[int, int]] = set()
    direct: list[Parts] = [()]
    linked: list[Parts] = []  # a heap: the linked directories, by path
    while direct or linked:
        parts = direct.pop() if direct else heapq.heappop(linked)
        path = os.path.join(root, *parts)
        try:
            status = os.stat(path)
            if (status.st_dev, status.st_ino) in visited:
                continue
            visited.add((status.st_dev, status.st_ino))
            entries = list(os.scandir(path))
        except OSError:
            continue
        for entry in entries:
            child = (*parts, entry.name)
            try:
                is_dir, is_link = entry.is_dir(), entry.is_symlink()
            except OSError:
                continue
            if is_dir:
                if descend(child):
                    if is_link:
                        heapq.heappush(linked, child)
                    else:
                        direct.append(child)
            elif entry.is_file():
                yield child


def recursive_glob(pattern: str) -> list[str]:
    """The files matching a local `pattern` that holds a ``**`` component, with
    ``glob.glob(pattern, recursive=True)``'s meaning (hidden names only match patterns
    that start with a dot), walked with `walk_files`."""
    components = pattern.split(os.sep)
    fixed = 0
    while fixed < len(components) and not _magic(components[fixed]):
        fixed += 1
    base = os.sep.join(components[:fixed])
    root = base or (os.sep if pattern.startswith(os.sep) else os.curdir)
    wanted = tuple(components[fixed:])
    matcher = _Matcher(wanted)
    return [
        os.path.join(base, *parts)
        for parts in walk_files(root, matcher.may_hold)
        if matcher.matches(parts)
    ]


def has_recursive_part(pattern: str) -> bool:
    """Whether `pattern` has a ``**`` component (which matches any number of directories)."""
    return "**" in pattern.split(os.sep)


def _magic(component: str) -> bool:
    return any(character in component for character in "*?[")


def _name_matches(wanted: str, name: str) -> bool:
    if name.startswith(".") and not wanted.startswith("."):
        return False
    return fnmatch.fnmatchcase(name, wanted) if _magic(wanted) else name == wanted


class _Matcher:
    """Matching paths (as components) against glob components, ``**`` among them."""

    def __init__(self, wanted: Parts) -> None:
        self._wanted = wanted

    def matches(self, parts: Parts) -> bool:
        """Whether the whole of `parts` matches."""
        return self._match(parts, complete=True)

    def may_hold(self, parts: Parts) -> bool:
        """Whether paths below the directory `parts` may match."""
        return self._match(parts, complete=False)

    def _match(self, parts: Parts, complete: bool) -> bool:
        wanted = self._wanted

        @functools.cache
        def match(i: int, j: int) -> bool:  # wanted[i:] against parts[j:]
            if j == len(parts):
                rest = wanted[i:]
                return all(part == "**" for part in rest) if complete else bool(rest)
            if i == len(wanted):
                return False
            if wanted[i] == "**":
                return match(i + 1, j) or (not parts[j].startswith(".") and match(i, j + 1))
            return _name_matches(wanted[i], parts[j]) and match(i + 1, j + 1)

        return match(0, 0)
