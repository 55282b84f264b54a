"""The pipeline graph: the stages a pipeline is made of, and how messages name a stage.

`walk` is the one walk over a pipeline (statistics, error notes, the watchdog, background
start, elastic restore and the contract checker all use it). Every message and report
names a stage by its path from the outermost stage: each step is a class name and the
attribute that leads on, ``.source`` for a stage's one source or ``.sources[i]`` for one
of several, e.g. ``FixedBatchIterator.source > ZipIterator.sources[1] > MapIterator``
(``pipeline.source.sources[1]``). A `Stage` shows its class and the arguments it was
built with (``MapIterator(source_iterator=ZipIterator, transform=parse)``).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from .names import callable_name, short_repr
from .protocol import CheckpointableIterator

ARGUMENT_LIMIT = 40
"""The most characters an argument takes in a stage's repr."""


class Node:
    """A stage as part of a pipeline graph: its sources (upstream), the stages that consume
    it (downstream, held weakly) and its repr. The base of `Stage`."""

    _upstream: tuple[Iterator[Any], ...] = ()
    _consumers: tuple[weakref.ref[Node], ...] = ()
    _replica_sources: ClassVar[bool] = False
    """Whether its sources are copies of one pipeline (statistics add them up)."""
    _init_args: tuple[tuple[Any, ...], dict[str, Any]] = ((), {})
    """The arguments it was built with (recorded by `Stage.__new__`)."""

    @property
    def _name(self) -> str:
        return type(self).__name__

    @property
    def source(self) -> Iterator[Any]:
        """The iterator this stage reads from, as paths name it
        (``MapIterator.source > SelectManyIterator``).

        Raises:
            AttributeError: for a stage with several sources (see `sources`) or none.
        """
        if len(self._upstream) != 1:
            raise AttributeError(
                f"{self._name} has {len(self._upstream)} sources, not one: see its .sources"
            )
        return self._upstream[0]

    @property
    def sources(self) -> tuple[Iterator[Any], ...]:
        """The iterators this stage reads from, in the order paths number them
        (``ZipIterator.sources[1] > MapIterator``)."""
        return self._upstream

    @property
    def _sources(self) -> tuple[Iterator[Any], ...]:
        """The upstream iterators; setting them registers this stage as their consumer."""
        return self._upstream

    @_sources.setter
    def _sources(self, sources: tuple[Iterator[Any], ...]) -> None:
        self._upstream = tuple(sources)
        for source in self._upstream:
            if isinstance(source, Node):
                source._consumers = (*source._consumers, weakref.ref(self))

    def __repr__(self) -> str:
        return f"{self._name}({', '.join(_shown_arguments(self))})"


def _shown_arguments(node: Node) -> list[str]:
    """``name=value`` for each argument `node` was built with (defaults left out)."""
    args, kwargs = node._init_args
    signature = inspect.signature(type(node).__init__)
    try:
        bound = signature.bind(node, *args, **kwargs).arguments
    except TypeError:
        return ["..."]
    shown: list[str] = []
    for name, value in list(bound.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            shown.extend(_shown(item) for item in value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            shown.extend(f"{key}={_shown(item)}" for key, item in value.items())
        else:
            shown.append(f"{name}={_shown(value)}")
    return shown


def _shown(value: object) -> str:
    """A source by its class name, a callable by its name, a list of sources as a list of
    class names, anything else by a short repr."""
    if isinstance(value, CheckpointableIterator):
        return type(value).__name__
    if callable(value) and not isinstance(value, type):
        return callable_name(value)
    if isinstance(value, (list, tuple)) and any(
        isinstance(item, CheckpointableIterator) for item in value
    ):
        text = f"[{', '.join(_shown(item) for item in value)}]"
        return text if len(text) <= ARGUMENT_LIMIT else f"{text[: ARGUMENT_LIMIT - 4]}...]"
    return short_repr(value, ARGUMENT_LIMIT)


def sources_of(stage: object) -> tuple[Iterator[Any], ...]:
    """The iterators `stage` reads from (none for an iterator outside the library)."""
    return stage._upstream if isinstance(stage, Node) else ()


def consumers_of(stage: Node) -> list[Node]:
    """The stages that read from `stage` and are still alive."""
    alive = (ref() for ref in stage._consumers)
    return [consumer for consumer in alive if consumer is not None]


def step(stage: object, index: int) -> str:
    """The path step from `stage` to its source number `index`: ``.source`` or
    ``.sources[index]``."""
    return ".source" if len(sources_of(stage)) == 1 else f".sources[{index}]"


def step_to(stage: object, source: object) -> str:
    """The path step from `stage` to `source` (see `step`); "" if it is not a source."""
    for index, candidate in enumerate(sources_of(stage)):
        if candidate is source:
            return step(stage, index)
    return ""


@dataclass(frozen=True, eq=False)
class Place:
    """A stage of a pipeline, with where it is."""

    stage: CheckpointableIterator[Any]
    path: str
    """``FixedBatchIterator.source > ZipIterator.sources[1] > MapIterator``."""
    pattern: str
    """`path` with the index of a copy of a replicated pipeline written ``*``
    (``_ShardGroup.sources[*] > MapIterator``: that stage in every copy)."""
    parent: Place | None
    """The place of the stage that reads from this one (None for the outermost)."""

    @property
    def depth(self) -> int:
        """0 for the outermost stage, 1 for its sources, ..."""
        return 0 if self.parent is None else self.parent.depth + 1

    def above(self) -> Iterator[Place]:
        """The places downstream of this one, nearest first."""
        place = self.parent
        while place is not None:
            yield place
            place = place.parent


def walk(
    pipeline: object, descend: Callable[[Place], bool] | None = None
) -> Iterator[Place]:
    """`pipeline` and the checkpointable iterators upstream of it, outermost first, depth
    first with sources in order, each once; `descend(place)` false: not into that
    stage's sources. Nothing if `pipeline` is not a CheckpointableIterator."""
    if not isinstance(pipeline, CheckpointableIterator):
        return
    seen: set[int] = set()
    name = type(pipeline).__name__
    pending = [Place(pipeline, name, name, None)]
    while pending:
        place = pending.pop()
        if id(place.stage) in seen:
            continue
        seen.add(id(place.stage))
        yield place
        if descend is not None and not descend(place):
            continue
        stage = place.stage
        replicas = isinstance(stage, Node) and stage._replica_sources
        inner = []
        for index, source in enumerate(sources_of(stage)):
            if isinstance(source, CheckpointableIterator):
                here, name = step(stage, index), type(source).__name__
                copy = ".sources[*]" if replicas else here
                path, pattern = f"{place.path}{here} > {name}", f"{place.pattern}{copy} > {name}"
                inner.append(Place(source, path, pattern, place))
        pending.extend(reversed(inner))


def stages(pipeline: object) -> list[Node]:
    """The library's stages of `pipeline`, in `walk` order."""
    return [place.stage for place in walk(pipeline) if isinstance(place.stage, Node)]


def chain(source: object, longest: int = 12) -> str:
    """``MapIterator.source > SelectManyIterator``: the path from `source` down its chain
    of single sources, to where it ends or branches (at most `longest` stages)."""
    path = type(source).__name__
    for _ in range(longest - 1):
        upstream = sources_of(source)
        if len(upstream) != 1:
            break
        source = upstream[0]
        path = f"{path}.source > {type(source).__name__}"
    return path
