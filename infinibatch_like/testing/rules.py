"""The checkpoint contract as a table: `RULES`, each rule an id, a one-sentence statement
and the function that checks it on a `Trial`.

`assert_checkpointable` runs the table in its order: the rules that read the states of one
run first, then the restores, then the rules that build pipelines of their own, and C8
(clean closing) last, once every other pipeline is closed. A check raises a
`ContractViolation` whose message starts with the rule's id (``"C4: ..."``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .fresh_runs import (
    check_closing,
    check_damage,
    check_different_arguments,
    check_foreign_state,
    check_inner_restore,
    check_pickle,
    check_snapshots,
)
from .states import dumped, shape
from .streams import all_same, preview, take
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
        check_foreign_state,
    ),
    Rule(
        "C9",
        "States are snapshots: emptying the dict returned by getstate(), or the dict given to "
        "setstate(), changes neither what the pipeline yields nor what it reports.",
        check_snapshots,
    ),
    Rule(
        "inner restore",
        "A setstate() on the source of the outermost stage never leaves that stage silently "
        "yielding a stream that does not match its getstate(): it follows, or raises.",
        check_inner_restore,
    ),
    Rule(
        "C10",
        "A state of the same pipeline built with other stream-deciding arguments (the "
        "`different` factory) is refused with a ValueError naming a stage.",
        check_different_arguments,
    ),
    Rule(
        "C11",
        "A damaged state (a count set to 10**18, 2**64 or -1, a number replaced by a str, a "
        "float, a bool or None) is refused with a ValueError or TypeError naming a stage, or "
        "restored, within the deadline: never a hang, never another exception.",
        check_damage,
    ),
    Rule("pickle", "A pipeline pickled mid-stream continues where it was.", check_pickle),
    Rule(
        "C8",
        "close() is idempotent, next() raises after it, no thread or process outlives it, and "
        "getstate() after it raises or returns the true position.",
        check_closing,
    ),
)
"""The rules, in the order `assert_checkpointable` checks them."""
