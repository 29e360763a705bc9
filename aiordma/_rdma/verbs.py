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

The binding is four modules under this one: :mod:`._native` (the native module, the count of
live objects), :mod:`._verbs_memory`, :mod:`._verbs_cq` and :mod:`._verbs_qp`; every name is
imported from here.
"""

from __future__ import annotations

import errno as _errno
import ipaddress
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from .._errors import PostError, RDMAError
from .lifetime import foreign
from .constants import (  # (re-exported: the binding's names are all here)
    DEFAULT_MR_ACCESS,
    DEFAULT_QP_ACCESS,
    ENUM_TO_MTU,
    EVENT_NAMES,
    LINK_LAYERS as _LINK_LAYERS,
    MTU_TO_ENUM,
    PORT_STATE_NAMES,
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
from ._native import (
    _IMPORT_REASON,
    _LIVE_KEYS,
    LIBIBVERBS,
    NOT_BUILT_REASON,
    SYSFS_IB,
    NativeContext,
    NativeDomain,
    _check,
    _count,
    _fail,
    _ffi,
    _lib,
    _mtu_enum,
    _require_native,
    assert_no_live_objects,
    live_objects,
    native_available,
)
from ._verbs_cq import CompletionChannel, CompletionQueue, WCArray, WorkCompletion
from ._verbs_memory import MemoryRegion, MemoryWindow, next_rkey
from ._verbs_qp import QueuePair, RCEndpoint
from ._verbs_srq import SharedReceiveQueue

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
    "SharedReceiveQueue",
    "WCArray",
    "WCOpcode",
    "WCStatus",
    "WorkCompletion",
    "assert_no_live_objects",
    "live_objects",
    "native_available",
]

# --------------------------------------------------------------------------
# Context
# --------------------------------------------------------------------------


_EV_KINDS: Final = {0: "none", 1: "cq", 2: "qp", 3: "srq", 4: "wq", 5: "port", 6: "device"}


class Context(NativeContext):
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
        self._qps = {}
        self._cqs = {}
        self._srqs = {}
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
            srq=self._srqs.get(elem) if kind == "srq" else None,
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


class ProtectionDomain(NativeDomain):
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

    def create_srq(self, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> SharedReceiveQueue:
        """``ibv_create_srq`` (see :mod:`aiordma._rdma._verbs_srq`)."""
        return SharedReceiveQueue(self, max_wr=max_wr, max_sge=max_sge, srq_limit=srq_limit)

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
