"""`assert_checkpointable`: the checkpoint contract checked on pipelines from a factory.

``assert_checkpointable(factory)`` builds fresh pipelines with `factory` and checks, for
the pipeline and every stage in it, each rule of the contract of ``docs/concepts.md``:
C1-C11, and that a state of another pipeline is refused naming the stage ("foreign
state"), that a restore of an inner stage is followed or refused ("inner restore") and
that a pipeline pickled mid-stream continues ("pickle"). The rules, each with its
statement and its check, are the table `infinibatch_like.testing.rules.RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from .rules import RULES
from .streams import Factory, default_same
from .trial import Options, Trial


def assert_checkpointable(
    factory: Factory,
    *,
    max_items: int = 60,
    restore_points: Sequence[int] | None = None,
    continuation: int = 20,
    same: Callable[[Any, Any], bool] | None = None,
    check_pickle: bool = True,
    check_torch: bool = True,
    different: Factory | None = None,
    check_damage: bool = True,
    deadline: float = 10.0,
    user_data_keys: Collection[str] = ("recurrent_state", "buffer"),
    exempt: Mapping[str, str] | None = None,
) -> None:
    """Check the checkpoint contract on pipelines built by `factory`.

    The rules (`infinibatch_like.testing.rules.RULES`) are checked in the table's order;
    the first that fails raises.

    Args:
        factory: builds a fresh pipeline each call (fresh sources too), deterministically.
        max_items: how many items of the stream to examine (fewer if it ends).
        restore_points: positions k whose states are restored into fresh pipelines; by
            default all of them up to 64, else 64 spread evenly, plus the end.
        continuation: items compared after each restore (the first, middle and last
            restore points are compared up to `max_items`).
        same: item equality (default ``==``, applied recursively to lists and tuples by
            Python itself).
        check_pickle: also pickle a pipeline mid-stream and continue from the copy.
        check_torch: also round-trip states through ``torch.save``/``torch.load(...,
            weights_only=True)`` when torch is installed.
        different: builds the same pipeline with other stream-deciding arguments, whose
            states must not fit the pipelines of `factory` (C10); None skips the check.
        check_damage: restore damaged states (C11).
        deadline: seconds that a restore of one damaged state and the next items may take.
            A restore that overruns it is left running in a daemon thread (Python cannot
            stop a thread), so a hang found this way can slow the rest of a test session.
        user_data_keys: state keys whose values are the user's data (items held, recurrent
            states), handed to user code as they are: C11 does not damage them.
        exempt: rules not checked, by id (``{"pickle": "holds a socket"}``), each with the
            reason the pipeline cannot keep it, for a reader of the test to review.

    Raises:
        ContractViolation: naming the rule that failed, the position and the details.
        ValueError: if `exempt` names a rule that does not exist or gives no reason.
    """
    skipped = _exempted(exempt or {})
    options = Options(
        max_items=max_items,
        restore_points=restore_points,
        continuation=continuation,
        equal=same or default_same,
        check_pickle=check_pickle,
        check_torch=check_torch,
        different=different,
        check_damage=check_damage,
        deadline=deadline,
        user_data_keys=frozenset(user_data_keys),
    )
    trial = Trial(factory, options)
    for rule in RULES:
        if rule.id not in skipped:
            rule.check(trial)
    trial.pipeline.close()  # closed already, unless C8 is exempt


def _exempted(exempt: Mapping[str, str]) -> set[str]:
    ids = [rule.id for rule in RULES]
    unknown = sorted(set(exempt) - set(ids))
    if unknown:
        raise ValueError(
            f"assert_checkpointable: exempt names no rule {unknown}; the rules are {ids}"
        )
    for rule, reason in exempt.items():
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(
                f"assert_checkpointable: exempt[{rule!r}] must say why the pipeline cannot keep "
                f"the rule, got {reason!r}"
            )
    return set(exempt)
