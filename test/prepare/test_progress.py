"""Progress bars: shown on terminals, silent elsewhere, and the [progress] extra."""

from __future__ import annotations

import io
import sys

import pytest

from infinibatch_like._core.extras import MissingExtraError
from infinibatch_like.prepare.progress import progress, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_counts_items_with_total_and_rate() -> None:
    out = _Terminal()
    assert list(progress(range(5), total=5, desc="epoch 1", unit="lines", file=out)) == list(
        range(5)
    )
    text = out.getvalue()
    assert "epoch 1" in text
    assert "5/5" in text
    assert "lines/s" in text


def test_no_bar_where_nobody_watches() -> None:
    out = io.StringIO()  # not a terminal
    assert list(progress("abc", file=out)) == ["a", "b", "c"]
    assert out.getvalue() == ""
    assert list(progress("ab", file=_Terminal(), disable=True)) == ["a", "b"]


def test_hand_driven_bar() -> None:
    out = _Terminal()
    with progress_bar(total=10, unit="B", file=out) as bar:
        bar.update(4)
        bar.set_postfix_str("12 items")
    assert "4/10" in out.getvalue()
    assert "12 items" in out.getvalue()


def test_missing_tqdm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    with pytest.raises(MissingExtraError, match=r"infinibatch_like\[progress\]"):
        progress([1], disable=False)
    assert list(progress([1, 2], disable=True)) == [1, 2]  # a hidden bar needs no tqdm
