"""How an exception raised in a worker reaches the consumer.

A worker process sends an `ErrorReport` (the exception pickled when it can be, and its
traceback as text); the consumer re-raises the original exception with the worker's
traceback as ``__cause__`` and a note naming where it was raised. A worker that dies
without a report becomes a `WorkerError`.
"""

from __future__ import annotations

import pickle
import signal
import traceback
from typing import NamedTuple

from .._core.notes import add_note, callable_origin


class WorkerError(RuntimeError):
    """A background worker died, or failed with an exception that cannot be re-raised."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (set as ``__cause__``)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


class ErrorReport(NamedTuple):
    """An exception raised in a worker process, as it travels to the consumer."""

    where: str
    type_name: str
    message: str
    traceback_text: str
    pickled: bytes | None
    """The exception itself, pickled, or None if it does not survive a pickle round trip."""


def report_error(error: BaseException, where: str, pipeline: object = None) -> ErrorReport:
    """Describe `error`, raised in a worker process while iterating `pipeline` (None: while
    applying a transform), for `rebuild_error` in the consumer."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    pickled: bytes | None = None
    try:
        candidate = pickle.dumps(error, pickle.HIGHEST_PROTOCOL)
        pickle.loads(candidate)
        pickled = candidate
    except Exception:
        pass
    return ErrorReport(
        _origin(error, where, pipeline), type(error).__qualname__, str(error), text, pickled
    )


def _origin(error: BaseException, where: str, pipeline: object) -> str:
    """`where`, after the user function of `pipeline` that raised `error`, if one did."""
    origin = None if pipeline is None else callable_origin(pipeline, error)
    return where if origin is None else f"{origin}, {where}"


def rebuild_error(report: ErrorReport) -> BaseException:
    """The exception of `report`, to raise in the consumer: its own type when it unpickles
    (with the worker's traceback as ``__cause__``), else a `WorkerError`."""
    remote = RemoteTraceback(
        f"\n\nTraceback in the worker ({report.where}):\n{report.traceback_text}"
    )
    error: object = None
    if report.pickled is not None:
        try:
            error = pickle.loads(report.pickled)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        return WorkerError(f"{report.type_name}: {report.message} (raised {report.where}){remote}")
    add_note(error, f"(raised {report.where}; the worker's traceback is shown above)")
    error.__cause__ = remote
    return error


def local_error(error: BaseException, where: str | None, pipeline: object = None) -> BaseException:
    """`error`, raised in a worker thread of this process while iterating `pipeline` (None:
    applying a transform), with a note naming `where` (None: passed on unchanged, it was
    described where it started)."""
    if where is not None:
        add_note(error, f"(raised {_origin(error, where, pipeline)})")
    return error


def describe_exit(exitcode: int | None) -> str:
    """``"killed by signal SIGKILL"``, ``"exit code 1"``: how a worker process ended."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def died(owner: str, pid: int | None, exitcode: int | None) -> WorkerError:
    """The error of a worker process of `owner` that died without a word."""
    return WorkerError(
        f"{owner}: its worker process (pid {pid}) died unexpectedly "
        f"({describe_exit(exitcode)}); call setstate() with a checkpoint to start a new one"
    )


def as_exception(failure: BaseException | ErrorReport) -> BaseException:
    """The exception to raise in the consumer for a worker's failure."""
    return failure if isinstance(failure, BaseException) else rebuild_error(failure)
