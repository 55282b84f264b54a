"""The state schema: the fields of a stage's state, declared once with validators, and
the one validation that checks a state against them.

A stage declares its fields in ``_state_fields`` (see `Stage`): each maps to a `Field`
(`Of`, `Int`, `OneOf`, `Real`, `ListOf`, `Pair`, `Record`, `Check`, `Omissible`) or, for a plain
type check, to a type or a tuple of types. `check_fields` validates a whole state in one
pass; what it finds wrong is a `SchemaError` naming the field by its path within the
state (``'skips.last[2]'``, ``'shards[0].replay'``) and what was wrong, which the stage
raises as its own `StateMismatchError` (so the message names the stage too). Bounds
that depend on the stage (a replay of at most its ``snapshot_every``, one weight per
source) are functions of the stage, called when a state is checked.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, cast

from .names import short_repr

Bound: TypeAlias = int | Callable[[Any], int]
"""A bound: a number, or a function of the stage whose state is checked."""


class SchemaError(ValueError):
    """A state (or part of one) that does not fit its schema: `path` names the field."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"state field {path!r} {problem}" if path else problem)


class Field(ABC):
    """A validator of one value of a state."""

    @abstractmethod
    def check(self, value: object, path: str, owner: Any) -> None:
        """Raise `SchemaError` (naming `path`) if `value` does not fit; `owner` is the stage
        whose state is checked (for bounds that depend on it)."""


FieldSpec: TypeAlias = Field | type | tuple[type, ...]
"""What a stage's ``_state_fields`` maps a field to: a `Field`, or a type or a tuple of
types (checked as `Of`)."""


def _bound(bound: Bound, owner: Any) -> int:
    return bound if isinstance(bound, int) else bound(owner)


def _type_name(kind: type) -> str:
    return "None" if kind is type(None) else kind.__name__


class Of(Field):
    """A value of one of `kinds` (a bool is not an int here unless `bool` is listed)."""

    def __init__(self, *kinds: type) -> None:
        self.kinds = kinds

    def check(self, value: object, path: str, owner: Any) -> None:
        kinds = self.kinds
        if not isinstance(value, kinds) or (
            type(value) is bool and bool not in kinds and object not in kinds
        ):
            names = " or ".join(_type_name(kind) for kind in kinds)
            raise SchemaError(
                path, f"has type {type(value).__name__}, expected {names}: {short_repr(value)}"
            )


class Int(Field):
    """An int (not a bool) >= `low` (None: unbounded) and <= `high` (or < `below`).

    `name` names what the upper bound is (``"snapshot_every"``, ``"batch_size"``), and
    `hint` says what to do about a value beyond it.
    """

    def __init__(
        self,
        low: Bound | None = 0,
        high: Bound | None = None,
        *,
        below: Bound | None = None,
        name: str = "",
        hint: str = "",
    ) -> None:
        self.low, self.high, self.below, self.name, self.hint = low, high, below, name, hint

    def check(self, value: object, path: str, owner: Any) -> None:
        Of(int).check(value, path, owner)
        number = cast(int, value)
        low = None if self.low is None else _bound(self.low, owner)
        high = None if self.high is None else _bound(self.high, owner)
        below = None if self.below is None else _bound(self.below, owner)
        if (
            (low is None or number >= low)
            and (high is None or number <= high)
            and (below is None or number < below)
        ):
            return
        lowest = "" if low is None else f">= {low}"
        if high is None and below is None:
            raise SchemaError(path, f"must be {lowest}, got {number}")
        bound = high if below is None else below
        named = f"{self.name}={bound}" if self.name else str(bound)
        if below is not None:
            problem = f"must be {lowest} and < {named}" if lowest else f"must be < {named}"
        else:
            problem = f"must be between {low} and {named}" if lowest else f"must be <= {named}"
        problem += f", got {number}"
        raise SchemaError(path, problem + (f"; {self.hint}" if self.hint else ""))


class OneOf(Field):
    """One of `values` (compared by type and value)."""

    def __init__(self, *values: object) -> None:
        self.values = values

    def check(self, value: object, path: str, owner: Any) -> None:
        if not any(type(value) is type(option) and value == option for option in self.values):
            raise SchemaError(path, f"must be one of {list(self.values)}, got {short_repr(value)}")


class Real(Field):
    """A finite real number (not a bool) >= `low`."""

    def __init__(self, low: float = 0.0) -> None:
        self.low = low

    def check(self, value: object, path: str, owner: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise SchemaError(path, f"must be a real number, got {short_repr(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number) or number < self.low:
            raise SchemaError(path, f"must be finite and >= {self.low:g}, got {short_repr(value)}")


class ListOf(Field):
    """A list whose items all fit `item`; with `length`, exactly that many (`per` says what
    each stands for in the message: ``"source"``); with `most`, at most that many."""

    def __init__(
        self,
        item: FieldSpec,
        length: Bound | None = None,
        per: str = "",
        *,
        most: Bound | None = None,
    ) -> None:
        self.item, self.length, self.per, self.most = as_field(item), length, per, most

    def check(self, value: object, path: str, owner: Any) -> None:
        if not isinstance(value, list):
            raise SchemaError(path, f"must be a list, got {type(value).__name__}")
        if self.most is not None and len(value) > _bound(self.most, owner):
            raise SchemaError(
                path,
                f"holds {len(value)} items, expected at most {_bound(self.most, owner)}: "
                f"{short_repr(value)}",
            )
        if self.length is not None:
            length = _bound(self.length, owner)
            if len(value) != length:
                per = f" (one per {self.per})" if self.per else ""
                raise SchemaError(
                    path, f"holds {len(value)} items, expected {length}{per}: {short_repr(value)}"
                )
        for index, item in enumerate(value):
            self.item.check(item, f"{path}[{index}]", owner)


class Pair(Field):
    """A list of two items, fitting `first` and `second` (``[name, count]``)."""

    def __init__(self, first: FieldSpec, second: FieldSpec) -> None:
        self.parts = (as_field(first), as_field(second))

    def check(self, value: object, path: str, owner: Any) -> None:
        if not isinstance(value, list) or len(value) != 2:
            raise SchemaError(path, f"must be a list of 2 items, got {short_repr(value)}")
        for index, (part, item) in enumerate(zip(self.parts, value, strict=True)):
            part.check(item, f"{path}[{index}]", owner)


class Record(Field):
    """A dict holding `fields` (each checked); with `exact`, no other keys."""

    def __init__(self, fields: Mapping[str, FieldSpec], exact: bool = False) -> None:
        self.fields = {key: as_field(spec) for key, spec in fields.items()}
        self.exact = exact

    def check(self, value: object, path: str, owner: Any) -> None:
        if not isinstance(value, dict):
            raise SchemaError(path, f"must be a dict, got {type(value).__name__}")
        missing = [key for key in self.fields if key not in value]
        if missing:
            raise SchemaError(path, f"lacks the fields {missing}: {short_repr(value)}")
        if self.exact:
            extra = sorted(str(key) for key in value if key not in self.fields)
            if extra:
                raise SchemaError(path, f"has unexpected fields {extra}")
        for key, field in self.fields.items():
            field.check(value[key], f"{path}.{key}", owner)


class Check(Field):
    """A value that `problem(value, owner)` accepts: it returns what is wrong, or None."""

    def __init__(self, problem: Callable[[Any, Any], str | None]) -> None:
        self.problem = problem

    def check(self, value: object, path: str, owner: Any) -> None:
        problem = self.problem(value, owner)
        if problem is not None:
            raise SchemaError(path, problem)


class Omissible(Field):
    """A field that a state may lack (written by some instances only); when present it
    fits `field`."""

    def __init__(self, field: FieldSpec) -> None:
        self.field = as_field(field)

    def check(self, value: object, path: str, owner: Any) -> None:
        self.field.check(value, path, owner)


def as_field(spec: FieldSpec) -> Field:
    """`spec` as a `Field`: a type or a tuple of types stands for `Of`."""
    if isinstance(spec, Field):
        return spec
    return Of(*spec) if isinstance(spec, tuple) else Of(spec)


def check_fields(fields: Mapping[str, FieldSpec], state: Mapping[str, Any], owner: Any) -> None:
    """Check the top-level `fields` of `state` (a stage's state): every one present and
    fitting its validator; a `SchemaError` for the first that does not."""
    missing = sorted(
        key for key, spec in fields.items() if key not in state and not isinstance(spec, Omissible)
    )
    if missing:
        raise SchemaError("", f"the state lacks the fields {missing}")
    for key, spec in fields.items():
        if key in state:
            as_field(spec).check(state[key], key, owner)
