"""The ```python blocks of the documentation pages."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


FENCE = re.compile(r"^```python(?P<attrs>[^\n]*)\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
TITLE = re.compile(r'title="(?P<name>[\w.-]+\.py)"')


def python_blocks(page: str, root: Path = DOCS) -> list[tuple[str | None, int, str]]:
    """(title or None, line number, code) of each top-level ```python block of a page."""
    text = (root / page).read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        title = TITLE.search(match.group("attrs"))
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((title.group("name") if title else None, line, match.group("code")))
    return blocks
