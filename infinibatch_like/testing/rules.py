"""The checkpoint contract as a table: `RULES`, each rule an id, a one-sentence statement
and the function that checks it on a `Trial`.

`assert_checkpointable` runs the table in its order: the rules that read the states of one
run first, then the restores, then the rules that build pipelines of their own, and C8
(clean closing) last, once every other pipeline is closed. A check raises a
`ContractViolation` whose message starts with the rule's id (``"C4: ..."``).
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import pickle
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._core.protocol import CheckpointableIterator
from .._core.stage import Stage
from .damage import check_damaged_states
from .states import dumped, emptied, shape, stage_names
from .streams import Same, all_same, preview, take
from .trial import Restore, Trial
from .violations import ContractViolation, require

_PLAIN_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class Rule:
    """One rule of the checkpoint contract.

    Attributes:
        id: how violations and exemptions name it (``"C4"``, ``"pickle"``).
        statement: the rule, in one sentence.
        check: raises a `ContractViolation` naming `id` where the trial breaks the rule.
    """

    id: str
    statement: str
    check: Callable[[Trial], None]


def _check_plain_states(trial: Trial) -> None:
    for position, state in enumerate(trial.states):
        _require_plain(state, position)


def _require_plain(value: Any, position: int, path: str = "state") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            require(
                isinstance(key, str), "C6", f"{path} has a non-str key {key!r} at item {position}"
            )
            _require_plain(item, position, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _require_plain(item, position, f"{path}[{index}]")
    else:
        require(
            isinstance(value, _PLAIN_SCALARS),
            "C6",
            f"{path} holds a {type(value).__name__} at item {position}; states must be dicts, "
            "lists, str, int, float, bool or None",
        )


def _check_getstate_is_free(trial: Trial) -> None:
    require(
        all_same(trial.items, trial.reference, trial.options.equal),
        "C1",
        "calling getstate() between items changed the stream",
    )
    for position, (state, text) in enumerate(zip(trial.states, trial.frozen, strict=True)):
        require(
            dumped(state) == text,
            "C1",
            f"the state taken at item {position} changed as iteration went on",
        )


def _check_stable_shape(trial: Trial) -> None:
    first = shape(trial.states[0])
    for position, state in enumerate(trial.states):
        require(
            shape(state) == first,
            "C5",
            f"the state's shape at item {position} differs from the one at item 0:\n"
            f"{shape(state)}\n!=\n{first}",
        )


def _check_sticky_end(trial: Trial) -> None:
    length = len(trial.reference)
    for after in [trial.beyond_end, *(restore.beyond_end for restore in trial.restores)]:
        if after:
            raise ContractViolation(
                f"C7: the stream ended after {length} items, then yielded {after[0]!r}"
            )


def _require_restored(restore: Restore, rule: str) -> None:
    if restore.refused is not None:
        raise ContractViolation(
            f"{rule}: the {restore.label} state of item {restore.position} was refused: "
            f"{restore.refused}"
        ) from restore.refused


def _check_faithful_restore(trial: Trial) -> None:
    for restore in trial.restores:
        _require_restored(restore, "C4")
        require(
            restore.state_after == trial.frozen[restore.position],
            "C4",
            f"getstate() right after setstate() of the {restore.label} state of item "
            f"{restore.position} differs from that state",
        )


def _check_exact_restore(trial: Trial) -> None:
    equal = trial.options.equal
    for restore in trial.restores:
        _require_restored(restore, "C2")
        require(
            all_same(restore.items, restore.expected, equal),
            "C2",
            f"a fresh pipeline restored from the {restore.label} state of item "
            f"{restore.position} yields {preview(restore.items)}, expected "
            f"{preview(restore.expected)}",
        )
    # Restores into one instance, in reverse order.
    pipeline, reference = trial.pipeline, trial.reference
    for position in reversed(trial.points):
        pipeline.setstate(copy.deepcopy(trial.states[position]))
        expected = reference[position : position + trial.options.continuation]
        got = take(pipeline, len(expected))
        require(
            all_same(got, expected, equal),
            "C2",
            f"the pipeline reused for a restore to item {position} yields {preview(got)}, "
            f"expected {preview(expected)}",
        )


def _check_reset(trial: Trial) -> None:
    trial.pipeline.setstate(None)
    got = take(trial.pipeline, len(trial.reference))
    require(
        all_same(got, trial.reference, trial.options.equal),
        "C3",
        f"after setstate(None) the pipeline yields {preview(got)}, expected "
        f"{preview(trial.reference)}",
    )


def _check_foreign_state(trial: Trial) -> None:
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


def _check_snapshots(trial: Trial) -> None:
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
    if isinstance(pipeline, Stage):
        for source in pipeline._sources:
            if isinstance(source, CheckpointableIterator):
                return source
    return None


def _check_inner_restore(trial: Trial) -> None:
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


def _check_different_arguments(trial: Trial) -> None:
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


def _check_damage(trial: Trial) -> None:
    options = trial.options
    if options.check_damage:
        state = trial.states[trial.middle]
        check_damaged_states(trial.factory, state, options.deadline, options.user_data_keys)


def _check_pickle(trial: Trial) -> None:
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


def _check_closing(trial: Trial) -> None:
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


RULES: tuple[Rule, ...] = (
    Rule(
        "C6",
        "States are plain data (dicts with str keys, lists, str, int, float, bool, None), "
        "which restore alike after a JSON and a torch.load(weights_only=True) round trip.",
        _check_plain_states,
    ),
    Rule(
        "C1",
        "getstate() does not advance the iterator, and what it returns does not change as "
        "iteration goes on.",
        _check_getstate_is_free,
    ),
    Rule(
        "C5",
        "The state has the same shape (keys and value types, None fitting any) at every step.",
        _check_stable_shape,
    ),
    Rule(
        "C7",
        "Exhaustion is sticky, and a state taken at the end restores to an exhausted iterator.",
        _check_sticky_end,
    ),
    Rule(
        "C4",
        "getstate() right after setstate(s) equals s, also when the caller added keys of its "
        "own to s, at the top level or inside nested stage states.",
        _check_faithful_restore,
    ),
    Rule(
        "C2",
        "A state taken after k items makes a fresh pipeline, or the same one restored again, "
        "yield the original run's items from item k on.",
        _check_exact_restore,
    ),
    Rule("C3", "setstate(None) equals a fresh construction.", _check_reset),
    Rule(
        "foreign state",
        "A state of another pipeline is refused with a ValueError naming the stage.",
        _check_foreign_state,
    ),
    Rule(
        "C9",
        "States are snapshots: emptying the dict returned by getstate(), or the dict given to "
        "setstate(), changes neither what the pipeline yields nor what it reports.",
        _check_snapshots,
    ),
    Rule(
        "inner restore",
        "A setstate() on the source of the outermost stage never leaves that stage silently "
        "yielding a stream that does not match its getstate(): it follows, or raises.",
        _check_inner_restore,
    ),
    Rule(
        "C10",
        "A state of the same pipeline built with other stream-deciding arguments (the "
        "`different` factory) is refused with a ValueError naming a stage.",
        _check_different_arguments,
    ),
    Rule(
        "C11",
        "A damaged state (a count set to 10**18, 2**64 or -1, a number replaced by a str, a "
        "float, a bool or None) is refused with a ValueError or TypeError naming a stage, or "
        "restored, within the deadline: never a hang, never another exception.",
        _check_damage,
    ),
    Rule("pickle", "A pipeline pickled mid-stream continues where it was.", _check_pickle),
    Rule(
        "C8",
        "close() is idempotent, next() raises after it, no thread or process outlives it, and "
        "getstate() after it raises or returns the true position.",
        _check_closing,
    ),
)
"""The rules, in the order `assert_checkpointable` checks them."""
