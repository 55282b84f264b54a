"""Shared memory for one sender and many receivers: a fan-out's owner puts the large
numpy arrays and CPU tensors of an item into segments once, and every consumer process
that receives the item maps them (see `shm` for the transport between one worker and its
consumer, whose pickler this reuses).

A `Broadcast` pickles a message with `encode`: each array or tensor of at least
``shm.THRESHOLD`` bytes is copied into a new segment of its own, named
``ibl_<sender pid>_<token>_t<tracker>_b<n>``, and pickled as a reference to it. A receiver's
``pickle.loads`` maps the segment copy-on-write (``MAP_PRIVATE``): what one consumer
writes into its array stays its own, as with a pickled copy. The sender unmaps its copy
at once; it keeps the name until it calls `unlink` (when no receiver will map the
segment any more), and the kernel frees the memory once the last receiver unmapped it
(when its array is collected, or its process ended).

Each segment is registered with the sender's resource tracker (``<tracker>`` in its name
says which: `segments.tracker_id`) while it has a name (see `segments.unlink_name`), so that
a sender killed with SIGKILL, together with every receiver, leaves nothing in /dev/shm:
the tracker unlinks its names once every process sharing it is gone. A receiver never
unlinks a name while the sender lives; once the sender is dead, `remove_left` unlinks
(and unregisters) its names in a receiver that shares its tracker, and leaves them to
that tracker otherwise (a name unregistered from a tracker that does not know it, or
unlinked behind its back, makes the tracker complain).
"""

from __future__ import annotations

import io
import mmap
import os
import secrets
from typing import Any

from . import segments, shm


class Broadcast(shm.Sender):
    """The segments of one sender for many receivers (see the module)."""

    def __init__(self) -> None:
        tracker = segments.tracker_id(start=True)
        self.prefix = f"{segments.names_prefix(os.getpid())}{secrets.token_hex(4)}_t{tracker}_b"
        """The prefix of its segments' names."""
        self._created = 0
        self._names: list[str] = []
        """The segments of the message being pickled."""
        self._file = io.BytesIO()
        self._pickler = shm._Pickler(self._file, self)
        self.array_loader, self.tensor_loader = _attach_array, _attach_tensor

    def space(self, size: int) -> tuple[Any, Any] | None:
        name = f"{self.prefix}{self._created}"
        try:
            segment = segments.Segment(name, size)
        except OSError:  # no room in /dev/shm: pickled in the message
            return None
        self._created += 1
        self._names.append(name)
        # The buffer keeps the mapping until the copy into it is done, then unmaps it.
        return segment.memory.buffer(segments.HEADER, size), (name, size)

    def encode(self, obj: Any) -> tuple[bytes, list[str]]:
        """`obj` pickled, its large arrays and tensors through new segments, and the
        names of those segments (to `unlink` once no receiver will map them). If
        pickling fails, the segments it made are unlinked (and the error raised)."""
        self._names = []
        file, pickler = self._file, self._pickler
        file.seek(0)
        file.truncate()
        try:
            pickler.dump(obj)
        except BaseException:
            unlink(self._names)
            raise
        finally:
            pickler.clear_memo()  # holds the message's objects
        names, self._names = self._names, []
        return file.getvalue(), names


def unlink(names: list[str]) -> None:
    """Remove the names of segments of a `Broadcast` (those mapped stay valid), in the
    process of the `Broadcast`."""
    for name in names:
        segments.unlink_name(name)


def remove_left(prefix: str) -> None:
    """Unlink the segments that the dead sender of `Broadcast.prefix` `prefix` left, if
    this process shares the resource tracker they are registered with (else that tracker
    unlinks them once every process sharing it is gone)."""
    tracker = prefix.rpartition("_t")[2].removesuffix("_b")
    if tracker and tracker == segments.tracker_id():
        segments.remove_prefixed(prefix)


def _mapped(reference: tuple[str, int]) -> Any:
    """The data of a segment of a `Broadcast`, mapped copy-on-write, as a buffer whose
    collection unmaps it."""
    name, size = reference
    try:
        memory = segments.mapped(name, segments.HEADER + size, os.O_RDONLY, mmap.MAP_PRIVATE)
    except FileNotFoundError:
        raise RuntimeError(
            f"the shared-memory segment {name} of a fan-out item is gone (its owner "
            "stopped, or removed it, before this consumer read the item)"
        ) from None
    return memory.buffer(segments.HEADER, size)


def _attach_array(reference: tuple[str, int], dtype: Any, shape: Any, order: str) -> Any:
    return shm.array_over(_mapped(reference), dtype, shape, order)


def _attach_tensor(reference: tuple[str, int], dtype: Any, shape: Any, strides: Any) -> Any:
    return shm.tensor_over(_mapped(reference), dtype, shape, strides)
