"""What the checkers raise: `ContractViolation`, naming the rule, and `ResumeMismatch`."""

from __future__ import annotations

from typing import Any


class ContractViolation(AssertionError):
    """A checkpoint-contract rule does not hold; the message names the rule."""


class ResumeMismatch(ContractViolation):
    """A restored pipeline does not continue the uninterrupted stream (see `check_resume`).

    Attributes:
        restore_point: how many items the interrupted run had taken when its state was saved.
        round_trip: how the state travelled (``"original"``, ``"JSON round-tripped"``,
            ``"torch.load(weights_only=True)"``, or ``"chained"`` for the run restored at
            every point in turn).
        index: the stream position of the first differing item (None if restoring raised).
        expected: the uninterrupted run's item there (None past its end).
        got: the restored pipeline's item there (None if it ended early).
    """

    def __init__(
        self,
        message: str,
        restore_point: int,
        round_trip: str,
        index: int | None,
        expected: Any = None,
        got: Any = None,
    ) -> None:
        super().__init__(message)
        self.restore_point, self.round_trip, self.index = restore_point, round_trip, index
        self.expected, self.got = expected, got


def require(condition: bool, rule: str, message: str) -> None:
    """Raise a `ContractViolation` of `rule` (``"C4: <message>"``) unless `condition`."""
    if not condition:
        raise ContractViolation(f"{rule}: {message}")
