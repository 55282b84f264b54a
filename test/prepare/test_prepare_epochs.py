"""`load_index`'s epoch arithmetic and shards against the pipelines they describe, iterated
for real."""

from __future__ import annotations

import random
from itertools import islice
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.io import read_lines
from infinibatch_like.iterators import FixedBatchIterator, NativeCheckpointableIterator
from infinibatch_like.prepare import ChunkIndex, chunk_corpus, load_index
from infinibatch_like.prepare.index import ChunkEntry, _count_congruent

WORLD_SIZES = (1, 2, 3, 5)


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> ChunkIndex:
    """13 chunks of unequal sizes (at most 3 lines a chunk, cut per input file)."""
    root = tmp_path_factory.mktemp("epochs")
    for number, size in enumerate((7, 0, 12, 5, 9, 1)):
        lines = "".join(f"f{number}-{i}\n" for i in range(size))
        (root / f"in-{number}.txt").write_text(lines)
    chunk_corpus([str(root / "in-*.txt")], str(root / "out"), items_per_chunk=3, workers=1)
    loaded = load_index(str(root / "out"))
    assert [chunk.items for chunk in loaded.chunks] == [3, 2, 2, 3, 3, 3, 3, 3, 2, 3, 3, 3, 1]
    return loaded


def _lines_of(index: ChunkIndex, positions: list[int]) -> list[str]:
    return [line for p in positions for line in read_lines(index.chunk_refs[p])]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_evaluation_pass_per_rank(index: ChunkIndex, world: int) -> None:
    seen = []
    for rank in range(world):
        kwargs = {"train": False, "shuffle": False}
        items = list(
            chunked_dataset_iterator(
                index.chunk_refs, read_lines, 1, num_instances=world, instance_rank=rank, **kwargs
            )
        )
        assert index.items_per_epoch(world, rank, **kwargs) == len(items)
        for drop_last in (False, True):
            batches = FixedBatchIterator(NativeCheckpointableIterator(items), 4)
            expected = [b for b in batches if len(b) == 4 or not drop_last]
            assert index.batches_per_epoch(4, world, rank, drop_last=drop_last, **kwargs) == len(
                expected
            )
        seen.extend(items)
    assert seen == _lines_of(index, list(range(len(index.chunks))))


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("shuffle", [True, False])
def test_training_passes_per_rank(index: ChunkIndex, world: int, shuffle: bool) -> None:
    # buffer_size=1: items keep their chunk's order, so each pass's items are recognisable;
    # the endless stream is taken pass by pass, the counts saying where each pass ends
    passes: list[list[str]] = [[], [], []]
    for rank in range(world):
        stream = chunked_dataset_iterator(
            index.chunk_refs, read_lines, 1, seed=7, shuffle=shuffle,
            num_instances=world, instance_rank=rank,
        )  # fmt: skip
        for epoch, seen in enumerate(passes):
            count = index.items_per_epoch(world, rank, shuffle=shuffle, seed=7, epoch=epoch)
            taken = list(islice(stream, count))
            chunks = index.rank_chunks(world, rank, shuffle=shuffle, seed=7, epoch=epoch)
            assert taken == _lines_of(index, chunks)
            seen.extend(taken)
    for seen in passes:  # each pass: every item exactly once, over all ranks
        assert sorted(seen) == sorted(_lines_of(index, list(range(13))))


def test_a_seed_is_needed_where_the_shuffle_decides(index: ChunkIndex) -> None:
    with pytest.raises(ValueError, match=r"seed=None .* pass the seed the pipeline uses"):
        index.items_per_epoch(2, 0)
    assert index.items_per_epoch(1, 0) == len(index) == 34
    equal = ChunkIndex("x", {}, tuple(ChunkEntry(f"c{i}", 5, 1, "0" * 64) for i in range(5)))
    assert [equal.items_per_epoch(2, rank) for rank in (0, 1)] == [15, 10]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda i: i.items_per_epoch(2, 2, seed=1), "instance_rank must be < num_instances"),
        (lambda i: i.items_per_epoch(0, 0, seed=1), "num_instances"),
        (lambda i: i.items_per_epoch(seed=1, epoch=-1), "epoch must be an int >= 0"),
        (lambda i: i.items_per_epoch(train=False), "shuffle=True is not supported"),
        (lambda i: i.items_per_epoch(train=False, shuffle=False, epoch=1), "one pass"),
        (lambda i: i.batches_per_epoch(0), "batch_size must be an int >= 1, got 0"),
        (lambda i: i.shards(0), "ChunkIndex.shards: num_shards must be >= 1, got 0"),
    ],
)
def test_bad_arguments(index: ChunkIndex, call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(index)  # type: ignore[operator]


@given(st.integers(0, 60), st.integers(0, 60), st.integers(1, 7), st.data())
def test_count_congruent(start: int, length: int, modulus: int, data: st.DataObject) -> None:
    residue, stop = data.draw(st.integers(0, modulus - 1)), start + length
    expected = sum(1 for p in range(start, stop) if p % modulus == residue)
    assert _count_congruent(start, stop, residue, modulus) == expected


def _spread(loads: list[int]) -> float:
    """(max - min) / mean of items per shard (or per rank)."""
    return (max(loads) - min(loads)) * len(loads) / sum(loads)


def test_shards_of_a_chunked_corpus_are_balanced_within_two_percent(tmp_path: Path) -> None:
    # inputs of 41 to 79 lines cut by at most 40 lines a chunk: each input gives two chunks,
    # a full one and a remainder (a stride over the chunks would give one shard the full
    # chunks, another the remainders); 6 shards, and 2 ranks of 3 shards each
    rng = random.Random(0)
    for number in range(18):
        lines = "".join(f"in{number}-{i}\n" for i in range(rng.randint(41, 79)))
        (tmp_path / f"in-{number:02d}.txt").write_text(lines)
    chunk_corpus([str(tmp_path / "in-*.txt")], str(tmp_path / "out"), items_per_chunk=40)
    index = load_index(str(tmp_path / "out"))
    items = {ref: chunk.items for ref, chunk in zip(index.chunk_refs, index.chunks, strict=True)}
    stride = [sum(index.chunks[p].items for p in range(s, 36, 6)) for s in range(6)]
    shards = index.shards(6)
    assert sorted(ref for shard in shards for ref in shard) == sorted(index.chunk_refs)
    assert shards == index.shards(6)
    balanced = [sum(items[ref] for ref in shard) for shard in shards]
    assert _spread(stride) > 0.05  # what a stride gives on these chunks
    assert _spread(balanced) <= 0.02

    def shard_lines(shard: int, num_shards: int) -> NativeCheckpointableIterator[str]:
        return NativeCheckpointableIterator(
            [line for ref in shards[shard] for line in read_lines(ref)]
        )

    per_rank = [len(list(ShardedIterator(shard_lines, 6, rank, 2))) for rank in range(2)]
    assert sum(per_rank) == len(index)
    assert _spread(per_rank) <= 0.02
