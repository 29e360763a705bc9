"""Registered memory of the verbs binding: regions (``ibv_reg_mr``) and type 2 windows
(``ibv_alloc_mw``), children of a protection domain (:mod:`aiordma._rdma.verbs`)."""

from __future__ import annotations

import errno as _errno
from typing import Any

from .constants import DEFAULT_MR_ACCESS, Access
from .lifetime import RegionBytes
from ._native import NativeDomain, _Resource, _addr, _check, _count, _fail, _ffi, _lib, _require_native

__all__ = ["MemoryRegion", "MemoryWindow", "next_rkey"]


class MemoryRegion(_Resource, RegionBytes):
    """A registered memory region (``ibv_reg_mr``).

    ``MemoryRegion(pd, n)`` allocates ``n`` bytes with an anonymous shared
    ``mmap`` (page-aligned, zero-filled) and registers them;
    ``MemoryRegion(pd, buffer)`` registers a writable buffer you own.
    ``addr``, ``lkey``, ``rkey`` and ``length`` go into work requests.

    ``close()`` (``ibv_dereg_mr``) must come after the QPs that used it are
    destroyed or at least drained: the device may still be writing into a
    posted buffer.  Memoryviews obtained by :meth:`view` stay valid after
    ``close()`` (the mapping is unmapped when the last one is released).
    """

    _kind = "mrs"
    _label = "memory region"

    def __init__(self, pd: NativeDomain, length_or_buffer: int | Any, access: int = DEFAULT_MR_ACCESS) -> None:
        _require_native("a MemoryRegion")
        pd._ensure_open("ibv_reg_mr")
        length = self._take_memory(length_or_buffer)
        # (a buffer the NIC only reads -- no local write, remote read at most -- may be read-only)
        writable = bool(int(access) & (Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC))
        cbuf = _ffi.from_buffer("char[]", self.buffer, require_writable=writable)
        h = _lib.ibv_reg_mr(pd._h, cbuf, length, int(access))
        if h == _ffi.NULL:
            err = int(_ffi.errno)
            _ffi.release(cbuf)
            self._give_back_memory()
            raise _fail(err, "ibv_reg_mr", f"{length} bytes{_memlock_hint(err)}")
        super().__init__((pd,))
        self.pd = pd
        self._h: Any = h
        self._cbuf: Any = cbuf
        self.addr: int = _addr(cbuf)
        self.length: int = length
        self.lkey: int = int(h.lkey)
        self.rkey: int = int(h.rkey)
        self.access = int(access)
        _count(self._kind, 1)
        _count("registered_bytes", length)

    def __repr__(self) -> str:
        return f"<MemoryRegion addr=0x{self.addr:x} len={self.length} lkey=0x{self.lkey:x} rkey=0x{self.rkey:x}>"

    def close(self) -> None:
        """``ibv_dereg_mr``, then unmap the memory this object allocated."""
        if self._closed:
            return
        rc = int(_lib.ibv_dereg_mr(self._h))
        if rc:
            raise _fail(rc, "ibv_dereg_mr")
        self._h = None
        _ffi.release(self._cbuf)
        self._cbuf = None
        self._give_back_memory()
        _count("registered_bytes", -self.length)
        self._mark_closed()


class MemoryWindow(_Resource):
    """A type 2 memory window (``ibv_alloc_mw``): remote access to part of a memory region
    (one with ``Access.MW_BIND``), granted through one QP only, from its bind until
    :meth:`close` (``ibv_dealloc_mw``, which invalidates it: when it returns, its rkey is dead).
    ``rkey`` is the key of the current binding (``post_bind_mw`` gives each binding a new one)."""

    _kind = "mws"
    _label = "memory window"

    def __init__(self, pd: NativeDomain) -> None:
        _require_native("a MemoryWindow")
        pd._ensure_open("ibv_alloc_mw")
        h = _lib.aiordma_alloc_mw2(pd._h)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno) or _errno.EOPNOTSUPP, "ibv_alloc_mw", "type 2")
        super().__init__((pd,))
        self.pd = pd
        self._h: Any = h
        self.rkey: int = int(_lib.aiordma_mw_rkey(h))
        _count(self._kind, 1)

    def __repr__(self) -> str:
        return f"<MemoryWindow rkey=0x{self.rkey:x}{' closed' if self._closed else ''}>"

    def close(self) -> None:
        if self._closed:
            return
        _check(int(_lib.aiordma_dealloc_mw(self._h)), "ibv_dealloc_mw")
        self._h = None
        self._mark_closed()


def next_rkey(rkey: int) -> int:
    """The rkey a window's next binding gets: the same index, another 8-bit key (``ibv_inc_rkey``)."""
    return (rkey & 0xFFFFFF00) | ((rkey + 1) & 0xFF)


def _memlock_hint(err: int) -> str:
    if err not in (_errno.ENOMEM, _errno.EPERM, _errno.EAGAIN):
        return ""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError):  # pragma: no cover
        return ""

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else f"{v} bytes"

    return (
        f"; registering memory pins it and counts against the locked-memory limit "
        f"(RLIMIT_MEMLOCK soft {fmt(soft)}, hard {fmt(hard)}) -- raise it "
        "(ulimit -l unlimited, LimitMEMLOCK=infinity for systemd, --ulimit memlock=-1 for docker)"
    )
