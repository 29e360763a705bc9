"""Registered memory on the simulated wire: regions of real memory and type 2 windows, and the
keys that reach them (:class:`_Memory`: the rules a NIC applies to an lkey or an rkey)."""

from __future__ import annotations

import ctypes
import errno
import pickle
from typing import Any

from .._errors import RDMAError
from .._rdma.constants import DEFAULT_MR_ACCESS, Access
from .._rdma.lifetime import RegionBytes
from ._simbase import _SimDomainBase, _SimResource, _pin_readonly, _unpin

__all__ = ["SimMemoryRegion", "SimMemoryWindow"]


class _Memory:
    """The fabric's registered memory, by key, and the checks a NIC makes before it touches it."""

    def __init__(self) -> None:
        self.by_lkey: dict[int, SimMemoryRegion] = {}
        self.by_rkey: dict[int, SimMemoryRegion] = {}
        self.mw_by_rkey: dict[int, SimMemoryWindow] = {}  # bound windows, by their current rkey

    def local_ok(self, pd: object, lkey: int, addr: int, length: int, write: bool) -> bool:
        mr = self.by_lkey.get(lkey)
        return (mr is not None and mr.pd is pd and (not write or bool(mr.access & Access.LOCAL_WRITE))
                and mr.addr <= addr and addr + length <= mr.addr + mr.length)  # fmt: skip

    def remote_ok(self, qp: object, pd: object, rkey: int, addr: int, length: int, need: int) -> bool:
        """Whether ``rkey`` lets a peer reach ``[addr, addr + length)`` with ``need`` through ``qp``
        (of protection domain ``pd``): a region of its PD with that access, or a window bound to
        ``qp`` itself."""
        mr = self.by_rkey.get(rkey)
        if mr is not None:
            return (mr.pd is pd and bool(mr.access & need)
                    and mr.addr <= addr and addr + length <= mr.addr + mr.length)  # fmt: skip
        mw = self.mw_by_rkey.get(rkey)
        if mw is None or mw._bound is None:
            return False
        bqp, mr, start, size, access = mw._bound
        return (bqp is qp and mw.pd is pd and not mr.closed and bool(access & need)
                and start <= addr and addr + length <= start + size)  # fmt: skip

    def registered(self, addr: int, length: int) -> bool:
        return any(m.addr <= addr and addr + length <= m.addr + m.length for m in self.by_lkey.values())


class SimMemoryRegion(_SimResource, RegionBytes):
    """A registered region of real memory: ``addr`` is its address in this process."""

    _kind = "mrs"
    _label = "memory region"

    def __init__(self, pd: _SimDomainBase, memory: _Memory, length_or_buffer: int | Any,
                 access: int = DEFAULT_MR_ACCESS) -> None:  # fmt: skip
        pd._ensure_open("ibv_reg_mr")
        access = int(access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
            raise RDMAError(errno.EINVAL, "ibv_reg_mr", "remote write access needs LOCAL_WRITE")
        length = self._take_memory(length_or_buffer)
        if length == 0:
            raise ValueError("cannot register an empty buffer")
        export = memoryview(self.buffer).cast("B")
        if export.readonly:
            if access & (Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC):
                export.release()
                raise TypeError("reg_buffer needs a writable buffer (or no write access at all)")
            self._pinned: Any
            self._pinned, self.addr = _pin_readonly(export)  # (read-only memory: its address)
        else:
            cobj = ctypes.c_char.from_buffer(export)
            self.addr = ctypes.addressof(cobj)
            del cobj
            # an export of the caller's object itself, held until close, as cffi's from_buffer in
            # the native MemoryRegion holds one: a registered memoryview cannot be released, nor
            # a registered bytearray resized, meanwhile (BufferError), as on a device
            self._held: pickle.PickleBuffer | None = pickle.PickleBuffer(self.buffer)
        self._export: memoryview | None = export
        super().__init__(pd._accounts, (pd,))
        accounts = self._accounts
        self.pd = pd
        self._memory = memory
        self.length: int = length
        self.lkey: int = accounts.new_id(1, 1 << 32)
        self.rkey: int = accounts.new_id(1, 1 << 32)
        self.access = access
        memory.by_lkey[self.lkey] = memory.by_rkey[self.rkey] = self
        accounts.live["registered_bytes"] += length

    def __repr__(self) -> str:
        return f"<SimMemoryRegion addr=0x{self.addr:x} len={self.length} lkey=0x{self.lkey:x} rkey=0x{self.rkey:x}>"

    def close(self) -> None:
        if self._closed:
            return
        memory = self._memory
        del memory.by_lkey[self.lkey], memory.by_rkey[self.rkey]
        if getattr(self, "_pinned", None) is not None:
            _unpin(self._pinned)
            self._pinned = None
        held, self._held = getattr(self, "_held", None), None
        if held is not None:
            held.release()
        if self._export is not None:
            self._export.release()
            self._export = None
        self._give_back_memory()
        self._accounts.live["registered_bytes"] -= self.length
        self._mark_closed()


class SimMemoryWindow(_SimResource):
    """A type 2 memory window: ``SimQueuePair.post_bind_mw`` binds it (to that QP); ``close()``
    (dealloc) invalidates it at once."""

    _kind = "mws"
    _label = "memory window"

    def __init__(self, pd: _SimDomainBase, memory: _Memory) -> None:
        pd._ensure_open("ibv_alloc_mw")
        super().__init__(pd._accounts, (pd,))
        self.pd = pd
        self._memory = memory
        self.rkey: int = (self._accounts.new_id(1, 1 << 24) << 8) | 1
        #: (qp, mr, addr, length, access) while bound (the QP, by identity: the one QP it serves)
        self._bound: tuple[object, SimMemoryRegion, int, int, int] | None = None

    def __repr__(self) -> str:
        return f"<SimMemoryWindow rkey=0x{self.rkey:x}{' bound' if self._bound else ''}>"

    def _unbind(self) -> None:
        if self._bound is not None:
            self._memory.mw_by_rkey.pop(self.rkey, None)
            self._bound = None

    def close(self) -> None:
        if self._closed:
            return
        self._unbind()
        self._mark_closed()

