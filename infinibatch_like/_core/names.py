"""How the library names values in its messages and reprs: short reprs and callables' names."""

from __future__ import annotations

import reprlib
from functools import partial


def short_repr(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut in the middle to about `limit` characters (so that a path keeps
    its file name); nested containers are cut too."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = limit
    text = short.repr(value)
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return f"{text[:head]}...{text[len(text) - (limit - 3 - head) :]}"


def callable_name(function: object) -> str:
    """A user callable's name as messages show it: ``parse``, ``Tokenizer.encode``,
    ``partial(parse)``, the class name of a callable object."""
    if isinstance(function, partial):
        return f"partial({callable_name(function.func)})"
    name = getattr(function, "__qualname__", None)
    if not isinstance(name, str):  # a callable object
        name = type(function).__qualname__
    return name.rpartition("<locals>.")[2]
