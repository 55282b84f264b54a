"""The state schema: one validation, naming the field by its path and what was wrong."""

from __future__ import annotations

from typing import Any

import pytest

from infinibatch_like._core.schema import (
    Check,
    Int,
    ListOf,
    Of,
    Omissible,
    OneOf,
    Pair,
    Real,
    Record,
    SchemaError,
    check_fields,
)


class Owner:
    """Stands for the stage whose state is checked (bounds are read from it)."""

    limit = 3
    count = 2


ENTRY = Record({"name": str, "at": Int(0, lambda owner: owner.limit, name="limit")}, exact=True)
FIELDS: dict[str, Any] = {
    "source": (dict, type(None)),
    "entries": ListOf(ENTRY),
    "pairs": ListOf(Pair(str, Int(0))),
    "weights": ListOf(Real(), lambda owner: owner.count, "source"),
    "offset": Int(0, below=lambda owner: owner.count, name="count"),
    "phase": OneOf("running", "ended"),
    "even": Check(lambda value, owner: None if value % 2 == 0 else f"must be even, got {value}"),
    "extra": Omissible(Int(1)),
}
GOOD: dict[str, Any] = {
    "source": None,
    "entries": [{"name": "a", "at": 3}],
    "pairs": [["x", 0]],
    "weights": [0.5, 2],
    "offset": 1,
    "phase": "ended",
    "even": 4,
}


def test_a_state_that_fits_passes_and_an_omissible_field_may_be_absent() -> None:
    check_fields(FIELDS, GOOD, Owner())
    check_fields(FIELDS, {**GOOD, "extra": 1}, Owner())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"source": 1}, "state field 'source' has type int, expected dict or None: 1"),
        ({"entries": {}}, "state field 'entries' must be a list, got dict"),
        ({"entries": [{"name": "a", "at": 4}]},
         "state field 'entries[0].at' must be between 0 and limit=3, got 4"),
        ({"entries": [{"name": "a", "at": True}]},
         "state field 'entries[0].at' has type bool, expected int: True"),
        ({"entries": [{"name": "a"}]},
         "state field 'entries[0]' lacks the fields ['at']: {'name': 'a'}"),
        ({"entries": [{"name": "a", "at": 0, "more": 1}]},
         "state field 'entries[0]' has unexpected fields ['more']"),
        ({"pairs": [["x"]]}, "state field 'pairs[0]' must be a list of 2 items, got ['x']"),
        ({"pairs": [["x", -1]]}, "state field 'pairs[0][1]' must be >= 0, got -1"),
        ({"weights": [1.0]},
         "state field 'weights' holds 1 items, expected 2 (one per source): [1.0]"),
        ({"weights": [1.0, float("nan")]},
         "state field 'weights[1]' must be finite and >= 0, got nan"),
        ({"weights": [1.0, "2"]}, "state field 'weights[1]' must be a real number, got '2'"),
        ({"offset": 2}, "state field 'offset' must be >= 0 and < count=2, got 2"),
        ({"phase": "paused"},
         "state field 'phase' must be one of ['running', 'ended'], got 'paused'"),
        ({"even": 3}, "state field 'even' must be even, got 3"),
        ({"extra": 0}, "state field 'extra' must be >= 1, got 0"),
    ],
)
def test_what_does_not_fit_is_named_by_its_path(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError) as caught:
        check_fields(FIELDS, {**GOOD, **change}, Owner())
    assert str(caught.value) == message


def test_missing_fields_are_listed_and_a_plain_type_is_checked_as_of() -> None:
    with pytest.raises(SchemaError, match=r"^the state lacks the fields \['offset', 'phase'\]$"):
        check_fields(FIELDS, {key: GOOD[key] for key in GOOD if key not in ("offset", "phase")},
                     Owner())
    with pytest.raises(SchemaError, match=r"^state field 'n' has type bool, expected int: False$"):
        check_fields({"n": int}, {"n": False}, None)
    Of(object).check(True, "any", None)  # object admits a bool
