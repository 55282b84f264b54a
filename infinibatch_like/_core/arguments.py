"""The arguments that decide a stage's stream: recorded in its states (the fingerprint),
checked when a state is restored, and named in errors as the pipeline's builder named them."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

from .protocol import State, StateMismatchError

A = TypeVar("A", bound="StreamArguments")


class StreamArguments:
    """The base of `Stage` that knows its stream-deciding arguments (`_arguments`)."""

    _argument_labels: Mapping[str, str] = MappingProxyType({})
    """How errors name this stage's arguments where a builder set them from its own (see
    `label_arguments`)."""

    def mismatch(self, reason: str) -> StateMismatchError:
        """A StateMismatchError raised by this stage itself."""
        return StateMismatchError(reason, (type(self).__name__,))

    @property
    def _fingerprint(self) -> State:
        cached: State | None = self.__dict__.get("_fingerprint_cache")
        if cached is None:
            cached = self.__dict__["_fingerprint_cache"] = self._arguments()
        return cached

    def _arguments(self) -> State:
        """The arguments that decide the stream, as small plain data (computed once).

        A state taken with other values is refused, naming the argument. Arguments that
        may change at a restart (sizes of background buffers, read-ahead) are left out.
        """
        return {}

    def label_arguments(self: A, labels: Mapping[str, str]) -> A:
        """Name some of this stage's arguments, in errors, as the builder of the pipeline
        named the arguments they came from (``{"block_size": "chunked_dataset_iterator's
        buffer_size"}``); returns the stage."""
        self._argument_labels = MappingProxyType(dict(labels))
        return self

    def _argument_changed(self, name: str, saved: object, own: object) -> StateMismatchError:
        """The error for a state taken with another value of the argument `name`."""
        label = self._argument_labels.get(name)
        taken = f"{name}={saved!r}, this stage has {name}={own!r}"
        if label is not None:
            taken = f"{label}={saved!r}, this pipeline has {own!r} ({type(self).__name__}'s {name})"
        return self.mismatch(
            f"the checkpoint was taken with {taken}; this argument decides the stream and "
            "cannot change at a restart"
        )

    def _check_fingerprint(self, saved: object, own: State) -> None:
        """Refuse a state whose fingerprint `saved` differs from this stage's `own`."""
        if not isinstance(saved, dict):
            raise self.mismatch(f"state field 'fingerprint' must be a dict, got {saved!r}")
        for name, value in own.items():
            if name not in saved:
                raise self.mismatch(f"the state's fingerprint lacks the argument {name!r}")
            if type(saved[name]) is not type(value) or saved[name] != value:
                raise self._argument_changed(name, saved[name], value)
