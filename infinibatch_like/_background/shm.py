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

Linux only (``/dev/shm``); elsewhere everything is pickled.
"""

from __future__ import annotations

import ctypes
import functools
import io
import mmap
import os
import pickle
import secrets
import sys
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from typing import Any

try:
    import _posixshmem  # type: ignore[import-not-found]  # CPython's, POSIX only
except ImportError:
    _posixshmem = None

THRESHOLD = 64 * 1024
"""Arrays and tensors smaller than this (bytes) are pickled through the pipe: below it
pickling costs less than a segment's bookkeeping (see bench/bench_transport.py)."""

MAX_SEGMENTS = 64
"""Segments per sender at most."""

MAX_BYTES = 2 << 30
"""Bytes of segments per sender at most."""

HEADER = 64
"""Bytes before a segment's data: the flag, then alignment padding."""

SHM_DIR = "/dev/shm"
ENABLED = _posixshmem is not None and sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)
"""Whether the transport is used on this platform."""

PROTOCOL = pickle.HIGHEST_PROTOCOL


def names_prefix(pid: int) -> str:
    """The prefix of the names of the segments that process `pid` creates."""
    return f"ibl_{pid}_"


def share_tracker() -> None:
    """Start multiprocessing's resource tracker in this process if it is not running, so
    that the worker processes started next share it (forked ones inherit it; spawned
    ones are given it by multiprocessing)."""
    if ENABLED:
        resource_tracker.ensure_running()


def _track(name: str) -> None:
    """Register segment `name` with the resource tracker, which unlinks it if every
    process that shares the tracker dies before one of them unlinks it."""
    resource_tracker.register("/" + name, "shared_memory")


def unlink_name(name: str, tracked: bool = True) -> None:
    """Remove the name of segment `name` if it is still there; `tracked`: it was
    registered with the resource tracker (`_track`), and is unregistered by whichever
    process unlinks it."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return
    if tracked:
        resource_tracker.unregister("/" + name, "shared_memory")


class _Mapping:
    """A segment mapped into this process; unmapped when collected (or `close`d).

    Mapped with libc's ``mmap``, not the `mmap` module, whose objects each keep a file
    descriptor open: a consumer holding many items would hold as many descriptors. Its
    first byte is the segment's flag; `buffer` gives a ctypes array over a part of it
    that keeps the mapping alive."""

    __slots__ = ("_flag", "_received", "address", "length", "pid")

    def __init__(self, fd: int, length: int, sharing: int = mmap.MAP_SHARED) -> None:
        address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, sharing, fd, 0)
        if address is None or address == _MAP_FAILED:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot map a shared-memory segment: {os.strerror(error)}")
        self.address, self.length, self.pid = address, length, os.getpid()
        self._flag = ctypes.c_ubyte.from_address(address)
        self._received = ctypes.c_ubyte.from_address(address + 1)

    @property
    def flag(self) -> int:
        value: int = self._flag.value
        return value

    @flag.setter
    def flag(self, value: int) -> None:
        self._flag.value = value

    @property
    def received(self) -> int:
        """The segment's second byte: set by the receiver when it decodes the message."""
        value: int = self._received.value
        return value

    @received.setter
    def received(self, value: int) -> None:
        self._received.value = value

    def buffer(self, offset: int, size: int, releasing: bool = False) -> Any:
        """`size` bytes at `offset`; `releasing`: clear the flag once they are collected."""
        view = _view_type(size, releasing).from_address(self.address + offset)
        view.mapping = self
        return view

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.length)
            self.address = 0

    def __del__(self) -> None:
        self.close()


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)


@functools.lru_cache(maxsize=256)
def _view_type(size: int, releasing: bool) -> Any:
    """A ctypes array type of `size` bytes whose instances take attributes; `releasing`:
    whose instances `_release` their mapping when collected."""
    namespace = {"__del__": lambda self: _release(self.mapping)} if releasing else {}
    return type(f"segment_view_{size}", (ctypes.c_char * size,), namespace)


def _mapped(name: str, length: int, flags: int, sharing: int = mmap.MAP_SHARED) -> _Mapping:
    """Open (`flags`: os.O_CREAT... to create it) and map the segment `name`; `sharing`:
    ``mmap.MAP_PRIVATE`` for a copy-on-write view of it (writes stay in this process)."""
    fd = _posixshmem.shm_open("/" + name, flags, 0o600)
    try:
        if flags & os.O_CREAT:
            os.ftruncate(fd, length)
            # Reserve the pages now: on a full /dev/shm (a container's 64 MiB), writing to
            # a page that cannot be allocated kills the process with SIGBUS.
            os.posix_fallocate(fd, 0, length)
            sharing |= _POPULATE  # its creator writes it all: no fault per page
        return _Mapping(fd, length, sharing)
    finally:
        os.close(fd)


# -- the sender ----------------------------------------------------------------------------


class _Segment:
    __slots__ = ("capacity", "memory", "name")

    def __init__(self, name: str, capacity: int, tracked: bool = True) -> None:
        try:
            self.memory = _mapped(name, HEADER + capacity, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        except BaseException:
            unlink_name(name, tracked=False)  # not registered yet
            raise
        if tracked:
            _track(name)
        self.name, self.capacity = name, capacity


class Sender:
    """What `_Pickler` puts large arrays and tensors through: `space` gives the bytes
    for an array's copy and the reference the receiver maps them by; `array_loader` and
    `tensor_loader` rebuild the array or tensor from that reference."""

    array_loader: Callable[..., Any]
    tensor_loader: Callable[..., Any]

    def space(self, size: int) -> tuple[Any, Any] | None:
        """A writable buffer of `size` bytes in a segment and its reference, or None."""
        raise NotImplementedError

    def put(self, obj: Any, np: Any) -> Any:
        """The reduction of numpy array `obj` through a segment, or NotImplemented."""
        taken = self.space(obj.nbytes)
        if taken is None:
            return NotImplemented
        buffer, reference = taken
        fortran = obj.flags.f_contiguous and not obj.flags.c_contiguous
        order = "F" if fortran else "C"
        np.ndarray(obj.shape, obj.dtype, buffer, order=order)[...] = obj
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
        self._segments: list[_Segment] = []
        self._created = 0
        self._retired: list[str] = []
        self._newest: str | None = None
        """The name of the newest segment (the receiver maps segments in order)."""
        self._sending: list[_Segment] = []
        """The segments of the message being pickled..."""
        self._fresh: list[_Segment] = []
        """... and those created for it."""
        self._file = io.BytesIO()
        self._pickler = _Pickler(self._file, self)
        """Reused from message to message (making one costs as much as a small message)."""
        self.array_loader, self.tensor_loader = _attach_array, _attach_tensor

    def _unread(self) -> int:
        sending = self._sending
        return sum(
            s.memory.flag == 1 and s.memory.received == 0 and s not in sending
            for s in self._segments
        )

    def _take(self, size: int) -> _Segment | None:
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
            segment = _Segment(f"{self.prefix}{self._created}", capacity)
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
        file, pickler = self._file, self._pickler
        file.seek(0)
        file.truncate()
        try:
            pickler.dump(obj)
        except BaseException:
            for segment in self._sending:
                segment.memory.flag = 0
            for segment in self._fresh:  # never sent: gone again
                self._segments.remove(segment)
                unlink_name(segment.name)
                segment.memory.close()
            self._newest, self._retired = newest, retired
            raise
        finally:
            self._sending, self._fresh = [], []
            pickler.clear_memo()  # holds the message's objects
        return file.getvalue()

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

_MAPPED: dict[str, _Mapping] = {}
"""This process's mappings of the segments it received, by name."""

_PID = [os.getpid()]
"""This process's pid (`os.getpid` is a system call)."""


def _after_fork_in_child() -> None:
    _MAPPED.clear()
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _release(memory: _Mapping) -> None:
    """The receiver dropped its last view of a segment: the sender may reuse it (not when
    a forked child drops its copy of the view: the receiver may still hold it)."""
    if memory.pid == _PID[0]:
        memory._flag.value = 0


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
            memory = _mapped(name, HEADER + capacity, os.O_RDWR)
        except FileNotFoundError:
            raise RuntimeError(
                f"the shared-memory segment {name} of a worker process is gone (the worker "
                "was stopped before its message was read)"
            ) from None
        finally:
            unlink_name(name)
        _MAPPED[name] = memory
    memory._received.value = 1
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


def remove_prefixed(prefix: str, tracked: bool = True) -> None:
    """Unlink the segments whose names start with `prefix` (those of a stopped sender;
    `tracked`: see `unlink_name`)."""
    if not ENABLED:
        return
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        unlink_name(name, tracked)
