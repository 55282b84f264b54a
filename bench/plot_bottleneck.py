"""The chart of docs/howto/bottleneck.md: stage time shares of P1 over a run, drawn by
``infinibatch_like.stats.History.plot``.

P1 (see ``bench_pipeline.py``): gzip chunks -> block-wise shuffle -> tokenize -> bucketed
batches, with statistics on, every pull timed (``sample_every=1``: exact shares, at about
a microsecond per item and stage); a record every ``--every`` batches.

Usage: ``python bench/plot_bottleneck.py`` (writes ``docs/img/bottleneck.png``; ~20 s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import _util
import bench_pipeline
from corpus import build_corpus

from infinibatch_like import stats

OUT = Path(__file__).resolve().parents[1] / "docs" / "img" / "bottleneck.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=600_000, help="lines to consume")
    parser.add_argument("--every", type=int, default=200, help="batches between records")
    parser.add_argument(
        "--sample-every", type=int, default=1, help="stats.enable's sample_every (1: exact)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    library = _util.load_libraries(["infinibatch_like"])["infinibatch_like"]
    chunks = build_corpus(args.lines)
    with bench_pipeline.make_pipeline(library, chunks) as pipeline:
        stats.enable(pipeline, sample_every=args.sample_every)
        history = stats.History(pipeline)
        history.record()
        seen = 0
        for index, batch in enumerate(pipeline, 1):
            seen += len(batch)
            if index % args.every == 0:
                history.record()
            if seen >= args.lines:
                break
        print(stats.report(pipeline))
        history.plot(str(args.out), title="P1: share of the pipeline's work per stage")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
