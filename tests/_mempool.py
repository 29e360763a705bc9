"""Registered memory pool: fixed-size slots in page-aligned regions, registered once.

A :class:`MemoryPool` asks its *registrar* for regions (``slots_per_region``
slots each, up to ``max_bytes``), registers each region once, and recycles the
slots.  With verbs the registrar is :func:`pd_registrar` (``ibv_reg_mr`` on an
anonymous mmap); the state tracking is pure Python, so tests can inject a fake
registrar and run without a device.

Every slot has exactly one owner at a time::

    FREE --acquire()--> ACQUIRED --mark_posted()--> POSTED --complete(wr_id)--> COMPLETED
      ^                  |  ^                        (device owns it)              |
      |                  |  +-------unpost()---------+                             |
      +----free()--------+                                                         |
      +----free()--------------------------------------------------------------- --+
      +----SlotView.release()---- LENT <--lend()-- (COMPLETED or ACQUIRED)

* ACQUIRED: the library owns it (filling a send buffer, about to post a receive);
* POSTED: the device owns it; nothing may touch or recycle it until its work
  completion is seen (the flush completions after ``QP -> ERROR`` count);
* COMPLETED: its completion was polled; the library decides what happens next;
* LENT: handed to the user as a :class:`SlotView` (a memoryview); it returns
  to FREE only when the view *and every slice made from it* are released.

Two shortcuts for the RDMA receive path take the same transitions without
the per-step calls: :meth:`MemoryPool.acquire_posted` (FREE -> ACQUIRED ->
POSTED for ``n`` slots about to be posted) and :meth:`MemoryPool.consume`
(COMPLETED -> LENT while a sink copies the bytes -> FREE, no
:class:`SlotView`; a view the sink kept alive leaves the slot LENT).

Misuse raises :class:`SlotStateError` (double free, recycling a posted slot,
a completion for a slot that is not posted or for an older use of the slot).
Completions carry ``wr_id = (generation << 32) | slot index``; the generation
changes on every acquire, so a stale completion can never free a reused slot.

Not thread-safe: use a pool from one thread / event loop.
"""

from __future__ import annotations

import enum
import errno as _errno
import mmap
import os
import pickle
import resource
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Protocol, Self

from aiordma._errors import AiordmaError, MemlockLimitError, RDMAError
from aiordma._conn.memory import _fmt_bytes, _getrlimit, memlock_advice

__all__ = [
    "MemlockLimitError",
    "MemoryPool",
    "PoolExhaustedError",
    "PoolStats",
    "Region",
    "Registrar",
    "Slot",
    "SlotState",
    "SlotStateError",
    "SlotView",
    "memlock_advice",
    "pd_registrar",
]

_GEN_SHIFT: Final = 32
_INDEX_MASK: Final = (1 << _GEN_SHIFT) - 1
_GEN_MASK: Final = (1 << 24) - 1
_ALIGN: Final = 64  # slot stride alignment (cache line)


class SlotState(enum.Enum):
    FREE = "free"
    ACQUIRED = "acquired"
    POSTED = "posted"
    COMPLETED = "completed"
    LENT = "lent"

    # members are singletons: hash by identity, in C (Enum's own hash is a
    # Python function, and the counters are updated on every transition)
    __hash__ = object.__hash__


_FREE: Final = SlotState.FREE
_ACQUIRED: Final = SlotState.ACQUIRED
_POSTED: Final = SlotState.POSTED
_COMPLETED: Final = SlotState.COMPLETED
_LENT: Final = SlotState.LENT


class SlotStateError(AiordmaError, RuntimeError):
    """A slot was used in a way its current owner forbids (a bug in the caller)."""


class PoolExhaustedError(AiordmaError, BufferError):
    """Every slot is in use and the pool reached ``max_bytes``."""


class Region(Protocol):
    """What a registrar returns: one registered, page-aligned buffer."""

    @property
    def addr(self) -> int: ...
    @property
    def lkey(self) -> int: ...
    @property
    def rkey(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def buffer(self) -> Any: ...  # a writable buffer of at least ``length`` bytes
    def close(self) -> None: ...


Registrar = Callable[[int], Region]


def pd_registrar(pd: Any, access: int | None = None) -> Registrar:
    """A registrar that allocates and registers regions on a verbs ProtectionDomain."""
    from aiordma._rdma import verbs as _verbs

    from aiordma._rdma.constants import DEFAULT_MR_ACCESS

    acc = DEFAULT_MR_ACCESS if access is None else access

    def register(length: int) -> Region:
        mr: Region = _verbs.MemoryRegion(pd, length, acc)
        return mr

    return register


@dataclass(frozen=True, slots=True)
class PoolStats:
    slot_size: int
    slots: int
    free: int
    acquired: int
    posted: int
    completed: int
    lent: int
    regions: int
    bytes_registered: int
    max_bytes: int

    @property
    def in_use(self) -> int:
        """Slots not FREE (acquired + posted + completed + lent)."""
        return self.slots - self.free


class Slot:
    """One fixed-size buffer of a pool.  Its methods check the state machine."""

    __slots__ = ("pool", "index", "region", "offset", "addr", "lkey", "rkey", "size", "state",
                 "generation", "byte_len", "status")  # fmt: skip

    def __init__(self, pool: MemoryPool, index: int, region: int, offset: int, addr: int, lkey: int, rkey: int,
                 size: int) -> None:  # fmt: skip
        self.pool = pool
        self.index = index
        self.region = region
        self.offset = offset  # inside the region
        self.addr = addr  # device address (region.addr + offset)
        self.lkey = lkey
        self.rkey = rkey
        self.size = size
        self.state = SlotState.FREE
        self.generation = 0
        self.byte_len = 0  # from the completion
        self.status = 0  # completion status

    def __repr__(self) -> str:
        return f"<Slot {self.index} gen={self.generation} {self.state.value}>"

    @property
    def wr_id(self) -> int:
        """The work request id to post this slot with."""
        return (self.generation << _GEN_SHIFT) | self.index

    def mark_posted(self) -> None:
        self.pool.mark_posted(self)

    def unpost(self) -> None:
        self.pool.unpost(self)

    def free(self) -> None:
        self.pool.free(self)

    def lend(self, nbytes: int | None = None, offset: int = 0) -> SlotView:
        return self.pool.lend(self, nbytes, offset)

    def fill(self, data: bytes | bytearray | memoryview, offset: int = 0) -> int:
        return self.pool.fill(self, data, offset)


class SlotView:
    """A slot's bytes handed to the user; ``release()`` (or ``with``) gives the slot back.

    ``data`` is a writable memoryview.  Slices of it are allowed, but the slot
    returns to the pool only after the view and every slice are released:
    ``release()`` raises :class:`BufferError` (the slot stays LENT) while one
    is still alive, and can be called again later.
    """

    __slots__ = ("_slot", "_base", "_mv", "_generation", "_released")

    def __init__(self, slot: Slot, base: memoryview) -> None:
        self._slot = slot
        self._generation = slot.generation
        # ``base`` is a fresh slice of the region's memoryview.  Going through a
        # PickleBuffer gives the user's memoryview its own managed buffer whose
        # export is held on ``base``: while the user's view or any slice of it
        # lives, ``base.release()`` fails -- that is the "still referenced" check.
        self._base = base
        pb = pickle.PickleBuffer(base)
        self._mv: memoryview | None = memoryview(pb)
        pb.release()
        self._released = False

    @property
    def data(self) -> memoryview:
        if self._mv is None:
            raise ValueError("the SlotView was released")
        return self._mv

    @property
    def nbytes(self) -> int:
        return self._base.nbytes

    @property
    def slot(self) -> Slot:
        return self._slot

    def tobytes(self) -> bytes:
        return self.data.tobytes()

    def release(self) -> None:
        """Release the view; the slot becomes FREE.  BufferError if a slice is still alive."""
        if self._released:
            return
        if self._mv is not None:
            try:
                self._mv.release()
            except BufferError as exc:
                raise BufferError(
                    f"slot {self._slot.index} cannot be returned: its memoryview is still exported ({exc}); "
                    "release whatever was built on it first"
                ) from None
            self._mv = None
        try:
            self._base.release()
        except BufferError:
            raise BufferError(
                f"slot {self._slot.index} cannot be returned: a slice of its memoryview is still alive; "
                "release or delete it, then call release() again"
            ) from None
        self._released = True
        self._slot.pool._returned(self._slot, self._generation)

    def __enter__(self) -> memoryview:
        return self.data

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class MemoryPool:
    """Fixed-size slots carved from registered regions, recycled, with ownership checks.

    ``register(length)`` must return a :class:`Region` (``pd_registrar(pd)``
    for verbs).  Regions of ``slots_per_region`` slots are added on demand
    until ``max_bytes`` would be exceeded (then :class:`PoolExhaustedError`).
    ``initial_slots`` are registered up front.

    A registration failure with ENOMEM/EPERM/EAGAIN becomes
    :class:`MemlockLimitError` explaining RLIMIT_MEMLOCK; with
    ``precheck_memlock`` (default: when not running as root) the limit is
    checked before registering.
    """

    def __init__(
        self,
        register: Registrar,
        slot_size: int,
        *,
        slots_per_region: int = 64,
        max_bytes: int = 64 << 20,
        initial_slots: int = 0,
        precheck_memlock: bool | None = None,
        memlock_limits: Callable[[], tuple[int, int]] = _getrlimit,
        already_locked: Callable[[], int] | None = None,
    ) -> None:
        if slot_size <= 0 or slots_per_region <= 0:
            raise ValueError("slot_size and slots_per_region must be positive")
        self._register = register
        self.slot_size = slot_size
        self._stride = (slot_size + _ALIGN - 1) // _ALIGN * _ALIGN
        self.slots_per_region = slots_per_region
        page = mmap.PAGESIZE
        self.region_bytes = (self._stride * slots_per_region + page - 1) // page * page
        if self.region_bytes > max_bytes:
            raise ValueError(
                f"one region ({self.region_bytes} bytes = {slots_per_region} slots of {slot_size}) "
                f"exceeds max_bytes={max_bytes}"
            )
        self.max_bytes = max_bytes
        self._precheck = (os.geteuid() != 0) if precheck_memlock is None else precheck_memlock
        self._limits = memlock_limits
        self._already_locked = already_locked
        self._regions: list[Region] = []
        self._region_views: list[memoryview] = []
        self._slots: list[Slot] = []
        self._free: list[Slot] = []  # LIFO: warm slots first
        self._counts: dict[SlotState, int] = dict.fromkeys(SlotState, 0)
        self._closed = False
        while len(self._slots) < initial_slots:
            self._grow()

    # -- bookkeeping -------------------------------------------------------
    def _set(self, slot: Slot, state: SlotState) -> None:
        self._counts[slot.state] -= 1
        self._counts[state] += 1
        slot.state = state

    def _expect(self, slot: Slot, allowed: tuple[SlotState, ...], action: str) -> None:
        if slot.pool is not self:
            raise SlotStateError(f"cannot {action}: slot {slot.index} belongs to another pool")
        if slot.state not in allowed:
            hint = {
                SlotState.FREE: "it is already free (double free?)",
                SlotState.POSTED: "the device owns it until its work completion is polled "
                "(move the QP to ERROR and poll the flush completion to get it back)",
                SlotState.LENT: "it is lent to the user; release the SlotView instead",
                SlotState.ACQUIRED: "it was never posted",
                SlotState.COMPLETED: "its completion was already handled",
            }[slot.state]
            raise SlotStateError(f"cannot {action} slot {slot.index}: it is {slot.state.value}; {hint}")

    def _ensure_open(self) -> None:
        if self._closed:
            raise SlotStateError("the memory pool is closed")

    @property
    def free_count(self) -> int:
        """Slots FREE now (without growing the pool)."""
        return len(self._free)

    @property
    def bytes_registered(self) -> int:
        return len(self._regions) * self.region_bytes

    def _grow(self) -> None:
        self._ensure_open()
        if self.bytes_registered + self.region_bytes > self.max_bytes:
            raise PoolExhaustedError(
                f"all {len(self._slots)} slots are in use and another region of {self.region_bytes} bytes "
                f"would exceed max_bytes={self.max_bytes}"
            )
        already = self._already_locked() if self._already_locked else self.bytes_registered
        if self._precheck:
            soft, _hard = self._limits()
            if soft != resource.RLIM_INFINITY and already + self.region_bytes > soft:
                raise MemlockLimitError(
                    _errno.ENOMEM, "ibv_reg_mr", memlock_advice(self.region_bytes, already, self._limits)
                )
        try:
            region = self._register(self.region_bytes)
        except OSError as exc:
            if exc.errno in (_errno.ENOMEM, _errno.EPERM, _errno.EAGAIN):
                raise MemlockLimitError(
                    exc.errno, "ibv_reg_mr", memlock_advice(self.region_bytes, already, self._limits)
                ) from exc
            raise
        if region.length < self.region_bytes:
            region.close()
            raise ValueError(f"the registrar returned {region.length} bytes, {self.region_bytes} were asked")
        rindex = len(self._regions)
        self._regions.append(region)
        self._region_views.append(memoryview(region.buffer).cast("B"))
        base = len(self._slots)
        new = [
            Slot(self, base + i, rindex, i * self._stride, region.addr + i * self._stride, region.lkey, region.rkey,
                 self.slot_size)  # fmt: skip
            for i in range(self.slots_per_region)
        ]
        self._slots.extend(new)
        self._counts[SlotState.FREE] += len(new)
        self._free.extend(reversed(new))

    # -- ownership transitions ---------------------------------------------
    def try_acquire(self) -> Slot | None:
        """FREE -> ACQUIRED, growing the pool if allowed; ``None`` when exhausted."""
        self._ensure_open()
        if not self._free:
            try:
                self._grow()
            except PoolExhaustedError:
                return None
        slot = self._free.pop()
        slot.generation = (slot.generation + 1) & _GEN_MASK
        slot.byte_len = 0
        slot.status = 0
        counts = self._counts
        counts[_FREE] -= 1
        counts[_ACQUIRED] += 1
        slot.state = _ACQUIRED
        return slot

    def acquire(self) -> Slot:
        """FREE -> ACQUIRED; raises :class:`PoolExhaustedError` when nothing is free."""
        slot = self.try_acquire()
        if slot is None:
            raise PoolExhaustedError(
                f"all {len(self._slots)} slots are in use ({self.stats()}) and max_bytes={self.max_bytes} is reached"
            )
        return slot

    def acquire_posted(self, n: int) -> list[Slot]:
        """``n`` slots FREE -> ACQUIRED -> POSTED in one call (all or none).

        For a caller that hands them to ``ibv_post_recv`` right away, on the
        data path: the device owns them from now on.  The slots the device
        refuses must go back with :meth:`unpost` then :meth:`free`.  Raises
        :class:`PoolExhaustedError` (and changes nothing) when fewer than
        ``n`` can be had.
        """
        self._ensure_open()
        free = self._free
        while len(free) < n:
            try:
                self._grow()
            except PoolExhaustedError:
                raise PoolExhaustedError(
                    f"{n} slots wanted, {len(free)} free ({self.stats()}) and max_bytes={self.max_bytes} is reached"
                ) from None
        got = free[len(free) - n :]
        del free[len(free) - n :]
        got.reverse()  # the order acquire() would give (LIFO)
        for slot in got:
            slot.generation = (slot.generation + 1) & _GEN_MASK
            slot.byte_len = 0
            slot.status = 0
            slot.state = _POSTED
        counts = self._counts
        counts[_FREE] -= n
        counts[_POSTED] += n
        return got

    def consume(self, slot: Slot, sink: Callable[[memoryview], object]) -> None:
        """Hand a COMPLETED slot's received bytes to ``sink`` and free it: COMPLETED -> FREE.

        The receive path's shortcut for ``lend()`` + ``SlotView.release()``
        without the :class:`SlotView`: ``sink`` gets a read-only view of the
        ``byte_len`` bytes, the slot is LENT while it runs, and the view is
        released right after it returns.  ``sink`` must copy what it keeps:
        if it kept the view (or a slice of it) alive, :class:`BufferError` is
        raised and the slot stays LENT (never recycled under a live view).
        """
        if slot.state is not _COMPLETED or slot.pool is not self:
            self._expect(slot, (SlotState.COMPLETED,), "consume")
        start = slot.offset
        base = self._region_views[slot.region][start : start + slot.byte_len]
        counts = self._counts
        counts[_COMPLETED] -= 1
        counts[_LENT] += 1
        slot.state = _LENT
        # as in SlotView: the PickleBuffer makes every view the sink derives
        # hold an export on ``base``, so base.release() fails while one lives
        pb = pickle.PickleBuffer(base)
        view = memoryview(pb).toreadonly()
        pb.release()
        try:
            sink(view)
        finally:
            try:
                view.release()
                base.release()
            except BufferError:
                raise BufferError(
                    f"slot {slot.index} cannot be returned: a view of its bytes outlived the sink"
                ) from None
            counts[_LENT] -= 1  # (also when the sink raised)
            counts[_FREE] += 1
            slot.state = _FREE
            self._free.append(slot)

    def acquire_many(self, n: int) -> list[Slot]:
        """``n`` slots or none (all-or-nothing)."""
        got: list[Slot] = []
        try:
            for _ in range(n):
                got.append(self.acquire())
        except BaseException:
            for s in got:
                self.free(s)
            raise
        return got

    def mark_posted(self, slot: Slot) -> None:
        """ACQUIRED -> POSTED: call right before handing it to ibv_post_*."""
        if slot.state is not _ACQUIRED or slot.pool is not self:
            self._expect(slot, (SlotState.ACQUIRED,), "post")
        self._set(slot, SlotState.POSTED)

    def unpost(self, slot: Slot) -> None:
        """POSTED -> ACQUIRED, only for a slot the device refused (ibv_post_* failed for it)."""
        self._expect(slot, (SlotState.POSTED,), "unpost")
        self._set(slot, SlotState.ACQUIRED)

    def slot_for(self, wr_id: int) -> Slot:
        """The slot a work request id names (checks the index and the generation)."""
        index = wr_id & _INDEX_MASK
        gen = (wr_id >> _GEN_SHIFT) & _GEN_MASK
        if index >= len(self._slots):
            raise SlotStateError(f"wr_id {wr_id:#x} names no slot of this pool")
        slot = self._slots[index]
        if slot.generation != gen:
            raise SlotStateError(
                f"wr_id {wr_id:#x} is for an earlier use of slot {index} (generation {gen}, now {slot.generation})"
            )
        return slot

    def complete(self, wr_id: int, byte_len: int = 0, status: int = 0) -> Slot:
        """POSTED -> COMPLETED for the slot of a polled work completion."""
        slot = self.slot_for(wr_id)
        if slot.state is not _POSTED:
            self._expect(slot, (SlotState.POSTED,), "complete")
        slot.byte_len = byte_len
        slot.status = status
        self._set(slot, SlotState.COMPLETED)
        return slot

    def free(self, slot: Slot) -> None:
        """ACQUIRED or COMPLETED -> FREE.  Raises on double free, posted or lent slots."""
        if (slot.state is not _COMPLETED and slot.state is not _ACQUIRED) or slot.pool is not self:
            self._expect(slot, (SlotState.ACQUIRED, SlotState.COMPLETED), "free")
        self._set(slot, SlotState.FREE)
        self._free.append(slot)

    def lend(self, slot: Slot, nbytes: int | None = None, offset: int = 0) -> SlotView:
        """COMPLETED or ACQUIRED -> LENT: a :class:`SlotView` of ``nbytes`` (default: the
        completion's ``byte_len`` for a completed slot, else the slot size)."""
        self._expect(slot, (SlotState.COMPLETED, SlotState.ACQUIRED), "lend")
        if nbytes is None:
            nbytes = (slot.byte_len if slot.state is SlotState.COMPLETED else slot.size) - offset
        if offset < 0 or nbytes < 0 or offset + nbytes > slot.size:
            raise ValueError(f"[{offset}:{offset + nbytes}] is outside the {slot.size}-byte slot")
        start = slot.offset + offset
        view = SlotView(slot, self._region_views[slot.region][start : start + nbytes])
        self._set(slot, SlotState.LENT)
        return view

    def _returned(self, slot: Slot, generation: int) -> None:
        if slot.state is not SlotState.LENT or slot.generation != generation:  # pragma: no cover - defensive
            raise SlotStateError(f"slot {slot.index} was returned twice")
        self._set(slot, SlotState.FREE)
        self._free.append(slot)

    def fill(self, slot: Slot, data: bytes | bytearray | memoryview, offset: int = 0) -> int:
        """Copy ``data`` into an ACQUIRED slot (before posting it); returns the length."""
        if slot.state is not _ACQUIRED or slot.pool is not self:
            self._expect(slot, (SlotState.ACQUIRED,), "fill")
        n = memoryview(data).nbytes
        if offset < 0 or offset + n > slot.size:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a {slot.size}-byte slot")
        start = slot.offset + offset
        self._region_views[slot.region][start : start + n] = data
        return n

    def read(self, slot: Slot, nbytes: int | None = None, offset: int = 0) -> bytes:
        """Copy bytes out of a slot the library owns (ACQUIRED or COMPLETED)."""
        self._expect(slot, (SlotState.ACQUIRED, SlotState.COMPLETED), "read")
        if nbytes is None:
            nbytes = (slot.byte_len if slot.state is SlotState.COMPLETED else slot.size) - offset
        start = slot.offset + offset
        return bytes(self._region_views[slot.region][start : start + nbytes])

    def reclaim_posted(self) -> int:
        """POSTED -> FREE for every posted slot.  Only after the QP that held them is
        destroyed (then the device can no longer touch them).  Returns how many."""
        n = 0
        for slot in self._slots:
            if slot.state is SlotState.POSTED:
                self._set(slot, SlotState.FREE)
                self._free.append(slot)
                n += 1
        return n

    # -- introspection -----------------------------------------------------
    def stats(self) -> PoolStats:
        c = self._counts
        return PoolStats(
            self.slot_size, len(self._slots), c[SlotState.FREE], c[SlotState.ACQUIRED], c[SlotState.POSTED],
            c[SlotState.COMPLETED], c[SlotState.LENT], len(self._regions), self.bytes_registered, self.max_bytes,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots)

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Deregister every region.  All slots must be FREE (SlotStateError otherwise)."""
        if self._closed:
            return
        busy = [s for s in self._slots if s.state is not SlotState.FREE]
        if busy:
            st = self.stats()
            raise SlotStateError(
                f"cannot close the pool: {len(busy)} slots are not free "
                f"(acquired {st.acquired}, posted {st.posted}, completed {st.completed}, lent {st.lent})"
            )
        for mv in self._region_views:
            mv.release()
        self._region_views.clear()
        errors: list[BaseException] = []
        while self._regions:
            region = self._regions.pop()
            try:
                region.close()
            except Exception as exc:  # keep closing the others
                errors.append(exc)
        self._slots.clear()
        self._free.clear()
        self._counts = dict.fromkeys(SlotState, 0)
        self._closed = True
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
