"""Every public stage (each CheckpointableIterator class or factory of the package root),
alone and in chains, passes the checkpoint-contract checker; a stage that cannot keep a
rule names the rule and says why."""

from __future__ import annotations

import inspect
import multiprocessing
import random
import sys
import tempfile
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import infinibatch_like
import infinibatch_like.iterators as it
from infinibatch_like import (
    FilterIterator,
    PackingIterator,
    RemoteConsumer,
    ShardedIterator,
    TokenBudgetMultiplexIterator,
    Watchdog,
    attach,
    create_source_iterator,
)
from infinibatch_like._core.protocol import CheckpointableIterator
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import EqualLengthIterator
from infinibatch_like.stages.bad_records import SkipPolicy
from infinibatch_like.stages.fanout import FanOut, FanOutConsumer
from infinibatch_like.stages.skipping import SkipIterator
from infinibatch_like.testing import ContractViolation, assert_checkpointable

CHUNKS = [[f"c{c}-{i}" for i in range(c % 4 + 1)] for c in range(9)]


def native(n: int = 23) -> it.NativeCheckpointableIterator:
    return it.NativeCheckpointableIterator(list(range(n)))


def read_chunk(index: int) -> list[str]:
    return CHUNKS[index]


def add_one(x: int) -> int:
    return x + 1


def add_one_each(items: list[int]) -> list[int]:
    return [x + 1 for x in items]


def fail_on_sevens(x: int) -> int:
    if x % 7 == 3:
        raise ValueError(f"bad item {x}")
    return x + 1


def fail_on_c7(record: str) -> str:
    if record == "c7-4":
        raise ValueError(f"bad record {record}")
    return record.upper()


class FlakyRecords:
    """The records of chunk `index`, raising on every third one and going on after it."""

    def __init__(self, index: int) -> None:
        self.index, self.position = index, 0

    def __iter__(self) -> FlakyRecords:
        return self

    def __next__(self) -> str:
        self.position += 1
        if self.position > self.index % 4 + 2:
            raise StopIteration
        if self.position % 3 == 0:
            raise ValueError(f"bad record {self.position} of chunk {self.index}")
        return f"c{self.index}-{self.position}"


def read_flaky_chunk(index: int) -> FlakyRecords:
    if index == 5:
        raise FileNotFoundError(f"chunk {index}")
    return FlakyRecords(index)


SKIPS = SkipPolicy(max_skips=2, per_items=7, keep_last=3)


def running_sum(total: int, x: int) -> tuple[int, int]:
    return total + x, total + x


def jitter(rng: random.Random, x: int) -> float:
    return x + rng.random() + rng.gauss(0, 1) + rng.randrange(5)


def capacity(longest: list[int]) -> int:
    return max(1, 12 // (len(longest) + 1))


def length_of(item: Any) -> int:
    return len(item)


def token_list(n: int) -> list[int]:
    return list(range(1, n % 7 + 1))


def packed_lists(sequence: Any) -> tuple[list[Any], ...]:
    return tuple(value.tolist() for value in sequence.values())


def documents(n: int = 40) -> it.MapIterator[list[int]]:
    return it.MapIterator(native(n), token_list)


class GeneratorIterable:
    """A re-iterable whose iterator is a generator (the non-indexed restore path)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return (i * i for i in range(self.n))


def fan_out_consumer(fan: FanOut[Any], index: int) -> FanOutConsumer[Any]:
    """Consumer `index` of `fan`, the others closed (they hold it back no more)."""
    for other in range(fan.consumers):
        if other != index:
            fan.consumer(other).close()
    return fan.consumer(index)


def is_odd(x: int) -> bool:
    return x % 2 == 1


def shard_items(shard: int, num_shards: int) -> it.NativeCheckpointableIterator[int]:
    return it.NativeCheckpointableIterator(list(range(shard, 40, num_shards)))


def shuffled_shard(shard: int, num_shards: int) -> it.BlockwiseShuffleIterator[int]:
    source = create_source_iterator(list(range(shard, 9, num_shards)), seed=shard)
    return it.BlockwiseShuffleIterator(it.SelectManyIterator(source, read_chunk), 4, shard)


def serve_fan_outs(requests: Any) -> None:
    """A fan-out owner process: for each (path, items) received, a fresh fan-out of the
    numbers 1 .. items served at path, consumer 1 closed and consumer 0 left to attach."""
    fans = []
    while (request := requests.recv()) is not None:
        path, items = request
        fan = FanOut(it.MapIterator(native(items), add_one), 2, max_lag=3, snapshot_every=4)
        fan.consumer(1).close()
        fans.append(fan)
        requests.send(fan.serve(path))


class FanOutOwner:
    """The owner process that the remote consumers' cases attach to (started before the
    checker counts the processes that must not outlive a close)."""

    def __init__(self) -> None:
        self.requests: Any = None
        self.paths: Iterator[str] = iter(())

    def consumer(self, items: int = 45, prefetch: int = 1) -> RemoteConsumer[Any]:
        """Consumer 0 of a fresh fan-out of the owner, attached with `attach`."""
        self.requests.send((next(self.paths), items))
        return attach(self.requests.recv(), 0, timeout=10, prefetch=prefetch)

    def remote_consumer(self, items: int = 45) -> RemoteConsumer[Any]:
        """The same, built as the class."""
        self.requests.send((next(self.paths), items))
        return RemoteConsumer(self.requests.recv(), 0, timeout=10)

    def running(self) -> Iterator[None]:
        requests, owner_end = multiprocessing.Pipe()
        owner = multiprocessing.get_context("fork").Process(
            target=serve_fan_outs, args=(owner_end,), name="fan-out owner"
        )
        with tempfile.TemporaryDirectory() as folder:
            self.requests = requests
            self.paths = (str(Path(folder, f"{index}.sock")) for index in range(10**9))
            owner.start()
            try:
                yield
            finally:
                requests.send(None)
                owner.join(10)
                requests.close()


OWNER = FanOutOwner()
REMOTE = {"RemoteConsumer", "attach"}
"""The stages whose cases need `OWNER` running."""


# Each public iterator class (or factory) -> factories of pipelines exercising it.
CASES: dict[str, list[Callable[[], CheckpointableIterator[Any]]]] = {
    "NativeCheckpointableIterator": [
        native,
        lambda: it.NativeCheckpointableIterator(GeneratorIterable(17)),
        lambda: it.NativeCheckpointableIterator(range(5, 40, 3)),
        lambda: it.NativeCheckpointableIterator(()),
    ],
    "ChunkedSourceIterator": [
        lambda: it.ChunkedSourceIterator(list(range(29)), num_instances=3, instance_rank=1),
    ],
    "InfinitePermutationSourceIterator": [
        lambda: it.InfinitePermutationSourceIterator(list(range(7)), seed=3),
        lambda: it.InfinitePermutationSourceIterator(list(range(5)), seed=1, num_instances=3,
                                                      instance_rank=2),
        lambda: it.InfinitePermutationSourceIterator(list(range(2)), seed=4, num_instances=5,
                                                      instance_rank=3),
        lambda: it.InfinitePermutationSourceIterator(list(range(4)), shuffle=False,
                                                      num_instances=2, instance_rank=1),
        lambda: it.InfinitePermutationSourceIterator(list(range(7)), seed=3, num_instances=3,
                                                      instance_rank=2, epochs=4),
    ],
    "PermutationSourceIterator": [
        lambda: it.PermutationSourceIterator(30, seed=3),
        lambda: it.PermutationSourceIterator(7, seed="s", epochs=3, num_instances=2,
                                              instance_rank=1),
        lambda: it.PermutationSourceIterator(3, seed=1, epochs=2, num_instances=5,
                                              instance_rank=4),
    ],
    "RandomIterator": [lambda: it.RandomIterator(seed=5)],
    "SelectManyIterator": [
        lambda: it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(9))),
                                      read_chunk),
        lambda: it.SelectManyIterator(it.NativeCheckpointableIterator(CHUNKS)),
        lambda: it.SelectManyIterator(
            it.NativeCheckpointableIterator(list(range(9))), read_chunk, read_ahead=2
        ),
        lambda: it.SelectManyIterator(
            it.NativeCheckpointableIterator(list(range(12))), read_flaky_chunk, on_error=SKIPS
        ),
        lambda: it.SelectManyIterator(
            it.NativeCheckpointableIterator(list(range(12))), read_flaky_chunk, read_ahead=2,
            on_error=SKIPS,
        ),
    ],
    "MapIterator": [
        lambda: it.MapIterator(native(), add_one),
        lambda: it.MapIterator(native(40), fail_on_sevens, on_error=SKIPS),
    ],
    "SamplingRandomMapIterator": [lambda: it.SamplingRandomMapIterator(native(), jitter, 7)],
    "BatchMapIterator": [
        lambda: it.BatchMapIterator(native(), add_one_each, 4),
        lambda: it.BatchMapIterator(it.MapIterator(native(13), add_one), add_one_each, 1),
    ],
    "RecurrentIterator": [lambda: it.RecurrentIterator(native(), running_sum, 0)],
    "ZipIterator": [lambda: it.ZipIterator(native(30), native(19), it.RandomIterator(1))],
    "MultiplexIterator": [
        lambda: it.MultiplexIterator(
            it.NativeCheckpointableIterator([0, 1, 1, 2, 0, 2, 2, 1, 0] * 3),
            [native(10), it.RandomIterator(2), it.MapIterator(native(12), add_one)],
        )
    ],
    "WeightedMultiplexIterator": [
        lambda: it.WeightedMultiplexIterator([native(20), native(9), native(30)], [1, 2.5, 0.5], 3),
        lambda: it.WeightedMultiplexIterator(
            [native(12), it.RandomIterator(4), native(7)], [3, 1, 2], exact=True
        ),
        lambda: it.WeightedMultiplexIterator(
            [native(15), native(6)], [1, 1], 5, stop_on="first_exhausted"
        ),
        lambda: it.WeightedMultiplexIterator(
            [native(10), native(8)], [0.25, 0.75], exact=True, stop_on="first_exhausted"
        ),
    ],
    "TokenBudgetMultiplexIterator": [
        lambda: TokenBudgetMultiplexIterator(
            [documents(20), documents(9), documents(30)], [1, 2, 1]
        ),
        lambda: TokenBudgetMultiplexIterator(
            [documents(15), it.MapIterator(it.RandomIterator(3), str)], [1, 1], exact=False,
            stop_on="first_exhausted",
        ),
    ],
    "PackingIterator": [
        lambda: it.MapIterator(PackingIterator(documents(), 5), packed_lists),
        lambda: it.MapIterator(
            PackingIterator(documents(60), 6, strategy="best_fit", window=3, eos_id=9),
            packed_lists,
        ),
    ],
    "EqualLengthIterator": [
        lambda: EqualLengthIterator(it.FixedBatchIterator(native(23), 4)),
        lambda: EqualLengthIterator(native(17), "drop"),
        lambda: EqualLengthIterator(native(9), fill=list),
    ],
    "WindowedIterator": [
        lambda: it.WindowedIterator(native(150), 3),
        lambda: it.WindowedIterator(native(4), 6),
        lambda: it.WindowedIterator(native(300), 70),
    ],
    "FixedBatchIterator": [lambda: it.FixedBatchIterator(native(), 4)],
    "BlockwiseShuffleIterator": [
        lambda: it.BlockwiseShuffleIterator(native(), 5, 3),
        lambda: it.BlockwiseShuffleIterator(native(20), 5, 3),
    ],
    "BufferedShuffleIterator": [
        lambda: it.BufferedShuffleIterator(native(), 6, 11),
        lambda: it.BufferedShuffleIterator(
            it.NativeCheckpointableIterator([None, 1, None, "a", 2.5] * 4), 4, 2
        ),
    ],
    "BucketedReadaheadBatchIterator": [
        lambda: it.BucketedReadaheadBatchIterator(
            it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(9))), read_chunk),
            read_ahead=7, key=length_of, batch_size=2, seed=1,
        ),
        lambda: it.BucketedReadaheadBatchIterator(
            it.FixedBatchIterator(native(60), 3), read_ahead=5, key=length_of,
            batch_size=capacity, boundary_key=length_of, shuffle=False,
        ),
    ],
    "PrefetchIterator": [
        lambda: it.PrefetchIterator(native(), 4, snapshot_every=7),
        lambda: it.PrefetchIterator(native(40), 3, mode="thread", snapshot_every=5),
        lambda: it.MapIterator(
            it.PrefetchIterator(
                it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(9))),
                                      read_chunk),
                5, snapshot_every=3,
            ),
            str.upper,
        ),
    ],
    "ParallelMapIterator": [
        lambda: it.ParallelMapIterator(native(30), add_one, 2, 3, snapshot_every=4),
        lambda: it.ParallelMapIterator(native(30), add_one, 3, 2, snapshot_every=5, mode="thread"),
        lambda: it.ParallelMapIterator(native(30), add_one_each, 2, 4, snapshot_every=3,
                                       batched=True),
        lambda: it.ParallelMapIterator(native(30), add_one_each, 2, 5, snapshot_every=7,
                                       batched=True, mode="thread"),
        lambda: it.ParallelMapIterator(
            it.PrefetchIterator(native(20), 6, snapshot_every=5), add_one, 2, 2,
            snapshot_every=3,
        ),
        lambda: it.ParallelMapIterator(native(40), fail_on_sevens, 2, 3, snapshot_every=4,
                                       mode="thread", on_error=SKIPS),
    ],
    "FanOutConsumer": [
        lambda: fan_out_consumer(FanOut(native(40), 2, max_lag=3, snapshot_every=4), 0),
        lambda: fan_out_consumer(
            FanOut(it.MapIterator(native(90), add_one), 3, mode="split", snapshot_every=5), 1
        ),
    ],
    "RemoteConsumer": [OWNER.remote_consumer],
    "attach": [lambda: OWNER.consumer(prefetch=4)],
    "FilterIterator": [
        lambda: FilterIterator(native(40), is_odd),
        lambda: FilterIterator(it.SelectManyIterator(native(9), read_chunk), str.isalnum),
    ],
    "ShardedIterator": [
        lambda: ShardedIterator(shard_items, 5, 1, 2),
        lambda: it.MapIterator(ShardedIterator(shuffled_shard, 4, 0, 1), str.upper),
    ],
    "Watchdog": [lambda: Watchdog(it.MapIterator(native(), add_one), timeout_s=60)],
    "create_source_iterator": [
        lambda: create_source_iterator(list(range(7)), seed=3, epochs=2),
        lambda: create_source_iterator(list(range(11)), train=False, shuffle=False,
                                       num_instances=3, instance_rank=1),
    ],
    "SkipIterator": [
        lambda: SkipIterator(it.MapIterator(native(40), add_one), skip=[(3, 6), (10, 11)]),
        lambda: SkipIterator(native(12), skip=[(9, 30)]),
    ],
    "chunked_dataset_iterator": [
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=5, seed=2),
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=4, seed=2,
                                         use_windowed=True, transform=str.upper),
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=4, train=False,
                                         shuffle=False, num_instances=2, instance_rank=1),
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=4, seed=3,
                                         prefetch=True),
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=5, seed=2,
                                         epochs=2),
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=4, seed=2,
                                         epochs=3, use_windowed=True, transform=str.upper,
                                         read_ahead_chunks=2, num_instances=2, instance_rank=1),
        lambda: chunked_dataset_iterator(list(range(9)), read_chunk, buffer_size=4, seed=3,
                                         epochs=2, prefetch=True, num_instances=3,
                                         instance_rank=2),
        lambda: chunked_dataset_iterator(list(range(12)), read_flaky_chunk, buffer_size=4,
                                         seed=3, transform=fail_on_c7, on_error=SKIPS),
    ],
}


# Case id -> the same pipeline built with other stream-deciding arguments (contract C10):
# its states must be refused by the case's pipeline and the other way round.
DIFFERENT: dict[str, Callable[[], CheckpointableIterator[Any]]] = {
    "NativeCheckpointableIterator-0": lambda: native(24),
    "NativeCheckpointableIterator-2": lambda: it.NativeCheckpointableIterator(range(5, 40, 4)),
    "ChunkedSourceIterator-0": lambda: it.ChunkedSourceIterator(
        list(range(29)), num_instances=3, instance_rank=2
    ),
    "InfinitePermutationSourceIterator-0": lambda: it.InfinitePermutationSourceIterator(
        list(range(7))[::-1], seed=3
    ),
    "InfinitePermutationSourceIterator-1": lambda: it.InfinitePermutationSourceIterator(
        list(range(5)), seed=1, num_instances=6, instance_rank=2
    ),
    "InfinitePermutationSourceIterator-3": lambda: it.InfinitePermutationSourceIterator(
        list(range(4)), shuffle=True, num_instances=2, instance_rank=1
    ),
    "InfinitePermutationSourceIterator-4": lambda: it.InfinitePermutationSourceIterator(
        list(range(7)), seed=3, num_instances=3, instance_rank=2, epochs=3
    ),
    "PermutationSourceIterator-0": lambda: it.PermutationSourceIterator(31, seed=3),
    "PermutationSourceIterator-1": lambda: it.PermutationSourceIterator(
        7, seed="s", epochs=2, num_instances=2, instance_rank=1
    ),
    "RandomIterator-0": lambda: it.RandomIterator(seed=6),
    "SelectManyIterator-0": lambda: it.SelectManyIterator(
        it.NativeCheckpointableIterator(list(range(1, 9))), read_chunk
    ),
    "MapIterator-0": lambda: it.MapIterator(native(22), add_one),
    "BatchMapIterator-0": lambda: it.BatchMapIterator(native(), add_one_each, 5),
    "SamplingRandomMapIterator-0": lambda: it.SamplingRandomMapIterator(native(), jitter, 8),
    "RecurrentIterator-0": lambda: it.RecurrentIterator(native(22), running_sum, 0),
    "ZipIterator-0": lambda: it.ZipIterator(native(30), native(18), it.RandomIterator(1)),
    "WeightedMultiplexIterator-0": lambda: it.WeightedMultiplexIterator(
        [native(20), native(9), native(30)], [1, 2.5, 0.5], 3, exact=True
    ),
    "WeightedMultiplexIterator-2": lambda: it.WeightedMultiplexIterator(
        [native(15), native(6)], [1, 1], 5
    ),
    "TokenBudgetMultiplexIterator-0": lambda: TokenBudgetMultiplexIterator(
        [documents(20), documents(9), documents(30)], [1, 2, 1], exact=False
    ),
    "PackingIterator-1": lambda: it.MapIterator(
        PackingIterator(documents(60), 6, strategy="best_fit", window=4, eos_id=9), packed_lists
    ),
    "EqualLengthIterator-1": lambda: EqualLengthIterator(native(17)),
    "WindowedIterator-0": lambda: it.WindowedIterator(native(150), 4),
    "FixedBatchIterator-0": lambda: it.FixedBatchIterator(native(), 5),
    "BlockwiseShuffleIterator-0": lambda: it.BlockwiseShuffleIterator(native(), 6, 3),
    "BufferedShuffleIterator-0": lambda: it.BufferedShuffleIterator(native(), 7, 11),
    "BucketedReadaheadBatchIterator-0": lambda: it.BucketedReadaheadBatchIterator(
        it.SelectManyIterator(it.NativeCheckpointableIterator(list(range(9))), read_chunk),
        read_ahead=7, key=length_of, batch_size=3, seed=1,
    ),
    "PrefetchIterator-0": lambda: it.PrefetchIterator(native(22), 4, snapshot_every=7),
    "ParallelMapIterator-0": lambda: it.ParallelMapIterator(
        native(31), add_one, 2, 3, snapshot_every=4
    ),
    "RemoteConsumer-0": lambda: OWNER.remote_consumer(items=46),
    "FilterIterator-0": lambda: FilterIterator(native(41), is_odd),
    "FilterIterator-1": lambda: FilterIterator(
        it.SelectManyIterator(native(8), read_chunk), str.isalnum
    ),
    "ShardedIterator-0": lambda: ShardedIterator(shard_items, 6, 1, 2),
    "ShardedIterator-1": lambda: it.MapIterator(
        ShardedIterator(shuffled_shard, 3, 0, 1), str.upper
    ),
    "Watchdog-0": lambda: Watchdog(it.MapIterator(native(24), add_one), timeout_s=60),
    "create_source_iterator-0": lambda: create_source_iterator(list(range(7)), seed=4, epochs=2),
    "create_source_iterator-1": lambda: create_source_iterator(
        list(range(11)), train=False, shuffle=False, num_instances=3, instance_rank=2
    ),
    "EqualLengthIterator-0": lambda: EqualLengthIterator(it.FixedBatchIterator(native(23), 5)),
    "PackingIterator-0": lambda: it.MapIterator(PackingIterator(documents(), 6), packed_lists),
    "WindowedIterator-1": lambda: it.WindowedIterator(native(4), 5),
    "FanOutConsumer-1": lambda: fan_out_consumer(
        FanOut(it.MapIterator(native(90), add_one), 3, snapshot_every=5), 1
    ),
    "chunked_dataset_iterator-0": lambda: chunked_dataset_iterator(
        list(range(9))[::-1], read_chunk, buffer_size=5, seed=2
    ),
    "chunked_dataset_iterator-4": lambda: chunked_dataset_iterator(
        list(range(9)), read_chunk, buffer_size=5, seed=2
    ),
    "chunked_dataset_iterator-2": lambda: chunked_dataset_iterator(
        list(range(9)), read_chunk, buffer_size=4, train=False, shuffle=False, num_instances=3,
        instance_rank=1,
    ),
}

# Stage -> the rules its cases cannot keep, each with the reason (reviewed exemptions: a
# stage says which rule and why; nothing is skipped silently).
EXEMPT: dict[str, dict[str, str]] = {
    "FanOutConsumer": {
        "pickle": "a consumer shares its fan-out with the others: it cannot be pickled alone",
    },
    "RemoteConsumer": {
        "pickle": "a consumer holds its connection to the owner process: it cannot be pickled",
    },
    "attach": {
        "pickle": "a consumer holds its connection to the owner process: it cannot be pickled",
    },
    "Watchdog": {
        "pickle": "a watchdog holds its monitoring thread and lock: pickle the pipeline and "
        "watch the copy with a Watchdog of its own",
        "foreign state": "a watchdog is transparent, its state is its pipeline's: a foreign "
        "state is refused by, and names, the pipeline's outermost stage (MapIterator)",
    },
}


# Stage -> checker options of its cases, where the defaults cost too much.
OPTIONS: dict[str, dict[str, Any]] = {
    # each restore attaches to the owner process over a socket: a few restore points
    name: {"restore_points": [0, 1, 7, 22, 44, 45]}
    for name in REMOTE
}

# Case id -> a bug the case finds, not fixed yet: the case fails (strictly: it must fail)
# until the bug is fixed.
KNOWN_BUGS = {
    "attach-0": "with prefetch > 1, the state taken at the end of the stream counts the "
    "end of stream that the consumer holds as an item it has not used (taken 44 of 45), "
    "and a fresh fan-out refuses it (C4)",
}


def returns_a_stage(function: Callable[..., Any]) -> bool:
    """Whether `function` is annotated to return a CheckpointableIterator (its return
    annotation's class, looked up in the function's module)."""
    returned = inspect.signature(function).return_annotation
    if isinstance(returned, str):  # postponed: "Stage[T]", "CheckpointableIterator[Any]"
        name = returned.partition("[")[0].rpartition(".")[2]
        returned = getattr(sys.modules[function.__module__], name, None)
    returned = typing.get_origin(returned) or returned
    return inspect.isclass(returned) and issubclass(returned, CheckpointableIterator)


def public_stage_names() -> set[str]:
    """Each CheckpointableIterator class, and each function returning one, exported by the
    package root (which exports every public name, `iterators`' included)."""
    names = set()
    for name in infinibatch_like.__all__:
        value = getattr(infinibatch_like, name)
        if value is CheckpointableIterator:
            continue
        is_class = inspect.isclass(value) and issubclass(value, CheckpointableIterator)
        if is_class or (inspect.isfunction(value) and returns_a_stage(value)):
            names.add(name)
    return names


def test_every_public_stage_has_a_case() -> None:
    missing = public_stage_names() - set(CASES)
    assert not missing, f"public stages without a contract case: {sorted(missing)}"


def test_the_guard_finds_the_stages_of_every_face() -> None:
    names = public_stage_names()
    assert {"ShardedIterator", "Watchdog", "RemoteConsumer", "FilterIterator"} <= names
    assert {"attach", "create_source_iterator", "chunked_dataset_iterator"} <= names
    assert {"SkipPolicy", "FanOut", "restore_state", "load_checkpoint"}.isdisjoint(names)


def contract_cases() -> list[Any]:
    cases = []
    for name, factories in CASES.items():
        for index, factory in enumerate(factories):
            case = f"{name}-{index}"
            bug = KNOWN_BUGS.get(case)
            marks = [pytest.mark.xfail(raises=ContractViolation, strict=True, reason=bug)]
            cases.append(
                pytest.param(
                    name, factory, DIFFERENT.get(case), id=case, marks=marks if bug else ()
                )
            )
    return cases


def test_every_different_factory_and_exemption_belongs_to_a_case() -> None:
    ids = {f"{name}-{index}" for name, cases in CASES.items() for index in range(len(cases))}
    assert set(DIFFERENT) <= ids
    assert set(EXEMPT) | set(OPTIONS) <= set(CASES)
    assert set(KNOWN_BUGS) <= ids


@pytest.fixture(scope="module")
def fan_out_owner() -> Iterator[None]:
    yield from OWNER.running()


@pytest.mark.parametrize(("name", "factory", "different"), contract_cases())
def test_contract(
    name: str,
    factory: Callable[[], CheckpointableIterator[Any]],
    different: Callable[[], CheckpointableIterator[Any]] | None,
    request: pytest.FixtureRequest,
) -> None:
    if name in REMOTE:
        request.getfixturevalue("fan_out_owner")
    exempt = EXEMPT.get(name, {})
    options = {"max_items": 80, **OPTIONS.get(name, {})}
    assert_checkpointable(factory, different=different, exempt=exempt, **options)
    if different is not None:  # and the other way round
        assert_checkpointable(different, max_items=20, different=factory, check_damage=False,
                              check_torch=False, exempt={**exempt, "pickle": "checked above"})
