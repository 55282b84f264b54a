"""`check_resume`: a training loop's resumes, end to end.

One uninterrupted run against runs interrupted at several points and restored, after a
JSON and a ``torch.load(weights_only=True)`` round trip of the state, into fresh pipelines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._core.protocol import State
from .streams import Factory, all_same, choose_points, default_same, preview, round_trips, take
from .violations import ResumeMismatch


def check_resume(
    factory: Factory,
    *,
    max_items: int = 200,
    restore_points: int | Sequence[int] = 8,
    same: Callable[[Any, Any], bool] | None = None,
    check_torch: bool = True,
) -> None:
    """Check that runs interrupted and restored yield the uninterrupted run's stream.

    Run this on your own pipeline, the way your training loop builds, saves and restores
    it. One run of `max_items` items from ``factory()`` is the reference. For each restore
    point k, a second pipeline takes k items, saves its state and is closed (the
    interruption); the state, as it is, after a JSON round trip and after a ``torch.save``
    / ``torch.load(weights_only=True)`` round trip, is restored into a fresh pipeline from
    `factory`, whose items must be the reference's items k, k+1, ... to the end (and end
    where it ends). Finally one chained run is interrupted at every restore point in turn,
    each time resumed by a fresh pipeline from the state of the previous one.

    Args:
        factory: builds the pipeline, fresh and deterministic, each call (fresh sources
            too, e.g. a new `chunked_dataset_iterator`).
        max_items: the length of the compared stream (fewer if the stream ends).
        restore_points: the positions to interrupt at, or how many positions to spread
            evenly over the stream (0 and the end included).
        same: item equality (default ``==`` and the same type; give one for items such as
            numpy arrays or tensors).
        check_torch: also round-trip the state through torch when torch is installed.

    Raises:
        ResumeMismatch: (a `ContractViolation`) for the first restore point and round trip
            whose resumed stream differs, naming the point, the round trip, the first
            differing item's index and previews of the expected and received items; or
            whose restore raised.
    """
    equal = same or default_same
    with factory() as pipeline:
        reference = take(pipeline, max_items)
    ended = len(reference) < max_items
    if isinstance(restore_points, int):
        points = choose_points(len(reference), None, spread=restore_points)
    else:
        points = choose_points(len(reference), restore_points)
    for point in points:
        with factory() as interrupted:
            take(interrupted, point)
            state = interrupted.getstate()
        for label, variant in round_trips(state, check_torch):
            _resume(factory, variant, point, label, reference, len(reference), ended, equal)
    _check_chained_resumes(factory, points, reference, ended, check_torch, equal)


def _check_chained_resumes(
    factory: Factory,
    points: Sequence[int],
    reference: Sequence[Any],
    ended: bool,
    check_torch: bool,
    equal: Callable[[Any, Any], bool],
) -> None:
    """One run interrupted at every point in turn, each time resumed by a fresh pipeline."""
    state: State | None = None
    position = 0
    for turn, point in enumerate(sorted({*points, len(reference)} - {0})):
        state = _resume(factory, state, position, "chained", reference, point, ended, equal)
        variants = round_trips(state, check_torch)
        state, position = variants[turn % len(variants)][1], point


def _resume(
    factory: Factory,
    state: State | None,
    point: int,
    label: str,
    reference: Sequence[Any],
    end: int,
    ended: bool,
    equal: Callable[[Any, Any], bool],
) -> State:
    """Restore `state` (saved at `point`) into a fresh pipeline, compare up to `end`."""
    with factory() as fresh:
        try:
            fresh.setstate(state)
        except Exception as error:
            raise ResumeMismatch(
                f"check_resume: restoring the {label} state saved at item {point} raised "
                f"{type(error).__name__}: {error}",
                point,
                label,
                None,
            ) from error
        extra = 1 if ended and end == len(reference) else 0
        got = take(fresh, end - point + extra)
        expected = reference[point:end]
        if not all_same(got, expected, equal):
            _report_difference(point, label, got, expected, equal)
        return fresh.getstate()


def _report_difference(
    point: int,
    label: str,
    got: Sequence[Any],
    expected: Sequence[Any],
    equal: Callable[[Any, Any], bool],
) -> None:
    offset = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if not equal(a, b)),
        min(len(got), len(expected)),
    )
    index = point + offset
    expected_item = expected[offset] if offset < len(expected) else None
    got_item = got[offset] if offset < len(got) else None
    if offset >= len(got):
        what = f"ended after {len(got)} items, expected {expected_item!r}"
    elif offset >= len(expected):
        what = f"yielded {got_item!r} where the uninterrupted run ended"
    else:
        what = f"expected {expected_item!r}, got {got_item!r}"
    raise ResumeMismatch(
        f"check_resume: a fresh pipeline restored from the {label} state saved at item "
        f"{point} differs from the uninterrupted run at item {index}: {what}\n"
        f"  expected from item {index}: {preview(expected[offset:])}\n"
        f"  got from item {index}:      {preview(got[offset:])}",
        point,
        label,
        index,
        expected_item,
        got_item,
    )
