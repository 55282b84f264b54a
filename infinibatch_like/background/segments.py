"""Shared-memory segments (``/dev/shm/ibl_<creator pid>_...``): creating and mapping
them, their names, and their registration with multiprocessing's resource tracker. What
travels through them, and who unlinks them when, is `shm`'s (one worker and its consumer)
and `shm_broadcast`'s (a fan-out's owner and its consumers).

Linux only (``/dev/shm``): `ENABLED` says whether segments can be used here.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
from collections.abc import Callable
from multiprocessing import resource_tracker
from typing import Any, Generic, TypeVar

try:
    import _posixshmem  # type: ignore[import-not-found]  # CPython's, POSIX only
except ImportError:
    _posixshmem = None

HEADER = 64
"""Bytes before a segment's data: the flag, then alignment padding."""

POOL_SEGMENTS = 64
"""Unused segments a `Pool` keeps for reuse, at most."""

POOL_BYTES = 512 << 20
"""Bytes of unused segments a `Pool` keeps for reuse, at most."""

SHM_DIR = "/dev/shm"
ENABLED = _posixshmem is not None and sys.platform.startswith("linux") and os.path.isdir(SHM_DIR)
"""Whether segments can be used on this platform (the transports use them then)."""


def names_prefix(pid: int) -> str:
    """The prefix of the names of the segments that process `pid` creates."""
    return f"ibl_{pid}_"


def share_tracker() -> None:
    """Start multiprocessing's resource tracker in this process if it is not running, so
    that the worker processes started next share it (forked ones inherit it; spawned
    ones are given it by multiprocessing)."""
    if ENABLED:
        resource_tracker.ensure_running()


def tracker_id(start: bool = False) -> str:
    """Which resource tracker this process registers segments with: the inode of its
    pipe to it, the same in every process that shares it ("" if none runs here);
    `start`: start one if none runs."""
    if not ENABLED:
        return ""
    if start:
        resource_tracker.ensure_running()
    fd = _tracker_fd()
    if fd is None:
        return ""
    try:
        return str(os.fstat(fd).st_ino)
    except OSError:
        return ""


def _tracker_message(command: str, name: str) -> bytes:
    """Message `command` (REGISTER, UNREGISTER) about segment `name` to the tracker."""
    return f"{command}:/{name}:shared_memory\n".encode("ascii")


def _tracker_fd() -> int | None:
    """This process's end of the pipe to the resource tracker (None: none started)."""
    fd: int | None = getattr(resource_tracker._resource_tracker, "_fd", None)
    return fd


def unlink_name(name: str, tracked: bool = True) -> None:
    """Remove the name of segment `name` if it is still there; `tracked`: it was
    registered with the resource tracker (`Segment`), and is unregistered by whichever
    process unlinks it.

    A name is registered with the tracker before its segment is created, and unregistered
    after it is unlinked; each message is written right beside its system call, by libc
    calls that keep the GIL (no other thread of the process runs in between, as one may
    after each call that lets it go; `resource_tracker.register` also writes a probe
    first). A process killed between the two leaves the tracker a name that is already
    gone (it says so as it fails to unlink it), never a segment that nobody unlinks."""
    path, message, fd = ("/" + name).encode(), _tracker_message("UNREGISTER", name), _tracker_fd()
    if _SHM_UNLINK(path) == 0:
        if tracked and (fd is None or _pylibc.write(fd, message, len(message)) != len(message)):
            resource_tracker.unregister("/" + name, "shared_memory")
        return
    error = _os_error("unlink", name)
    if error.errno != errno.ENOENT:
        raise error


def _created(name: str) -> int:
    """A descriptor of the new segment `name`, registered with the tracker first."""
    resource_tracker.ensure_running()
    path, message, fd = ("/" + name).encode(), _tracker_message("REGISTER", name), _tracker_fd()
    if fd is None or _pylibc.write(fd, message, len(message)) != len(message):
        resource_tracker.register("/" + name, "shared_memory")  # starts it again if it died
    descriptor: int = _SHM_OPEN(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    if descriptor < 0:
        error = _os_error("create", name)
        resource_tracker.unregister("/" + name, "shared_memory")
        raise error
    return descriptor


def _os_error(doing: str, name: str) -> OSError:
    """The error of the libc call that failed `doing` segment `name` (from errno)."""
    number = ctypes.get_errno()
    return OSError(
        number, f"cannot {doing} the shared-memory segment {name}: {os.strerror(number)}"
    )


class Mapping:
    """A segment mapped into this process; unmapped when collected (or `close`d).

    Mapped with libc's ``mmap``, not the `mmap` module, whose objects each keep a file
    descriptor open: a consumer holding many items would hold as many descriptors. Its
    first byte is the segment's flag; `buffer` gives a ctypes array over a part of it
    that keeps the mapping alive."""

    __slots__ = ("_flag", "_received", "address", "length", "pid")

    def __init__(
        self, fd: int, length: int, sharing: int = mmap.MAP_SHARED, writable: bool = True
    ) -> None:
        protection = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        address = _libc.mmap(None, length, protection, sharing, fd, 0)
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
_pylibc = ctypes.PyDLL(None, use_errno=True)
"""libc, called without releasing the GIL."""
_pylibc.write.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
_pylibc.write.restype = ctypes.c_ssize_t


def _as_libc(call: Callable[[], int | None]) -> int:
    """What `call()` (of CPython's `_posixshmem`, which lets the GIL go) returns, as libc
    would: its result (0 for None), or -1 with errno set."""
    try:
        result = call()
    except OSError as error:
        ctypes.set_errno(error.errno or 0)
        return -1
    return 0 if result is None else result


def _posix_shm_unlink(path: bytes) -> int:
    """``shm_unlink`` through CPython's module: 0, or -1 and errno."""
    return _as_libc(lambda: _posixshmem.shm_unlink(path.decode()))


def _posix_shm_open(path: bytes, flags: int, mode: int) -> int:
    """``shm_open`` through CPython's module: a descriptor, or -1 and errno."""
    return _as_libc(lambda: _posixshmem.shm_open(path.decode(), flags, mode))


_SHM_OPEN: Callable[[bytes, int, int], int]
_SHM_UNLINK: Callable[[bytes], int]
if hasattr(_pylibc, "shm_open") and hasattr(_pylibc, "shm_unlink"):
    _pylibc.shm_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint]
    _pylibc.shm_unlink.argtypes = [ctypes.c_char_p]
    _SHM_OPEN, _SHM_UNLINK = _pylibc.shm_open, _pylibc.shm_unlink
else:  # glibc before 2.34 has them in librt
    _SHM_OPEN, _SHM_UNLINK = _posix_shm_open, _posix_shm_unlink
_POPULATE: int = getattr(mmap, "MAP_POPULATE", 0)


@functools.lru_cache(maxsize=256)
def _view_type(size: int, releasing: bool) -> Any:
    """A ctypes array type of `size` bytes whose instances take attributes; `releasing`:
    whose instances `_release` their mapping when collected."""
    namespace = {"__del__": lambda self: _release(self.mapping)} if releasing else {}
    return type(f"segment_view_{size}", (ctypes.c_char * size,), namespace)


def mapped(name: str, length: int, flags: int, sharing: int = mmap.MAP_SHARED) -> Mapping:
    """Open (`flags`: os.O_RDONLY, os.O_RDWR) and map the segment `name`; `sharing`:
    ``mmap.MAP_PRIVATE`` for a copy-on-write view of it (writes stay in this process);
    ``os.O_RDONLY`` with ``mmap.MAP_SHARED``: a read-only view of what others write."""
    fd = _posixshmem.shm_open("/" + name, flags, 0o600)
    readonly = flags & os.O_ACCMODE == os.O_RDONLY and sharing == mmap.MAP_SHARED
    return _mapping(fd, length, sharing, writable=not readonly)


def _mapping(
    fd: int, length: int, sharing: int, creating: bool = False, writable: bool = True
) -> Mapping:
    """The segment open at `fd` mapped (`length` bytes, given it if `creating`; read only
    unless `writable`); closes `fd`."""
    try:
        if creating:
            os.ftruncate(fd, length)
            # Reserve the pages now: on a full /dev/shm (a container's 64 MiB), writing to
            # a page that cannot be allocated kills the process with SIGBUS.
            os.posix_fallocate(fd, 0, length)
            sharing |= _POPULATE  # its creator writes it all: no fault per page
        return Mapping(fd, length, sharing, writable)
    finally:
        os.close(fd)


_PID = [os.getpid()]
"""This process's pid (`os.getpid` is a system call)."""


def _after_fork_in_child() -> None:
    _PID[0] = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _release(memory: Mapping) -> None:
    """The receiver dropped its last view of a segment: the sender may reuse it (not when
    a forked child drops its copy of the view: the receiver may still hold it)."""
    if memory.pid == _PID[0]:
        memory._flag.value = 0


class Segment:
    __slots__ = ("capacity", "memory", "name")

    def __init__(self, name: str, capacity: int) -> None:
        fd = _created(name)
        try:
            self.memory = _mapping(fd, HEADER + capacity, mmap.MAP_SHARED, creating=True)
        except BaseException:
            unlink_name(name)
            raise
        self.name, self.capacity = name, capacity


def size_class(size: int) -> int:
    """The capacity of a pooled segment for `size` bytes: the next of 4 steps per power
    of 2 (at most a quarter more than `size`), so arrays of similar sizes share segments."""
    step = max(1 << max(size.bit_length() - 3, 0), mmap.PAGESIZE)
    return -(-size // step) * step


Unused = TypeVar("Unused")


class Pool(Generic[Unused]):
    """Unused segments kept for reuse (fresh pages cost as much as filling them), by
    capacity: at most `POOL_SEGMENTS` and `POOL_BYTES`."""

    def __init__(self) -> None:
        self._free: dict[int, list[Unused]] = {}
        self._count = self._bytes = 0

    def take(self, capacity: int) -> Unused | None:
        """An unused segment of `capacity`, or None."""
        free = self._free.get(capacity)
        if not free:
            return None
        self._count -= 1
        self._bytes -= capacity
        return free.pop()

    def keep(self, capacity: int, segment: Unused) -> bool:
        """Keep `segment` for reuse; False if the pool is full (unlink it then)."""
        if self._count >= POOL_SEGMENTS or self._bytes + capacity > POOL_BYTES:
            return False
        self._free.setdefault(capacity, []).append(segment)
        self._count += 1
        self._bytes += capacity
        return True

    def clear(self) -> None:
        self._free.clear()
        self._count = self._bytes = 0


def remove_prefixed(prefix: str) -> None:
    """Unlink (and unregister) the segments whose names start with `prefix` (those of a
    stopped sender whose resource tracker this process shares)."""
    if not ENABLED:
        return
    try:
        names = [name for name in os.listdir(SHM_DIR) if name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        unlink_name(name)
