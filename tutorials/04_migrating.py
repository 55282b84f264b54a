"""Migrating from infinibatch 0.1.1: change the imports, keep the data, get better checkpoints.

Run it with ``python tutorials/04_migrating.py``. It runs the same pipeline code with both
libraries side by side, so it needs ``pip install infinibatch==0.1.1`` (a test dependency
of this project) next to ``infinibatch_like``.

1. The change: the imports, nothing else.
2. What stays the same: for the same seeds, the same batches in the same order, and the
   same ``getstate``/``setstate``/``close`` protocol.
3. What is better: small plain-JSON states, ``seed=None`` that reproduces, clear errors for
   a state that does not fit, no dropped ``None`` items, pipelines that pickle, and
   prefetching that never silently turns itself off.

Every claim is checked with an ``assert``; docs/migrating.md says the same in prose.
"""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from collections.abc import Callable
from itertools import islice
from types import ModuleType
from typing import Any

try:
    # Step 1: the change. Code written for infinibatch imports its modules ...
    import infinibatch.datasets as old_datasets
    import infinibatch.iterators as old_iterators
except ImportError:
    sys.exit("this tutorial compares with infinibatch: pip install infinibatch==0.1.1")

# ... and after `sed -i 's/\binfinibatch\b/infinibatch_like/g'` it imports these instead.
import infinibatch_like.datasets as new_datasets
import infinibatch_like.iterators as new_iterators
from infinibatch_like import StateMismatchError

# ---------------------------------------------------------------------------------------
# A corpus of 8 chunks of sentences, and the pipeline code of a training script. The code
# is written once and receives the library's modules, so that both libraries run exactly
# the same lines.
# ---------------------------------------------------------------------------------------

rng = random.Random(3)
WORDS = [f"w{index}" for index in range(50)]
CHUNKS = {
    f"chunk-{chunk}": [
        " ".join(rng.choices(WORDS, k=rng.randint(1, 30))) for _ in range(rng.randint(20, 60))
    ]
    for chunk in range(8)
}


def read_chunk(name: str) -> list[str]:
    """In a real job: read a file. Module-level, so that pipelines can be pickled."""
    return CHUNKS[name]


def num_words(line: str) -> int:
    return len(line.split())


def words_per_batch(longest: str) -> int:
    return max(1, 120 // num_words(longest))


def training_batches(
    datasets: ModuleType, iterators: ModuleType, seed: int, use_windowed: bool = False
) -> Any:
    """Shuffled lines in bucketed batches of about 120 words: a typical training pipeline."""
    lines = datasets.chunked_dataset_iterator(
        sorted(CHUNKS), read_chunk, buffer_size=100, seed=seed, use_windowed=use_windowed
    )
    return iterators.BucketedReadaheadBatchIterator(
        lines, read_ahead=80, key=num_words, batch_size=words_per_batch, seed=seed + 1
    )


def take(iterator: Any, count: int) -> list[Any]:
    return list(islice(iterator, count))


def error_of(action: Callable[[], Any]) -> Exception | None:
    """The exception `action()` raises, or None."""
    try:
        action()
    except Exception as error:
        return error
    return None


def main() -> None:
    # -----------------------------------------------------------------------------------
    # Step 2: what stays the same.
    # -----------------------------------------------------------------------------------

    # The same batches, for the same seeds: blockwise and buffered ("windowed") shuffling,
    # chunk permutations over several passes, bucketing and batch shuffling all draw
    # exactly the random numbers infinibatch draws.
    for use_windowed in (False, True):
        old = take(training_batches(old_datasets, old_iterators, 7, use_windowed), 300)
        new = take(training_batches(new_datasets, new_iterators, 7, use_windowed), 300)
        assert old == new
    print("step 2: 300 batches identical to infinibatch's, with both shuffling kinds")

    # The same protocol: getstate() after k batches, setstate() on a freshly built
    # pipeline, and the stream continues with batch k. Close with close() or `with`.
    continuations = []
    for datasets, iterators in ((old_datasets, old_iterators), (new_datasets, new_iterators)):
        pipeline = training_batches(datasets, iterators, 7)
        expected = take(pipeline, 60)[40:]
        pipeline = training_batches(datasets, iterators, 7)
        take(pipeline, 40)
        state = pipeline.getstate()
        restored = training_batches(datasets, iterators, 7)
        restored.setstate(state)
        continuations.append(take(restored, 20))
        assert continuations[-1] == expected
        restored.close()
    assert continuations[0] == continuations[1]
    print("step 2: getstate/setstate: both resume at batch 40 with the same batches")

    # -----------------------------------------------------------------------------------
    # Step 3: what is better.
    # -----------------------------------------------------------------------------------

    old_pipeline = training_batches(old_datasets, old_iterators, 7)
    new_pipeline = training_batches(new_datasets, new_iterators, 7)
    take(old_pipeline, 40)
    take(new_pipeline, 40)
    old_state, new_state = old_pipeline.getstate(), new_pipeline.getstate()

    # 3a. States are small plain data. infinibatch stores whole random.getstate() tuples
    # (2.5 KB each); here a generator is a seed and a count of draws.
    old_size, new_size = len(pickle.dumps(old_state)), len(pickle.dumps(new_state))
    assert new_size * 10 < old_size
    print(f"step 3a: state of {new_size} bytes instead of {old_size} (pickled)")

    # ... and a JSON round trip keeps them exact: one small file per rank, readable by
    # any tool. infinibatch's states do not survive it (lists come back, not tuples).
    via_json = training_batches(new_datasets, new_iterators, 7)
    via_json.setstate(json.loads(json.dumps(new_state)))
    assert take(via_json, 20) == continuations[1]
    old_via_json = training_batches(old_datasets, old_iterators, 7)
    error = error_of(lambda: old_via_json.setstate(json.loads(json.dumps(old_state))))
    assert isinstance(error, TypeError)
    print(f"step 3a: JSON round trip restores exactly; infinibatch's fails ({error})")

    # 3b. seed=None draws a seed once and keeps it, so setstate(None) and checkpoints
    # reproduce the stream. In infinibatch, seed=None streams cannot be replayed.
    def unseeded(datasets: ModuleType) -> Any:
        return datasets.chunked_dataset_iterator(sorted(CHUNKS), read_chunk, 100, seed=None)

    new_unseeded, old_unseeded = unseeded(new_datasets), unseeded(old_datasets)
    new_first, old_first = take(new_unseeded, 200), take(old_unseeded, 200)
    new_unseeded.setstate(None)
    old_unseeded.setstate(None)
    assert take(new_unseeded, 200) == new_first
    assert take(old_unseeded, 200) != old_first
    print("step 3b: seed=None: setstate(None) replays the stream (infinibatch: another one)")

    # 3c. A state given to the wrong pipeline says where it does not fit. infinibatch
    # does not check: here it takes the state without a word, elsewhere it raises a
    # KeyError from deep inside.
    def fixed_batches(datasets: ModuleType, iterators: ModuleType) -> Any:
        lines = datasets.chunked_dataset_iterator(sorted(CHUNKS), read_chunk, 100, seed=7)
        return iterators.FixedBatchIterator(lines, 4)

    error = error_of(lambda: fixed_batches(new_datasets, new_iterators).setstate(new_state))
    assert isinstance(error, StateMismatchError)
    assert "FixedBatchIterator" in str(error)
    print(f"step 3c: {error}")
    assert error_of(lambda: fixed_batches(old_datasets, old_iterators).setstate(old_state)) is None
    print("step 3c: infinibatch accepts that state silently")

    # 3d. None items are items. infinibatch's BufferedShuffleIterator marks empty slots
    # with None and so drops them silently.
    items = [None, 1, None, 2, 3, None]

    def shuffled(iterators: ModuleType) -> list[Any]:
        source = iterators.NativeCheckpointableIterator(items)
        return list(iterators.BufferedShuffleIterator(source, 3, seed=0))

    assert sorted(map(repr, shuffled(new_iterators))) == sorted(map(repr, items))
    assert None not in shuffled(old_iterators)
    print(f"step 3d: {shuffled(new_iterators)} (infinibatch: {shuffled(old_iterators)})")

    # 3e. Pipelines pickle (as their arguments plus their state), so they can be sent to
    # a spawned process. infinibatch turns pickling into checkpoints: the copy is broken.
    copy = pickle.loads(pickle.dumps(new_pipeline))
    assert take(copy, 20) == take(new_pipeline, 20)
    error = error_of(lambda: take(pickle.loads(pickle.dumps(old_pipeline)), 1))
    assert isinstance(error, AttributeError)
    print(f"step 3e: a pickled copy continues; infinibatch's copy fails ({error})")

    # 3f. Prefetching never turns itself off. Under the spawn start method (the default on
    # macOS and Windows) infinibatch prints a warning and returns the source unchanged.
    probe = (
        "import multiprocessing; multiprocessing.set_start_method('spawn')\n"
        "from {lib}.iterators import NativeCheckpointableIterator, PrefetchIterator\n"
        "if __name__ == '__main__':\n"
        "    it = PrefetchIterator(NativeCheckpointableIterator(list(range(100))), 10)\n"
        "    print(type(it).__name__, sum(it))\n"
        "    getattr(it, 'close', lambda: None)()\n"
    )
    outputs = {}
    for lib in ("infinibatch", "infinibatch_like"):
        proc = subprocess.run(
            [sys.executable, "-c", probe.format(lib=lib)],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        outputs[lib] = proc.stdout.split()[-2:]
    assert outputs["infinibatch_like"] == ["PrefetchIterator", "4950"]
    assert outputs["infinibatch"] == ["NativeCheckpointableIterator", "4950"]
    print("step 3f: under spawn, PrefetchIterator prefetches; infinibatch's silently does not")

    for pipeline in (new_pipeline, copy, via_json, new_unseeded):
        pipeline.close()
    print("migrating: all checks passed")


if __name__ == "__main__":
    main()
