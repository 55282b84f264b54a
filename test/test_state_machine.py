"""A hypothesis state machine over randomly composed pipelines.

Each run draws a recipe (a source and up to four wrapper stages with random parameters),
builds the pipeline under test and, once, an uninterrupted reference run of the same
recipe. The rules advance the pipeline, take checkpoints (kept as returned and as a JSON
round-tripped copy), restore them into the same instance or a freshly built one, reset it
and pickle it; every item yielded must be the reference's item at the tracked position,
and the pipeline must end exactly where the reference ends, and stay ended.

Everything a recipe needs is a module-level function or a ``functools.partial`` of one, so
that pipelines pickle.
"""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

import infinibatch_like.iterators as it
from infinibatch_like import PackingIterator, TokenBudgetMultiplexIterator
from infinibatch_like.datasets import chunked_dataset_iterator

REFERENCE_CAP = 300
"""Positions beyond this are never visited: infinite streams are compared up to here."""


# -- item functions (module level so that pipelines pickle) ---------------------------------


def weight(item: Any) -> int:
    """A deterministic non-negative int for any item a recipe can produce."""
    if item is None:
        return 0
    if isinstance(item, int):
        return abs(item)
    if isinstance(item, float):
        return int(abs(item) * 1000)
    if isinstance(item, str):
        return sum(map(ord, item))
    return len(item) + sum(weight(element) for element in item)


def to_plain(item: Any) -> Any:
    """The item with every tuple turned into a list (plain data for JSON states)."""
    if isinstance(item, (list, tuple)):
        return [to_plain(element) for element in item]
    return item


def tag(item: Any) -> list[Any]:
    return ["t", weight(item) % 97]


def repeat_by_weight(offset: int, item: Any) -> list[Any]:
    """``[item] * (weight % 3 + offset)``: with offset 0 some collections are empty."""
    return [item] * (weight(item) % 3 + offset)


def parity(item: Any) -> int:
    return weight(item) % 2


def capacity(base: int, item: Any) -> int:
    """A batch capacity from the batch's first item; may be 0 or negative (counts as 1)."""
    return base - weight(item) % 4


def sample_with(rng: random.Random, item: Any) -> float:
    """Uses several of the generator's methods, gauss (with its cached value) included."""
    choice = rng.randrange(4)
    if choice == 0:
        drawn = rng.random()
    elif choice == 1:
        drawn = float(rng.choice([3, 5, 7]))
    else:
        drawn = rng.gauss(0.0, 1.0)
    return weight(item) % 5 + drawn


def accumulate(state: dict[str, int], item: Any) -> tuple[dict[str, int], list[int]]:
    """A step function that mutates its state in place (checkpoints must deep-copy it)."""
    state["count"] += 1
    state["acc"] = (state["acc"] * 31 + weight(item)) % 10_007
    return state, [state["count"], state["acc"]]


def as_document(item: Any) -> list[int]:
    """A non-empty token list (1 to 5 tokens) for any item."""
    value = weight(item)
    return [value % 50 + 3] * (value % 5 + 1)


def packed_plain(sequence: dict[str, Any]) -> list[list[Any]]:
    return [array.tolist() for array in sequence.values()]


def choose_source(item: Any) -> int:
    return weight(item) % 2


def read_chunk_from(chunks: tuple[tuple[str, ...], ...], index: int) -> list[str]:
    return list(chunks[index])


class Squares:
    """A re-iterable whose iterator is a generator (the non-indexed restore path)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return (i * i for i in range(self.n))

    def __repr__(self) -> str:
        return f"Squares({self.n})"


# -- recipes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """A source spec and the wrapper stage specs applied to it, in order."""

    source: tuple[Any, ...]
    stages: tuple[tuple[Any, ...], ...] = field(default=())
    unseeded: bool = False


def build_source(spec: tuple[Any, ...]) -> it.CheckpointableIterator[Any]:
    kind, *args = spec
    if kind == "native":
        return it.NativeCheckpointableIterator(list(args[0]))
    if kind == "squares":
        return it.NativeCheckpointableIterator(Squares(args[0]))
    if kind == "permutation":
        items, seed, shuffle, num_instances, rank, epochs = args
        return it.InfinitePermutationSourceIterator(
            list(items), seed=seed, shuffle=shuffle, num_instances=num_instances,
            instance_rank=rank, epochs=epochs,
        )
    if kind == "indices":
        num_items, seed, num_instances, rank, epochs = args
        return it.PermutationSourceIterator(
            num_items, seed=seed, epochs=epochs, num_instances=num_instances, instance_rank=rank
        )
    if kind == "chunked":
        items, num_instances, rank = args
        return it.ChunkedSourceIterator(list(items), num_instances=num_instances,
                                        instance_rank=rank)
    if kind == "random":
        return it.RandomIterator(seed=args[0])
    if kind == "dataset":
        chunks, buffer_size, train, seed, shuffle, use_windowed, transform, n, rank, epochs = args
        return chunked_dataset_iterator(
            list(range(len(chunks))), partial(read_chunk_from, chunks), buffer_size,
            train=train, seed=seed, shuffle=shuffle, use_windowed=use_windowed,
            transform=transform, num_instances=n, instance_rank=rank, epochs=epochs,
        )
    raise AssertionError(f"unknown source {kind}")


def build_stage(
    pipeline: it.CheckpointableIterator[Any], spec: tuple[Any, ...]
) -> it.CheckpointableIterator[Any]:
    kind, *args = spec
    if kind == "map":
        functions = {"weight": weight, "to_plain": to_plain, "tag": tag}
        return it.MapIterator(pipeline, functions[args[0]])
    if kind == "select_many":
        selector = None if args[0] is None else partial(repeat_by_weight, args[0])
        return it.SelectManyIterator(pipeline, selector, read_ahead=args[1])
    if kind == "batch":
        return it.FixedBatchIterator(pipeline, args[0])
    if kind == "window":
        return it.WindowedIterator(pipeline, args[0])
    if kind == "blockwise":
        return it.BlockwiseShuffleIterator(pipeline, args[0], args[1])
    if kind == "buffered":
        return it.BufferedShuffleIterator(pipeline, args[0], args[1])
    if kind == "bucketed":
        read_ahead, use_key, size, use_boundary, shuffle, seed = args
        return it.BucketedReadaheadBatchIterator(
            pipeline, read_ahead, weight if use_key else None,
            size if isinstance(size, int) else partial(capacity, size[1]),
            boundary_key=parity if use_boundary else None, shuffle=shuffle, seed=seed,
        )
    if kind == "sampling":
        return it.SamplingRandomMapIterator(pipeline, sample_with, args[0])
    if kind == "recurrent":
        return it.RecurrentIterator(pipeline, accumulate, {"count": 0, "acc": args[0]})
    if kind == "zip":
        other = build_source(args[0])
        return it.ZipIterator(pipeline, other) if args[1] else it.ZipIterator(other, pipeline)
    if kind == "weighted":
        other, weights, seed, exact, stop_on = args
        sources = [it.MapIterator(pipeline, weight), it.MapIterator(build_source(other), weight)]
        return it.WeightedMultiplexIterator(
            sources, list(weights), seed, exact=exact, stop_on=stop_on
        )
    if kind == "budget":
        other, weights, seed, exact, stop_on = args
        sources = [it.MapIterator(pipeline, weight), it.MapIterator(build_source(other), weight)]
        return TokenBudgetMultiplexIterator(
            sources, list(weights), weight, seed, exact=exact, stop_on=stop_on
        )
    if kind == "pack":
        seq_len, window, truncate = args
        options: dict[str, Any] = {"strategy": "best_fit", "window": window} if window else {}
        packer = PackingIterator(
            it.MapIterator(pipeline, as_document), seq_len, bos_id=1,
            long_documents="truncate" if truncate else "split", **options,
        )  # fmt: skip
        return it.MapIterator(packer, packed_plain)
    if kind == "multiplex":
        control = it.MapIterator(pipeline, choose_source)
        return it.MultiplexIterator(control, [build_source(args[0]), build_source(args[1])])
    raise AssertionError(f"unknown stage {kind}")


def build(recipe: Recipe) -> it.CheckpointableIterator[Any]:
    """A fresh pipeline for `recipe` (fresh sources too)."""
    pipeline = build_source(recipe.source)
    for spec in recipe.stages:
        pipeline = build_stage(pipeline, spec)
    return pipeline


@dataclass
class Drawn:
    """What the recipe strategy knows about the stream built so far."""

    infinite: bool
    depth: int  # nesting of lists/tuples in the items
    tuples: bool  # items may hold tuples (not plain data for JSON states)
    unseeded: bool = False


def seeds(draw: Any, drawn: Drawn, allow_str: bool = True) -> int | str | None:
    options: list[st.SearchStrategy[int | str | None]] = [st.integers(0, 2**40), st.none()]
    if allow_str:
        options.append(st.sampled_from(["alpha", "β-seed"]))
    seed: int | str | None = draw(st.one_of(*options))
    if seed is None:
        drawn.unseeded = True
    return seed


def ranks(draw: Any, most: int = 4) -> tuple[int, int]:
    num_instances = draw(st.integers(1, most))
    return num_instances, draw(st.integers(0, num_instances - 1))


def draw_source(draw: Any, drawn: Drawn, infinite_only: bool = False) -> tuple[Any, ...]:
    kinds = ["permutation", "indices", "random", "dataset"]
    epochs = st.none() if infinite_only else st.one_of(st.none(), st.integers(1, 3))
    if not infinite_only:
        kinds += ["native", "native", "squares", "chunked"]
    kind = draw(st.sampled_from(kinds))
    small_ints = st.lists(st.integers(0, 40), max_size=25)
    if kind == "native":
        return ("native", tuple(draw(small_ints)))
    if kind == "squares":
        return ("squares", draw(st.integers(0, 150)))
    if kind == "chunked":
        return ("chunked", tuple(draw(small_ints)), *ranks(draw))
    if kind == "permutation":
        items = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=12)))
        seed = seeds(draw, drawn)
        return ("permutation", items, seed, draw(st.booleans()), *ranks(draw, most=5),
                draw(epochs))
    if kind == "indices":
        return ("indices", draw(st.integers(1, 30)), seeds(draw, drawn), *ranks(draw, most=5),
                draw(epochs))
    if kind == "random":
        return ("random", seeds(draw, drawn))
    train = infinite_only or draw(st.booleans())
    passes = draw(epochs) if train else None
    # Endless training: every chunk has an item, else it could search forever.
    endless = train and passes is None
    chunk_sizes = draw(st.lists(st.integers(1 if endless else 0, 4), min_size=1 if train else 0,
                                max_size=6))
    chunks = tuple(
        tuple(f"k{c}.{i}" for i in range(size)) for c, size in enumerate(chunk_sizes)
    )
    shuffle = draw(st.booleans()) if train else False
    seed = seeds(draw, drawn, allow_str=False) if train else draw(st.integers(0, 99))
    transform = draw(st.sampled_from([None, str.upper]))
    return ("dataset", chunks, draw(st.integers(1, 6)), train, seed, shuffle,
            draw(st.booleans()), transform, *ranks(draw), passes)


def source_infinite(spec: tuple[Any, ...]) -> bool:
    """Whether the source spec's stream is endless (its epochs, the last field, None)."""
    if spec[0] == "random":
        return True
    if spec[0] == "dataset":
        return bool(spec[3]) and spec[-1] is None
    return spec[0] in ("permutation", "indices") and spec[-1] is None


STAGE_KINDS = [
    "map", "select_many", "batch", "window", "blockwise", "buffered", "bucketed",
    "sampling", "recurrent", "zip", "multiplex", "weighted", "budget", "pack",
]


def draw_stage(draw: Any, drawn: Drawn) -> list[tuple[Any, ...]]:
    """One stage spec (or two, when items must be made plain before a buffered shuffle)."""
    kind = draw(st.sampled_from(STAGE_KINDS))
    if kind == "map":
        name = draw(st.sampled_from(["weight", "to_plain", "tag"]))
        if name == "weight":
            drawn.depth = 0
        elif name == "tag":
            drawn.depth = 1
        drawn.tuples = False
        return [("map", name)]
    if kind == "select_many":
        options: list[int | None] = [1] if drawn.infinite else [0, 1]
        if drawn.depth > 0:
            options.append(None)  # flatten the item itself (lists and tuples are non-empty)
        offset = draw(st.sampled_from(options))
        if offset is None:
            drawn.depth -= 1
        return [("select_many", offset, draw(st.sampled_from([0, 0, 1, 3])))]
    if kind == "batch":
        drawn.depth += 1
        return [("batch", draw(st.integers(1, 4)))]
    if kind == "window":
        # Wide windows (over scalars only, to keep items small) move WindowedIterator's
        # anchors, taken every max(width, 64) items.
        widths = st.integers(1, 4)
        if drawn.depth == 0:
            widths = st.one_of(widths, st.integers(64, 70))
        drawn.depth += 1
        drawn.tuples = True
        return [("window", draw(widths))]
    if kind == "blockwise":
        return [("blockwise", draw(st.integers(1, 6)), seeds(draw, drawn))]
    if kind == "buffered":
        prefix = [("map", "to_plain")] if drawn.tuples else []
        drawn.tuples = False
        return [*prefix, ("buffered", draw(st.integers(1, 6)), seeds(draw, drawn))]
    if kind == "bucketed":
        size = draw(st.one_of(st.integers(1, 4), st.tuples(st.just("capacity"),
                                                          st.integers(0, 4))))
        drawn.depth += 1
        return [("bucketed", draw(st.integers(1, 8)), draw(st.booleans()), size,
                 draw(st.booleans()), draw(st.booleans()), seeds(draw, drawn))]
    if kind == "sampling":
        drawn.depth, drawn.tuples = 0, False
        return [("sampling", seeds(draw, drawn))]
    if kind == "recurrent":
        drawn.depth, drawn.tuples = 1, False
        return [("recurrent", draw(st.integers(0, 100)))]
    if kind == "zip":
        other = draw_source(draw, drawn)
        drawn.infinite = drawn.infinite and source_infinite(other)
        drawn.depth, drawn.tuples = drawn.depth + 1, True
        return [("zip", other, draw(st.booleans()))]
    if kind == "pack":  # items as token lists, packed (concat, or best fit in a window)
        drawn.depth, drawn.tuples = 2, False
        window = draw(st.sampled_from([0, 1, 3]))
        return [("pack", draw(st.integers(1, 7)), window, draw(st.booleans()))]
    if kind in ("weighted", "budget"):  # the stream and another source, as ints, mixed
        other = draw_source(draw, drawn)
        weights = draw(st.tuples(st.integers(0, 3), st.integers(0, 3)).filter(any))
        stop_on = draw(st.sampled_from(["all_exhausted", "first_exhausted"]))
        flags = (drawn.infinite, source_infinite(other))
        endless = [flag for flag, share in zip(flags, weights, strict=True) if share]
        drawn.infinite = any(endless) if stop_on == "all_exhausted" else all(endless)
        drawn.depth, drawn.tuples = 0, False
        seed = seeds(draw, drawn)
        return [(kind, other, weights, seed, draw(st.booleans()), stop_on)]
    # multiplex: the current stream picks (by item parity) between two endless sources
    first, second = draw_source(draw, drawn, True), draw_source(draw, drawn, True)
    drawn.depth, drawn.tuples = 0, False
    return [("multiplex", first, second)]


@st.composite
def recipes(draw: Any) -> Recipe:
    drawn = Drawn(infinite=False, depth=0, tuples=False)
    source = draw_source(draw, drawn)
    drawn.infinite = source_infinite(source)
    stages: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(0, 4))):
        stages += draw_stage(draw, drawn)
    return Recipe(source, tuple(stages), drawn.unseeded)


class FixedSystemRandom:
    """Stands in for ``random.SystemRandom`` while a seed=None recipe is first built.

    seed=None stages draw their seed from the operating system; drawing fixed seeds
    instead makes a failing example replay exactly. (If the library draws its seeds in
    another way, the test still holds; a failure may just not replay.)
    """

    def __init__(self) -> None:
        self._rng = random.Random(20_240_601)

    def __call__(self) -> FixedSystemRandom:
        return self

    def getrandbits(self, k: int) -> int:
        return self._rng.getrandbits(k)


# -- the machine ---------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal, with equal types all the way down (1 != 1.0, [1] != (1,))."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def dumped(state: Any) -> str:
    return json.dumps(state, sort_keys=True)


@dataclass(frozen=True)
class Checkpoint:
    position: int
    state: dict[str, Any]
    json_state: dict[str, Any]
    text: str

    def __repr__(self) -> str:
        return f"Checkpoint(position={self.position}, state={self.text})"


class PipelineMachine(RuleBasedStateMachine):
    checkpoints = Bundle("checkpoints")

    def __init__(self) -> None:
        super().__init__()
        self.recipe: Recipe | None = None
        self.pipeline: it.CheckpointableIterator[Any] | None = None
        self.reference_run: it.CheckpointableIterator[Any] | None = None
        self.reference: list[Any] = []
        self.reference_ended = False
        self.position = 0

    # -- the reference run, extended lazily --

    def reference_has(self, position: int) -> bool:
        """Whether the reference has an item at `position` (extending it as needed)."""
        assert self.reference_run is not None
        while len(self.reference) <= position and not self.reference_ended:
            try:
                self.reference.append(next(self.reference_run))
            except StopIteration:
                self.reference_ended = True
        return position < len(self.reference)

    def replace(self, pipeline: it.CheckpointableIterator[Any]) -> None:
        assert self.pipeline is not None
        if pipeline is not self.pipeline:
            self.pipeline.close()
        self.pipeline = pipeline

    # -- rules --

    @initialize(recipe=recipes())
    def start(self, recipe: Recipe) -> None:
        self.recipe = recipe
        if recipe.unseeded:
            with mock.patch.object(random, "SystemRandom", FixedSystemRandom()):
                self.pipeline = build(recipe)
        else:
            self.pipeline = build(recipe)
        self.reference_run = build(recipe)
        if recipe.unseeded:
            # A seed=None stage adopts the seed of the state it is given (pickled and
            # freshly built pipelines do too), so the reference replays the same stream.
            self.reference_run.setstate(json.loads(dumped(self.pipeline.getstate())))

    @rule(n=st.integers(1, 60))
    def advance(self, n: int) -> None:
        assert self.pipeline is not None
        for _ in range(n):
            if self.position >= REFERENCE_CAP:
                return
            if not self.reference_has(self.position):
                for attempt in range(2):
                    try:
                        item = next(self.pipeline)
                    except StopIteration:
                        continue
                    raise AssertionError(
                        f"the reference ended after {self.position} items, but the pipeline "
                        f"then yields {item!r} (attempt {attempt + 1})"
                    )
                return
            expected = self.reference[self.position]
            try:
                item = next(self.pipeline)
            except StopIteration:
                raise AssertionError(
                    f"the pipeline ended at item {self.position}; the reference yields "
                    f"{expected!r} there"
                ) from None
            assert same(item, expected), (
                f"item {self.position}: got {item!r}, expected {expected!r}"
            )
            self.position += 1

    @rule(target=checkpoints)
    def checkpoint(self) -> Checkpoint:
        assert self.pipeline is not None
        state = self.pipeline.getstate()
        text = dumped(state)
        return Checkpoint(self.position, state, json.loads(text), text)

    def check_restored(self, checkpoint: Checkpoint) -> None:
        assert self.pipeline is not None
        got = dumped(self.pipeline.getstate())
        assert got == checkpoint.text, (
            f"getstate() right after setstate() differs:\n{got}\n!=\n{checkpoint.text}"
        )
        self.position = checkpoint.position

    @staticmethod
    def chosen_state(checkpoint: Checkpoint, use_json: bool) -> dict[str, Any]:
        # C1: neither later iteration nor earlier restores may have changed a state.
        assert dumped(checkpoint.state) == checkpoint.text, (
            f"the state taken at item {checkpoint.position} changed afterwards:\n"
            f"{dumped(checkpoint.state)}\n!=\n{checkpoint.text}"
        )
        assert dumped(checkpoint.json_state) == checkpoint.text, "a restore changed the state"
        return checkpoint.json_state if use_json else checkpoint.state

    @rule(checkpoint=checkpoints, use_json=st.booleans())
    def restore_same(self, checkpoint: Checkpoint, use_json: bool) -> None:
        assert self.pipeline is not None
        self.pipeline.setstate(self.chosen_state(checkpoint, use_json))
        self.check_restored(checkpoint)

    @rule(checkpoint=checkpoints, use_json=st.booleans())
    def restore_fresh(self, checkpoint: Checkpoint, use_json: bool) -> None:
        assert self.recipe is not None
        fresh = build(self.recipe)
        fresh.setstate(self.chosen_state(checkpoint, use_json))
        self.replace(fresh)
        self.check_restored(checkpoint)

    @rule()
    def reset(self) -> None:
        # A stage built with seed=None keeps the seed it drew (or adopted from a restored
        # checkpoint), so a reset replays the reference's stream in every case.
        assert self.pipeline is not None
        self.pipeline.setstate(None)
        self.position = 0

    @rule()
    def pickle_roundtrip(self) -> None:
        assert self.pipeline is not None
        before = dumped(self.pipeline.getstate())
        copied = pickle.loads(pickle.dumps(self.pipeline))
        after = dumped(copied.getstate())
        assert after == before, f"the unpickled pipeline's state differs:\n{after}\n!=\n{before}"
        self.replace(copied)

    # -- invariants and teardown --

    @invariant()
    def state_is_plain_data(self) -> None:
        if self.pipeline is None:
            return
        state = self.pipeline.getstate()
        assert json.loads(json.dumps(state)) == state, f"state is not plain data: {state!r}"

    def teardown(self) -> None:
        for pipeline in (self.pipeline, self.reference_run):
            if pipeline is not None:
                pipeline.close()


PipelineMachine.TestCase.settings = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
TestPipelineMachine = PipelineMachine.TestCase
