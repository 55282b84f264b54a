"""Quickstart: from a chunked text corpus to padded, resumable training batches.

Run it with ``python tutorials/01_quickstart.py``. It needs ``infinibatch_like`` and numpy;
torch is optional (used, when installed, to show saving a data checkpoint with a model).

The story, top to bottom:

1. cut a small corpus into gzip chunk files (real corpora have thousands of them);
2. read it in a randomized, infinite order with ``chunked_dataset_iterator``;
3. group lines of similar length into batches whose size adapts to the length
   (``BucketedReadaheadBatchIterator``), so every batch costs about the same memory;
4. turn each batch into a padded numpy array with a length vector and a mask;
5. checkpoint the whole pipeline mid-stream, restore it into a fresh pipeline, and check
   that training would see exactly the same batches as without the interruption.

Every claim the comments make is checked with an ``assert``.
"""

from __future__ import annotations

import gzip
import json
import random
import tempfile
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.iterators import (
    BucketedReadaheadBatchIterator,
    CheckpointableIterator,
    MapIterator,
)
from infinibatch_like.torch import PaddedArrays, pad_batch  # numpy only; no torch needed

try:
    import torch
except ImportError:  # torch is optional here; step 5 then skips the torch.save example
    torch = None  # type: ignore[assignment]

# ---------------------------------------------------------------------------------------
# Step 1: a corpus in gzip chunks.
#
# A chunk is the unit of reading: it must fit in memory, the corpus need not. We make 1,200
# "sentences" of 2 to 40 words from a tiny vocabulary and deal them round-robin into 6 files.
# ---------------------------------------------------------------------------------------

VOCABULARY = ["<pad>"] + [f"w{index}" for index in range(1, 200)]
PAD_ID = 0

rng = random.Random(2024)
corpus = [
    " ".join(rng.choice(VOCABULARY[1:]) for _ in range(rng.randint(2, 40))) for _ in range(1200)
]

scratch = tempfile.TemporaryDirectory(prefix="quickstart_")  # removed at the end
workdir = Path(scratch.name)
chunk_paths = []
for chunk_index in range(6):
    path = workdir / f"part-{chunk_index:02d}.txt.gz"
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for line in corpus[chunk_index::6]:
            out.write(line + "\n")
    chunk_paths.append(str(path))
print(f"step 1: {len(corpus)} lines written to {len(chunk_paths)} chunks in {workdir}")


def read_chunk(path: str) -> Iterator[str]:
    """The only I/O code the library needs from us: a chunk reference -> its items."""
    with gzip.open(path, "rt", encoding="utf-8") as chunk:
        return iter(chunk.read().splitlines())


# ---------------------------------------------------------------------------------------
# Step 2: randomized reading.
#
# chunked_dataset_iterator visits the chunks in a random order, one permutation after the
# other (training mode is infinite: an "epoch" is just a stretch of the stream), and shuffles
# lines inside a window of `buffer_size` lines. Only that window is ever in memory.
# ---------------------------------------------------------------------------------------

BUFFER_SIZE = 300
lines = chunked_dataset_iterator(chunk_paths, read_chunk, buffer_size=BUFFER_SIZE, seed=7)
first_pass = list(islice(lines, 3 * len(corpus)))
lines.close()

# Every line of the corpus shows up, and the order is not the file order.
assert set(first_pass) == set(corpus)
assert first_pass[: len(corpus)] != corpus

# The same seed gives the same stream, on any machine; another seed gives another one.
with chunked_dataset_iterator(chunk_paths, read_chunk, buffer_size=BUFFER_SIZE, seed=7) as again:
    assert list(islice(again, 500)) == first_pass[:500]
with chunked_dataset_iterator(chunk_paths, read_chunk, buffer_size=BUFFER_SIZE, seed=8) as other:
    assert list(islice(other, 500)) != first_pass[:500]

# For evaluation, train=False (with shuffle=False) makes one ordered pass instead. With
# several ranks, each rank reads its own contiguous share of the chunks, and the shares,
# concatenated in rank order, are the whole corpus in order, each line exactly once.
shares = []
for rank in range(2):
    with chunked_dataset_iterator(
        chunk_paths,
        read_chunk,
        buffer_size=BUFFER_SIZE,
        train=False,
        shuffle=False,
        num_instances=2,
        instance_rank=rank,
    ) as evaluation:
        shares.append(list(evaluation))
in_file_order = [line for path in chunk_paths for line in read_chunk(path)]
assert shares[0] + shares[1] == in_file_order
print(f"step 2: randomized stream checked; eval shares of {len(shares[0])} + {len(shares[1])}")

# ---------------------------------------------------------------------------------------
# Step 3: dynamic batches of similar lengths.
#
# Padding a 3-word line to the length of a 40-word one wastes compute. The bucketed batcher
# reads `read_ahead` items, sorts them by `key` (longest first), and cuts batches; a callable
# `batch_size` receives the longest item of each new batch and returns its capacity. Here a
# batch may hold about TOKENS words in total, padding included. Then the batches of the window
# are shuffled, so that training does not see lengths in order.
# ---------------------------------------------------------------------------------------

TOKENS = 400


def num_words(line: str) -> int:
    """The bucketing key: the length of a line in words (our "tokens")."""
    return len(line.split())


def make_text_batches(seed: int) -> CheckpointableIterator[list[str]]:
    """Randomized lines, then batches of lines of similar length, about TOKENS words each."""
    source = chunked_dataset_iterator(chunk_paths, read_chunk, buffer_size=BUFFER_SIZE, seed=seed)
    return BucketedReadaheadBatchIterator(
        source,
        read_ahead=200,  # lines sorted together: larger means less padding, more memory
        key=num_words,
        batch_size=lambda longest: max(1, TOKENS // num_words(longest)),
        seed=seed + 1,  # seeds the shuffling of the batches of each window
    )


with make_text_batches(seed=7) as text_batches:
    some_batches = list(islice(text_batches, 40))
for batch in some_batches:
    longest = max(num_words(line) for line in batch)
    assert num_words(batch[0]) == longest  # the first line of a batch is its longest
    assert len(batch) * longest <= TOKENS  # the padded batch stays within the budget
sizes = sorted({len(batch) for batch in some_batches})
print(f"step 3: 40 batches, sizes between {sizes[0]} and {sizes[-1]} lines, all <= {TOKENS} words")

# ---------------------------------------------------------------------------------------
# Step 4: padded arrays.
#
# A model wants a rectangle. We map each word to an id, and pad_batch pads every row to the
# longest row of its batch with PAD_ID, keeping the true lengths and a boolean mask
# (True = real token).
# In step 5 a MapIterator applies this conversion inside the pipeline, so the conversion is
# part of what gets checkpointed and restored.
# ---------------------------------------------------------------------------------------

WORD_IDS = {word: index for index, word in enumerate(VOCABULARY)}


def to_padded(lines_of_batch: list[str]) -> PaddedArrays:
    rows = [[WORD_IDS[word] for word in line.split()] for line in lines_of_batch]
    return pad_batch(rows, pad_value=PAD_ID, dtype=np.int64)  # values, lengths, mask


example = to_padded(some_batches[0])
assert example.mask is not None
assert example.values.shape == (len(some_batches[0]), int(example.lengths.max()))
assert int(example.mask.sum()) == int(example.lengths.sum())
assert (example.values[~example.mask] == PAD_ID).all()  # padding is PAD_ID ...
assert (example.values[example.mask] != PAD_ID).all()  # ... and real words never are
shape, lengths = example.values.shape, example.lengths.tolist()
print(f"step 4: first batch as arrays: ids {shape}, lengths {lengths}")

# ---------------------------------------------------------------------------------------
# Step 5: checkpoint and restore.
#
# getstate() on the last stage describes the whole chain (chunk order, shuffle windows,
# bucketing) as a small dict of plain data. Save it next to the model weights. After a crash,
# build the same pipeline from scratch, setstate() the saved dict, and the stream continues
# exactly where it stopped: no batch repeated, none skipped.
# ---------------------------------------------------------------------------------------


def same_batches(left: list[PaddedArrays], right: list[PaddedArrays]) -> bool:
    return len(left) == len(right) and all(
        np.array_equal(a.values, b.values) and np.array_equal(a.lengths, b.lengths)
        for a, b in zip(left, right, strict=True)
    )


# The whole pipeline, built by one function so that a restart can build it again.
def make_pipeline(seed: int) -> CheckpointableIterator[PaddedArrays]:
    """Build the full pipeline: randomized lines -> bucketed batches -> padded arrays."""
    return MapIterator(make_text_batches(seed), to_padded)


# The reference: one run that is never interrupted.
with make_pipeline(seed=11) as uninterrupted:
    reference = list(islice(uninterrupted, 50))

# A training run that stops after 30 batches and saves its data state.
with make_pipeline(seed=11) as training:
    seen = list(islice(training, 30))
    state = training.getstate()
assert same_batches(seen, reference[:30])

# The state is plain data: JSON can hold it exactly ...
as_json = json.dumps(state)
assert json.loads(as_json) == state
# ... and so can a torch checkpoint that loads with the safe weights_only=True.
if torch is not None:
    checkpoint_file = workdir / "checkpoint.pt"
    torch.save({"model": {"weight": torch.zeros(2, 2)}, "data": state}, checkpoint_file)
    state = torch.load(checkpoint_file, weights_only=True)["data"]
    assert state == json.loads(as_json)

# A fresh process would rebuild the pipeline from the same code and restore the state.
with make_pipeline(seed=11) as resumed:
    resumed.setstate(json.loads(as_json))
    continuation = list(islice(resumed, 20))
assert same_batches(continuation, reference[30:])
print(
    f"step 5: state of {len(as_json)} bytes of JSON; the 20 batches after the restore are "
    "identical to the uninterrupted run"
)

scratch.cleanup()
print("quickstart: all checks passed")
