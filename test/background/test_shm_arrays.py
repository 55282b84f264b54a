"""Arrays made in shared memory (infinibatch_like/background/shm_arrays.py): large ones lie
in this process's segments, a segment is reused only once no array viewing it is alive and
no sender holds it, and none is left in /dev/shm at exit; small arrays, arrays of objects
and a full /dev/shm give ordinary numpy arrays."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _profiles import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from infinibatch_like import empty_shared_pool, shared_empty, shared_zeros
from infinibatch_like.background import segments, shm, shm_arrays

pytestmark = pytest.mark.skipif(not segments.ENABLED, reason="no /dev/shm")

LARGE = shm.THRESHOLD // 4
"""int32 values in the smallest array made in shared memory."""


@pytest.fixture(autouse=True)
def _nothing_left_after_each_test() -> Iterator[None]:
    """Each test's arrays, once collected, leave no segment behind (pool emptied)."""
    yield
    gc.collect()
    empty_shared_pool()
    prefix = shm_arrays.names_prefix(os.getpid(), segments.tracker_id())
    assert not [name for name in os.listdir(segments.SHM_DIR) if name.startswith(prefix)]


def place(array: Any) -> tuple[str, int] | None:
    return shm_arrays.place_of(array, "C")


def in_dev_shm(name: str) -> bool:
    return os.path.exists(f"{segments.SHM_DIR}/{name}")


def test_large_arrays_lie_in_this_process_segments_and_others_are_numpy_arrays() -> None:
    large = shared_zeros((4, LARGE // 4), np.int32)
    found = place(large)
    assert found is not None
    assert found[1] == 0
    assert found[0].startswith(shm_arrays.names_prefix(os.getpid(), segments.tracker_id()))
    assert type(large) is np.ndarray
    assert large.shape == (4, LARGE // 4)
    assert not large.any()
    for ordinary in (
        shared_zeros(LARGE - 1, np.int32),  # below the threshold: pickled anyway
        shared_empty(LARGE, object),
        np.zeros(LARGE, np.int32),
    ):
        assert place(ordinary) is None
    assert place(shared_empty(np.int64(LARGE), "int32")) is not None  # numpy ints, lists
    assert shared_empty([2, LARGE], "float64").shape == (2, LARGE)
    assert place(large[1:]) == (found[0], LARGE)  # a view lies where its values do
    assert place(large.T) is None  # not contiguous: copied when sent


def test_zeros_are_zeros_in_a_reused_segment() -> None:
    first = shared_empty(LARGE, np.int32)
    first[:] = 7
    name = place(first)
    del first
    gc.collect()
    again = shared_zeros(LARGE, np.int32)
    assert place(again) == name  # its segment, from the pool
    assert not again.any()


operations = st.lists(
    st.one_of(
        st.tuples(st.just("make"), st.integers(1, 6)),
        st.tuples(st.just("keep a view, drop the array"), st.integers(0, 1 << 16)),
        st.tuples(st.just("drop"), st.integers(0, 1 << 16)),
    ),
    max_size=60,
)


def assert_intact(live: list[tuple[int, Any]]) -> None:
    """Every array (or view, or tensor of one) in `live` still holds the value written
    into it, and no two made apart share memory."""
    import torch

    spans = []
    for written, array in live:
        values = array.numpy() if isinstance(array, torch.Tensor) else array
        assert (values == written).all()  # nothing else was made in its memory
        name, offset = place(values) or ("", -1)
        spans.append((name, offset, offset + values.nbytes, written))
    spans.sort()
    for (name, _, end, one), (other, start, _, two) in itertools.pairwise(spans):
        assert name != other or end <= start or one == two  # only views of one array


@settings(max_examples=examples(0.6), deadline=None)
@given(operations=operations)
def test_live_arrays_never_share_a_segment_and_keep_their_values(
    operations: list[tuple[str, int]],
) -> None:
    import torch

    live: list[tuple[int, Any]] = []  # (value written, the array or a view of it)
    for number, (operation, value) in enumerate(operations):
        if operation == "make":
            made = shared_empty(value * LARGE, np.int32)
            made[:] = number
            live.append((number, made))
            del made
        elif live:
            written, dropped = live.pop(value % len(live))
            if operation == "keep a view, drop the array":
                tensor = value % 2 and not isinstance(dropped, torch.Tensor)
                live.append((written, torch.from_numpy(dropped) if tensor else dropped[1:]))
            del dropped  # the last reference to it but the views in `live`
        gc.collect()
        assert_intact(live)


def test_a_segment_held_by_a_sender_is_reused_only_once_it_lets_go() -> None:
    array = shared_empty(LARGE, np.int32)
    name = place(array)[0]  # type: ignore[index]
    shm_arrays.hold(name)  # a fan-out sent it
    del array
    gc.collect()
    other = shared_empty(LARGE, np.int32)
    assert place(other)[0] != name  # type: ignore[index]
    shm_arrays.let_go(name)
    assert place(shared_empty(LARGE, np.int32))[0] == name  # type: ignore[index]


def test_a_retired_segment_is_unlinked_once_nobody_holds_it() -> None:
    array = shared_empty(LARGE, np.int32)
    name = place(array)[0]  # type: ignore[index]
    shm_arrays.hold(name)
    shm_arrays.let_go(name, retire=True)  # a closed fan-out: its consumers may map it
    assert in_dev_shm(name)  # the array is alive
    del array
    gc.collect()
    assert not in_dev_shm(name)


def test_emptying_the_pool_unlinks_the_unused_segments_only() -> None:
    kept, dropped = shared_empty(LARGE, np.int32), shared_empty(LARGE, np.int32)
    kept_name, dropped_name = place(kept)[0], place(dropped)[0]  # type: ignore[index]
    del dropped
    gc.collect()
    empty_shared_pool()
    assert in_dev_shm(kept_name)
    assert not in_dev_shm(dropped_name)
    del kept
    gc.collect()
    empty_shared_pool()
    assert not in_dev_shm(kept_name)


def test_a_full_dev_shm_gives_ordinary_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    empty_shared_pool()

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    array = shared_zeros(LARGE, np.int32)
    assert place(array) is None
    assert array.shape == (LARGE,)
    assert not array.any()


def _in_forked_child(parent_array: Any, out: Any) -> None:
    own = shared_empty(LARGE, np.int32)
    out.send((place(parent_array), place(own)))


def test_a_forked_child_makes_segments_of_its_own() -> None:
    parent_array = shared_zeros(LARGE, np.int32)
    reader, writer = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_in_forked_child, args=(parent_array, writer)
    )
    child.start()
    inherited, own = reader.recv()
    child.join(30)
    assert child.exitcode == 0
    assert inherited is None  # its parent's: a fan-out of the child would copy it
    assert own[0].startswith(shm_arrays.names_prefix(child.pid, segments.tracker_id()))
    assert not in_dev_shm(own[0])  # unlinked as the child exited


def test_no_segment_is_left_at_exit() -> None:
    code = (
        "import numpy, infinibatch_like as ibl\n"
        "from infinibatch_like.background import shm_arrays\n"
        f"kept = ibl.shared_zeros({LARGE}, numpy.int32)\n"
        f"dropped = ibl.shared_zeros({LARGE}, numpy.int32)\n"
        "print(shm_arrays.place_of(kept, 'C')[0], shm_arrays.place_of(dropped, 'C')[0])\n"
        "del dropped\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    names = done.stdout.split()
    assert len(names) == 2
    assert not any(in_dev_shm(name) for name in names)
    assert "leaked" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
