"""A simulated RC wire: pure-Python stand-ins for the verbs objects.

Theory of operation
-------------------
:class:`SimFabric` is at once the verbs provider and the network.  Its devices
hand out contexts, PDs, MRs, completion channels, CQs and reliable-connected
QPs with the method names of :mod:`aiordma._rdma.verbs`, so transport code
written against the native binding runs unchanged on them.

* **Memory is real.**  A memory region is a real buffer of this process (an
  anonymous ``mmap`` or a registered buffer) and ``addr`` its real address;
  the wire copies bytes with ``ctypes.memmove`` between addresses, but only
  after checking that each range lies inside a live MR with the right key, PD
  and access (so a bad ``lkey``/``rkey`` is a failed completion, never a
  crash).  Inline data is read at post time from any registered range.
* **The wire is instant.**  A send WR executes synchronously inside
  ``post_send*``: the responder's receive is consumed, bytes are copied and
  both completions are queued before the call returns.  Only the holds delay
  something: :attr:`SimFabric.hold_acks` (the requester's successful send-queue
  completions wait until :meth:`SimFabric.release_acks`), and per QP
  :meth:`SimFabric.hold` -- late ACKs, late receive completions (the data is
  placed and ACKed but the responder sees it later), slow READs (they execute
  at :meth:`SimFabric.release`, against whatever the responder has then) --
  which force the orderings a NIC can produce and an instant wire cannot.
* **Verbs rules are strict.**  No receive posted is an immediate
  ``RNR_RETRY_EXC_ERR`` (as if ``rnr_retry`` ran out), an unreachable or dead
  peer an immediate ``RETRY_EXC_ERR``; send-queue slots are freed only by
  *polling* a signaled completion; arming a CQ never fires for entries already
  queued; a CQ overrun loses the entry, raises ``IBV_EVENT_CQ_ERR`` and moves
  the QPs on it to ERROR.  Responder-side errors (length, protection, remote
  access) move both QPs to ERROR, as rxe does.
* **Readiness is real.**  A completion channel and a context's async-event
  queue each own a non-blocking pipe whose read end is readable exactly while
  events are pending, so ``loop.add_reader``, ``select`` and trio's
  ``wait_readable`` work on their ``fileno()``.

* **Shared receive queues as rxe's** (:mod:`._simsrq`): QPs created with one take their receive
  buffers from it in posting order; empty is RNR; the limit event fires once, when a receive taken
  leaves fewer than the limit posted; a QP going to ERROR flushes none of its buffers (and, as
  rxe, raises no "last WQE reached").

* **Protection is enforced like a NIC's.**  An rkey reaches memory only through a QP of the
  region's protection domain, and a type 2 memory window's rkey only through the one QP that
  bound it, only while it is bound (``dealloc`` invalidates it) and only within its range and
  access; a QP's own access flags (``to_init``, ``set_access``) are checked first.  A refused
  access is ``REM_ACCESS_ERR`` at the requester and moves both QPs to ERROR, as on rxe.  A device
  may be made without memory windows (``add_device(memory_windows=False)``, as siw).

Not simulated: timing (no latency, bandwidth, timeouts or retransmission,
hence no PSN checks and no packets), path MTU segmentation, atomics,
type 1 memory windows, multiple ports, UD QPs, and the cost of anything.  Everything
is deterministic (keys and QP numbers come from a seeded PRNG) and needs no
event loop; the objects are not thread-safe.

The modules: this one has the fabric (its knobs), contexts and protection domains, and every
name is imported from here; the queue pairs and the wire between them (routing, holds, faults)
are :mod:`._simwire`'s, completion channels and CQs :mod:`._simcq`'s, registered memory and the
rules on its keys :mod:`._simmemory`'s, and the plumbing (accounts, readiness pipes, queued
completions, the bases a child names its parent by) :mod:`._simbase`'s.
"""

from __future__ import annotations

import errno
import ipaddress
from typing import TYPE_CHECKING, Any

from .._errors import RDMAError
from .._rdma.lifetime import foreign
from .._rdma.constants import DEFAULT_MR_ACCESS, MTU_TO_ENUM, AsyncEvent, DeviceAttr, GidEntry, PortAttr, gid_bytes
from ._simbase import (
    _GID_TBL_LEN,
    _MAX_SGE,
    SimWCArray,
    SimWorkCompletion,
    _Accounts,
    _Device,
    _ReadyQueue,
    _SimContextBase,
    _SimDomainBase,
)
from ._simcq import SimCompletionChannel, SimCompletionQueue
from ._simmemory import SimMemoryRegion, SimMemoryWindow, _Memory
from ._simsrq import SimSharedReceiveQueue
from ._simwire import SimQueuePair, _Wire

if TYPE_CHECKING:
    from .._rdma import objects as _o

__all__ = [
    "SimFabric",
    "SimContext",
    "SimProtectionDomain",
    "SimMemoryRegion",
    "SimCompletionChannel",
    "SimCompletionQueue",
    "SimQueuePair",
    "SimWCArray",
    "SimWorkCompletion",
]


class SimFabric:
    """A simulated RDMA fabric: devices, and the RC wire between their QPs (the "verbs provider").

    Fault knobs: :attr:`hold_acks` / :meth:`release_acks` (and :attr:`flush_held_on_error`), :meth:`hold` /
    :meth:`release` (one QP's late ACKs, late receive completions, slow READs), :meth:`kill_qp`,
    :meth:`fail_next`, :meth:`not_ready`, :meth:`post_async_event`.  :attr:`counters` counts
    posts, polls, events and errors for tests and benchmarks.
    """

    def __init__(self, *, seed: int = 0) -> None:
        self._accounts = _Accounts(seed)
        self.counters: dict[str, int] = self._accounts.counters
        self._memory = _Memory()
        self._wire = _Wire(self._accounts, self._memory)
        self._devices: dict[str, _Device] = {}
        self._contexts: list[SimContext] = []

    @property
    def hold_acks(self) -> bool:
        """When True, successful send-queue completions wait for :meth:`release_acks`."""
        return self._wire.hold_acks

    @hold_acks.setter
    def hold_acks(self, on: bool) -> None:
        self._wire.hold_acks = on

    @property
    def flush_held_on_error(self) -> bool:
        """When True, a QP moved to ERROR flushes its held send completions (WR_FLUSH_ERR), as a
        NIC does with work requests whose ACKs never came: with ``hold_acks``, a silent peer."""
        return self._wire.flush_held_on_error

    @flush_held_on_error.setter
    def flush_held_on_error(self, on: bool) -> None:
        self._wire.flush_held_on_error = on

    # devices and discovery -----------------------------------------------
    def add_device(self, name: str = "sim0", ip: str = "127.0.0.1", *, active_mtu: int = 4096,
                   max_qp_wr: int = 4096, max_cqe: int = 65536, max_inline_data: int = 256,
                   max_qp_rd_atom: int = 16, memory_windows: bool = True) -> None:  # fmt: skip
        addr = ipaddress.ip_address(ip)
        if name in self._devices:
            raise ValueError(f"device {name!r} already exists")
        if any(d.ip == addr for d in self._devices.values()):
            raise ValueError(f"another device already has IP {ip}")
        if active_mtu not in MTU_TO_ENUM:
            raise ValueError(f"active_mtu must be one of {sorted(MTU_TO_ENUM)}")
        guid = 0x02_00_5E_FF_FE_00_00_00 | (len(self._devices) + 1)
        link_local = ipaddress.IPv6Address((0xFE80 << 112) | guid)
        self._devices[name] = _Device(name, addr, (link_local, ipaddress.IPv6Address(gid_bytes(addr))), guid,
                                      active_mtu, max_qp_wr, max_cqe, max_inline_data, max_qp_rd_atom,
                                      memory_windows)  # fmt: skip

    def device_names(self) -> list[str]:
        return list(self._devices)

    def gid_for_ip(self, ip: str) -> GidEntry | None:
        """The RoCEv2 GID entry (port 1, index 1) of the device with this IP, or ``None``."""
        addr = ipaddress.ip_address(ip)
        for d in self._devices.values():
            if d.ip == addr:
                return GidEntry(d.name, 1, 1, d.gids[1], "RoCEv2", None)
        return None

    # the provider API -----------------------------------------------------
    def open_context(self, name: str | None = None) -> SimContext:
        """Open a device by name (the first one for ``None``); ``RDMAError(ENODEV)`` if unknown."""
        if not self._devices:
            raise RDMAError(errno.ENODEV, "ibv_get_device_list", "no RDMA device")
        dev = self._devices.get(name if name is not None else next(iter(self._devices)))
        if dev is None:
            raise RDMAError(errno.ENODEV, "ibv_open_device", f"no device {name!r} (have: {', '.join(self._devices)})")
        return SimContext(self, dev)

    def WCArray(self, n: int) -> SimWCArray:  # noqa: N802 - mirrors verbs.WCArray
        return SimWCArray(n)

    def live_objects(self) -> dict[str, int]:
        """Open objects per class and the registered bytes (a copy), like ``verbs.live_objects``."""
        return dict(self._accounts.live)

    def assert_no_live_objects(self) -> None:
        left = {k: v for k, v in self._accounts.live.items() if v}
        if left:
            raise AssertionError(f"simulated verbs objects still open: {left}")

    # fault knobs ----------------------------------------------------------
    def release_acks(self) -> int:
        """Queue every held send completion on its CQ, in order (held READs run now); returns how
        many.  Per-QP holds (:meth:`hold`) stay as they are."""
        return self._wire.release_acks()

    def hold(self, qp_num: int, *, acks: bool = False, recvs: bool = False, reads: bool = False) -> None:
        """Make one QP's traffic come late, in an order a NIC can produce, until :meth:`release`:

        * ``acks``: its successful send completions wait (the peer has the data; the ACK is late);
        * ``recvs``: its receive completions wait -- the data is placed in its buffers and ACKed
          (the sender's completion comes back), but the completion is late, so the sender may
          tell us on another channel (the TCP connection) before we see it;
        * ``reads``: its RDMA READs wait before they execute (a slow response): the responder
          may deregister, invalidate or destroy what they target first, and the READ then fails
          as it would on a NIC.  Completions of this QP after a held READ wait behind it.
        """
        self._wire.hold(qp_num, acks=acks, recvs=recvs, reads=reads)

    def release(self, qp_num: int | None = None) -> int:
        """End :meth:`hold` for one QP (``None``: all of them) and deliver what waited, in order
        (a held READ executes now); returns how many completions and READs were released."""
        return self._wire.release(qp_num)

    def kill_qp(self, qp_num: int) -> None:
        """The QP vanishes as its host would: traffic towards it fails with RETRY_EXC_ERR at the
        requester and it receives nothing any more.  Its own side (in this process) still
        gets what its teardown needs: its sends fail (RETRY_EXC_ERR), its receives flush."""
        self._wire.kill_qp(qp_num)

    def fail_next(self, qp_num: int, status: int) -> None:
        """The next work request this QP processes fails with ``status`` and the QP goes to ERROR.

        That is the next send WR it executes (it does not take effect and completes with
        ``status`` even if unsignaled) or the next receive WR that incoming traffic
        consumes (the requester then gets ``REM_OP_ERR``).
        """
        self._wire.fail_next(qp_num, status)

    def not_ready(self, qp_num: int) -> None:
        """The next message that comes to this QP (a send, or a write with immediate) finds no
        receive posted, whatever is posted: receiver not ready, retries exhausted -- the
        requester's work request fails with ``RNR_RETRY_EXC_ERR`` and its QP goes to ERROR (this
        QP stays as it is, as on a NIC: an RNR NAK does not break the responder)."""
        self._wire.not_ready(qp_num)

    def post_async_event(self, context_name: str, event_type: int, qp_num: int | None = None) -> None:
        """Make the async fd of the open contexts of that device readable with this event."""
        if context_name not in self._devices:
            raise ValueError(f"no device {context_name!r}")
        targets = [c for c in self._contexts if c.name == context_name]
        owner = [c for c in targets if qp_num is not None and qp_num in c._qps]
        for ctx in owner or targets:  # a QP's event goes to the context that owns the QP
            qp = ctx._qps.get(qp_num) if qp_num is not None else None
            ctx._post_event(event_type, qp=qp, qp_event=qp_num is not None)


class SimContext(_SimContextBase):
    """An opened simulated device; ``fileno()`` is the async-event fd (non-blocking)."""

    _kind = "contexts"
    _label = "context"

    def __init__(self, fabric: SimFabric, device: _Device) -> None:
        self._events = _ReadyQueue()
        super().__init__(fabric._accounts, ())
        self._fabric = fabric
        self._device = device
        self.name: str = device.name
        self.num_comp_vectors = 1
        self._qps = {}
        fabric._contexts.append(self)

    def __repr__(self) -> str:
        return f"<SimContext {self.name}{' closed' if self._closed else ''}>"

    def fileno(self) -> int:
        self._ensure_open("fileno")
        return self._events.fileno()

    @property
    def async_fd(self) -> int:
        return self.fileno()

    def query_device(self) -> DeviceAttr:
        self._ensure_open("ibv_query_device")
        d = self._device
        return DeviceAttr(d.node_guid, 1 << 40, 0xFFFFFF, 0, 1 << 16, d.max_qp_wr, _MAX_SGE, 1 << 16, d.max_cqe,
                          1 << 16, 1 << 16, d.max_qp_rd_atom, d.max_qp_rd_atom, 1, "0.0.0-sim")  # fmt: skip

    def query_port(self, port: int = 1) -> PortAttr:
        self._ensure_open("ibv_query_port")
        if port != 1:
            raise RDMAError(errno.EINVAL, "ibv_query_port", f"port {port}")
        return PortAttr(1, 4, "ACTIVE", self._device.active_mtu, 4096, _GID_TBL_LEN, 0, "Ethernet", 1 << 31)

    def query_gid(self, port: int = 1, index: int = 0) -> ipaddress.IPv6Address:
        self._ensure_open("ibv_query_gid")
        if port != 1 or not 0 <= index < _GID_TBL_LEN:
            raise RDMAError(errno.EINVAL, "ibv_query_gid", f"port {port} index {index}")
        gids = self._device.gids
        return gids[index] if index < len(gids) else ipaddress.IPv6Address(0)

    def query_gid_table(self) -> list[GidEntry]:
        self._ensure_open("ibv_query_gid_table")
        return [GidEntry(self.name, 1, i, g, "RoCEv2", None) for i, g in enumerate(self._device.gids)]

    def get_async_event(self) -> AsyncEvent | None:
        """Read one async event (non-blocking); ``None`` if none is pending."""
        self._ensure_open("ibv_get_async_event")
        got = self._events.pop(1)
        return got[0] if got else None

    def alloc_pd(self) -> SimProtectionDomain:
        return SimProtectionDomain(self)

    def create_comp_channel(self) -> SimCompletionChannel:
        return SimCompletionChannel(self)

    def create_cq(self, cqe: int = 256, channel: _o.CompletionChannel | None = None,
                  comp_vector: int = 0) -> SimCompletionQueue:  # fmt: skip
        if channel is not None and not isinstance(channel, SimCompletionChannel):
            raise foreign(channel, SimCompletionChannel, "ibv_create_cq")
        return SimCompletionQueue(self, cqe, channel)

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_close_device")
        self._events.close()
        self._fabric._contexts.remove(self)
        self._mark_closed()



class SimProtectionDomain(_SimDomainBase):
    _kind = "pds"
    _label = "protection domain"

    def __init__(self, context: SimContext) -> None:
        super().__init__(context._accounts, (context,))
        self._fabric = context._fabric
        self.context = context

    def reg_mr(self, length: int, access: int = DEFAULT_MR_ACCESS) -> SimMemoryRegion:
        """Allocate ``length`` bytes of page-aligned memory (anonymous mmap) and register it."""
        return SimMemoryRegion(self, self._fabric._memory, length, access)

    def reg_buffer(self, buffer: Any, access: int = DEFAULT_MR_ACCESS) -> SimMemoryRegion:
        """Register an existing writable buffer (kept exported until ``close()``)."""
        return SimMemoryRegion(self, self._fabric._memory, buffer, access)

    def alloc_mw(self) -> SimMemoryWindow:
        """A type 2 memory window (``RDMAError`` EOPNOTSUPP on a device made without them)."""
        if not self.context._device.memory_windows:
            raise RDMAError(errno.EOPNOTSUPP, "ibv_alloc_mw", "this device has no memory windows")
        return SimMemoryWindow(self, self._fabric._memory)

    def create_srq(self, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> SimSharedReceiveQueue:
        """``ibv_create_srq`` (see :mod:`._simsrq`: the rules it keeps)."""
        return SimSharedReceiveQueue(self, max_wr=max_wr, max_sge=max_sge, srq_limit=srq_limit)

    def create_qp(self, send_cq: _o.CompletionQueue, recv_cq: _o.CompletionQueue | None = None, *,
                  max_send_wr: int = 64, max_recv_wr: int = 64, max_send_sge: int = 1, max_recv_sge: int = 1,
                  max_inline_data: int = 0, sq_sig_all: bool = False,
                  srq: SimSharedReceiveQueue | None = None) -> SimQueuePair:  # fmt: skip
        if not isinstance(send_cq, SimCompletionQueue):
            raise foreign(send_cq, SimCompletionQueue, "ibv_create_qp")
        if recv_cq is not None and not isinstance(recv_cq, SimCompletionQueue):
            raise foreign(recv_cq, SimCompletionQueue, "ibv_create_qp")
        return SimQueuePair(self._fabric._wire, self, send_cq, recv_cq, max_send_wr=max_send_wr, max_recv_wr=max_recv_wr,
                            max_send_sge=max_send_sge, max_recv_sge=max_recv_sge,
                            max_inline_data=max_inline_data, sq_sig_all=sq_sig_all, srq=srq)  # fmt: skip

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_dealloc_pd")
        self._mark_closed()


if TYPE_CHECKING:  # mypy holds these objects to the interfaces the transport uses (aiordma._rdma.objects)

    def _held(ctx: SimContext, pd: SimProtectionDomain, mr: SimMemoryRegion, mw: SimMemoryWindow,
              channel: SimCompletionChannel, cq: SimCompletionQueue, wc: SimWCArray,
              qp: SimQueuePair) -> tuple[_o.Context, _o.Domain, _o.Region, _o.Window, _o.CompletionChannel,
              _o.CompletionQueue, _o.WorkCompletions, _o.QueuePair]:  # fmt: skip
        return ctx, pd, mr, mw, channel, cq, wc, qp

