"""A StatefulDataLoader checkpoint resumed with another number of DataLoader workers (and
of ranks) through `resize_loader_state`: every item of a finite pass exactly once, each
shard continuing in order; and clear errors for states it cannot convert.

torchdata's own protocol refuses another number of workers (tested first, so that a
torchdata that starts allowing it is noticed). Worker processes start in a fraction of a
second under fork, so the loaders here are real; one case runs under spawn.
"""

from __future__ import annotations

import copy
import functools
import gc
import io
import json
import multiprocessing
from collections import defaultdict
from itertools import islice
from typing import Any

import pytest
import torch
from _streams import ChunkReader
from torchdata.stateful_dataloader import StatefulDataLoader

from infinibatch_like import StateMismatchError
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed.sharded import ShardedIterator
from infinibatch_like.iterators import CheckpointableIterator, MapIterator
from infinibatch_like.torch import CheckpointableDataset, resize_loader_state

# torchdata 0.11 calls a torch function that torch 2.13 deprecates: not ours to fix.
# Up to 4 workers on a 2-core machine: torch warns that this is more than it suggests.
pytestmark = [
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
]

CORPUS = [[f"c{chunk:02d}-{line}" for line in range(chunk % 4 + 1)] for chunk in range(21)]
ITEMS = sorted(item for chunk in CORPUS for item in chunk)
SHARDS = 8


read_chunk = ChunkReader(CORPUS)


def shard_pass(shard: int, num_shards: int) -> CheckpointableIterator[str]:
    """One shuffled pass (epochs=1) over the shard's chunks."""
    chunks = list(range(shard, len(CORPUS), num_shards))
    return chunked_dataset_iterator(chunks, read_chunk, buffer_size=3, seed=shard, epochs=1)


READER = functools.partial(ShardedIterator, shard_pass, SHARDS)
SHARD_PASSES = {shard: list(shard_pass(shard, SHARDS)) for shard in range(SHARDS)}


def loader(
    workers: int, rank: int = 0, world_size: int = 1, factory: Any = READER, **options: Any
) -> StatefulDataLoader:
    dataset = CheckpointableDataset(factory, rank=rank, world_size=world_size)
    return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, **options)


def saved(state: Any) -> Any:
    """`state` after torch.save and torch.load(weights_only=True)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def interrupted(workers: int, rank: int, world_size: int, count: int, **options: Any) -> Any:
    """(items delivered, loader state) of a loader stopped after `count` items; it reads
    two more items after the state, lost in the "crash"."""
    old = loader(workers, rank, world_size, **options)
    batches = iter(old)
    delivered = list(islice(batches, count))
    state = saved(old.state_dict())
    list(islice(batches, 2))
    del batches, old
    return delivered, state


def by_shard(items: list[str]) -> dict[int, list[str]]:
    shards: dict[int, list[str]] = defaultdict(list)
    for item in items:
        shards[int(item[1:3]) % SHARDS].append(item)
    return shards


def assert_exactly_once(before: list[list[str]], after: list[list[str]]) -> None:
    """Every item once over all readers, and each shard's items in its pass's order."""
    assert sorted(item for items in before + after for item in items) == ITEMS
    delivered: dict[int, list[str]] = defaultdict(list)
    for items in before + after:  # each list: one loader's delivery order
        for shard, shard_items in by_shard(items).items():
            delivered[shard] += shard_items
    # A shard moves to one reader: its items before, then after, are its pass in order.
    for shard in range(SHARDS):
        old = [i for items in before for i in by_shard(items)[shard]]
        new = [i for items in after for i in by_shard(items)[shard]]
        assert old + new == SHARD_PASSES[shard], shard


# -- torchdata's protocol refuses another number of workers ---------------------------------


class Counting(torch.utils.data.IterableDataset[int]):
    """A stateful dataset that accepts any state (no reader identity to check)."""

    def __init__(self) -> None:
        self.count = 0

    def __iter__(self) -> Any:
        while True:
            self.count += 1
            yield self.count

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.count = state["count"]


def test_stateful_dataloader_itself_refuses_another_number_of_workers() -> None:
    three = StatefulDataLoader(Counting(), batch_size=None, num_workers=3)
    list(islice(iter(three), 4))
    resumed = StatefulDataLoader(Counting(), batch_size=None, num_workers=2)
    resumed.load_state_dict(three.state_dict())
    with pytest.raises(AssertionError):  # _restore_main_state: assert self._num_workers == ...
        iter(resumed)
    del three, resumed
    gc.collect()  # the refused iterator's workers stop with it
    _, two = interrupted(2, 0, 1, 3)
    _, none = interrupted(0, 0, 1, 3)
    without_workers, with_workers = loader(0), loader(2)
    without_workers.load_state_dict(two)
    with pytest.raises(AssertionError, match="'_num_yielded' expected for single process"):
        iter(without_workers)
    with_workers.load_state_dict(none)
    with pytest.raises(AssertionError, match="'_snapshot' expected for multiprocess"):
        iter(with_workers)
    assert not multiprocessing.active_children()


# -- k workers -> k' workers, and W1 x k -> W2 x k' ------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [(2, 3), (3, 2), (0, 2), (2, 0), (1, 4), (4, 1), (3, 0), (0, 3)],
)
def test_a_pass_resumed_with_another_number_of_workers_delivers_every_item_once(
    old: int, new: int
) -> None:
    before, state = interrupted(old, 0, 1, 9)
    resized = resize_loader_state(state, num_workers=new)
    assert json.loads(json.dumps(resized)) == resized
    resumed = loader(new)
    resumed.load_state_dict(saved(resized))
    assert_exactly_once([before], [list(resumed)])
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("old", "new"),
    [((2, 2), (3, 1)), ((3, 0), (1, 4)), ((1, 3), (2, 0)), ((2, 1), (2, 3))],
    ids=["2x2->3x1", "3x0->1x4", "1x3->2x0", "2x1->2x3"],
)
def test_a_pass_resumed_on_other_numbers_of_ranks_and_workers_delivers_every_item_once(
    old: tuple[int, int], new: tuple[int, int]
) -> None:
    (old_ranks, old_workers), (new_ranks, new_workers) = old, new
    before, states = [], []
    for rank in range(old_ranks):
        delivered, state = interrupted(old_workers, rank, old_ranks, 2 + 3 * rank)
        before.append(delivered)
        states.append(state)
    after = []
    for rank in range(new_ranks):
        resumed = loader(new_workers, rank, new_ranks)
        resumed.load_state_dict(
            resize_loader_state(states, num_workers=new_workers, rank=rank, world_size=new_ranks)
        )
        after.append(list(resumed))
    assert_exactly_once(before, after)


def test_a_state_of_forked_workers_resumes_in_a_spawned_worker() -> None:
    # The converted state travels to the spawned worker pickled with the dataset.
    before, state = interrupted(2, 0, 1, 7)
    resumed = loader(1, multiprocessing_context="spawn")
    resumed.load_state_dict(resize_loader_state(state, num_workers=1))
    assert_exactly_once([before], [list(resumed)])


def test_batches_made_by_the_loader_resume_with_another_count() -> None:
    old = StatefulDataLoader(CheckpointableDataset(READER), batch_size=3, num_workers=2)
    batches = iter(old)
    before = [item for batch in islice(batches, 4) for item in batch]
    state = old.state_dict()
    del batches, old
    resumed = StatefulDataLoader(CheckpointableDataset(READER), batch_size=3, num_workers=1)
    resumed.load_state_dict(resize_loader_state(state, num_workers=1))
    assert_exactly_once([before], [[item for batch in resumed for item in batch]])


def test_the_same_numbers_give_the_loaders_own_state_back() -> None:
    _, state = interrupted(2, 0, 1, 5, snapshot_every_n_steps=3)
    resized = resize_loader_state([state], num_workers=2)
    assert resized == state
    assert resized is not state


def test_a_finished_pass_stays_finished() -> None:
    old = loader(2)
    items = list(old)
    resized = resize_loader_state(saved(old.state_dict()), num_workers=3)
    assert resized["_iterator_finished"] is True
    resumed = loader(3)
    resumed.load_state_dict(resized)
    assert sorted(resumed) == sorted(items) == ITEMS  # a finished pass: the next one starts


# -- what cannot be converted is refused by name --------------------------------------------


@pytest.fixture(scope="module")
def two_workers() -> Any:
    """The state of a 2-worker loader of one rank, after 5 items."""
    return interrupted(2, 0, 1, 5)[1]


def test_a_state_taken_between_snapshots_is_refused() -> None:
    _, state = interrupted(2, 0, 1, 5, snapshot_every_n_steps=3)
    with pytest.raises(
        ValueError, match="rank 0's state was taken 2 steps after its last snapshot"
    ):
        resize_loader_state(state, num_workers=3)


def test_readers_that_are_not_elastic_are_refused_naming_the_stage() -> None:
    def chunks(reader: int, readers: int) -> CheckpointableIterator[str]:
        return chunked_dataset_iterator(
            list(range(len(CORPUS))),
            read_chunk,
            3,
            seed=1,
            num_instances=readers,
            instance_rank=reader,
        )

    old = loader(0, factory=chunks)
    next(iter(old))
    with pytest.raises(
        ValueError,
        match=r"the loader states hold 1 readers, the new loader has 2, and "
        r"\w+Iterator cannot be elastic \(",
    ):
        resize_loader_state(old.state_dict(), num_workers=2)
    mapped = loader(0, factory=lambda r, n: MapIterator(READER(r, n), str.upper))
    next(iter(mapped))
    state = resize_loader_state(mapped.state_dict(), num_workers=2)  # MapIterator: elastic
    assert state["_snapshot"]["_main_snapshot"]["_num_workers"] == 2


def test_missing_and_repeated_ranks_are_refused(two_workers: Any) -> None:
    _, rank1 = interrupted(0, 1, 2, 1)
    _, rank0 = interrupted(0, 0, 2, 1)
    with pytest.raises(ValueError, match=r"the states hold readers \[0\] of 2: give the states"):
        resize_loader_state([rank0], num_workers=1)
    with pytest.raises(ValueError, match="rank 1's state is the state of reader 0 of 2, which"):
        resize_loader_state([rank0, rank0], num_workers=1)
    with pytest.raises(ValueError, match="rank 1's state, worker_1 is the state of reader 1 of 2"):
        resize_loader_state([rank1, two_workers], num_workers=1)


def damaged(state: Any, change: Any) -> Any:
    state = copy.deepcopy(state)
    change(state)
    return state


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop("_snapshot"), "rank 0's state is not a StatefulDataLoader state"),
        (
            lambda s: s["_snapshot"]["_worker_snapshots"].pop("worker_0"),
            r"has worker states \['worker_1'\], not \['worker_0'\]",
        ),
        (
            lambda s: s["_snapshot"]["_worker_snapshots"]["worker_1"].update(dataset_state=7),
            "rank 0's state, worker_1: 'dataset_state': .*expected a dict, got int",
        ),
        (
            lambda s: s["_snapshot"]["_worker_snapshots"]["worker_1"]["dataset_state"][
                "pipeline"
            ].update(shards="x"),
            "reader 1's 'shards' is not a list",
        ),
        (
            lambda s: s.update(_steps_since_snapshot="2"),
            "needs '_steps_since_snapshot' of type int, got str",
        ),
        (
            lambda s: s["_snapshot"]["_main_snapshot"].pop("_shared_seed"),
            r"lacks the main process's fields \['_shared_seed'\]",
        ),
    ],
    ids=["no-snapshot", "worker-missing", "dataset-state", "shards", "steps", "main"],
)
def test_damaged_states_are_refused_naming_the_field(
    two_workers: Any, change: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resize_loader_state(damaged(two_workers, change), num_workers=3)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"states": []}, TypeError, "states must be a loader state dict or a non-empty list"),
        ({"states": [1]}, TypeError, r"got a list of \['int'\]"),
        ({"num_workers": -1}, ValueError, "num_workers must be >= 0, got -1"),
        ({"rank": 2, "world_size": 2}, ValueError, "need rank < world_size, got rank=2"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    two_workers: Any, arguments: dict[str, Any], error: type, message: str
) -> None:
    call = {"states": two_workers, "num_workers": 1, **arguments}
    with pytest.raises(error, match=f"resize_loader_state: .*{message}"):
        resize_loader_state(**call)


def test_the_dataset_names_the_conversion_when_a_reader_state_does_not_fit() -> None:
    single = CheckpointableDataset(READER)
    next(iter(single))
    other = CheckpointableDataset(READER, rank=1, world_size=2)
    other.load_state_dict(single.state_dict())
    with pytest.raises(StateMismatchError, match=r"infinibatch_like\.torch\.resize_loader_state"):
        iter(other)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("arguments", "readers"),
    [
        ({"num_workers": 10**9}, r"1000000000 readers \(world_size=1 x num_workers=1000000000"),
        ({"num_workers": 9}, r"9 readers \(world_size=1 x num_workers=9"),
        ({"num_workers": 0, "world_size": 10**9}, r"1000000000 readers \(world_size=1000000000"),
        ({"num_workers": 3, "world_size": 3, "rank": 2}, r"9 readers \(world_size=3 x num_w"),
    ],
)
def test_more_readers_than_shards_are_refused_at_once(
    two_workers: Any, arguments: dict[str, Any], readers: str
) -> None:
    with pytest.raises(
        ValueError,
        match=f"resize_loader_state: the new job would have {readers}.* for the 8 shards "
        "that the states hold: a reader beyond the shards would read nothing",
    ):
        resize_loader_state(two_workers, **arguments)


def test_as_many_readers_as_shards_are_accepted(two_workers: Any) -> None:
    states = [resize_loader_state(two_workers, num_workers=4, rank=r, world_size=2) for r in (0, 1)]
    workers = [s["_snapshot"]["_worker_snapshots"] for s in states]
    shards = [
        [entry["shard"] for entry in w[f"worker_{i}"]["dataset_state"]["pipeline"]["shards"]]
        for w in workers
        for i in range(4)
    ]
    assert shards == [[shard] for shard in range(SHARDS)]
