"""Per-item overhead of a chain of map stages: infinibatch_like vs infinibatch vs the floor.

Every variant applies the same cheap function (``x + 1``) ``--stages`` times (default 10) to
``range(--items)`` (default 1,000,000) and is drained by ``collections.deque(maxlen=0)``:

* ``generator floor``: nested generator expressions ``(inc(x) for x in g)``;
* ``builtin map``: nested ``map(inc, g)``;
* ``infinibatch`` / ``infinibatch_like``: ``MapIterator`` stages over
  ``NativeCheckpointableIterator(list(range(items)))``;
* ``torchdata.nodes`` (only if ``torchdata`` is installed): ``Mapper`` stages over
  ``IterableWrapper``.

Reported per variant (best of ``--reps`` runs, the variants interleaved, GC off while timing;
process CPU time, which other processes on a shared machine do not inflate, with wall-clock
time alongside):

* ``ns/item/stage``: (T(stages) - T(0 stages)) / (items * stages), the marginal cost of one
  stage (the source and the draining loop are subtracted);
* ``raw ns/item/stage``: T(stages) / (items * stages), the source amortised over the stages;
* ratios of infinibatch_like to the generator floor and to infinibatch.

Target for infinibatch_like: <= 40 ns per item per stage on a reference machine where
infinibatch takes ~70 and the floor ~28, i.e. <= 1.43x the floor and <= 0.57x infinibatch.

Usage: ``python bench/bench_map_chain.py`` (well under a minute) or ``--quick``.
"""

from __future__ import annotations

import argparse
import collections
import gc
import sys
from collections.abc import Callable, Iterator
from typing import Any

import _util
from _util import Samples, Stopwatch, median, print_table, ratio, verdict

FLOOR = "generator floor"
BUILTIN = "builtin map"
TORCHDATA = "torchdata.nodes"

REFERENCE_NS = {"infinibatch_like (target)": 40.0, "infinibatch": 70.0, FLOOR: 28.0}
TARGET_VS_FLOOR = 40.0 / 28.0
TARGET_VS_IB = 40.0 / 70.0


def inc(x: int) -> int:
    return x + 1


ChainFactory = Callable[[list[int], int], Iterator[int]]


def generator_chain(data: list[int], stages: int) -> Iterator[int]:
    it: Iterator[int] = iter(data)
    for _ in range(stages):
        it = (inc(x) for x in it)
    return it


def map_chain(data: list[int], stages: int) -> Iterator[int]:
    it: Iterator[int] = iter(data)
    for _ in range(stages):
        it = map(inc, it)
    return it


def library_chain(lib: _util.Library) -> ChainFactory:
    def build(data: list[int], stages: int) -> Iterator[int]:
        it: Any = lib.iterators.NativeCheckpointableIterator(data)
        for _ in range(stages):
            it = lib.iterators.MapIterator(it, inc)
        return it  # type: ignore[no-any-return]

    return build


def checkpoint_ok(factory: ChainFactory, stages: int) -> bool:
    """Checkpoint a chain after 500 of 1,000 items; a fresh chain must restore to the rest."""
    data = list(range(1_000))
    chain: Any = factory(data, stages)
    for _ in range(500):
        next(chain)
    state = chain.getstate()
    rest = list(chain)
    fresh: Any = factory(data, stages)
    fresh.setstate(state)
    return list(fresh) == rest == [x + stages for x in range(500, 1_000)]


def torchdata_chain() -> ChainFactory | None:
    try:
        from torchdata import nodes
    except Exception:
        return None

    def build(data: list[int], stages: int) -> Iterator[int]:
        node: Any = nodes.IterableWrapper(data)
        for _ in range(stages):
            node = nodes.Mapper(node, inc)
        node.reset()
        return node  # type: ignore[no-any-return]

    return build


def time_chain(factory: ChainFactory, data: list[int], stages: int) -> tuple[float, float]:
    """(wall, CPU) seconds to build the chain and drain it."""
    gc.collect()
    gc.disable()
    try:
        watch = Stopwatch()
        collections.deque(factory(data, stages), maxlen=0)
        return watch.read()
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200,000 items, 3 repeats")
    parser.add_argument("--items", type=int, default=None)
    parser.add_argument("--stages", type=int, default=10)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-torchdata", action="store_true", help="skip torchdata.nodes")
    args = parser.parse_args(argv)
    items = args.items or (200_000 if args.quick else 1_000_000)
    reps = args.reps or (3 if args.quick else 7)
    stages = args.stages
    if stages < 1:
        parser.error("--stages must be >= 1")

    variants: dict[str, ChainFactory] = {FLOOR: generator_chain, BUILTIN: map_chain}
    for name, lib in _util.load_libraries().items():
        variants[name] = library_chain(lib)
    td = None if args.no_torchdata else torchdata_chain()
    if td is not None:
        variants[TORCHDATA] = td

    # correctness: every variant yields the same values
    small = list(range(1_000))
    expected = [x + stages for x in small]
    agrees = {name: list(f(small, stages)) == expected for name, f in variants.items()}
    restores: dict[str, bool | None] = {n: None for n in variants}
    for name in _util.LIBRARIES:
        if name in variants:
            restores[name] = checkpoint_ok(variants[name], stages)

    data = list(range(items))
    print(
        f"{items:,} items, {stages} stages, {reps} repeats; variants: {', '.join(variants)}",
        flush=True,
    )
    full: dict[str, Samples] = {n: Samples() for n in variants}
    empty: dict[str, Samples] = {n: Samples() for n in variants}
    names = list(variants)
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]  # rotate the order
        for name in order:
            full[name].add(time_chain(variants[name], data, stages))
            empty[name].add(time_chain(variants[name], data, 0))
        print(
            f"  rep {rep + 1}/{reps} (CPU s): "
            + "  ".join(f"{n} {full[n].cpu[-1]:.3f}" for n in names),
            flush=True,
        )

    per = items * stages / 1e9  # seconds -> ns per item per stage
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        f, e = full[name], empty[name]
        results[name] = {
            "ns_per_item_per_stage": (min(f.cpu) - min(e.cpu)) / per,
            "raw_ns_per_item_per_stage": min(f.cpu) / per,
            "ns_per_item_per_stage_median": (median(f.cpu) - median(e.cpu)) / per,
            "ns_per_item_per_stage_wall": (min(f.wall) - min(e.wall)) / per,
            "source_only_ns_per_item": min(e.cpu) / items * 1e9,
            "correct_output": agrees[name],
            "checkpoint_restore_ok": restores[name],
            "chain_s": f.summary(),
            "source_only_s": e.summary(),
        }
    floor_ns = results[FLOOR]["ns_per_item_per_stage"]
    ib_ns = results["infinibatch"]["ns_per_item_per_stage"] if "infinibatch" in results else None
    for r in results.values():
        r["ratio_vs_floor"] = ratio(r["ns_per_item_per_stage"], floor_ns)
        r["ratio_vs_infinibatch"] = ratio(r["ns_per_item_per_stage"], ib_ns)
        r["raw_ratio_vs_floor"] = ratio(
            r["raw_ns_per_item_per_stage"], results[FLOOR]["raw_ns_per_item_per_stage"]
        )
        r["wall_ratio_vs_floor"] = ratio(
            r["ns_per_item_per_stage_wall"], results[FLOOR]["ns_per_item_per_stage_wall"]
        )

    print_table(
        f"Map chain: {stages} stages x {items:,} items (best of {reps}, CPU time)",
        [
            "variant",
            "ns/item/stage",
            "x floor",
            "x infinibatch",
            "raw ns/item/stage",
            "source-only ns/item",
            "wall ns/item/stage",
            "wall x floor",
            "output ok",
            "restore ok",
        ],
        [
            [
                n,
                r["ns_per_item_per_stage"],
                r["ratio_vs_floor"],
                r["ratio_vs_infinibatch"],
                r["raw_ns_per_item_per_stage"],
                r["source_only_ns_per_item"],
                r["ns_per_item_per_stage_wall"],
                r["wall_ratio_vs_floor"],
                r["correct_output"],
                r["checkpoint_restore_ok"],
            ]
            for n, r in results.items()
        ],
    )
    summary: dict[str, Any] = {}
    like = results.get("infinibatch_like")
    if like is not None:
        # scale the 40 ns reference target by this machine's floor speed
        scaled_target = 40.0 * floor_ns / REFERENCE_NS[FLOOR]
        summary = {
            "like_ns_per_item_per_stage": like["ns_per_item_per_stage"],
            "like_over_floor": like["ratio_vs_floor"],
            "like_over_infinibatch": like["ratio_vs_infinibatch"],
            "target_ns_scaled_to_this_machine": scaled_target,
        }
        rows = [
            (
                "ns/item/stage, unscaled reference target",
                like["ns_per_item_per_stage"],
                "<= 40",
                verdict(like["ns_per_item_per_stage"], 40.0, False),
            ),
            (
                "ns/item/stage, target scaled by this machine's floor",
                like["ns_per_item_per_stage"],
                f"<= {scaled_target:.1f}",
                verdict(like["ns_per_item_per_stage"], scaled_target, False),
            ),
            (
                "infinibatch_like / floor",
                like["ratio_vs_floor"],
                f"<= {TARGET_VS_FLOOR:.2f}",
                verdict(like["ratio_vs_floor"], TARGET_VS_FLOOR, False),
            ),
            (
                "infinibatch_like / infinibatch",
                like["ratio_vs_infinibatch"],
                f"<= {TARGET_VS_IB:.2f}",
                verdict(like["ratio_vs_infinibatch"], TARGET_VS_IB, False),
            ),
        ]
        print_table(
            "infinibatch_like against its targets", ["metric", "value", "target", "verdict"], rows
        )
        summary["verdicts"] = {r[0]: r[3] for r in rows}
    else:
        print("\ninfinibatch_like not measured: no targets to check")

    _util.write_result(
        "bench_map_chain_quick" if args.quick else "bench_map_chain",
        {
            "config": {
                "items": items,
                "stages": stages,
                "reps": reps,
                "function": "x + 1",
                "reference_ns": REFERENCE_NS,
                "quick": args.quick,
                "primary_clock": "process CPU time",
            },
            "results": results,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
