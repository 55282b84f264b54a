"""The shared-memory transport: numpy arrays and torch tensors inside the messages between
a worker process and its consumer (both ways) travel through shared memory instead of
being pickled through a pipe.

The sender (`Outgoing`, one per pipe) pickles a message with `encode`: every numpy array
and CPU torch tensor of at least `THRESHOLD` bytes, wherever pickle finds it (nested in
lists, tuples, dicts, objects), is copied into a segment of the sender's pool and
pickled as a small reference to it; everything else pickles as usual (object arrays,
array subclasses, tensors that require a gradient, small arrays). The receiver's
``pickle.loads`` maps the segment and returns an array (or tensor) viewing it: no copy.

Ownership, so that a segment is unlinked exactly once whoever dies:

- A segment has a name (``/dev/shm/ibl_<sender pid>_<token>_<n>``) only from its
  creation by the sender until the receiver first maps it: the receiver unlinks it right
  then. From there on it is shared memory between two processes that map it, freed by
  the kernel when both have unmapped it (a killed process unmaps everything).
- A named segment that the receiver never mapped is unlinked by the sender when it stops
  (`Outgoing.unlink_names`: on SIGTERM, when its parent is gone, at its normal end once
  the receiver took everything: `Outgoing.wait_taken`), or by the consumer once the
  sender is gone (`remove_names`, e.g. after a worker was killed with SIGKILL).
- Every segment is also registered with multiprocessing's resource tracker, which the
  consumer starts before its workers (`share_tracker`) and shares with them, and is
  unregistered by whichever process unlinks its name (`unlink_name`): a worker and its
  consumer killed at the same instant leave names that the tracker unlinks once every
  process sharing it is gone. Otherwise its view ends empty.

Reuse: the sender reuses a segment only after the receiver released it. The first byte
of a segment is its flag: the sender sets it when it sends the segment, the receiver
clears it when the last array or tensor viewing it (the item, its slices, views,
``torch.from_numpy`` of it...) is garbage collected (the ``__del__`` of the delivered
buffer). An item the user keeps is never overwritten. When every segment is
held and the pool is at its limits, arrays are pickled through the pipe (a copy) until
some are released.

Linux only (``/dev/shm``); elsewhere everything is pickled. The segments themselves
(creating, mapping, naming, registering) are `segments`'.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

from . import segments
from .segments import HEADER, SHM_DIR, names_prefix, remove_prefixed, unlink_name

THRESHOLD = 64 * 1024
"""Arrays and tensors smaller than this (bytes) are pickled through the pipe: below it
pickling costs less than a segment's bookkeeping (see bench/bench_transport.py)."""

MAX_SEGMENTS = 64
"""Segments per sender at most."""

MAX_BYTES = 2 << 30
"""Bytes of segments per sender at most."""

ENABLED = segments.ENABLED
"""Whether the transport is used (on this platform; benchmarks turn it off)."""

PROTOCOL = pickle.HIGHEST_PROTOCOL


# -- the sender ----------------------------------------------------------------------------


class Sender:
    """What `_Pickler` puts large arrays and tensors through: `copy_in` copies an
    array's values into a segment (by default into the bytes that `space` gives) and
    returns the reference the receiver maps them by; `array_loader` and `tensor_loader`
    rebuild the array or tensor from that reference."""

    array_loader: Callable[..., Any]
    tensor_loader: Callable[..., Any]

    def __init__(self) -> None:
        self._file = io.BytesIO()
        self._pickler = _Pickler(self._file, self)
        """Reused from message to message (making one costs as much as a small message)."""

    def _pickled(self, obj: Any, undo: Callable[[], None]) -> bytes:
        """`obj` pickled, its large arrays and tensors through this sender's segments; if
        pickling fails, `undo()` gives back the segments it took (and the error is
        raised)."""
        file, pickler = self._file, self._pickler
        file.seek(0)
        file.truncate()
        try:
            pickler.dump(obj)
        except BaseException:
            undo()
            raise
        finally:
            pickler.clear_memo()  # holds the message's objects
        return file.getvalue()

    def space(self, size: int) -> tuple[Any, Any] | None:
        """A writable buffer of `size` bytes in a segment and its reference, or None."""
        raise NotImplementedError

    def copy_in(self, obj: Any, order: str, np: Any) -> Any | None:
        """Copy the values of numpy array `obj`, in `order`, into a segment: its
        reference, or None (no room)."""
        taken = self.space(obj.nbytes)
        if taken is None:
            return None
        buffer, reference = taken
        np.ndarray(obj.shape, obj.dtype, buffer, order=order)[...] = obj
        return reference

    def put(self, obj: Any, np: Any) -> Any:
        """The reduction of numpy array `obj` through a segment, or NotImplemented."""
        fortran = obj.flags.f_contiguous and not obj.flags.c_contiguous
        order = "F" if fortran else "C"
        reference = self.copy_in(obj, order, np)
        if reference is None:
            return NotImplemented
        dtype = obj.dtype
        plain = dtype.fields is None and dtype.subdtype is None and dtype.metadata is None
        return self.array_loader, (reference, dtype.str if plain else dtype, obj.shape, order)

    def put_tensor(self, tensor: Any, torch: Any, np: Any) -> Any:
        """The reduction of CPU tensor `tensor` through a segment, or NotImplemented."""
        shape, strides = tuple(tensor.shape), tuple(tensor.stride())
        extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides, strict=False))
        span = tensor.as_strided((extent,), (1,), tensor.storage_offset())
        raw = span.view(torch.uint8).numpy()
        reduced = self.put(raw, np)
        if reduced is NotImplemented:
            return NotImplemented
        reference = reduced[1][0]
        return self.tensor_loader, (reference, tensor.dtype, shape, strides)


class Outgoing(Sender):
    """The segments of one sender (one pipe): at most `MAX_SEGMENTS` and `MAX_BYTES`."""

    def __init__(self, max_unread: int | None = None) -> None:
        self.prefix = f"{names_prefix(os.getpid())}{secrets.token_hex(4)}_"
        """The prefix of its segments' names."""
        self._max_unread = max_unread
        """Segments sent and not yet decoded by the receiver at most (None: no bound): a
        sender ahead by that many waits. The pipe holds hundreds of small messages, so
        its size no longer bounds how far ahead the sender runs."""
        self._max_segments, self._max_bytes = MAX_SEGMENTS, MAX_BYTES
        self._segments: list[segments.Segment] = []
        self._created = 0
        self._retired: list[str] = []
        self._newest: str | None = None
        """The name of the newest segment (the receiver maps segments in order)."""
        self._sending: list[segments.Segment] = []
        """The segments of the message being pickled..."""
        self._fresh: list[segments.Segment] = []
        """... and those created for it."""
        super().__init__()
        self.array_loader, self.tensor_loader = _attach_array, _attach_tensor

    def _unread(self) -> int:
        sending = self._sending
        return sum(
            s.memory.flag == 1 and s.memory.received == 0 and s not in sending
            for s in self._segments
        )

    def _take(self, size: int) -> segments.Segment | None:
        """A free segment of at least `size` bytes, new if need be; None if none can be."""
        if self._max_unread is not None:
            pause = 0.0002
            while self._unread() >= self._max_unread:  # like a full pipe
                time.sleep(pause)
                pause = min(2 * pause, 0.01)
        free = [s for s in self._segments if s.memory.flag == 0]
        fitting = [s for s in free if s.capacity >= size]
        if fitting:
            return min(fitting, key=lambda s: s.capacity)
        capacity = 1 << (size - 1).bit_length()  # room for slightly larger arrays later
        used = sum(s.capacity for s in self._segments)
        for segment in sorted(free, key=lambda s: s.capacity):  # make room: retire free ones
            if len(self._segments) < self._max_segments and used + capacity <= self._max_bytes:
                break
            self._segments.remove(segment)
            self._retired.append(segment.name)
            used -= segment.capacity
            segment.memory.close()
        if len(self._segments) >= self._max_segments or used + capacity > self._max_bytes:
            return None
        try:
            segment = segments.Segment(f"{self.prefix}{self._created}", capacity)
        except OSError:  # no room in /dev/shm: pickle through the pipe
            return None
        self._created += 1
        self._segments.append(segment)
        self._fresh.append(segment)
        self._newest = segment.name
        return segment

    def space(self, size: int) -> tuple[Any, Any] | None:
        segment = self._take(size)
        if segment is None:
            return None
        segment.memory.received, segment.memory.flag = 0, 1
        self._sending.append(segment)
        retired, self._retired = tuple(self._retired), []
        reference = (segment.name, segment.capacity, size, retired)
        return segment.memory.buffer(HEADER, size), reference

    def encode(self, obj: Any) -> bytes:
        """`obj` pickled, its large arrays and tensors through segments; if pickling
        fails, the segments it took are given back (and the error raised)."""
        newest, retired = self._newest, list(self._retired)
        self._sending, self._fresh = [], []

        def give_back() -> None:
            for segment in self._sending:
                segment.memory.flag = 0
            for segment in self._fresh:  # never sent: gone again
                self._segments.remove(segment)
                unlink_name(segment.name)
                segment.memory.close()
            self._newest, self._retired = newest, retired

        try:
            return self._pickled(obj, give_back)
        finally:
            self._sending, self._fresh = [], []

    def wait_taken(self, alive: Callable[[], bool], poll_s: float = 0.02) -> None:
        """Wait until the receiver has mapped every segment sent (it maps them in order),
        or until `alive()` is false."""
        while self._newest is not None and alive():
            if not os.path.exists(f"{SHM_DIR}/{self._newest}"):
                return
            time.sleep(poll_s)

    def unlink_names(self) -> None:
        """Unlink the names of the segments that the receiver has not mapped (safe from
        any thread, any number of times; what is mapped stays valid)."""
        for segment in list(self._segments):
            unlink_name(segment.name)


class _Pickler(pickle.Pickler):
    """Pickles large numpy arrays and CPU tensors through an `Outgoing`'s segments."""

    def __init__(self, file: io.BytesIO, outgoing: Sender) -> None:
        super().__init__(file, PROTOCOL)
        self._outgoing = outgoing

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        modules = sys.modules  # imported now, maybe not when this pickler was made
        np, torch = modules.get("numpy"), modules.get("torch")
        if np is not None and kind is np.ndarray:
            if obj.nbytes < THRESHOLD or obj.dtype.hasobject:
                return NotImplemented
            return self._outgoing.put(obj, np)
        if kind is getattr(torch, "Tensor", None) and _plain_tensor(obj, torch):
            return self._outgoing.put_tensor(obj, torch, np)
        return NotImplemented


def _plain_tensor(tensor: Any, torch: Any) -> bool:
    """Whether `tensor` is a large CPU tensor that pickles as its values alone."""
    return bool(
        tensor.device.type == "cpu"
        and tensor.layout is torch.strided
        and not tensor.requires_grad
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
        and tensor.numel() * tensor.element_size() >= THRESHOLD
    )


def encode(obj: Any, outgoing: Outgoing | None) -> bytes:
    """`obj` pickled, its large arrays and tensors through `outgoing`'s segments (None,
    or neither numpy nor torch imported: plain pickle)."""
    if outgoing is None or ("numpy" not in sys.modules and "torch" not in sys.modules):
        return pickle.dumps(obj, PROTOCOL)
    return outgoing.encode(obj)


# -- the receiver --------------------------------------------------------------------------

_MAPPED: dict[str, segments.Mapping] = {}
"""This process's mappings of the segments it received, by name."""

os.register_at_fork(after_in_child=_MAPPED.clear)


def _delivered(reference: tuple[str, int, int, tuple[str, ...]]) -> Any:
    """The data of a segment, mapped (and unlinked) the first time it is seen, as a
    buffer of its own (a ctypes array, which numpy and torch keep as their base: a
    memoryview would be replaced by one of numpy's) whose collection releases the
    segment to its sender."""
    name, capacity, size, retired = reference
    for old in retired:
        _MAPPED.pop(old, None)
    memory = _MAPPED.get(name)
    if memory is None:
        try:
            memory = segments.mapped(name, HEADER + capacity, os.O_RDWR)
        except FileNotFoundError:
            raise RuntimeError(
                f"the shared-memory segment {name} of a worker process is gone (the worker "
                "was stopped before its message was read)"
            ) from None
        finally:
            unlink_name(name)
        _MAPPED[name] = memory
    memory.received = 1
    return memory.buffer(HEADER, size, releasing=True)


_DTYPES: dict[str, Any] = {}
"""numpy dtypes by their string (parsing one costs more than building the array)."""

_NDARRAY: list[Any] = []
"""``numpy.ndarray``, once an array was built (numpy is imported by then)."""


def array_over(buffer: Any, dtype: Any, shape: Any, order: str) -> Any:
    """An array of `shape` and `dtype` (a dtype's ``str``, or a dtype) viewing `buffer`
    (which the array keeps as its base)."""
    if not _NDARRAY:
        import numpy as np

        _NDARRAY.append(np.ndarray)
    if type(dtype) is str:
        found = _DTYPES.get(dtype)
        if found is None:
            import numpy as np

            found = _DTYPES[dtype] = np.dtype(dtype)
        dtype = found
    return _NDARRAY[0](shape, dtype, buffer, 0, None, order)


def tensor_over(buffer: Any, dtype: Any, shape: Any, strides: Any) -> Any:
    """A tensor of `shape`, `strides` and `dtype` viewing `buffer`."""
    import numpy as np
    import torch

    raw = torch.from_numpy(np.frombuffer(buffer, np.uint8))
    return raw.view(dtype).as_strided(shape, strides)


def _attach_array(
    reference: tuple[str, int, int, tuple[str, ...]], dtype: Any, shape: Any, order: str
) -> Any:
    return array_over(_delivered(reference), dtype, shape, order)


def _attach_tensor(
    reference: tuple[str, int, int, tuple[str, ...]], dtype: Any, shape: Any, strides: Any
) -> Any:
    return tensor_over(_delivered(reference), dtype, shape, strides)


def forget(pid: int) -> None:
    """Drop this process's mappings of segments from process `pid` (stopped): they are
    unmapped once the items viewing them are collected."""
    prefix = names_prefix(pid)
    for name in [name for name in _MAPPED if name.startswith(prefix)]:
        del _MAPPED[name]


def remove_names(pid: int) -> None:
    """Unlink what named segments process `pid` (a stopped sender) left, and `forget` it."""
    forget(pid)
    remove_prefixed(names_prefix(pid))
