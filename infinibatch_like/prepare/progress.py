"""Progress bars for long passes (chunking a corpus, a training or evaluation pass).

A thin layer over tqdm (the ``[progress]`` extra): the bar shows the count, the rate and,
given a `total`, the remaining time; it stays silent where nobody watches (output that is
not a terminal) or when `disable` is set, so scripts and logs get no control characters.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import IO, Any, Protocol, TypeVar

from .._core.extras import missing_extra

T = TypeVar("T")


class ProgressBar(Protocol):
    """What a progress bar offers: the subset of ``tqdm.tqdm`` this library relies on."""

    def update(self, n: float = 1) -> bool | None:
        """Advance the bar by `n` units."""

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Show `s` after the counts (e.g. the bytes written)."""

    def close(self) -> None:
        """Finish the bar (idempotent)."""

    def __enter__(self) -> ProgressBar: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def __iter__(self) -> Iterator[Any]: ...


def _tqdm() -> Any:
    try:
        from tqdm.auto import tqdm
    except ModuleNotFoundError as error:
        raise missing_extra("tqdm", "progress", "infinibatch_like.prepare.progress") from error
    return tqdm


def _disabled(disable: bool | None, file: IO[str] | None) -> bool:
    if disable is not None:
        return disable
    stream = sys.stderr if file is None else file
    isatty = getattr(stream, "isatty", None)
    return not (callable(isatty) and isatty())


def progress(
    iterable: Iterable[T],
    *,
    total: int | float | None = None,
    desc: str | None = None,
    unit: str = "items",
    disable: bool | None = None,
    file: IO[str] | None = None,
    **options: Any,
) -> Iterator[T]:
    """Yield the items of `iterable` while a progress bar counts them.

    Args:
        iterable: anything iterable, e.g. a pipeline.
        total: the number of items expected (e.g. ``index.items_per_epoch(...)``), for a
            percentage and a remaining time; None shows the count and the rate only.
        desc: a label before the bar.
        unit: what one item is called.
        disable: True hides the bar, False shows it; None (default) shows it only when
            `file` (default: stderr) is a terminal.
        file: where the bar is drawn (default: stderr).
        **options: further ``tqdm`` options (e.g. ``unit_scale=True``, ``mininterval``).

    Raises:
        MissingExtraError: if the bar is to be shown and tqdm is not installed (``pip
            install 'infinibatch_like[progress]'``); a hidden bar needs no tqdm.
    """
    return _iterate(_make(iterable, total, desc, unit, disable, file, options))


def _iterate(bar: ProgressBar) -> Iterator[Any]:
    with bar:
        yield from bar


def progress_bar(
    *,
    total: int | float | None = None,
    desc: str | None = None,
    unit: str = "items",
    disable: bool | None = None,
    file: IO[str] | None = None,
    **options: Any,
) -> ProgressBar:
    """A progress bar advanced by hand with ``bar.update(n)`` (for work done elsewhere,
    e.g. by worker processes); the arguments are those of `progress`. Close it, or use it
    as a context manager.

    Raises:
        MissingExtraError: if the bar is to be shown and tqdm is not installed.
    """
    return _make(None, total, desc, unit, disable, file, options)


def _make(
    iterable: Iterable[Any] | None,
    total: int | float | None,
    desc: str | None,
    unit: str,
    disable: bool | None,
    file: IO[str] | None,
    options: dict[str, Any],
) -> ProgressBar:
    if _disabled(disable, file):
        return _Hidden(iterable)
    bar: ProgressBar = _tqdm()(
        iterable, total=total, desc=desc, unit=unit, file=file, dynamic_ncols=True, **options
    )
    return bar


class _Hidden:
    """A progress bar that shows nothing (and needs no tqdm)."""

    def __init__(self, iterable: Iterable[Any] | None) -> None:
        self._iterable = () if iterable is None else iterable

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Hidden:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def __iter__(self) -> Iterator[Any]:
        return iter(self._iterable)
