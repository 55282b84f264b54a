"""A public conformance checker for the checkpoint contract, for users' own stages and
pipelines.

- `checker`: `assert_checkpointable`, which runs the rules on pipelines from a factory.
- `rules`: the contract as a table (`RULES`): each rule's id, statement and check.
- `trial`: the runs several rules share (the reference, states at every item, restores).
- `fresh_runs`: the checks of the rules that build pipelines of their own.
- `damage`: damaged states and their bounded-time check (C11).
- `resume`: `check_resume` (a training loop's resumes, end to end).
- `states`, `streams`: what the checkers do with states and streams.
- `violations`: `ContractViolation` (naming the rule) and `ResumeMismatch`.
"""

from .checker import assert_checkpointable
from .resume import check_resume
from .violations import ContractViolation, ResumeMismatch

__all__ = ["ContractViolation", "ResumeMismatch", "assert_checkpointable", "check_resume"]
