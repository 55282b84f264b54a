"""The checks of the rules that build pipelines of their own with the trial's factory:
foreign states, snapshots (C9), inner restores, other arguments (C10), damaged states
(C11), pickling and closing (C8). `infinibatch_like.testing.rules.RULES` runs them."""

from __future__ import annotations

import json
import multiprocessing
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from .._core.graph import walk
from .._core.protocol import CheckpointableIterator
from .damage import check_damaged_states
from .states import dumped, emptied, stage_names
from .streams import Same, all_same, preview, take
from .trial import Trial
from .violations import ContractViolation, require


def check_foreign_state(trial: Trial) -> None:
    """Three foreign states (another stage tag, an unexpected field, not a dict) are each
    refused with a ValueError naming the pipeline's stage."""
    pipeline = trial.factory()
    name = type(pipeline).__name__
    foreigns: list[Any] = [{"stage": "NoSuchStage"}, {"stage": name, "unexpected": 1}, []]
    for foreign in foreigns:
        try:
            pipeline.setstate(foreign)
        except ValueError as error:
            require(
                name in str(error),
                "foreign state",
                f"the error for a foreign state does not name the stage {name}: {error}",
            )
        else:
            raise ContractViolation(f"foreign state: {name} accepted the state {foreign!r}")
    pipeline.close()


def check_snapshots(trial: Trial) -> None:
    """C9: the dicts returned by and given to getstate()/setstate() are emptied; the
    pipelines report and yield as before."""
    middle = trial.middle
    pipeline = trial.factory()
    take(pipeline, middle)
    returned = pipeline.getstate()
    kept = dumped(returned)
    emptied(returned)
    require(
        dumped(pipeline.getstate()) == kept,
        "C9",
        f"emptying the dict returned by getstate() at item {middle} changed the pipeline's state",
    )
    given = json.loads(kept)
    fresh = trial.factory()
    fresh.setstate(given)
    emptied(given)
    require(
        dumped(fresh.getstate()) == kept,
        "C9",
        f"emptying the dict given to setstate() (item {middle}) changed the pipeline's state",
    )
    for label, iterator in (("getstate()", pipeline), ("setstate()", fresh)):
        _require_continuation(
            iterator,
            trial.reference,
            middle,
            trial.options.equal,
            "C9",
            f"after emptying the dict given to or returned by {label} at item {middle}, the "
            "pipeline",
        )
        iterator.close()


def _require_continuation(
    iterator: CheckpointableIterator[Any],
    reference: Sequence[Any],
    start: int,
    equal: Same,
    rule: str,
    what: str,
) -> None:
    """Require `iterator` to yield ``reference[start:]``; else a violation of `rule`."""
    got = take(iterator, len(reference) - start)
    require(
        all_same(got, reference[start:], equal),
        rule,
        f"{what} yields {preview(got)}, expected {preview(reference[start:])}",
    )


def _inner_stage(pipeline: CheckpointableIterator[Any]) -> CheckpointableIterator[Any] | None:
    """The first checkpointable source of `pipeline`, if it has one."""
    return next((place.stage for place in walk(pipeline) if place.parent is not None), None)


def check_inner_restore(trial: Trial) -> None:
    """A state of the outermost stage's source, given to that source, leaves the outer
    stage following it or raising."""
    reference, equal = trial.reference, trial.options.equal
    pipeline = trial.factory()
    inner = _inner_stage(pipeline)
    if inner is None or len(reference) < 4:
        pipeline.close()
        return
    take(pipeline, len(reference) // 4)
    early = inner.getstate()
    take(pipeline, len(reference) // 4)
    inner.setstate(early)
    try:
        state = pipeline.getstate()
        got = take(pipeline, 10)
    except (RuntimeError, ValueError):
        pipeline.close()
        return  # a clear refusal to go on
    fresh = trial.factory()
    fresh.setstate(state)
    expected = take(fresh, len(got))
    fresh.close()
    pipeline.close()
    require(
        all_same(got, expected, equal),
        "inner restore",
        f"after setstate() on the pipeline's source {type(inner).__name__}, the pipeline "
        f"yields {preview(got)} while its getstate() describes {preview(expected)}; it "
        "must follow its source or raise",
    )


def check_different_arguments(trial: Trial) -> None:
    """C10: the `different` factory's pipeline refuses a state, naming a stage."""
    different = trial.options.different
    if different is None:
        return
    pipeline = trial.factory()
    take(pipeline, trial.middle)
    state = pipeline.getstate()
    pipeline.close()
    other = different()
    names = stage_names(state) | {type(other).__name__}
    try:
        other.setstate(state)
    except ValueError as error:
        require(
            any(name in str(error) for name in names),
            "C10",
            f"the error for a state of a differently built pipeline names no stage: {error}",
        )
    else:
        raise ContractViolation(
            "C10: a pipeline built with other stream-deciding arguments accepted a state of "
            f"the original one (item {trial.middle})"
        )
    finally:
        other.close()


def check_damage(trial: Trial) -> None:
    """C11, on the state taken at the middle (see `check_damaged_states`)."""
    options = trial.options
    if options.check_damage:
        state = trial.states[trial.middle]
        check_damaged_states(trial.factory, state, options.deadline, options.user_data_keys)


def check_pickle(trial: Trial) -> None:
    """A pipeline pickled at the middle continues there."""
    if not trial.options.check_pickle:
        return
    pipeline = trial.factory()
    middle = trial.middle
    take(pipeline, middle)
    copied = pickle.loads(pickle.dumps(pipeline))
    _require_continuation(
        copied,
        trial.reference,
        middle,
        trial.options.equal,
        "pickle",
        f"a pipeline pickled at item {middle}",
    )
    copied.close()
    pipeline.close()


def check_closing(trial: Trial) -> None:
    """C8: the position after a close, then the trial's pipeline closed twice, next()
    raising, and no thread or process of the check left."""
    _check_closed_state(trial)
    pipeline = trial.pipeline
    pipeline.close()
    pipeline.close()
    try:
        next(pipeline)
    except StopIteration:
        raise ContractViolation("C8: next() after close() raised StopIteration") from None
    except Exception:  # any error is the expected outcome
        pass
    else:
        raise ContractViolation("C8: next() after close() returned an item")
    leaked = [thread for thread in threading.enumerate() if thread not in trial.threads_before]
    require(not leaked, "C8", f"threads outlive close(): {leaked}")
    children = [
        child
        for child in multiprocessing.active_children()
        if child not in trial.children_before
    ]
    require(not children, "C8", f"processes outlive close(): {children}")


def _check_closed_state(trial: Trial) -> None:
    middle = trial.middle
    with trial.factory() as pipeline:
        take(pipeline, middle)
    try:
        state = pipeline.getstate()
    except RuntimeError:
        return  # raising is allowed; a wrong position is not
    fresh = trial.factory()
    fresh.setstate(state)
    _require_continuation(
        fresh,
        trial.reference,
        middle,
        trial.options.equal,
        "C8",
        f"a pipeline restored from the state returned by getstate() after closing at item {middle}",
    )
    fresh.close()
