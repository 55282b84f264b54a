"""Shared memory for one sender and many receivers: a fan-out's owner puts the large
numpy arrays and CPU tensors of an item into segments once, and every consumer process
that receives the item maps them (see `shm` for the transport between one worker and its
consumer, whose pickler this reuses).

A `Broadcast` pickles a message with `encode`: each array or tensor of at least
``shm.THRESHOLD`` bytes is copied into a segment of its own (through the sender's mapping
of it, whose pages are reserved and mapped when it is created), named
``ibl_<sender pid>_<token>_t<tracker>_b<n>``, and pickled as a reference to it. A receiver's
``pickle.loads`` maps the segment copy-on-write (``MAP_PRIVATE``): what one consumer
writes into its array stays its own, as with a pickled copy. An array that already lies
in shared memory (made by `shm_arrays.shared_empty` or `shared_zeros`) is not copied:
it is pickled as a reference to where it lies, and held (`shm_arrays.hold`) as long as a
segment of its own would be.

Segments are recycled, as fresh pages cost as much as the copy itself: a segment is
*held* by its message while the sender may still send it (until `drop`), and by each
receiver process it was sent to (`sent`) until that receiver's mapping of it is
collected (the receiver reports it, `take_released`, and the sender is told,
`released`) or the receiver is found dead (`sweep`). A segment nobody holds goes to a
pool for the next array of its size class (`segments.Pool`; beyond its bounds, it is
unlinked). A receiver that closed its connection while it still holds
segments keeps them out of the pool until it dies. The sender unlinks every segment at
`close`; the kernel frees the memory once the last receiver unmapped it.

Each segment is registered with the sender's resource tracker (``<tracker>`` in its name
says which: `segments.tracker_id`) while it has a name (see `segments.unlink_name`), so
that a sender killed with SIGKILL, together with every receiver, leaves nothing in
/dev/shm: the tracker unlinks its names once every process sharing it is gone. A
receiver never unlinks a name while the sender lives; once the sender is dead,
`remove_left` unlinks (and unregisters) its names in a receiver that shares its tracker,
and leaves them to that tracker otherwise (a name unregistered from a tracker that does
not know it, or unlinked behind its back, makes the tracker complain).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref
from collections import Counter, defaultdict, deque
from collections.abc import Iterable
from typing import Any

from . import segments, shm, shm_arrays

_RELEASED: defaultdict[str, deque[str]] = defaultdict(deque)
"""In a receiver: the segments whose mapping was collected, by the prefix of their
sender's names, not yet reported to the sender."""


class Broadcast(shm.Sender):
    """The segments of one sender for many receivers (see the module)."""

    def __init__(self) -> None:
        tracker = segments.tracker_id(start=True)
        self.prefix = f"{segments.names_prefix(os.getpid())}{secrets.token_hex(4)}_t{tracker}_b"
        """The prefix of its segments' names."""
        self._created = 0
        self._names: list[str] = []
        """The segments of the message being pickled."""
        super().__init__()
        self.array_loader, self.tensor_loader = _attach_array, _attach_tensor
        self._segments: dict[str, tuple[Any, int]] = {}
        """Every segment of this sender (named): a writable view of its data (mapped while
        the segment has a name) and its capacity."""
        self._holds: Counter[str] = Counter()
        """The holders of each segment in use (its message, and receivers)."""
        self._held_by: dict[int, Counter[str]] = {}
        """The segments sent to each receiver process and not released by it."""
        self._pool: segments.Pool[str] = segments.Pool()
        """The unused segments of its own (not those of `shm_arrays`)."""

    def copy_in(self, obj: Any, order: str, np: Any) -> Any | None:
        place = shm_arrays.place_of(obj, order)
        if place is not None:  # made in shared memory: sent where it lies, no copy
            shared, offset = place
            if not self._holds[shared]:
                shm_arrays.hold(shared)
            self._holds[shared] += 1
            self._names.append(shared)
            return shared, obj.nbytes, offset, self.prefix
        values = memoryview(np.ravel(obj, order=order).view(np.uint8))  # no copy if contiguous
        size = len(values)
        capacity = segments.size_class(size)
        name = self._pool.take(capacity)
        if name is None:
            name = f"{self.prefix}{self._created}"
            try:
                segment = segments.Segment(name, capacity)
            except OSError:  # no room in /dev/shm: pickled in the message
                return None
            self._created += 1
            view = memoryview(segment.memory.buffer(segments.HEADER, capacity)).cast("B")
            self._segments[name] = view, capacity
        self._segments[name][0][:size] = values
        self._holds[name] = 1
        self._names.append(name)
        return name, size

    def encode(self, obj: Any) -> tuple[bytes, list[str]]:
        """`obj` pickled, its large arrays and tensors through segments, and the names of
        those segments, which the message holds until `drop`. If pickling fails, the
        segments it took are let go (and the error raised)."""
        self._names = []
        data = self._pickled(obj, lambda: self.drop(self._names))
        names, self._names = self._names, []
        return data, names

    def drop(self, names: Iterable[str]) -> None:
        """The message of segments `names` will not be sent any more."""
        for name in names:
            self._let_go(name)

    def sent(self, receiver: int, names: list[str]) -> None:
        """Segments `names` were sent to process `receiver`: it holds them until it
        reports them released (or dies)."""
        if names:
            held = self._held_by.setdefault(receiver, Counter())
            for name in names:
                if not self._holds[name]:  # pooled, maybe reused: mapping it would be wrong
                    raise RuntimeError(f"segment {name} was sent after it was let go")
                held[name] += 1
                self._holds[name] += 1

    def released(self, receiver: int, names: Iterable[str]) -> None:
        """Process `receiver` collected its mappings of segments `names`."""
        held = self._held_by.get(receiver)
        if held is None:
            return
        for name in names:
            if held[name] > 0:  # not a name it was never sent (nor one forgotten)
                held[name] -= 1
                self._let_go(name)
        if not +held:
            del self._held_by[receiver]

    def sweep(self, connected: Iterable[int]) -> None:
        """Let go of what receivers that are not `connected` and are dead held."""
        live = set(connected)
        for receiver in [pid for pid in self._held_by if pid not in live]:
            if not _running(receiver):
                held = self._held_by.pop(receiver)
                for name, count in held.items():
                    for _ in range(count):
                        self._let_go(name)

    def _let_go(self, name: str) -> None:
        if self._holds[name] <= 0:
            return
        self._holds[name] -= 1
        if self._holds[name]:
            return
        del self._holds[name]
        own = self._segments.get(name)
        if own is None:  # one of `shm_arrays`'
            shm_arrays.let_go(name)
        elif not self._pool.keep(own[1], name):
            self._unlink(name)

    def _unlink(self, name: str) -> None:
        self._segments.pop(name)[0].release()  # unmapped once collected
        segments.unlink_name(name)

    def close(self) -> None:
        """Unlink every segment of its own (receivers' mappings stay valid), and let go of
        those of `shm_arrays` for good (receivers may map them still). Idempotent."""
        shared = [name for name in self._holds if name not in self._segments]
        for name in list(self._segments):
            self._unlink(name)
        for name in shared:
            shm_arrays.let_go(name, retire=True)
        self._holds.clear()
        self._held_by.clear()
        self._pool.clear()

    def forget(self) -> None:
        """In a forked child: let go of the inherited mappings (the names stay)."""
        self._segments.clear()
        self._holds.clear()


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (whose mappings are gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def remove_left(prefix: str) -> None:
    """Unlink the segments that the dead sender of `Broadcast.prefix` `prefix` left, its
    process's `shm_arrays` with them, if this process shares the resource tracker they
    are registered with (else that tracker unlinks them once every process sharing it is
    gone)."""
    tracker = prefix.rpartition("_t")[2].removesuffix("_b")
    if tracker and tracker == segments.tracker_id():
        segments.remove_prefixed(prefix)
        pid = int(prefix.split("_")[1])
        segments.remove_prefixed(shm_arrays.names_prefix(pid, tracker))


def take_released(prefix: str) -> list[str]:
    """In a receiver: the segments of the sender whose names start with `prefix` whose
    mappings were collected since the last call."""
    queue = _RELEASED.get(prefix)
    names: list[str] = []
    with contextlib.suppress(IndexError):  # another thread took the last one
        while queue:
            names.append(queue.popleft())
    return names


def _mapped(reference: tuple[Any, ...]) -> Any:
    """The data of a segment of a `Broadcast` (``(name, size)``), or of an array of its
    sender's `shm_arrays` (``(name, size, offset, sender prefix)``), mapped copy-on-write,
    as a buffer whose collection unmaps it and reports the segment released
    (`take_released`)."""
    name, size = reference[0], reference[1]
    if len(reference) > 2:
        offset, prefix = reference[2], reference[3]
    else:
        offset, prefix = 0, name[: name.rindex("_b") + 2]
    try:
        memory = segments.mapped(
            name, segments.HEADER + offset + size, os.O_RDONLY, mmap.MAP_PRIVATE
        )
    except FileNotFoundError:
        raise RuntimeError(
            f"the shared-memory segment {name} of a fan-out item is gone (its owner "
            "stopped, or removed it, before this consumer read the item)"
        ) from None
    buffer = memory.buffer(segments.HEADER + offset, size)
    weakref.finalize(buffer, _RELEASED[prefix].append, name)
    return buffer


def _attach_array(reference: tuple[Any, ...], dtype: Any, shape: Any, order: str) -> Any:
    return shm.array_over(_mapped(reference), dtype, shape, order)


def _attach_tensor(reference: tuple[Any, ...], dtype: Any, shape: Any, strides: Any) -> Any:
    return shm.tensor_over(_mapped(reference), dtype, shape, strides)

