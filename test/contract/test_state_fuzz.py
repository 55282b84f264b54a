"""Fuzzed states: real states of composed pipelines, damaged at random, are refused with a
clear error naming a stage or restored coherently, always within a deadline (C11)."""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Callable
from typing import Any

from _profiles import examples
from _streams import ChunkReader, native, take
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import infinibatch_like.iterators as it
from infinibatch_like._core.stage import Stage
from infinibatch_like.datasets import chunked_dataset_iterator
from infinibatch_like.distributed import EqualLengthIterator

DEADLINE = 2.0
"""Seconds a restore and the next items may take (restores take milliseconds; this is
generous so that a loaded machine does not fail the test)."""

CHUNKS = [[f"c{c}-{i}" for i in range(c % 4 + 1)] for c in range(10)]


read_chunk = ChunkReader(CHUNKS)


def length(item: Any) -> int:
    return len(item)


def capacity(longest: Any) -> int:
    return max(1, 9 // (len(longest) + 1))


def noisy(rng: random.Random, item: Any) -> Any:
    return (item, rng.randrange(10), round(rng.gauss(0, 1), 3))


def running_total(total: int, item: Any) -> tuple[int, int]:
    return total + len(str(item)), total


PIPELINES: list[Callable[[], it.CheckpointableIterator[Any]]] = [
    lambda: chunked_dataset_iterator(list(range(10)), read_chunk, buffer_size=5, seed=1),
    lambda: chunked_dataset_iterator(
        list(range(10)), read_chunk, buffer_size=4, seed=2, use_windowed=True, transform=str.upper
    ),
    lambda: chunked_dataset_iterator(
        list(range(10)), read_chunk, buffer_size=3, train=False, shuffle=False, num_instances=2
    ),
    lambda: it.BucketedReadaheadBatchIterator(
        it.SelectManyIterator(
            it.InfinitePermutationSourceIterator(list(range(10)), seed=3), read_chunk, read_ahead=1
        ),
        read_ahead=7,
        key=length,
        batch_size=capacity,
        seed=4,
    ),
    lambda: it.WindowedIterator(it.MapIterator(native(200), str), 3),
    lambda: it.WeightedMultiplexIterator(
        [it.BlockwiseShuffleIterator(native(40), 6, 5), it.RandomIterator(6)], [2, 1], 7
    ),
    lambda: it.ZipIterator(
        it.FixedBatchIterator(native(90), 4), it.RecurrentIterator(native(60), running_total, 0)
    ),
    lambda: it.SamplingRandomMapIterator(it.BufferedShuffleIterator(native(50), 5, 8), noisy, 9),
    lambda: EqualLengthIterator(it.WindowedIterator(native(30), 70), fill=list),
    lambda: it.WeightedMultiplexIterator(
        [native(20), native(15), native(5)], [1, 2, 1], exact=True, stop_on="first_exhausted"
    ),
    lambda: chunked_dataset_iterator(
        list(range(10)), read_chunk, buffer_size=5, seed=1, epochs=2, num_instances=2,
        instance_rank=1,
    ),
    lambda: it.FixedBatchIterator(
        it.PermutationSourceIterator(50, seed=3, epochs=2, num_instances=3, instance_rank=2), 4
    ),
]

STAGE_NAMES = sorted(
    name
    for name, value in {**vars(it), "EqualLengthIterator": EqualLengthIterator}.items()
    if isinstance(value, type) and issubclass(value, Stage)
)

NUMBER_DAMAGE: list[Any] = [10**18, 2**64, -1, -(2**63), 0, 3, "7", 1.5, None, True, [], {}]
OTHER_DAMAGE: list[Any] = [0, -1, 10**18, "x", "A" * 3336, None, 1.5, False, [None], {}]


USER_DATA = {"buffer", "recurrent_state"}
"""Keys holding the user's items and states, handed to user code as they are: not damaged."""


def nodes(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) in a state, the root included, except the user's data."""
    found = [(path, value)]
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in USER_DATA:
                found += nodes(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += nodes(item, (*path, index))
    return found


def replaced(state: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    container = state
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = value
    return state


@st.composite
def damage(draw: st.DrawFn, state: Any) -> tuple[str, Any]:
    """One random damage of `state` (a deep copy): its description and the damaged state."""
    state = copy.deepcopy(state)
    numbers = [(path, value) for path, value in nodes(state) if type(value) in (int, float)]
    if numbers and draw(st.booleans()):  # counts are where hangs hide: damage them most
        path, value = draw(st.sampled_from(numbers))
    else:
        path, value = draw(st.sampled_from(nodes(state)))
    where = "state" + "".join(f"[{key!r}]" for key in path)
    if isinstance(value, dict) and value and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(value)))
        if key == "stage" and draw(st.booleans()):
            value["stage"] = draw(st.sampled_from(STAGE_NAMES))
            return f"{where}['stage'] = {value['stage']!r}", state
        del value[key]
        return f"del {where}[{key!r}]", state
    if isinstance(value, dict) and draw(st.booleans()):
        value[draw(st.sampled_from(["extra", "draws", "source"]))] = draw(
            st.sampled_from(OTHER_DAMAGE)
        )
        return f"a key added to {where}", state
    if isinstance(value, list) and value and draw(st.booleans()):
        cut = draw(st.integers(0, len(value) - 1))
        del value[cut:]
        return f"{where} cut to {cut} items", state
    if isinstance(value, list) and draw(st.booleans()):
        value.append(copy.deepcopy(value[-1]) if value and draw(st.booleans()) else 0)
        return f"{where} extended", state
    is_number = isinstance(value, (int, float)) and type(value) is not bool
    new = draw(st.sampled_from(NUMBER_DAMAGE if is_number else OTHER_DAMAGE))
    return f"{where} = {new!r}"[:200], replaced(state, path, new)


def names_in(state: Any) -> set[str]:
    return {
        value for path, value in nodes(state) if value in STAGE_NAMES and path[-1:] == ("stage",)
    }


def within_deadline(action: Callable[[], Any], what: str) -> tuple[Any, BaseException | None]:
    outcome: list[tuple[Any, BaseException | None]] = []

    def run() -> None:
        try:
            outcome.append((action(), None))
        except BaseException as error:  # judged by the caller
            outcome.append((None, error))

    thread = threading.Thread(target=run, name="test_state_fuzz", daemon=True)
    thread.start()
    thread.join(DEADLINE)
    assert outcome, f"{what} did not finish within {DEADLINE} s"
    return outcome[0]


@settings(
    max_examples=examples(5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    index=st.integers(0, len(PIPELINES) - 1),
    position=st.integers(0, 40),
    data=st.data(),
    repeats=st.integers(1, 2),
)
def test_a_damaged_state_is_refused_clearly_or_restored_coherently(
    index: int, position: int, data: st.DataObject, repeats: int
) -> None:
    build = PIPELINES[index]
    original = build()
    take(original, position)
    state = original.getstate()
    original.close()
    description, damaged = "", state
    for _ in range(repeats):
        change, damaged = data.draw(damage(damaged))
        description += change + "; "
    names = names_in(state) | names_in(damaged) | {type(original).__name__}

    pipeline = build()

    def restore() -> tuple[Any, list[Any]]:
        pipeline.setstate(damaged)
        restored = pipeline.getstate()
        return restored, take(pipeline, 5)

    result, error = within_deadline(restore, f"restoring ({description})")
    pipeline.close()
    if error is not None:
        assert isinstance(error, (ValueError, TypeError)), (
            f"{description}: {type(error).__name__}: {error}"
        )
        assert any(name in str(error) for name in names), f"{description}: {error}"
        return
    # Accepted: the state the pipeline reports must restore to the same items.
    restored, items = result
    again = build()
    again_items, again_error = within_deadline(
        lambda: (again.setstate(restored), take(again, 5))[1], "restoring the reported state"
    )
    again.close()
    assert again_error is None, f"{description}: {again_error!r}"
    assert again_items == items, description
