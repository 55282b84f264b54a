"""A public conformance checker for the checkpoint contract, for users' own stages and
pipelines.

- `checker`: `assert_checkpointable` (every rule of the contract, for a pipeline and every
  stage in it) and `check_resume` (a training loop's resumes, end to end).
"""

from .checker import ContractViolation, ResumeMismatch, assert_checkpointable, check_resume

__all__ = ["ContractViolation", "ResumeMismatch", "assert_checkpointable", "check_resume"]
