"""How the checker looks at states: their shape, the stages they name, their text, and the
changes a caller makes to them (added keys, emptied dicts)."""

from __future__ import annotations

import json
from typing import Any


def dumped(state: Any) -> str:
    """`state` as canonical text, to compare states taken at different times (the repr
    of a state that is not JSON: rule C6 reports those)."""
    try:
        return json.dumps(state, sort_keys=True)
    except (TypeError, ValueError):
        return repr(state)


def shape(value: Any) -> Any:
    """Keys and value types; None fits any type, lists of stage states are compared."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(item, dict) and "stage" in item for item in value):
            return [shape(item) for item in value]
        return "list"
    if value is None:
        return _AnyType()
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


class _AnyType:
    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "None"


def with_caller_keys(state: Any) -> Any:
    """`state` with keys a caller might add: at the top (``epoch``) and in nested states."""
    if isinstance(state, dict):
        extended = {key: with_caller_keys(value) for key, value in state.items()}
        if "stage" in state:
            extended["added_by_caller"] = {"note": [1, "x"]}
        return extended
    if isinstance(state, list):
        return [with_caller_keys(value) for value in state]
    return state


def emptied(value: Any) -> None:
    """Empty every dict and list in `value`, in place."""
    if isinstance(value, (dict, list)):
        for item in list(value.values() if isinstance(value, dict) else value):
            emptied(item)
        value.clear()


def stage_names(state: Any) -> set[str]:
    """The stage tags (``"stage"`` values) anywhere in `state`."""
    if isinstance(state, dict):
        names = {state["stage"]} if isinstance(state.get("stage"), str) else set()
        for value in state.values():
            names |= stage_names(value)
        return names
    if isinstance(state, list):
        return set().union(*(stage_names(value) for value in state))
    return set()
