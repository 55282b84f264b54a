"""Optional dependencies: the error raised when a feature's extra is not installed."""

from __future__ import annotations


class MissingExtraError(ModuleNotFoundError):
    """A feature needs a package from one of this library's optional extras."""


def missing_extra(module: str, extra: str, feature: str) -> MissingExtraError:
    """The error for `feature` needing `module`, installed by ``infinibatch_like[extra]``.

    Raise it from the original ``ModuleNotFoundError`` (``raise missing_extra(...) from
    error``) so that both show.
    """
    return MissingExtraError(
        f"{feature} needs the package {module!r}, which is not installed; install it with "
        f"`pip install 'infinibatch_like[{extra}]'`",
        name=module,
    )
