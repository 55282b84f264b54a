"""What /proc says about processes (Linux): parents, command lines, descendants."""

from __future__ import annotations

import os


def parent_of(pid: int | str) -> int | None:
    """The parent's pid, or None if `pid` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def command_of(pid: int | str, limit: int = 120) -> str:
    """The command line of `pid` (its first `limit` characters), or "?" if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")[:limit]
    except OSError:
        return "?"


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    entries = (entry for entry in os.listdir("/proc") if entry.isdigit())
    return [int(entry) for entry in entries if parent_of(entry) == pid]


def descendants_of(root: int) -> list[int]:
    """Every process below `root`: children, their children, and so on."""
    parents = {int(entry): parent_of(entry) for entry in os.listdir("/proc") if entry.isdigit()}
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found
