"""Arrays made in shared memory: `shared_empty` and `shared_zeros` give numpy arrays
whose memory is a segment of this process's, so that a fan-out sends them to its
consumer processes by reference, with no copy (`shm_broadcast.Broadcast` asks `place_of`
where an array lies). Elsewhere they are ordinary arrays.

A segment is *held* by the arrays viewing it in this process (until the last of them,
views and ``torch.from_numpy`` tensors included, is collected) and by each fan-out
sender that still may send it or whose consumer processes still map it (`hold`,
`let_go`). Once nobody holds it, it returns to this process's pool for the next array of
its size class (`segments.Pool`; beyond its bounds, or once `retire`d, it is unlinked);
`empty_shared_pool` unlinks the unused ones now, and every one is unlinked at exit.

Segments are named ``ibl_<pid>_t<tracker>_a<n>`` (`names_prefix`) and registered with
this process's resource tracker (see `segments`), so that a process killed with SIGKILL
leaves nothing in /dev/shm once its tracker ends, and consumers that share that tracker
unlink them at once (`shm_broadcast.remove_left`).

Arrays smaller than `shm.THRESHOLD` bytes, arrays of objects, and every array when
/dev/shm is missing or full, are made by numpy as usual (fan-outs pickle those).
"""

from __future__ import annotations

import bisect
import multiprocessing.util
import operator
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is needed to make arrays, not to import this module
    from numpy.typing import NDArray

from . import segments, shm


class _Shared:
    """A segment of the pool and its holders."""

    __slots__ = ("address", "capacity", "holds", "name", "retired", "segment")

    def __init__(self, segment: segments.Segment) -> None:
        self.segment, self.name, self.capacity = segment, segment.name, segment.capacity
        self.address: int = segment.memory.address + segments.HEADER
        """Where its data starts in this process."""
        self.holds = 0
        self.retired = False
        """Unlinked, not pooled, once nobody holds it."""


_lock = threading.Lock()
_by_name: dict[str, _Shared] = {}
_by_address: list[_Shared] = []
"""The segments of `_by_name`, sorted by the address of their data."""
_pool: segments.Pool[_Shared] = segments.Pool()
_collected: deque[str] = deque()
"""The segments whose arrays were all collected, not yet let go (a collection may happen
while `_lock` is held)."""
_created = [0]
_prefix: list[str] = []


def names_prefix(pid: int, tracker: str) -> str:
    """The prefix of the names of the segments of process `pid` registered with resource
    tracker `tracker` (`segments.tracker_id`)."""
    return f"{segments.names_prefix(pid)}t{tracker}_a"


def shared_empty(shape: int | Sequence[int], dtype: Any = float) -> NDArray[Any]:
    """A new numpy array of `shape` and `dtype`, its values unset, in shared memory: a
    `FanOut` sends it to consumer processes without copying it.

    Do not write into it once a pipeline yielded it: consumer processes map its memory,
    and see what the owner writes (as consumer threads see the object itself).

    Checkpoint: no state; where an item's arrays lie does not change what is delivered."""
    return _allocated(shape, dtype, zeroed=False)


def shared_zeros(shape: int | Sequence[int], dtype: Any = float) -> NDArray[Any]:
    """A new numpy array of `shape` and `dtype`, filled with zeros, in shared memory (see
    `shared_empty`).

    Checkpoint: no state (see `shared_empty`)."""
    return _allocated(shape, dtype, zeroed=True)


def empty_shared_pool() -> None:
    """Unlink this process's unused segments now (those in use are pooled again once
    nobody holds them).

    Checkpoint: no state."""
    with _lock:
        _collect()
        for shared in [shared for shared in _by_name.values() if shared.holds == 0]:
            _forget(shared)
        _pool.clear()


def _allocated(shape: int | Sequence[int], dtype: Any, zeroed: bool) -> NDArray[Any]:
    import numpy as np

    dtype = np.dtype(dtype)
    dims = _dims(shape)
    size = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    shared = None
    if segments.ENABLED and size >= shm.THRESHOLD and not dtype.hasobject:
        with _lock:
            _collect()
            shared = _taken(segments.size_class(size))
    if shared is None:
        return np.zeros(dims, dtype) if zeroed else np.empty(dims, dtype)
    buffer = shared.segment.memory.buffer(segments.HEADER, shared.capacity)
    weakref.finalize(buffer, _on_collected, shared.name)
    array: NDArray[Any] = shm.array_over(buffer, dtype, dims, "C")
    if zeroed:
        array.fill(0)
    return array


def _dims(shape: Any) -> tuple[int, ...]:
    """`shape` as a tuple of ints (an int, numpy's included, is one dimension)."""
    if hasattr(shape, "__index__"):
        return (operator.index(shape),)
    return tuple(operator.index(length) for length in shape)


def _taken(capacity: int) -> _Shared | None:
    """A segment of `capacity` held once (by the array about to view it), pooled or new;
    None if /dev/shm has no room."""
    shared = _pool.take(capacity)
    if shared is None:
        if not _prefix:
            _prefix.append(names_prefix(os.getpid(), segments.tracker_id(start=True)))
            # at exit, in worker processes too (they skip atexit)
            multiprocessing.util.Finalize(None, _unlink_all, (os.getpid(),), exitpriority=0)
        for _ in range(3):  # a name left by a dead process with this pid is skipped
            name = f"{_prefix[0]}{_created[0]}"
            _created[0] += 1
            try:
                segment = segments.Segment(name, capacity)
                break
            except FileExistsError:
                continue
            except OSError:
                return None
        else:
            return None
        shared = _Shared(segment)
        _by_name[name] = shared
        bisect.insort(_by_address, shared, key=_address)
    shared.holds = 1
    return shared


def _address(shared: _Shared) -> int:
    return shared.address


def place_of(array: Any, order: str) -> tuple[str, int] | None:
    """The segment of this process's pool that numpy array `array` lies in (contiguous in
    `order`), and its offset in it; None if it lies elsewhere."""
    contiguous = array.flags.c_contiguous if order == "C" else array.flags.f_contiguous
    if not _by_address or not contiguous:
        return None
    address = array.__array_interface__["data"][0]
    with _lock:
        index = bisect.bisect_right(_by_address, address, key=_address) - 1
        if index < 0:
            return None
        shared = _by_address[index]
        offset = address - shared.address
        if offset + array.nbytes > shared.capacity or shared.holds == 0:
            return None
        return shared.name, offset


def hold(name: str) -> None:
    """A sender holds segment `name` (an array of it is alive: it is in use)."""
    with _lock:
        _by_name[name].holds += 1


def let_go(name: str, retire: bool = False) -> None:
    """A sender no longer holds segment `name`; `retire`: it may not know who maps it
    still, so the segment is never reused (unlinked once nobody holds it)."""
    with _lock:
        shared = _by_name.get(name)
        if shared is not None:
            shared.retired |= retire
            _release(shared)
        _collect()


def _on_collected(name: str) -> None:
    """The last array viewing segment `name` was collected: let go of it now, or at the
    next call here if this thread (or another) holds `_lock`."""
    _collected.append(name)
    if _lock.acquire(blocking=False):
        try:
            _collect()
        finally:
            _lock.release()


def _collect() -> None:
    """Let go of the segments whose arrays were collected (`_lock` held)."""
    while _collected:
        shared = _by_name.get(_collected.popleft())
        if shared is not None:  # not one inherited from the parent of a forked child
            _release(shared)


def _release(shared: _Shared) -> None:
    shared.holds -= 1
    if shared.holds == 0 and (shared.retired or not _pool.keep(shared.capacity, shared)):
        _forget(shared)


def _forget(shared: _Shared) -> None:
    """Unlink segment `shared` and drop it (unmapped once its last view is collected)."""
    del _by_name[shared.name]
    _by_address.remove(shared)
    segments.unlink_name(shared.name)


def _unlink_all(pid: int) -> None:
    """At exit: unlink every segment (what consumers map stays valid)."""
    if pid == os.getpid():
        for name in list(_by_name):
            segments.unlink_name(name)


def _after_fork_in_child() -> None:
    """A forked child makes segments of its own; its parent's stay its parent's."""
    _by_name.clear()
    _by_address.clear()
    _pool.clear()
    _collected.clear()
    _created[0] = 0
    _prefix.clear()
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
