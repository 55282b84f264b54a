"""Fault injection at scale: 50+ kills of a real training loop, and the table of the docs.

For every kind of fault (SIGKILL of the loop, SIGKILL of one of its worker processes,
SIGTERM, SIGINT), start method (fork, forkserver, spawn) and layout of the background
stages (a process or thread prefetcher before the parallel map, or the parallel map
inside it), one campaign of `fault_harness` kills the loop of `fault_loop.py`
``--kills`` times, restarting it from its last checkpoint, then lets it finish and
compares what it consumed with an uninterrupted run. Prints a markdown table (one row per
kind x start method x layout: runs, kills, items lost, duplicated, out of order, stalls,
leaks) and writes it, with every leak and failure, to ``bench/results/fault_injection.json``.

    python bench/fault_injection.py              # 60 campaigns x 2 kills: ~10 minutes
    python bench/fault_injection.py --kills 1 --start-methods fork   # a quick look
    python bench/fault_injection.py --fanout     # also kill the processes of a FanOut
    python bench/fault_injection.py --fanout --arrays --kinds --kills 3
        # fan-out only, items with arrays that the consumers map from the owner's shared
        # memory: no segment left (/dev/shm) and nothing reported by the resource tracker
    python bench/fault_injection.py --kinds --fanout "fan-out owner SIGKILL" --kills 2
        # fan-out only, its owner killed and restarted, its consumers re-attaching
    python bench/fault_injection.py --arrays --kinds "loop SIGKILL" "worker SIGKILL" --kills 3
        # items with numpy arrays: the shared-memory transport under consumer and worker kills

With ``--arrays`` the results go to ``bench/results/fault_injection-arrays.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import fault_harness as harness
from _util import RESULTS_DIR, machine_info

LAYOUTS = (("process", "flat"), ("process", "nested"), ("thread", "flat"), ("thread", "nested"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=2, help="kills per campaign")
    parser.add_argument("--start-methods", nargs="+", default=["fork", "forkserver", "spawn"])
    parser.add_argument("--kinds", nargs="*", default=list(harness.KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fanout",
        nargs="*",
        choices=harness.FANOUT_KINDS,
        help="also SIGKILL processes of a FanOut --kills times per start method and layout: "
        "a consumer, the owner, or both (without a value: each in turn)",
    )
    parser.add_argument(
        "--arrays",
        action="store_true",
        help="items carry a 72 kB numpy array (the shared-memory transport of the workers)",
    )
    args = parser.parse_args()
    rng = random.Random(args.seed)
    rows = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fault-injection-") as scratch:
        root = Path(scratch)
        corpus = harness.make_corpus(root / "corpus")
        reference = harness.reference_stream(
            harness.Campaign(root / "reference", corpus, harness.Config(arrays=args.arrays))
        )
        combos = itertools.product(args.kinds, args.start_methods, LAYOUTS)
        for number, (kind, method, (mode, nesting)) in enumerate(combos):
            config = harness.Config(method, mode, nesting, args.arrays)
            campaign = harness.Campaign(root / f"campaign-{number}", corpus, config)
            outcome = harness.run_campaign(campaign, kind, args.kills, reference, rng)
            rows.append(outcome)
            print(_row(outcome), flush=True)
        if args.fanout is not None:
            rows += fanout_campaigns(root, corpus, reference, args, rng)
    elapsed = time.monotonic() - started
    print()
    print(table(rows))
    print(f"\n{sum(o.kills for o in rows)} kills in {len(rows)} campaigns, {elapsed:.0f} s")
    RESULTS_DIR.mkdir(exist_ok=True)
    name = "fault_injection-arrays.json" if args.arrays else "fault_injection.json"
    (RESULTS_DIR / name).write_text(
        json.dumps(
            {
                "machine": machine_info(),
                "arguments": vars(args),
                "seconds": elapsed,
                "campaigns": [
                    {**dataclasses.asdict(o), "config": dataclasses.asdict(o.config)} for o in rows
                ],
                "table": table(rows),
            },
            indent=1,
        )
    )
    return 0 if all(o.clean for o in rows) else 1


def fanout_campaigns(
    root: Path, corpus: Path, reference: list[str], args: argparse.Namespace, rng: random.Random
) -> list[harness.Outcome]:
    """One campaign per kind, start method and layout: a consumer process of a FanOut
    serving the loop's pipeline, its owner, or both are SIGKILLed `--kills` times and
    restarted (a consumer from its checkpoint)."""
    rows = []
    for number, (kind, method, (mode, nesting)) in enumerate(
        itertools.product(args.fanout or harness.FANOUT_KINDS, args.start_methods, LAYOUTS)
    ):
        config = harness.Config(method, mode, nesting, args.arrays)
        campaign = harness.FanOutCampaign(root / f"fanout-{number}", corpus, config)
        outcome = harness.run_fanout_campaign(campaign, args.kills, reference, rng, kind)
        rows.append(outcome)
        print(_row(outcome), flush=True)
    return rows


HEADER = (
    "| fault | start method | layout | runs | kills | items lost | duplicated "
    "| out of order | stalls | leaks |"
)


def _row(o: harness.Outcome) -> str:
    cells = (
        o.kind,
        o.config.start_method,
        o.config.layout,
        o.runs,
        o.kills,
        o.lost,
        o.duplicated,
        0 if o.same_order else 1,
        o.stalls,
        len(o.leaks) + len(o.failures),
    )
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def table(rows: list[harness.Outcome]) -> str:
    total = (
        f"| **all** | | | {sum(o.runs for o in rows)} | {sum(o.kills for o in rows)} "
        f"| {sum(o.lost for o in rows)} | {sum(o.duplicated for o in rows)} "
        f"| {sum(not o.same_order for o in rows)} | {sum(o.stalls for o in rows)} "
        f"| {sum(len(o.leaks) + len(o.failures) for o in rows)} |"
    )
    lines = [HEADER, "|" + "---|" * 10, *map(_row, rows), total]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
