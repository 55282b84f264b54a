"""Randomly composed pipelines for property tests: a recipe (a source and up to four
wrapper stages with random parameters), how to draw one with hypothesis and how to build it.

Everything a recipe needs is a module-level function or a ``functools.partial`` of one, so
that pipelines pickle.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from hypothesis import strategies as st

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
            list(items),
            seed=seed,
            shuffle=shuffle,
            num_instances=num_instances,
            instance_rank=rank,
            epochs=epochs,
        )
    if kind == "indices":
        num_items, seed, num_instances, rank, epochs = args
        return it.PermutationSourceIterator(
            num_items, seed=seed, epochs=epochs, num_instances=num_instances, instance_rank=rank
        )
    if kind == "chunked":
        items, num_instances, rank = args
        return it.ChunkedSourceIterator(
            list(items), num_instances=num_instances, instance_rank=rank
        )
    if kind == "random":
        return it.RandomIterator(seed=args[0])
    if kind == "dataset":
        chunks, buffer_size, train, seed, shuffle, use_windowed, transform, n, rank, epochs = args
        return chunked_dataset_iterator(
            list(range(len(chunks))),
            partial(read_chunk_from, chunks),
            buffer_size,
            train=train,
            seed=seed,
            shuffle=shuffle,
            use_windowed=use_windowed,
            transform=transform,
            num_instances=n,
            instance_rank=rank,
            epochs=epochs,
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
            pipeline,
            read_ahead,
            weight if use_key else None,
            size if isinstance(size, int) else partial(capacity, size[1]),
            boundary_key=parity if use_boundary else None,
            shuffle=shuffle,
            seed=seed,
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
        return ("permutation", items, seed, draw(st.booleans()), *ranks(draw, most=5), draw(epochs))
    if kind == "indices":
        return (
            "indices",
            draw(st.integers(1, 30)),
            seeds(draw, drawn),
            *ranks(draw, most=5),
            draw(epochs),
        )
    if kind == "random":
        return ("random", seeds(draw, drawn))
    train = infinite_only or draw(st.booleans())
    passes = draw(epochs) if train else None
    # Endless training: every chunk has an item, else it could search forever.
    endless = train and passes is None
    chunk_sizes = draw(
        st.lists(st.integers(1 if endless else 0, 4), min_size=1 if train else 0, max_size=6)
    )
    chunks = tuple(tuple(f"k{c}.{i}" for i in range(size)) for c, size in enumerate(chunk_sizes))
    shuffle = draw(st.booleans()) if train else False
    seed = seeds(draw, drawn, allow_str=False) if train else draw(st.integers(0, 99))
    transform = draw(st.sampled_from([None, str.upper]))
    return (
        "dataset",
        chunks,
        draw(st.integers(1, 6)),
        train,
        seed,
        shuffle,
        draw(st.booleans()),
        transform,
        *ranks(draw),
        passes,
    )


def source_infinite(spec: tuple[Any, ...]) -> bool:
    """Whether the source spec's stream is endless (its epochs, the last field, None)."""
    if spec[0] == "random":
        return True
    if spec[0] == "dataset":
        return bool(spec[3]) and spec[-1] is None
    return spec[0] in ("permutation", "indices") and spec[-1] is None


STAGE_KINDS = [
    "map",
    "select_many",
    "batch",
    "window",
    "blockwise",
    "buffered",
    "bucketed",
    "sampling",
    "recurrent",
    "zip",
    "multiplex",
    "weighted",
    "budget",
    "pack",
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
        size = draw(st.one_of(st.integers(1, 4), st.tuples(st.just("capacity"), st.integers(0, 4))))
        drawn.depth += 1
        return [
            (
                "bucketed",
                draw(st.integers(1, 8)),
                draw(st.booleans()),
                size,
                draw(st.booleans()),
                draw(st.booleans()),
                seeds(draw, drawn),
            )
        ]
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
