"""Registered memory: buffers the NIC may read and write, registered once per device.

Theory of operation
-------------------
The NIC reaches host memory by DMA, so memory it uses must be *registered*
(``ibv_reg_mr``): the kernel pins the pages (they can be neither swapped out
nor moved) and hands back the keys a work request names them by.
Registering costs a system call and a page-table walk per page, so it is
done once per buffer and device and kept:

* :class:`RegisteredBuffer` -- memory of our own: an anonymous ``mmap``,
  page-aligned, zero-filled; ``memoryview(buf)`` works (it *is* an ``mmap``);
* :func:`register` -- an existing writable buffer (``bytearray``, ``mmap``, a
  numpy array, anything with the buffer protocol, C-contiguous): the handle
  holds a buffer export, so the object cannot be resized or freed under the
  NIC.

Both are :class:`RegisteredMemory`.  They are registered lazily, the first
time a connection on a device uses them, and that registration stays until
:meth:`RegisteredMemory.close` (or the device closes).  Any buffer handed to
a zero-copy call (``send``, ``receive_into``, ``read``, ``write``) is looked
up by its *address range* among the live registered memories: a slice of a
registered buffer is registered too (this is the registration cache; a hit
costs a dictionary walk, no system call).  A buffer that is not inside a
live registration is staged through the device's registered regions (one
copy): caching registrations of arbitrary objects is unsafe in Python,
whose allocator reuses freed addresses for new objects -- a cached
registration would then name pages that hold someone else's data.

Pinned bytes are limited per process (:func:`set_pinned_limit`; by default
the RLIMIT_MEMLOCK soft limit when it is finite and applies -- a process with
CAP_IPC_LOCK, as root, is not bound by it -- else half the RAM): beyond
it, registering raises :class:`~aiordma.MemlockLimitError`, whose message
says in plain words what the limit is and how to raise it.

Ownership: while a work request that names the memory is posted (a ``read``
or ``write`` in flight, an exposure the peer may use), the memory is the
device's: :meth:`RegisteredMemory.close` raises :class:`BufferBusyError`
instead of deregistering it.
"""

from __future__ import annotations

import mmap
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, Self

from .._errors import AiordmaError, MemlockLimitError

__all__ = [
    "BufferBusyError",
    "MemoryStats",
    "RegisteredBuffer",
    "RegisteredMemory",
    "memory_stats",
    "register",
    "set_pinned_limit",
]


class BufferBusyError(AiordmaError):
    """The memory is in use by the NIC (an operation in flight, a live exposure)."""


def _has_ipc_lock() -> bool:
    """Whether this process may pin memory beyond RLIMIT_MEMLOCK (CAP_IPC_LOCK, as root has)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 14 & 1)
    except (OSError, ValueError):
        pass
    return False


def _default_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and not _has_ipc_lock():
        return int(soft)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError):  # pragma: no cover - every Linux has both
        return 1 << 34


class _State:
    """Process-wide counters and the live registered memories (by address)."""

    def __init__(self) -> None:
        self.limit: int | None = None  # None: the default, computed when first needed
        self.pinned = 0  # bytes registered by RegisteredMemory and exposures, over all devices
        self.registrations = 0
        self.live: dict[int, RegisteredMemory] = {}  # start address -> memory
        self.hits = 0
        self.misses = 0
        self.staged = 0

    def get_limit(self) -> int:
        if self.limit is None:
            self.limit = _default_limit()
        return self.limit


_state = _State()


def set_pinned_limit(nbytes: int | None) -> None:
    """The most bytes this process may register through aiordma (None: the default, see the
    module docs).  Rings of open connections are not counted; they are sized by ``RdmaConfig``."""
    if nbytes is not None and nbytes < 0:
        raise ValueError("the pinned-memory limit cannot be negative")
    _state.limit = nbytes


def pinned_limit() -> int:
    """The pinned-bytes limit in force (:func:`set_pinned_limit`, else the default)."""
    return _state.get_limit()


@dataclass(frozen=True, slots=True)
class MemoryStats:
    """What :func:`memory_stats` reports."""

    #: bytes registered right now (each device's registration counts)
    pinned_bytes: int
    #: registrations right now (a buffer on two devices counts twice)
    registrations: int
    #: live RegisteredBuffer / register() handles
    buffers: int
    #: zero-copy calls that found their buffer registered already / that had to register it
    cache_hits: int
    cache_misses: int
    #: bytes copied through staging regions (buffers outside any registration)
    staged_bytes: int
    #: the pinned-bytes limit in force
    limit: int


def memory_stats() -> MemoryStats:
    s = _state
    return MemoryStats(s.pinned, s.registrations, len(s.live), s.hits, s.misses, s.staged, s.get_limit())


def reserve_pinned(nbytes: int) -> None:
    """Count ``nbytes`` more pinned bytes (a registration); raises past the limit."""
    limit = _state.get_limit()
    if _state.pinned + nbytes > limit:

        raise MemlockLimitError(
            12,  # ENOMEM
            "register memory",
            f"aiordma's pinned-memory limit is {limit} bytes and {_state.pinned} are registered; "
            f"{nbytes} more were asked for (aiordma.set_pinned_limit raises it). "
            + memlock_advice(nbytes, _state.pinned),
        )
    _state.pinned += nbytes
    _state.registrations += 1


def release_pinned(nbytes: int) -> None:
    _state.pinned -= nbytes
    _state.registrations -= 1


def _fmt_bytes(n: int) -> str:
    if n == resource.RLIM_INFINITY or n < 0:
        return "unlimited"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def _getrlimit() -> tuple[int, int]:
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)


def memlock_advice(
    wanted: int, already: int = 0, limits: Callable[[], tuple[int, int]] = _getrlimit
) -> str:
    """A plain-words explanation of an RLIMIT_MEMLOCK problem and how to fix it."""
    soft, hard = limits()
    need = already + wanted
    need_kib = (need + 1023) // 1024
    text = (
        f"cannot register {_fmt_bytes(wanted)} more memory for RDMA "
        f"({_fmt_bytes(already)} already registered): RDMA pins registered memory in RAM, "
        f"and pinned memory counts against the locked-memory limit RLIMIT_MEMLOCK, which is "
        f"{_fmt_bytes(soft)} (soft) / {_fmt_bytes(hard)} (hard) for this process. "
        f"Raise it to at least {need_kib} KiB, or to unlimited: `ulimit -l unlimited` in the "
        "shell that starts the program (as root, or up to the hard limit), "
        "'* - memlock unlimited' in /etc/security/limits.conf, LimitMEMLOCK=infinity in a "
        "systemd unit, or `--ulimit memlock=-1` with docker. Or lower aiordma.set_pinned_limit's limit."
    )
    if hard != resource.RLIM_INFINITY and need > hard:
        text += " The hard limit is too low as well, so only root (or the system configuration) can raise it."
    return text



class Registration(Protocol):
    """This memory's region on one device (``_rdma.objects.Region`` satisfies it)."""

    addr: int
    lkey: int

    def close(self) -> None:
        """Deregister (idempotent)."""


class Registrar(Protocol):
    """Where memory registers: a device (shared PD) or one connection's own PD."""

    def register_user(self, mem: RegisteredMemory, view: memoryview) -> Registration:
        """Register ``view`` (``mem``'s bytes) for local access; remembered until unregistered."""
        ...

    def unregister_user(self, mem: RegisteredMemory, mr: Registration) -> None: ...


class RegisteredMemory:
    """Memory registered for RDMA (see the module docs).  Use :class:`RegisteredBuffer` or
    :func:`register`; release with :meth:`close` or ``with``."""

    # (the attributes live in the concrete classes: RegisteredBuffer is an mmap subclass)
    _view: memoryview
    _addr: int
    _mrs: dict[Registrar, Registration]
    _busy: int
    _closed: bool

    def _setup(self, view: memoryview) -> None:
        if view.readonly:
            raise TypeError("registered memory must be writable")
        if not view.c_contiguous:
            raise TypeError("registered memory must be C-contiguous")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._view = view
        self._addr = _address(view) if view.nbytes else 0
        self._mrs = {}  # device -> its memory region for this memory
        self._busy = 0
        self._closed = False
        if view.nbytes:
            _state.live[self._addr] = self

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    @property
    def view(self) -> memoryview:
        """A writable byte view of the memory (valid until :meth:`close`)."""
        if self._closed:
            raise ValueError("the registered memory is closed")
        return self._view

    @property
    def busy(self) -> bool:
        """Whether the NIC may use the memory right now (an operation in flight, an exposure)."""
        return self._busy > 0

    def mr_for(self, device: Registrar) -> Registration:
        """This memory's registration on ``device`` (registered on first use: counted as a miss)."""
        mr = self._mrs.get(device)
        if mr is not None:
            _state.hits += 1
            return mr
        if self._closed:
            raise ValueError("the registered memory is closed")
        _state.misses += 1
        reserve_pinned(self._view.nbytes)
        try:
            mr = device.register_user(self, self._view)
        except BaseException:
            release_pinned(self._view.nbytes)
            raise
        self._mrs[device] = mr
        return mr

    def forget_device(self, device: Registrar) -> Registration | None:
        """The device closes: its registration goes (the caller deregisters the returned MR)."""
        mr = self._mrs.pop(device, None)
        if mr is not None:
            release_pinned(self._view.nbytes)
        return mr

    def hold(self) -> None:
        """The NIC may use the memory from now on (a post, an exposure)."""
        self._busy += 1

    def unhold(self) -> None:
        self._busy -= 1

    def close(self) -> None:
        """Deregister everywhere and let the memory go.  Raises :class:`BufferBusyError` while the
        NIC may still use it (nothing changes then).  Idempotent."""
        if self._closed:
            return
        if self._busy:
            raise BufferBusyError(
                f"the registered memory is in use by {self._busy} RDMA operation(s) or exposure(s); "
                "close it after they ended"
            )
        self._closed = True
        for device in list(self._mrs):
            mr = self.forget_device(device)
            if mr is not None:
                device.unregister_user(self, mr)
        if self._view.nbytes:
            _state.live.pop(self._addr, None)
        self._release()

    def _release(self) -> None:
        self._view.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        try:
            self.close()
        except BufferError:  # (not BufferBusyError: the NIC's memory stays registered, and says so)
            # with an error in flight, its frames keep views of this memory (ours inside a
            # receive_into, the caller's): the registration is gone all the same (no NIC can
            # touch the memory), the mapping follows the last view, and the error that matters
            # is the one in flight
            if exc is None:
                raise


class RegisteredBuffer(RegisteredMemory, mmap.mmap):
    """``size`` bytes of page-aligned, zero-filled memory, registered with each device on first
    use (it is an ``mmap``: ``memoryview(buf)``, slicing and ``buf[i]`` work)."""

    def __new__(cls, size: int) -> RegisteredBuffer:
        if size <= 0:
            raise ValueError("a RegisteredBuffer needs a positive size")
        return super().__new__(cls, -1, size)

    def __init__(self, size: int) -> None:
        self._setup(memoryview(self))

    def close(self) -> None:
        """Deregister everywhere (:meth:`RegisteredMemory.close`), then unmap.  While views of
        the buffer are alive (a ``memoryview``, a numpy array) it cannot be unmapped: it is
        deregistered all the same, and ``BufferError`` says so; close again once they are
        released.  (``mmap.close`` alone would unmap under a registration.)"""
        RegisteredMemory.close(self)
        if not self.closed:
            try:
                mmap.mmap.close(self)
            except BufferError:
                raise BufferError(
                    "the RegisteredBuffer is deregistered, but views of it are alive (a memoryview, "
                    "a numpy array): release them, then close it again to unmap it"
                ) from None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._mrs)} device(s)"
        return f"<aiordma.RegisteredBuffer {self.nbytes} bytes, {state}>"


class _Registered(RegisteredMemory):
    """What :func:`register` returns: a handle on someone else's buffer."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        self._setup(memoryview(obj))

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<aiordma registered {type(self.obj).__name__} of {self.nbytes} bytes>"


def register(obj: Any) -> RegisteredMemory:
    """Register an existing writable, C-contiguous buffer (``bytearray``, ``mmap``, numpy array, ...).

    The handle keeps a buffer export of ``obj`` (a bytearray cannot be resized meanwhile) and
    registers it with each device on first use; :meth:`~RegisteredMemory.close` deregisters it."""
    return _Registered(obj)


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def find_registered(view: memoryview) -> tuple[RegisteredMemory, int] | None:
    """The live registered memory that holds all of ``view`` (writable, contiguous), and the
    offset of ``view`` in it; None if there is none."""
    if view.readonly or not view.c_contiguous or not view.nbytes or not _state.live:
        return None
    addr = _address(view)
    end = addr + view.nbytes
    for start, mem in _state.live.items():
        if start <= addr and end <= start + mem._view.nbytes and not mem._closed:
            return mem, addr - start
    return None


def count_staged(nbytes: int) -> None:
    _state.staged += nbytes

