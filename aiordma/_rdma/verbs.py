"""Typed wrappers around libibverbs (through the cffi module ``aiordma._verbs_cffi``).

This module imports on every host: when the native module was not built (no
libibverbs headers at install time) or cannot load, :func:`native_available`
says why and creating any verbs object raises :class:`RDMAUnavailableError`.
Importing it loads the native module (and maps libibverbs): the transport
imports it only when a connection first offers RDMA.  Device discovery lives
in :mod:`aiordma._rdma.discovery` (sysfs), constants and plain records in
:mod:`aiordma._rdma.constants` (no native code).

Lifetimes are explicit: every object has ``close()`` and is a context manager;
nothing is freed by ``__del__``.  An object forgotten without ``close()`` stays
allocated until the process exits (the kernel cleans up then) and shows up in
:func:`live_objects`, which counts open objects per class and the registered
bytes -- tests assert it returns to zero.

Parents refuse to close while children are open (``RDMAError(EBUSY)``).  The
teardown order of a connection is:

1. stop posting new work requests;
2. move the QP to ERROR (:meth:`QueuePair.to_error`): the device then completes
   every outstanding work request with ``IBV_WC_WR_FLUSH_ERR``;
3. poll the CQs until those flush completions have been seen (each posted
   buffer is the device's until its completion is polled), and drain / ack the
   completion channel's events (:meth:`CompletionChannel.drain_events`);
4. destroy the QP, then the CQs, then the completion channel;
5. deregister the memory regions, deallocate the PD, close the context.

Threads: the objects are not locked; use each from one thread (or task) at a
time.  cffi releases the GIL around every call into C, so a long
:meth:`CompletionQueue.poll_spin` lets other threads run.

Immediate data is a host-order ``int`` in this API; the C helpers convert.
"""

from __future__ import annotations

import enum
import functools
import errno as _errno
import importlib
import ipaddress
import mmap
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .._errors import PostError, RDMAError, RDMAUnavailableError
from . import completions
from .lifetime import Resource, foreign
from .constants import (
    DEFAULT_MR_ACCESS,
    DEFAULT_QP_ACCESS,
    ENUM_TO_MTU,
    EVENT_NAMES,
    FENCE as _FENCE,
    INLINE as _INLINE,
    LINK_LAYERS as _LINK_LAYERS,
    MTU_TO_ENUM,
    PORT_STATE_NAMES,
    SIGNALED as _SIGNALED,
    SOLICITED as _SOLICITED,
    WC_WITH_IMM as _WC_WITH_IMM,
    Access,
    AsyncEvent,
    DeviceAttr,
    GidEntry,
    PortAttr,
    Opcode,
    QPCaps,
    QPState,
    SendFlags,
    SendWR,
    WCOpcode,
    WCStatus,
    event_type_name,
    gid_bytes as _gid_bytes,
    wc_status_name,
)

if TYPE_CHECKING:
    from . import objects as _o

__all__ = [
    "Access",
    "AsyncEvent",
    "CompletionChannel",
    "CompletionQueue",
    "Context",
    "DeviceAttr",
    "GidEntry",
    "MemoryRegion",
    "Opcode",
    "PortAttr",
    "PostError",
    "ProtectionDomain",
    "QPCaps",
    "QPState",
    "QueuePair",
    "RCEndpoint",
    "SendWR",
    "WCArray",
    "WCOpcode",
    "WCStatus",
    "WorkCompletion",
    "assert_no_live_objects",
    "live_objects",
    "native_available",
]

# --------------------------------------------------------------------------
# The native module (optional)
# --------------------------------------------------------------------------

SYSFS_IB: Final = "/sys/class/infiniband"
NOT_BUILT_REASON: Final = "native module not built (it was installed with AIORDMA_NO_NATIVE, or without a C compiler)"
#: the library the native module needs (by soname: it is linked against a stub, _native/build_verbs.py);
#: loaded first here so that its absence is named as such
LIBIBVERBS: Final = "libibverbs.so.1"


def _load_libibverbs() -> str:
    """Whether libibverbs loads (the native module needs it); the reason it cannot, named as such."""
    import ctypes

    try:
        ctypes.CDLL(LIBIBVERBS, mode=os.RTLD_NOW)
    except OSError as exc:
        return (
            f"{LIBIBVERBS} cannot be loaded ({exc}): install libibverbs (Debian/Ubuntu: libibverbs1 and "
            "ibverbs-providers; Fedora: libibverbs) for RDMA"
        )
    return ""


_ffi: Any
_lib: Any
_IMPORT_REASON: str = _load_libibverbs()
try:
    if _IMPORT_REASON:
        raise ImportError(_IMPORT_REASON)
    _mod = importlib.import_module("aiordma._verbs_cffi")
except ModuleNotFoundError as _exc:
    _ffi = _lib = None
    _IMPORT_REASON = (
        NOT_BUILT_REASON if _exc.name == "aiordma._verbs_cffi" else f"native module cannot be loaded: {_exc}"
    )
except ImportError as _exc:  # libibverbs.so.1 missing at run time (said so above), or the module broken
    _ffi = _lib = None
    _IMPORT_REASON = _IMPORT_REASON or f"native module cannot be loaded: {_exc}"
else:
    _ffi, _lib = _mod.ffi, _mod.lib
    _IMPORT_REASON = ""



def native_available() -> tuple[bool, str]:
    """Can verbs be used here?  ``(True, "RDMA devices: rxe0")`` or ``(False, reason)``.

    Reasons: ``"native module not built (no libibverbs headers at install
    time)"``, ``"native module cannot be loaded: ..."``, ``"libibverbs cannot
    list devices: <errno text>"`` (with a hint when the kernel has no RDMA
    support), ``"no RDMA device"``.  Never raises.
    """
    if _lib is None:
        return False, _IMPORT_REASON
    num = _ffi.new("int *")
    lst = _lib.ibv_get_device_list(num)
    if lst == _ffi.NULL:
        err = int(_ffi.errno)
        why = f"libibverbs cannot list devices: {os.strerror(err) if err else 'unknown error'}"
        if not os.path.isdir(SYSFS_IB):
            why += f" ({SYSFS_IB} does not exist: no RDMA support in this kernel)"
        return False, why
    try:
        names = [_ffi.string(_lib.ibv_get_device_name(lst[i])).decode() for i in range(num[0])]
    finally:
        _lib.ibv_free_device_list(lst)
    if not names:
        return False, "no RDMA device"
    return True, "RDMA devices: " + ", ".join(names)


def _require_native(what: str) -> None:
    if _lib is None:
        raise RDMAUnavailableError(f"{_IMPORT_REASON} (while creating {what})")


# --------------------------------------------------------------------------
# Live-object accounting
# --------------------------------------------------------------------------

_LIVE_KEYS: Final = ("contexts", "pds", "mrs", "mws", "cqs", "channels", "qps", "registered_bytes")
_live: dict[str, int] = dict.fromkeys(_LIVE_KEYS, 0)
_live_lock = threading.Lock()


def _count(key: str, delta: int) -> None:
    with _live_lock:
        _live[key] += delta


def live_objects() -> dict[str, int]:
    """Open verbs objects per class and bytes currently registered (a copy).

    Keys: contexts, pds, mrs, cqs, channels, qps, registered_bytes.
    """
    with _live_lock:
        return dict(_live)


def assert_no_live_objects() -> None:
    """Raise ``AssertionError`` naming what is still open (for tests)."""
    left = {k: v for k, v in live_objects().items() if v}
    if left:
        raise AssertionError(f"verbs objects still open: {left}")


# --------------------------------------------------------------------------
# Constants (the verbs ABI values; the guest tests check them against lib)
# --------------------------------------------------------------------------


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _addr(ptr: Any) -> int:
    return int(_ffi.cast("uintptr_t", ptr))


def _fail(err: int, call: str, detail: str = "") -> RDMAError:
    return RDMAError(err or _errno.EIO, call, detail)


def _check(rc: int, call: str, detail: str = "") -> int:
    """Helpers return ``-errno`` on failure."""
    if rc < 0:
        raise _fail(-rc, call, detail)
    return rc


def _mtu_enum(path_mtu: int) -> int:
    try:
        return MTU_TO_ENUM[path_mtu]
    except KeyError:
        raise ValueError(f"path_mtu must be one of {sorted(MTU_TO_ENUM)} (bytes), got {path_mtu}") from None


# --------------------------------------------------------------------------
# Resource base
# --------------------------------------------------------------------------


class _Resource(Resource):
    """A native verbs object (the rule: :mod:`aiordma._rdma.lifetime`), counted in :func:`live_objects`."""

    def __init__(self, parents: Sequence[_Resource]) -> None:
        super().__init__(parents)

    def _counted(self, kind: str, delta: int) -> None:
        _count(kind, delta)


# --------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------


_EV_KINDS: Final = {0: "none", 1: "cq", 2: "qp", 3: "srq", 4: "wq", 5: "port", 6: "device"}


class Context(_Resource):
    """An opened RDMA device (``ibv_open_device``).

    ``Context()`` opens the first device; ``Context("rxe0")`` a named one.
    ``fileno()`` is the async-event fd (non-blocking); read events with
    :meth:`get_async_event` when it is readable.

    ``close()`` (``ibv_close_device``) requires every PD, CQ and completion
    channel of this context to be closed first.
    """

    _kind = "contexts"
    _label = "context"

    def __init__(self, name: str | None = None) -> None:
        _require_native("a verbs Context")
        num = _ffi.new("int *")
        lst = _lib.ibv_get_device_list(num)
        if lst == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_get_device_list")
        try:
            names = [_ffi.string(_lib.ibv_get_device_name(lst[i])).decode() for i in range(num[0])]
            if not names:
                raise RDMAError(_errno.ENODEV, "ibv_get_device_list", "no RDMA device")
            if name is None:
                idx = 0
            elif name in names:
                idx = names.index(name)
            else:
                raise RDMAError(_errno.ENODEV, "ibv_open_device", f"no device {name!r} (have: {', '.join(names)})")
            handle = _lib.ibv_open_device(lst[idx])
            if handle == _ffi.NULL:
                raise _fail(int(_ffi.errno), "ibv_open_device", names[idx])
        finally:
            _lib.ibv_free_device_list(lst)
        super().__init__(())
        self._h: Any = handle
        self.name: str = names[idx]
        fds = _ffi.new("int[2]")
        _lib.aiordma_context_fds(handle, fds, fds + 1)
        self._async_fd = int(fds[0])
        self.num_comp_vectors = int(fds[1])
        rc = int(_lib.aiordma_set_nonblock(self._async_fd))
        if rc < 0:  # pragma: no cover - only with a broken fd
            _lib.ibv_close_device(handle)
            raise _fail(-rc, "fcntl(async_fd, O_NONBLOCK)")
        self._qps: dict[int, QueuePair] = {}
        self._cqs: dict[int, CompletionQueue] = {}
        _count(self._kind, 1)

    def __repr__(self) -> str:
        return f"<Context {self.name}{' closed' if self._closed else ''}>"

    def fileno(self) -> int:
        """The async-event fd (non-blocking)."""
        self._ensure_open("fileno")
        return self._async_fd

    @property
    def async_fd(self) -> int:
        return self.fileno()

    def query_device(self) -> DeviceAttr:
        self._ensure_open("ibv_query_device")
        d = _ffi.new("struct aiordma_device_info *")
        _check(int(_lib.aiordma_query_device(self._h, d)), "ibv_query_device")
        return DeviceAttr(
            int(d.node_guid), int(d.max_mr_size), int(d.vendor_id), int(d.vendor_part_id),
            int(d.max_qp), int(d.max_qp_wr), int(d.max_sge), int(d.max_cq), int(d.max_cqe),
            int(d.max_mr), int(d.max_pd), int(d.max_qp_rd_atom), int(d.max_qp_init_rd_atom),
            int(d.phys_port_cnt), _ffi.string(d.fw_ver).decode(errors="replace"),
        )  # fmt: skip

    def query_port(self, port: int = 1) -> PortAttr:
        self._ensure_open("ibv_query_port")
        p = _ffi.new("struct aiordma_port_info *")
        _check(int(_lib.aiordma_query_port(self._h, port, p)), "ibv_query_port", f"port {port}")
        state = int(p.state)
        return PortAttr(
            port, state, PORT_STATE_NAMES.get(state, str(state)),
            ENUM_TO_MTU.get(int(p.active_mtu), 0), ENUM_TO_MTU.get(int(p.max_mtu), 0),
            int(p.gid_tbl_len), int(p.lid), _LINK_LAYERS.get(int(p.link_layer), str(int(p.link_layer))),
            int(p.max_msg_sz),
        )  # fmt: skip

    def query_gid(self, port: int = 1, index: int = 0) -> ipaddress.IPv6Address:
        self._ensure_open("ibv_query_gid")
        buf = _ffi.new("uint8_t[16]")
        _check(int(_lib.aiordma_query_gid(self._h, port, index, buf)), "ibv_query_gid", f"port {port} index {index}")
        return ipaddress.IPv6Address(bytes(_ffi.buffer(buf, 16)))

    def query_gid_table(self) -> list[GidEntry]:
        """Every valid GID of every port (``ibv_query_gid_table``), with type and netdev."""
        self._ensure_open("ibv_query_gid_table")
        ports = self.query_device().phys_port_cnt
        room = sum(self.query_port(p).gid_tbl_len for p in range(1, ports + 1)) or 1
        arr = _ffi.new("struct aiordma_gid_entry[]", room)
        n = _check(int(_lib.aiordma_query_gid_table(self._h, arr, room)), "ibv_query_gid_table")
        out = []
        for i in range(n):
            e = arr[i]
            gtype = {0: "IB", 1: "RoCEv1", 2: "RoCEv2"}.get(int(e.gid_type), str(int(e.gid_type)))
            ifindex = int(e.ndev_ifindex)
            try:
                ndev: str | None = socket.if_indextoname(ifindex) if ifindex else None
            except OSError:
                ndev = None
            gid = ipaddress.IPv6Address(bytes(_ffi.buffer(e.gid, 16)))
            out.append(GidEntry(self.name, int(e.port_num), int(e.gid_index), gid, gtype, ndev))
        return sorted(out, key=lambda g: (g.port, g.index))

    def get_async_event(self) -> AsyncEvent | None:
        """Read one async event (non-blocking) and acknowledge it; ``None`` if none is pending."""
        self._ensure_open("ibv_get_async_event")
        ev = _ffi.new("struct aiordma_async_event *")
        rc = int(_lib.aiordma_get_async_event(self._h, ev))
        if rc in (-_errno.EAGAIN, -_errno.EWOULDBLOCK):
            return None
        _check(rc, "ibv_get_async_event")
        etype = int(ev.event_type)
        kind = _EV_KINDS.get(int(ev.element_kind), "none")
        elem = int(ev.element)
        desc = _ffi.string(_lib.ibv_event_type_str(etype)).decode()
        return AsyncEvent(
            etype,
            event_type_name(etype),
            desc,
            kind,
            qp=self._qps.get(elem) if kind == "qp" else None,
            cq=self._cqs.get(elem) if kind == "cq" else None,
            port=int(ev.port_num) if kind == "port" else None,
        )

    # factories ------------------------------------------------------------
    def alloc_pd(self) -> ProtectionDomain:
        return ProtectionDomain(self)

    def create_comp_channel(self) -> CompletionChannel:
        return CompletionChannel(self)

    def create_cq(
        self, cqe: int = 256, channel: _o.CompletionChannel | None = None, comp_vector: int = 0
    ) -> CompletionQueue:
        if channel is not None and not isinstance(channel, CompletionChannel):
            raise foreign(channel, CompletionChannel, "ibv_create_cq")
        return CompletionQueue(self, cqe, channel, comp_vector)

    def close(self) -> None:
        """``ibv_close_device``; every child object must be closed already."""
        if self._closed:
            return
        self._check_children("ibv_close_device")
        rc = int(_lib.ibv_close_device(self._h))
        if rc:
            raise _fail(int(_ffi.errno) or _errno.EIO, "ibv_close_device")
        self._h = None
        self._mark_closed()


# --------------------------------------------------------------------------
# Protection domain and memory regions
# --------------------------------------------------------------------------


class ProtectionDomain(_Resource):
    """``ibv_alloc_pd``.  ``close()`` needs its MRs and QPs closed first."""

    _kind = "pds"
    _label = "protection domain"

    def __init__(self, context: Context) -> None:
        _require_native("a ProtectionDomain")
        context._ensure_open("ibv_alloc_pd")
        h = _lib.ibv_alloc_pd(context._h)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_alloc_pd")
        super().__init__((context,))
        self.context = context
        self._h: Any = h
        _count(self._kind, 1)

    def reg_mr(self, length: int, access: int = DEFAULT_MR_ACCESS) -> MemoryRegion:
        """Allocate ``length`` bytes of page-aligned memory (anonymous mmap) and register it."""
        return MemoryRegion(self, length, access)

    def reg_buffer(self, buffer: Any, access: int = DEFAULT_MR_ACCESS) -> MemoryRegion:
        """Register an existing writable buffer (kept exported until ``close()``)."""
        return MemoryRegion(self, buffer, access)

    def create_qp(self, send_cq: _o.CompletionQueue, recv_cq: _o.CompletionQueue | None = None, **kw: Any) -> QueuePair:
        if not isinstance(send_cq, CompletionQueue):
            raise foreign(send_cq, CompletionQueue, "ibv_create_qp")
        if recv_cq is not None and not isinstance(recv_cq, CompletionQueue):
            raise foreign(recv_cq, CompletionQueue, "ibv_create_qp")
        return QueuePair(self, send_cq, recv_cq, **kw)

    def alloc_mw(self) -> MemoryWindow:
        """A type 2 memory window (``ibv_alloc_mw``): bound to one QP by
        :meth:`QueuePair.post_bind_mw`; ``RDMAError`` (EOPNOTSUPP ...) where the device has none."""
        return MemoryWindow(self)

    def close(self) -> None:
        """``ibv_dealloc_pd``; its memory regions and queue pairs must be closed first."""
        if self._closed:
            return
        self._check_children("ibv_dealloc_pd")
        rc = int(_lib.ibv_dealloc_pd(self._h))
        if rc:
            raise _fail(rc, "ibv_dealloc_pd")
        self._h = None
        self._mark_closed()


class MemoryRegion(_Resource):
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

    def __init__(self, pd: ProtectionDomain, length_or_buffer: int | Any, access: int = DEFAULT_MR_ACCESS) -> None:
        _require_native("a MemoryRegion")
        pd._ensure_open("ibv_reg_mr")
        self._mmap: mmap.mmap | None = None
        if isinstance(length_or_buffer, int):
            length = length_or_buffer
            if length <= 0:
                raise ValueError("a memory region needs a positive length")
            page = mmap.PAGESIZE
            mm = mmap.mmap(-1, (length + page - 1) // page * page)
            self._mmap = mm
            self.buffer: Any = mm
        else:
            self.buffer = length_or_buffer
            length = memoryview(length_or_buffer).nbytes
        # (a buffer the NIC only reads -- no local write, remote read at most -- may be read-only)
        writable = bool(int(access) & (Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_ATOMIC))
        cbuf = _ffi.from_buffer("char[]", self.buffer, require_writable=writable)
        h = _lib.ibv_reg_mr(pd._h, cbuf, length, int(access))
        if h == _ffi.NULL:
            err = int(_ffi.errno)
            _ffi.release(cbuf)
            if self._mmap is not None:
                self._mmap.close()
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

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable memoryview of part of the region; release it when done."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"[{offset}:{offset + length}] is outside the {self.length}-byte region")
        with memoryview(self.buffer) as mv:
            return mv.cast("B")[offset : offset + length]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        with self.view(offset, len(data)) as v:
            v[:] = data

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        with self.view(offset, length) as v:
            return bytes(v)

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
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still out: the mapping goes when it is released
            self._mmap = None
        self.buffer = None
        _count("registered_bytes", -self.length)
        self._mark_closed()


class MemoryWindow(_Resource):
    """A type 2 memory window (``ibv_alloc_mw``): remote access to part of a memory region
    (one with ``Access.MW_BIND``), granted through one QP only, from its bind until
    :meth:`close` (``ibv_dealloc_mw``, which invalidates it: when it returns, its rkey is dead).
    ``rkey`` is the key of the current binding (``post_bind_mw`` gives each binding a new one)."""

    _kind = "mws"
    _label = "memory window"

    def __init__(self, pd: ProtectionDomain) -> None:
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


# --------------------------------------------------------------------------
# Completions
# --------------------------------------------------------------------------


class WorkCompletion(completions.WorkCompletion):
    """A decoded ``ibv_wc`` (see ``completions.py``), described by libibverbs."""

    __slots__ = ()

    @property
    def status_str(self) -> str:
        """``ibv_wc_status_str()``: ``"success"``, ``"Work Request Flushed Error"``, ..."""
        if _lib is None:
            return self.status_name
        return str(_ffi.string(_lib.ibv_wc_status_str(self.status)).decode())


#: struct aiordma_wc as Python's struct module sees it (native layout, checked below)
_WC_STRUCT: Final = struct.Struct("@QIIIIIIII")
_WC_SIZE: Final = _WC_STRUCT.size
if _ffi is not None and _ffi.sizeof("struct aiordma_wc") != _WC_SIZE:  # pragma: no cover - ABI guard
    raise ImportError("struct aiordma_wc does not have the layout aiordma expects")


class WCArray(completions.CompletionArray):
    """A preallocated array of flat completions for allocation-free polling.

    ``cq.poll_into(arr)`` fills it and returns a count; the data path reads it with
    :meth:`entries`, anything else decodes entries with ``arr[i]``.
    """

    def __init__(self, n: int) -> None:
        _require_native("a WCArray")
        if n <= 0:
            raise ValueError("a WCArray needs at least one entry")
        self.n = n
        self._a: Any = _ffi.new("struct aiordma_wc[]", n)

    def __getitem__(self, i: int) -> WorkCompletion:
        w = self._a[i]
        flags = int(w.wc_flags)
        return WorkCompletion(
            int(w.wr_id), int(w.status), int(w.opcode), int(w.byte_len),
            int(w.imm_data) if flags & _WC_WITH_IMM else None,
            int(w.qp_num), int(w.src_qp), int(w.vendor_err), flags,
        )  # fmt: skip

    def entries(self, count: int) -> list[tuple[int, int, int, int, int, int]]:
        """In one pass: the array is read as bytes and unpacked by ``struct`` in C."""
        if count <= 0:
            return []
        raw = _ffi.buffer(self._a, count * _WC_SIZE)
        return [
            (wr_id, status, op, byte_len, imm if flags & _WC_WITH_IMM else -1, qp)
            for wr_id, status, op, _vendor, byte_len, imm, qp, _src, flags in _WC_STRUCT.iter_unpack(raw)
        ]


class CompletionChannel(_Resource):
    """``ibv_create_comp_channel``; ``fileno()`` is non-blocking.

    The fd becomes readable when a CQ attached to it was armed with
    :meth:`CompletionQueue.req_notify` and a completion arrived.  Then call
    :meth:`drain_events` (which also acknowledges the events), re-arm, and
    poll the CQ.  ``close()`` needs the CQs attached to it closed first.
    """

    _kind = "channels"
    _label = "completion channel"

    def __init__(self, context: Context) -> None:
        _require_native("a CompletionChannel")
        context._ensure_open("ibv_create_comp_channel")
        h = _lib.ibv_create_comp_channel(context._h)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_create_comp_channel")
        fd = int(_lib.aiordma_channel_fd(h))
        rc = int(_lib.aiordma_set_nonblock(fd))
        if rc < 0:  # pragma: no cover
            _lib.ibv_destroy_comp_channel(h)
            raise _fail(-rc, "fcntl(channel fd, O_NONBLOCK)")
        super().__init__((context,))
        self.context = context
        self._h: Any = h
        self._fd = fd
        self._ev_max = 0
        self._ev_cqs: Any = None
        self._ev_counts: Any = None
        self._ev_n: Any = _ffi.new("int *")
        _count(self._kind, 1)

    def fileno(self) -> int:
        self._ensure_open("fileno")
        return self._fd

    def drain_events_per_cq(self, max_events: int = 64) -> dict[CompletionQueue, int]:
        """Read pending events (until EAGAIN or ``max_events``), ack them, and count them per CQ."""
        self._ensure_open("ibv_get_cq_event")
        if max_events > self._ev_max:
            self._ev_cqs = _ffi.new("struct ibv_cq *[]", max_events)
            self._ev_counts = _ffi.new("unsigned int[]", max_events)
            self._ev_max = max_events
        total = int(_lib.aiordma_drain_cq_events(self._h, max_events, self._ev_cqs, self._ev_counts, self._ev_n))
        _check(total, "ibv_get_cq_event")
        out: dict[CompletionQueue, int] = {}
        for i in range(int(self._ev_n[0])):
            cq = self.context._cqs.get(_addr(self._ev_cqs[i]))
            if cq is not None:
                out[cq] = out.get(cq, 0) + int(self._ev_counts[i])
        return out

    def drain_events(self, max_events: int = 64) -> int:
        """Read and acknowledge pending events; returns how many (0 if none)."""
        if self._h is None:
            self._ensure_open("ibv_get_cq_event")
        if max_events > self._ev_max:
            self._ev_cqs = _ffi.new("struct ibv_cq *[]", max_events)
            self._ev_counts = _ffi.new("unsigned int[]", max_events)
            self._ev_max = max_events
        total = int(_lib.aiordma_drain_cq_events(self._h, max_events, self._ev_cqs, self._ev_counts, self._ev_n))
        return _check(total, "ibv_get_cq_event")

    def close(self) -> None:
        """``ibv_destroy_comp_channel``; the CQs using it must be closed first."""
        if self._closed:
            return
        self._check_children("ibv_destroy_comp_channel")
        rc = int(_lib.ibv_destroy_comp_channel(self._h))
        if rc:
            raise _fail(int(_ffi.errno) or rc, "ibv_destroy_comp_channel")
        self._h = None
        self._mark_closed()


class CompletionQueue(_Resource):
    """``ibv_create_cq`` with at least ``cqe`` entries, optionally on a channel.

    ``close()`` (``ibv_destroy_cq``) needs the QPs using it closed first.
    Events read by :meth:`CompletionChannel.drain_events` are already acked,
    so destroying never waits on unacknowledged events.
    """

    _kind = "cqs"
    _label = "completion queue"

    def __init__(
        self, context: Context, cqe: int = 256, channel: CompletionChannel | None = None, comp_vector: int = 0
    ) -> None:
        _require_native("a CompletionQueue")
        context._ensure_open("ibv_create_cq")
        if channel is not None:
            channel._ensure_open("ibv_create_cq")
        h = _lib.ibv_create_cq(context._h, cqe, _ffi.NULL, channel._h if channel else _ffi.NULL, comp_vector)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_create_cq", f"cqe={cqe}")
        super().__init__((context, channel) if channel else (context,))
        self.context = context
        self.channel = channel
        self.cqe: int = int(h.cqe)  # what the device granted (>= the cqe asked)
        self._h: Any = h
        self._key = _addr(h)
        context._cqs[self._key] = self
        self._scratch = WCArray(16)
        _count(self._kind, 1)

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next completion makes the channel fd readable."""
        self._ensure_open("ibv_req_notify_cq")
        _check(int(_lib.aiordma_req_notify(self._h, 1 if solicited_only else 0)), "ibv_req_notify_cq")

    def poll_into(self, arr: _o.WorkCompletions, max_entries: int | None = None) -> int:
        """Poll up to ``max_entries`` (default ``len(arr)``) completions into ``arr``; returns the count."""
        if not isinstance(arr, WCArray):
            raise foreign(arr, WCArray, "ibv_poll_cq")
        self._ensure_open("ibv_poll_cq")
        n = arr.n if max_entries is None else min(max_entries, arr.n)
        return _check(int(_lib.aiordma_poll_batch(self._h, n, arr._a)), "ibv_poll_cq")

    def native_waker(self, channel: _o.CompletionChannel | None) -> Callable[..., int]:
        """``aiordma_wake`` bound to this CQ and ``channel`` (the poller's one call per wake;
        see ``_native/aiordma_fast.h``).  The poller must stop calling it before this CQ closes."""
        if channel is not None and not isinstance(channel, CompletionChannel):
            raise foreign(channel, CompletionChannel, "aiordma_wake")
        self._ensure_open("aiordma_wake")
        return functools.partial(_lib.aiordma_wake, channel._h if channel is not None else _ffi.NULL, self._h)

    def poll(self, max_entries: int = 16) -> list[completions.WorkCompletion]:
        """Poll up to ``max_entries`` completions (an empty list if none)."""
        arr = self._scratch if max_entries <= self._scratch.n else WCArray(max_entries)
        return arr.decode(self.poll_into(arr, max_entries))

    def poll_spin_into(self, arr: WCArray, spin_ns: int, max_entries: int | None = None) -> int:
        """Busy-poll (GIL released) up to ``spin_ns`` ns until something arrives; returns the count."""
        self._ensure_open("ibv_poll_cq")
        n = arr.n if max_entries is None else min(max_entries, arr.n)
        return _check(int(_lib.aiordma_poll_spin(self._h, n, arr._a, int(spin_ns))), "ibv_poll_cq")

    def poll_spin(self, max_entries: int = 16, spin_ns: int = 50_000) -> list[completions.WorkCompletion]:
        arr = self._scratch if max_entries <= self._scratch.n else WCArray(max_entries)
        return arr.decode(self.poll_spin_into(arr, spin_ns, max_entries))

    def close(self) -> None:
        """``ibv_destroy_cq``; the QPs using it must be destroyed first."""
        if self._closed:
            return
        self._check_children("ibv_destroy_cq")
        rc = int(_lib.ibv_destroy_cq(self._h))
        if rc:
            raise _fail(rc, "ibv_destroy_cq")
        self.context._cqs.pop(self._key, None)
        self._h = None
        self._mark_closed()


# --------------------------------------------------------------------------
# Queue pairs
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RCEndpoint:
    """What one side of an RC connection tells the other: QP number, GID, first PSN."""

    qp_num: int
    gid: ipaddress.IPv6Address
    psn: int = 0


class QueuePair(_Resource):
    """A reliable-connected queue pair (``ibv_create_qp``, ``IBV_QPT_RC``).

    Bring it up with :meth:`to_init`, :meth:`to_rtr` (the remote QP number,
    GID and PSN) and :meth:`to_rts`, or :meth:`connect` for all three.  The
    retry counts are finite by default (``retry_cnt=6`` transport retries: rxe takes 7 as forever,
    ``rnr_retry=6``: 7 would mean retrying forever when the peer has no
    receive posted), so a dead or stalled peer ends in a failed completion
    (``IBV_WC_RETRY_EXC_ERR`` / ``IBV_WC_RNR_RETRY_EXC_ERR``) instead of a hang.

    Teardown: stop posting, :meth:`to_error`, poll the CQs until every
    outstanding work request came back (flushed ones with
    ``IBV_WC_WR_FLUSH_ERR``), then :meth:`close` (``ibv_destroy_qp``).
    """

    _kind = "qps"
    _label = "queue pair"

    def __init__(
        self,
        pd: ProtectionDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue | None = None,
        *,
        max_send_wr: int = 64,
        max_recv_wr: int = 64,
        max_send_sge: int = 1,
        max_recv_sge: int = 1,
        max_inline_data: int = 0,
        sq_sig_all: bool = False,
    ) -> None:
        _require_native("a QueuePair")
        recv_cq = recv_cq or send_cq
        for obj in (pd, send_cq, recv_cq):
            obj._ensure_open("ibv_create_qp")
        caps = _ffi.new("struct aiordma_qp_caps *")
        caps.max_send_wr = max_send_wr
        caps.max_recv_wr = max_recv_wr
        caps.max_send_sge = max_send_sge
        caps.max_recv_sge = max_recv_sge
        caps.max_inline_data = max_inline_data
        h = _lib.aiordma_create_rc_qp(pd._h, send_cq._h, recv_cq._h, caps, 1 if sq_sig_all else 0)
        if h == _ffi.NULL:
            raise _fail(
                int(_ffi.errno),
                "ibv_create_qp",
                f"RC max_send_wr={max_send_wr} max_recv_wr={max_recv_wr} max_inline_data={max_inline_data}",
            )
        parents: tuple[_Resource, ...] = (pd, send_cq) if recv_cq is send_cq else (pd, send_cq, recv_cq)
        super().__init__(parents)
        self.pd = pd
        self.context = pd.context
        self.send_cq = send_cq
        self.recv_cq = recv_cq
        self._h: Any = h
        self._key = _addr(h)
        self.qp_num: int = int(_lib.aiordma_qp_num(h))
        self.caps = QPCaps(
            int(caps.max_send_wr), int(caps.max_recv_wr), int(caps.max_send_sge),
            int(caps.max_recv_sge), int(caps.max_inline_data),
        )  # fmt: skip
        self.port_num = 1
        self.context._qps[self._key] = self
        self._send_arr: Any = _ffi.new("struct aiordma_send_wr[]", max(1, self.caps.max_send_wr))
        self._recv_n = max(1, self.caps.max_recv_wr)
        self._recv_addrs: Any = _ffi.new("uint64_t[]", self._recv_n)
        self._recv_lens: Any = _ffi.new("uint32_t[]", self._recv_n)
        self._recv_ids: Any = _ffi.new("uint64_t[]", self._recv_n)
        self._posted: Any = _ffi.new("int *")
        _count(self._kind, 1)

    def __repr__(self) -> str:
        return f"<QueuePair qp_num={self.qp_num}{' closed' if self._closed else ''}>"

    # state transitions ----------------------------------------------------
    def to_init(self, port_num: int = 1, pkey_index: int = 0, access: int = DEFAULT_QP_ACCESS) -> None:
        self._ensure_open("ibv_modify_qp(INIT)")
        self.port_num = port_num
        _check(int(_lib.aiordma_qp_to_init(self._h, port_num, pkey_index, int(access))), "ibv_modify_qp(INIT)")

    def to_rtr(
        self,
        dest_qp_num: int,
        dgid: str | bytes | ipaddress.IPv4Address | ipaddress.IPv6Address,
        *,
        sgid_index: int,
        rq_psn: int = 0,
        path_mtu: int = 1024,
        port_num: int | None = None,
        hop_limit: int = 64,
        traffic_class: int = 0,
        flow_label: int = 0,
        sl: int = 0,
        max_dest_rd_atomic: int = 1,
        min_rnr_timer: int = 12,
        is_global: bool = True,
        dlid: int = 0,
    ) -> None:
        """INIT -> RTR towards the remote QP (RoCEv2: GRH with ``dgid`` and our ``sgid_index``)."""
        self._ensure_open("ibv_modify_qp(RTR)")
        a = _ffi.new("struct aiordma_rtr_attr *")
        a.dgid = _gid_bytes(dgid)
        a.dest_qp_num = dest_qp_num
        a.rq_psn = rq_psn & 0xFFFFFF
        a.path_mtu = _mtu_enum(path_mtu)
        a.port_num = self.port_num if port_num is None else port_num
        a.is_global = 1 if is_global else 0
        a.sgid_index = sgid_index
        a.hop_limit = hop_limit
        a.traffic_class = traffic_class
        a.flow_label = flow_label
        a.sl = sl
        a.dlid = dlid
        a.max_dest_rd_atomic = max_dest_rd_atomic
        a.min_rnr_timer = min_rnr_timer
        _check(
            int(_lib.aiordma_qp_to_rtr(self._h, a)),
            "ibv_modify_qp(RTR)",
            f"dest_qp_num={dest_qp_num} dgid={ipaddress.IPv6Address(_gid_bytes(dgid))} sgid_index={sgid_index}",
        )

    def to_rts(
        self, sq_psn: int = 0, *, timeout: int = 14, retry_cnt: int = 6, rnr_retry: int = 6, max_rd_atomic: int = 1
    ) -> None:
        """RTR -> RTS.  ``timeout`` is 4.096 us * 2**timeout (14: ~67 ms); ``rnr_retry`` 7 = infinite."""
        self._ensure_open("ibv_modify_qp(RTS)")
        if not (0 <= retry_cnt <= 7 and 0 <= rnr_retry <= 7):
            raise ValueError("retry_cnt and rnr_retry are 0..7")
        a = _ffi.new("struct aiordma_rts_attr *")
        a.sq_psn = sq_psn & 0xFFFFFF
        a.timeout = timeout
        a.retry_cnt = retry_cnt
        a.rnr_retry = rnr_retry
        a.max_rd_atomic = max_rd_atomic
        _check(int(_lib.aiordma_qp_to_rts(self._h, a)), "ibv_modify_qp(RTS)")

    def connect(
        self,
        remote: RCEndpoint,
        *,
        sgid_index: int,
        sq_psn: int = 0,
        port_num: int = 1,
        path_mtu: int = 1024,
        access: int = DEFAULT_QP_ACCESS,
        rtr: dict[str, Any] | None = None,
        rts: dict[str, Any] | None = None,
    ) -> None:
        """RESET -> INIT -> RTR -> RTS in one call (extra options via ``rtr``/``rts``)."""
        self.to_init(port_num, access=access)
        self.to_rtr(remote.qp_num, remote.gid, sgid_index=sgid_index, rq_psn=remote.psn, path_mtu=path_mtu,
                    **(rtr or {}))  # fmt: skip
        self.to_rts(sq_psn, **(rts or {}))

    def to_error(self) -> None:
        """Move to ERROR: outstanding work requests complete with ``IBV_WC_WR_FLUSH_ERR``.

        A QP still in RESET (never brought up) has nothing outstanding, and the
        kernel refuses RESET -> ERR; that case is a silent no-op.
        """
        self._ensure_open("ibv_modify_qp(ERR)")
        rc = int(_lib.aiordma_qp_to_state(self._h, QPState.ERR))
        if rc == -_errno.EINVAL and int(_lib.aiordma_qp_state(self._h)) == QPState.RESET:
            return
        _check(rc, "ibv_modify_qp(ERR)")

    def to_reset(self) -> None:
        self._ensure_open("ibv_modify_qp(RESET)")
        _check(int(_lib.aiordma_qp_to_state(self._h, QPState.RESET)), "ibv_modify_qp(RESET)")

    @property
    def state(self) -> QPState:
        """The current state, asked from the device (``ibv_query_qp``)."""
        self._ensure_open("ibv_query_qp")
        return QPState(_check(int(_lib.aiordma_qp_state(self._h)), "ibv_query_qp"))

    # posting --------------------------------------------------------------
    def post_recv(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self.post_recv_batch((addr,), (length,), lkey, (wr_id,))

    def post_recv_batch(self, addrs: Sequence[int], lens: Sequence[int], lkey: int, wr_ids: Sequence[int]) -> None:
        """Post receive buffers (one sge each, same ``lkey``) as chained WRs.

        Raises :class:`PostError` (with ``posted``) if the device refused some.
        """
        self._ensure_open("ibv_post_recv")
        n = len(addrs)
        if not (len(lens) == len(wr_ids) == n):
            raise ValueError("addrs, lens and wr_ids must have the same length")
        if n == 0:
            return
        if n > self._recv_n:
            self._recv_n = n
            self._recv_addrs = _ffi.new("uint64_t[]", n)
            self._recv_lens = _ffi.new("uint32_t[]", n)
            self._recv_ids = _ffi.new("uint64_t[]", n)
        ra, rl, ri = self._recv_addrs, self._recv_lens, self._recv_ids
        for i in range(n):
            ra[i] = addrs[i]
            rl[i] = lens[i]
            ri[i] = wr_ids[i]
        rc = int(_lib.aiordma_post_recv_batch(self._h, n, ra, rl, lkey, ri, self._posted))
        if rc < 0:
            raise PostError(-rc, "ibv_post_recv", int(self._posted[0]), n)

    def post_recv_one(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        """Post one receive buffer (the data path's re-post; one C call, no arrays).

        Raises :class:`PostError` (``posted`` 0) if the device refused it.
        """
        if self._h is None:
            self._ensure_open("ibv_post_recv")
        rc = int(_lib.aiordma_post_recv_one(self._h, wr_id, addr, length, lkey))
        if rc < 0:
            raise PostError(-rc, "ibv_post_recv", 0, 1)

    def post_send_imm(self, wr_id: int, addr: int, length: int, lkey: int, imm_data: int, flags: int) -> None:
        """Post one SEND_WITH_IMM (``imm_data`` in host order; ``length`` 0: no sge;
        ``flags``: ``SIGNALED | SOLICITED | INLINE`` bits as plain ints).

        The data path's scalar fast path: the same work request as
        ``post_send(SendWR(Opcode.SEND_WITH_IMM, ...))`` without building a
        :class:`SendWR` or an array.  Raises :class:`PostError` (``posted`` 0)
        if the device refused it.
        """
        if self._h is None:
            self._ensure_open("ibv_post_send")
        rc = int(_lib.aiordma_post_send_imm(self._h, wr_id, addr, length, lkey, imm_data, flags))
        if rc < 0:
            raise PostError(-rc, "ibv_post_send", 0, 1)

    def post_send(self, wr: SendWR) -> None:
        self.post_send_batch((wr,))

    def post_bind_mw(self, wr_id: int, mw: _o.Window, mr: _o.Region, addr: int, length: int, access: int,
                     signaled: bool = True) -> int:  # fmt: skip
        """Post a BIND_MW work request: ``mw`` grants ``access`` (``Access.REMOTE_*``) to
        ``[addr, addr + length)`` of ``mr`` through this QP only, once it executed (in order with
        the rest of the send queue).  Returns the binding's rkey (also ``mw.rkey`` from now on).
        Raises :class:`PostError` if the device refused it."""
        if not isinstance(mw, MemoryWindow):
            raise foreign(mw, MemoryWindow, "ibv_post_send(BIND_MW)")
        if not isinstance(mr, MemoryRegion):
            raise foreign(mr, MemoryRegion, "ibv_post_send(BIND_MW)")
        self._ensure_open("ibv_post_send")
        rkey = next_rkey(mw.rkey)
        rc = int(_lib.aiordma_post_bind_mw(self._h, wr_id, mw._h, mr._h, addr, length, int(access), rkey,
                                           _SIGNALED if signaled else 0))  # fmt: skip
        if rc < 0:
            raise PostError(-rc, "ibv_post_send(BIND_MW)", 0, 1)
        mw.rkey = rkey
        return rkey

    def set_access(self, access: int) -> None:
        """What the peer may do on this QP from now on (``Access.REMOTE_*``; in RTR or RTS)."""
        self._ensure_open("ibv_modify_qp(access)")
        _check(int(_lib.aiordma_qp_set_access(self._h, int(access))), "ibv_modify_qp(access)")

    def post_send_batch(self, wrs: Sequence[SendWR]) -> None:
        """Post send-queue work requests as chained WRs (one C call per batch).

        Raises :class:`PostError` (with ``posted``) if the device refused some.
        """
        self._ensure_open("ibv_post_send")
        n = len(wrs)
        if n == 0:
            return
        if n > len(self._send_arr):
            self._send_arr = _ffi.new("struct aiordma_send_wr[]", n)
        arr = self._send_arr
        for i, w in enumerate(wrs):
            s = arr[i]
            s.wr_id = w.wr_id
            s.addr = w.addr
            s.length = w.length
            s.lkey = w.lkey
            s.remote_addr = w.remote_addr
            s.rkey = w.rkey
            s.imm_data = w.imm_data or 0
            s.opcode = int(w.opcode)
            # plain ints: IntFlag arithmetic costs a Python call per operator
            s.send_flags = (
                (_SIGNALED if w.signaled else 0)
                | (_INLINE if w.inline else 0)
                | (_SOLICITED if w.solicited else 0)
                | (_FENCE if w.fence else 0)
            )
        rc = int(_lib.aiordma_post_send_batch(self._h, n, arr, self._posted))
        if rc < 0:
            raise PostError(-rc, "ibv_post_send", int(self._posted[0]), n)

    def close(self) -> None:
        """``ibv_destroy_qp``.  Move it to ERROR and drain its completions first."""
        if self._closed:
            return
        rc = int(_lib.ibv_destroy_qp(self._h))
        if rc:
            raise _fail(rc, "ibv_destroy_qp")
        self.context._qps.pop(self._key, None)
        self._h = None
        self._mark_closed()


def iter_gids(ctx: Context, port: int = 1) -> Iterator[tuple[int, ipaddress.IPv6Address]]:
    """Non-zero GIDs of a port as ``(index, gid)`` asked through verbs (``ibv_query_gid``)."""
    n = ctx.query_port(port).gid_tbl_len
    for i in range(n):
        try:
            g = ctx.query_gid(port, i)
        except RDMAError:
            continue
        if g.packed != bytes(16):
            yield i, g


if TYPE_CHECKING:  # mypy holds these objects to the interfaces the transport uses (aiordma._rdma.objects)

    def _held(ctx: Context, pd: ProtectionDomain, mr: MemoryRegion, mw: MemoryWindow, channel: CompletionChannel,
              cq: CompletionQueue, wc: WCArray, qp: QueuePair) -> tuple[_o.Context, _o.Domain, _o.Region, _o.Window,
              _o.CompletionChannel, _o.CompletionQueue, _o.WorkCompletions, _o.QueuePair]:  # fmt: skip
        return ctx, pd, mr, mw, channel, cq, wc, qp
