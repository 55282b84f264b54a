"""Checking the lines of a piece as it is read: UTF-8 text, or a JSON value per line.

A bad line raises ValueError naming the input and the line, or, under a `SkipPolicy`
(``chunk --skip-bad-lines``), is left out of the chunks and counted, as long as no window
of ``per_items`` lines of the piece (or, with ``per_items=None``, the whole job) holds more
than ``max_skips`` bad lines. Line numbers count from 1 in the piece: in the input file,
or from a byte range's start. The lines skipped depend only on the inputs and the options,
never on the workers.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..stages.bad_records import SkipPolicy

EXAMPLES = 5
"""How many skipped lines a piece (and the index) describes; all are counted."""


@dataclass
class BadLines:
    """The bad lines of one piece: raised without a policy, else skipped within its budget."""

    policy: SkipPolicy | None
    where: str
    """The piece, for messages: the input, and the byte range's start if it is one."""
    count: int = 0

    def __post_init__(self) -> None:
        self.examples: list[str] = []
        self._windows: Counter[int] = Counter()

    def bad(self, number: int, problem: str) -> None:
        """Line `number` has `problem`: count it, or raise ValueError."""
        found = f"line {number} of {self.where} {problem}"
        policy = self.policy
        if policy is None:
            raise ValueError(f"chunk: {found}")
        window = 0 if policy.per_items is None else (number - 1) // policy.per_items
        self._windows[window] += 1
        if self._windows[window] > policy.max_skips:
            span = (
                "in all"
                if policy.per_items is None
                else f"in lines {window * policy.per_items + 1}-{(window + 1) * policy.per_items}"
            )
            raise ValueError(
                f"chunk: more than {policy.max_skips} bad lines {span} of {self.where}, beyond "
                f"the budget on_error={policy!r}; the last: {found}"
            )
        self.count += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(found)


def text_blocks(blocks: Iterable[list[bytes]], bad: BadLines) -> Iterator[list[bytes]]:
    """The lines that are UTF-8 text (as ``read_lines`` reads them)."""
    number = 0
    for block in blocks:
        first, number = number + 1, number + len(block)
        try:
            b"\n".join(block).decode("utf-8")
        except UnicodeDecodeError:
            yield [
                line
                for line_number, line in enumerate(block, first)
                if _text(line, line_number, bad)
            ]
        else:
            yield block


def _text(line: bytes, number: int, bad: BadLines) -> bool:
    try:
        line.decode("utf-8")
    except UnicodeDecodeError as error:
        bad.bad(number, f"is not UTF-8 text ({error.reason} at byte {error.start} of the line)")
        return False
    return True


def json_blocks(blocks: Iterable[list[bytes]], bad: BadLines) -> Iterator[list[bytes]]:
    """The lines that hold a JSON value; blank lines left out (as ``read_jsonl`` skips them)."""
    number = 0
    for block in blocks:
        kept = []
        for number, line in enumerate(block, number + 1):  # noqa: B020 - runs on
            try:
                text = line.decode("utf-8")
                if text and not text.isspace():
                    json.loads(text)
                    kept.append(line)
            except ValueError as error:  # UnicodeDecodeError too
                bad.bad(number, f"is not JSON ({error}): {line[:80]!r}")
            except RecursionError:
                bad.bad(number, f"is nested too deeply to parse: {line[:80]!r}")
        yield kept
