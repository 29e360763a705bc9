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

* **Protection is enforced like a NIC's.**  An rkey reaches memory only through a QP of the
  region's protection domain, and a type 2 memory window's rkey only through the one QP that
  bound it, only while it is bound (``dealloc`` invalidates it) and only within its range and
  access; a QP's own access flags (``to_init``, ``set_access``) are checked first.  A refused
  access is ``REM_ACCESS_ERR`` at the requester and moves both QPs to ERROR, as on rxe.  A device
  may be made without memory windows (``add_device(memory_windows=False)``, as siw).

Not simulated: timing (no latency, bandwidth, timeouts or retransmission,
hence no PSN checks and no packets), path MTU segmentation, atomics, SRQs,
type 1 memory windows, multiple ports, UD QPs, and the cost of anything.  Everything
is deterministic (keys and QP numbers come from a seeded PRNG) and needs no
event loop; the objects are not thread-safe.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import mmap
import os
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from .._errors import PostError, RDMAError
from .._rdma.completions import CompletionArray, WorkCompletion
from .._rdma.lifetime import Resource, foreign
from .._rdma.constants import (
    DEFAULT_MR_ACCESS,
    DEFAULT_QP_ACCESS,
    INLINE,
    MTU_TO_ENUM,
    SIGNALED,
    SOLICITED,
    WC_WITH_IMM,
    Access,
    AsyncEvent,
    DeviceAttr,
    GidEntry,
    Opcode,
    PortAttr,
    QPCaps,
    QPState,
    SendWR,
    WCOpcode,
    WCStatus,
    event_type_name,
    gid_bytes,
)

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

_T = TypeVar("_T")


class _PyBuffer(ctypes.Structure):
    """``Py_buffer``: what ``PyObject_GetBuffer`` fills (the address of a read-only buffer, which
    ``ctypes.c_char.from_buffer`` refuses)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]  # fmt: skip


def _pin_readonly(obj: Any) -> tuple[_PyBuffer, int]:
    """A buffer export of ``obj`` (released by :func:`_unpin`) and its address."""
    view = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(obj), ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise TypeError("the object has no contiguous buffer")
    return view, int(view.buf or 0)


def _unpin(view: _PyBuffer) -> None:
    ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))
_LIVE_KEYS: Final = ("contexts", "pds", "mrs", "mws", "cqs", "channels", "qps", "registered_bytes")
_COUNTERS: Final = (
    "posts", "recv_posts", "polls", "polled", "req_notify", "events", "async_events",
    "completions", "errors", "rnr_errors", "bytes", "cq_overruns", "dropped",
)  # fmt: skip
#: ibv_event_type_str(), by event type
_EVENT_TEXT: Final = (
    "CQ error", "local work queue catastrophic error", "invalid request local work queue error",
    "local access violation work queue error", "communication established", "send queue drained",
    "path migrated", "path migration request error", "local catastrophic error", "port active",
    "port error", "LID change", "P_Key change", "SM change", "SRQ catastrophic error",
    "SRQ limit reached", "last WQE reached", "client reregistration", "GID table change", "WQ fatal",
)  # fmt: skip
_EVENT_KIND: Final = {0: "cq", 8: "device", 14: "srq", 15: "srq", 19: "wq"} | dict.fromkeys(
    (9, 10, 11, 12, 13, 17, 18), "port"
)
#: send WR opcode -> completion opcode
#: the send opcode of a BIND_MW (``IBV_WR_BIND_MW``; posted only through post_bind_mw)
_OP_BIND: Final = 8
_WC_OF: Final = {
    Opcode.RDMA_WRITE: WCOpcode.RDMA_WRITE,
    Opcode.RDMA_WRITE_WITH_IMM: WCOpcode.RDMA_WRITE,
    Opcode.SEND: WCOpcode.SEND,
    Opcode.SEND_WITH_IMM: WCOpcode.SEND,
    Opcode.RDMA_READ: WCOpcode.RDMA_READ,
}
_WC_OP: Final = {**{int(k): int(v) for k, v in _WC_OF.items()}, _OP_BIND: int(WCOpcode.BIND_MW)}
_MAX_SGE: Final = 32
_GID_TBL_LEN: Final = 16
_OK: Final = int(WCStatus.SUCCESS)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


# --------------------------------------------------------------------------
# Plumbing: readiness queues, completions, the resource base
# --------------------------------------------------------------------------


class _ReadyQueue(Generic[_T]):
    """A FIFO whose pipe read end is readable exactly while the FIFO is non-empty."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._items: deque[_T] = deque()

    def fileno(self) -> int:
        return self._r

    def push(self, item: _T) -> None:
        if not self._items:
            os.write(self._w, b"\x01")
        self._items.append(item)

    def pop(self, max_items: int) -> list[_T]:
        out: list[_T] = []
        while self._items and len(out) < max_items:
            out.append(self._items.popleft())
        if out and not self._items:
            try:
                os.read(self._r, 1)
            except BlockingIOError:  # pragma: no cover - someone else read it
                pass
        return out

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class _Completion:
    """A queued completion; ``qp``/``sq_seq`` let polling retire send-queue slots."""

    __slots__ = ("wr_id", "status", "opcode", "byte_len", "imm", "qp_num", "src_qp", "solicited", "qp", "sq_seq")

    def __init__(self, wr_id: int, status: int, opcode: int, byte_len: int, imm: int, qp_num: int, *,
                 src_qp: int = 0, solicited: bool = False, qp: SimQueuePair | None = None,
                 sq_seq: int = 0) -> None:  # fmt: skip
        self.wr_id, self.status, self.opcode, self.byte_len = wr_id, status, opcode, byte_len
        self.imm, self.qp_num, self.src_qp, self.solicited = imm, qp_num, src_qp, solicited
        self.qp, self.sq_seq = qp, sq_seq


#: a decoded completion: the same class as the native binding's (``_rdma/completions.py``)
SimWorkCompletion = WorkCompletion


class SimWCArray(CompletionArray):
    """The counterpart of ``verbs.WCArray``: ``cq.poll_into(arr)`` fills it."""

    def __init__(self, n: int) -> None:
        if n <= 0:
            raise ValueError("a WCArray needs at least one entry")
        self.n = n
        self._wc: list[_Completion | None] = [None] * n

    def _get(self, i: int) -> _Completion:
        c = self._wc[i]
        if c is None:
            raise IndexError(f"entry {i} was never filled")
        return c

    def __getitem__(self, i: int) -> WorkCompletion:
        c = self._get(i)
        imm = None if c.imm < 0 else c.imm
        return WorkCompletion(c.wr_id, c.status, c.opcode, c.byte_len, imm, c.qp_num, c.src_qp, 0,
                              0 if imm is None else WC_WITH_IMM)  # fmt: skip

    def entries(self, count: int) -> list[tuple[int, int, int, int, int, int]]:
        return [(c.wr_id, c.status, c.opcode, c.byte_len, c.imm, c.qp_num) for c in map(self._get, range(count))]


class _SimResource(Resource):
    """A simulated verbs object under the same lifetime rule as the native ones
    (:mod:`aiordma._rdma.lifetime`), counted in its fabric's ``live_objects()``."""

    def __init__(self, fabric: SimFabric, parents: Sequence[_SimResource]) -> None:
        super().__init__(parents)
        self._fabric = fabric
        fabric._live[self._kind] += 1

    def _counted(self, kind: str, delta: int) -> None:
        self._fabric._live[kind] += delta


# --------------------------------------------------------------------------
# The fabric
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Device:
    name: str
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    gids: tuple[ipaddress.IPv6Address, ipaddress.IPv6Address]  # index 0 link-local, 1 from the IP
    node_guid: int
    active_mtu: int
    max_qp_wr: int
    max_cqe: int
    max_inline_data: int
    max_qp_rd_atom: int
    memory_windows: bool = True


class SimFabric:
    """A simulated RDMA fabric: devices, and the RC wire between their QPs (the "verbs provider").

    Fault knobs: :attr:`hold_acks` / :meth:`release_acks` (and :attr:`flush_held_on_error`), :meth:`hold` /
    :meth:`release` (one QP's late ACKs, late receive completions, slow READs), :meth:`kill_qp`,
    :meth:`fail_next`, :meth:`not_ready`, :meth:`post_async_event`.  :attr:`counters` counts
    posts, polls, events and errors for tests and benchmarks.
    """

    def __init__(self, *, seed: int = 0) -> None:
        #: when True, successful send-queue completions wait for :meth:`release_acks`
        self.hold_acks: bool = False
        #: when True, a QP moved to ERROR flushes its held send completions (WR_FLUSH_ERR), as a
        #: NIC does with work requests whose ACKs never came: with ``hold_acks``, a silent peer
        self.flush_held_on_error: bool = False
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._rng = random.Random(seed)
        self._devices: dict[str, _Device] = {}
        self._contexts: list[SimContext] = []
        self._qps: dict[int, SimQueuePair] = {}
        self._issued: set[int] = set()  # every QP number and key ever handed out (never reused)
        self._by_lkey: dict[int, SimMemoryRegion] = {}
        self._by_rkey: dict[int, SimMemoryRegion] = {}
        self._mw_by_rkey: dict[int, SimMemoryWindow] = {}  # bound windows, by their current rkey
        #: held send-side items in order: completions (late ACKs) and RDMA READs not executed yet
        self._held: list[tuple[SimQueuePair, _Completion | _Work]] = []
        self._held_recvs: list[tuple[SimQueuePair, _Completion]] = []  # late receive completions
        self._holds: dict[int, frozenset[str]] = {}  # qp_num -> what is held for it (see hold())
        self._killed: set[int] = set()
        self._recorders: dict[int, SimQueuePair] = {}  # native-path chan address -> its QP (record mode)
        self._fail_next: dict[int, int] = {}
        self._not_ready: set[int] = set()  # QPs whose next incoming message finds no receive
        self._live: dict[str, int] = dict.fromkeys(_LIVE_KEYS, 0)

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
        return dict(self._live)

    def assert_no_live_objects(self) -> None:
        left = {k: v for k, v in self._live.items() if v}
        if left:
            raise AssertionError(f"simulated verbs objects still open: {left}")

    # fault knobs ----------------------------------------------------------
    def release_acks(self) -> int:
        """Queue every held send completion on its CQ, in order (held READs run now); returns how
        many.  Per-QP holds (:meth:`hold`) stay as they are."""
        held, self._held = self._held, []
        for qp, _item in held:
            qp._held = 0
        for qp, item in held:
            qp._release_item(item)
        return len(held)

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
        what = {name for name, on in (("acks", acks), ("recvs", recvs), ("reads", reads)) if on}
        self._holds[qp_num] = self._holds.get(qp_num, frozenset()) | what

    def release(self, qp_num: int | None = None) -> int:
        """End :meth:`hold` for one QP (``None``: all of them) and deliver what waited, in order
        (a held READ executes now); returns how many completions and READs were released."""
        if qp_num is None:
            self._holds.clear()
        else:
            self._holds.pop(qp_num, None)
        mine = [(q, i) for q, i in self._held if qp_num is None or q.qp_num == qp_num]
        self._held = [(q, i) for q, i in self._held if not (qp_num is None or q.qp_num == qp_num)]
        recvs = [(q, c) for q, c in self._held_recvs if qp_num is None or q.qp_num == qp_num]
        self._held_recvs = [(q, c) for q, c in self._held_recvs if not (qp_num is None or q.qp_num == qp_num)]
        for qp, _item in mine:
            qp._held = 0
        for qp, _c in recvs:
            qp._held_recvs = 0
        for qp, item in mine:
            qp._release_item(item)
        for qp, c in recvs:
            if not qp.closed:
                qp.recv_cq._push(c)
        return len(mine) + len(recvs)

    def _holding(self, qp: SimQueuePair, what: str) -> bool:
        held = self._holds.get(qp.qp_num)
        return held is not None and what in held

    def kill_qp(self, qp_num: int) -> None:
        """The QP vanishes as its host would: traffic towards it fails with RETRY_EXC_ERR at the
        requester and it receives nothing any more.  Its own side (in this process) still
        gets what its teardown needs: its sends fail (RETRY_EXC_ERR), its receives flush."""
        self._killed.add(qp_num)
        qp = self._qps.get(qp_num)
        if qp is not None and qp._held:
            self._held = [(q, c) for q, c in self._held if q is not qp]
            qp._held = 0
        if qp is not None and qp._held_recvs:
            self._held_recvs = [(q, c) for q, c in self._held_recvs if q is not qp]
            qp._held_recvs = 0

    def fail_next(self, qp_num: int, status: int) -> None:
        """The next work request this QP processes fails with ``status`` and the QP goes to ERROR.

        That is the next send WR it executes (it does not take effect and completes with
        ``status`` even if unsignaled) or the next receive WR that incoming traffic
        consumes (the requester then gets ``REM_OP_ERR``).
        """
        if int(status) == _OK:
            raise ValueError("fail_next needs an error status")
        self._fail_next[qp_num] = int(status)

    def not_ready(self, qp_num: int) -> None:
        """The next message that comes to this QP (a send, or a write with immediate) finds no
        receive posted, whatever is posted: receiver not ready, retries exhausted -- the
        requester's work request fails with ``RNR_RETRY_EXC_ERR`` and its QP goes to ERROR (this
        QP stays as it is, as on a NIC: an RNR NAK does not break the responder)."""
        self._not_ready.add(qp_num)

    def post_async_event(self, context_name: str, event_type: int, qp_num: int | None = None) -> None:
        """Make the async fd of the open contexts of that device readable with this event."""
        if context_name not in self._devices:
            raise ValueError(f"no device {context_name!r}")
        targets = [c for c in self._contexts if c.name == context_name]
        owner = [c for c in targets if qp_num is not None and qp_num in c._qps]
        for ctx in owner or targets:  # a QP's event goes to the context that owns the QP
            qp = ctx._qps.get(qp_num) if qp_num is not None else None
            ctx._post_event(event_type, qp=qp, qp_event=qp_num is not None)

    # internals ------------------------------------------------------------
    def _new_id(self, lo: int, hi: int) -> int:
        while True:
            v = self._rng.randrange(lo, hi)
            if v not in self._issued:
                self._issued.add(v)
                return v

    def _local_ok(self, pd: SimProtectionDomain, lkey: int, addr: int, length: int, write: bool) -> bool:
        mr = self._by_lkey.get(lkey)
        return (mr is not None and mr.pd is pd and (not write or bool(mr.access & Access.LOCAL_WRITE))
                and mr.addr <= addr and addr + length <= mr.addr + mr.length)  # fmt: skip

    def _remote_ok(self, qp: SimQueuePair, rkey: int, addr: int, length: int, need: int) -> bool:
        """Whether ``rkey`` lets a peer reach ``[addr, addr + length)`` with ``need`` through ``qp``:
        a region of its PD with that access, or a window bound to ``qp`` itself."""
        mr = self._by_rkey.get(rkey)
        if mr is not None:
            return (mr.pd is qp.pd and bool(mr.access & need)
                    and mr.addr <= addr and addr + length <= mr.addr + mr.length)  # fmt: skip
        mw = self._mw_by_rkey.get(rkey)
        if mw is None or mw._bound is None:
            return False
        bqp, mr, start, size, access = mw._bound
        return (bqp is qp and mw.pd is qp.pd and not mr.closed and bool(access & need)
                and start <= addr and addr + length <= start + size)  # fmt: skip

    def _registered(self, addr: int, length: int) -> bool:
        return any(m.addr <= addr and addr + length <= m.addr + m.length for m in self._by_lkey.values())

    def _route(self, qp: SimQueuePair) -> SimQueuePair | None:
        """The responder QP a requester's packets reach, or ``None`` (they are lost)."""
        peer = self._qps.get(qp._dest_qp_num)
        if peer is None or peer.qp_num in self._killed or peer._state not in (QPState.RTR, QPState.RTS):
            return None
        if qp._dgid not in (g.packed for g in peer.context._device.gids):
            return None
        return peer

    def _deliver_send(self, qp: SimQueuePair, c: _Completion) -> None:
        # FIFO per send queue: once one is held, everything after it waits behind it
        if ((self.hold_acks or self._holding(qp, "acks")) and c.status == _OK) or qp._held:
            self._held.append((qp, c))
            qp._held += 1
        else:
            qp.send_cq._push(c)

    def _deliver_recv(self, qp: SimQueuePair, c: _Completion) -> None:
        if qp._held_recvs or (self._holding(qp, "recvs") and c.status == _OK):
            self._held_recvs.append((qp, c))
            qp._held_recvs += 1
        else:
            qp.recv_cq._push(c)


# --------------------------------------------------------------------------
# Context, PD, MR
# --------------------------------------------------------------------------


class SimContext(_SimResource):
    """An opened simulated device; ``fileno()`` is the async-event fd (non-blocking)."""

    _kind = "contexts"
    _label = "context"

    def __init__(self, fabric: SimFabric, device: _Device) -> None:
        self._events: _ReadyQueue[AsyncEvent] = _ReadyQueue()
        super().__init__(fabric, ())
        self._device = device
        self.name: str = device.name
        self.num_comp_vectors = 1
        self._qps: dict[int, SimQueuePair] = {}
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

    def _post_event(self, etype: int, *, qp: SimQueuePair | None = None, cq: SimCompletionQueue | None = None,
                    qp_event: bool = False) -> None:  # fmt: skip
        kind = "qp" if qp_event or qp is not None else _EVENT_KIND.get(etype, "qp")
        text = _EVENT_TEXT[etype] if 0 <= etype < len(_EVENT_TEXT) else "unknown"
        self._events.push(AsyncEvent(etype, event_type_name(etype), text, kind, qp=qp, cq=cq,
                                     port=1 if kind == "port" else None))  # fmt: skip
        self._fabric.counters["async_events"] += 1

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


class SimProtectionDomain(_SimResource):
    _kind = "pds"
    _label = "protection domain"

    def __init__(self, context: SimContext) -> None:
        super().__init__(context._fabric, (context,))
        self.context = context

    def reg_mr(self, length: int, access: int = DEFAULT_MR_ACCESS) -> SimMemoryRegion:
        """Allocate ``length`` bytes of page-aligned memory (anonymous mmap) and register it."""
        return SimMemoryRegion(self, length, access)

    def reg_buffer(self, buffer: Any, access: int = DEFAULT_MR_ACCESS) -> SimMemoryRegion:
        """Register an existing writable buffer (kept exported until ``close()``)."""
        return SimMemoryRegion(self, buffer, access)

    def alloc_mw(self) -> SimMemoryWindow:
        """A type 2 memory window (``RDMAError`` EOPNOTSUPP on a device made without them)."""
        if not self.context._device.memory_windows:
            raise RDMAError(errno.EOPNOTSUPP, "ibv_alloc_mw", "this device has no memory windows")
        return SimMemoryWindow(self)

    def create_qp(self, send_cq: _o.CompletionQueue, recv_cq: _o.CompletionQueue | None = None, *,
                  max_send_wr: int = 64, max_recv_wr: int = 64, max_send_sge: int = 1, max_recv_sge: int = 1,
                  max_inline_data: int = 0, sq_sig_all: bool = False) -> SimQueuePair:  # fmt: skip
        if not isinstance(send_cq, SimCompletionQueue):
            raise foreign(send_cq, SimCompletionQueue, "ibv_create_qp")
        if recv_cq is not None and not isinstance(recv_cq, SimCompletionQueue):
            raise foreign(recv_cq, SimCompletionQueue, "ibv_create_qp")
        return SimQueuePair(self, send_cq, recv_cq, max_send_wr=max_send_wr, max_recv_wr=max_recv_wr,
                            max_send_sge=max_send_sge, max_recv_sge=max_recv_sge,
                            max_inline_data=max_inline_data, sq_sig_all=sq_sig_all)  # fmt: skip

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_dealloc_pd")
        self._mark_closed()


class SimMemoryRegion(_SimResource):
    """A registered region of real memory: ``addr`` is its address in this process."""

    _kind = "mrs"
    _label = "memory region"

    def __init__(self, pd: SimProtectionDomain, length_or_buffer: int | Any, access: int = DEFAULT_MR_ACCESS) -> None:
        pd._ensure_open("ibv_reg_mr")
        access = int(access)
        if access & (Access.REMOTE_WRITE | Access.REMOTE_ATOMIC) and not access & Access.LOCAL_WRITE:
            raise RDMAError(errno.EINVAL, "ibv_reg_mr", "remote write access needs LOCAL_WRITE")
        self._mmap: mmap.mmap | None = None
        if isinstance(length_or_buffer, int):
            if length_or_buffer <= 0:
                raise ValueError("a memory region needs a positive length")
            page = mmap.PAGESIZE
            self._mmap = mmap.mmap(-1, (length_or_buffer + page - 1) // page * page)
            self.buffer: Any = self._mmap
            length = length_or_buffer
        else:
            self.buffer = length_or_buffer
            length = memoryview(length_or_buffer).nbytes
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
            del cobj  # release its export: only ours keeps the buffer pinned
        self._export: memoryview | None = export
        super().__init__(pd._fabric, (pd,))
        fab = self._fabric
        self.pd = pd
        self.length: int = length
        self.lkey: int = fab._new_id(1, 1 << 32)
        self.rkey: int = fab._new_id(1, 1 << 32)
        self.access = access
        fab._by_lkey[self.lkey] = fab._by_rkey[self.rkey] = self
        fab._live["registered_bytes"] += length

    def __repr__(self) -> str:
        return f"<SimMemoryRegion addr=0x{self.addr:x} len={self.length} lkey=0x{self.lkey:x} rkey=0x{self.rkey:x}>"

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable memoryview of part of the region; release it when done."""
        self._ensure_open("view")
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
        if self._closed:
            return
        fab = self._fabric
        del fab._by_lkey[self.lkey], fab._by_rkey[self.rkey]
        if getattr(self, "_pinned", None) is not None:
            _unpin(self._pinned)
            self._pinned = None
        if self._export is not None:
            self._export.release()
            self._export = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still out: the mapping goes when it is released
            self._mmap = None
        self.buffer = None
        fab._live["registered_bytes"] -= self.length
        self._mark_closed()


class SimMemoryWindow(_SimResource):
    """A type 2 memory window: ``SimQueuePair.post_bind_mw`` binds it (to that QP); ``close()``
    (dealloc) invalidates it at once."""

    _kind = "mws"
    _label = "memory window"

    def __init__(self, pd: SimProtectionDomain) -> None:
        pd._ensure_open("ibv_alloc_mw")
        super().__init__(pd._fabric, (pd,))
        self.pd = pd
        self.rkey: int = (self._fabric._new_id(1, 1 << 24) << 8) | 1
        #: (qp, mr, addr, length, access) while bound
        self._bound: tuple[SimQueuePair, SimMemoryRegion, int, int, int] | None = None

    def __repr__(self) -> str:
        return f"<SimMemoryWindow rkey=0x{self.rkey:x}{' bound' if self._bound else ''}>"

    def _unbind(self) -> None:
        if self._bound is not None:
            self._fabric._mw_by_rkey.pop(self.rkey, None)
            self._bound = None

    def close(self) -> None:
        if self._closed:
            return
        self._unbind()
        self._mark_closed()


# --------------------------------------------------------------------------
# Completion channel and CQ
# --------------------------------------------------------------------------


class SimCompletionChannel(_SimResource):
    """``fileno()`` becomes readable when an armed CQ on this channel gets a qualifying completion."""

    _kind = "channels"
    _label = "completion channel"

    def __init__(self, context: SimContext) -> None:
        context._ensure_open("ibv_create_comp_channel")
        self._ready: _ReadyQueue[SimCompletionQueue] = _ReadyQueue()
        super().__init__(context._fabric, (context,))
        self.context = context

    def fileno(self) -> int:
        self._ensure_open("fileno")
        return self._ready.fileno()

    def drain_events(self, max_events: int = 64) -> int:
        """Read and acknowledge pending events; returns how many (0 if none)."""
        self._ensure_open("ibv_get_cq_event")
        return len(self._ready.pop(max_events))

    def drain_events_per_cq(self, max_events: int = 64) -> dict[SimCompletionQueue, int]:
        self._ensure_open("ibv_get_cq_event")
        out: dict[SimCompletionQueue, int] = {}
        for cq in self._ready.pop(max_events):
            out[cq] = out.get(cq, 0) + 1
        return out

    def _signal(self, cq: SimCompletionQueue) -> None:
        self._ready.push(cq)
        self._fabric.counters["events"] += 1

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_destroy_comp_channel")
        self._ready.close()
        self._mark_closed()


class SimCompletionQueue(_SimResource):
    """A CQ of exactly ``cqe`` entries (as rxe grants); see :meth:`_push` for overrun."""

    _kind = "cqs"
    _label = "completion queue"

    def __init__(self, context: SimContext, cqe: int = 256, channel: SimCompletionChannel | None = None) -> None:
        context._ensure_open("ibv_create_cq")
        if not 1 <= cqe <= context._device.max_cqe:
            raise RDMAError(errno.EINVAL, "ibv_create_cq", f"cqe={cqe} (device max {context._device.max_cqe})")
        super().__init__(context._fabric, (context, channel) if channel else (context,))
        self.context = context
        self.channel = channel
        self.cqe: int = cqe
        self.overrun = False
        self._queue: deque[_Completion] = deque()
        self._armed = 0  # 0: not armed, 1: solicited only, 2: any completion
        self._scratch = SimWCArray(16)

    def __repr__(self) -> str:
        return f"<SimCompletionQueue cqe={self.cqe} queued={len(self._queue)}>"

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm once: the next qualifying completion *from now on* writes one channel event."""
        self._ensure_open("ibv_req_notify_cq")
        self._armed = max(self._armed, 1 if solicited_only else 2)
        self._fabric.counters["req_notify"] += 1

    def poll_into(self, arr: _o.WorkCompletions, max_entries: int | None = None) -> int:
        """Move up to ``max_entries`` (default ``len(arr)``) completions into ``arr``; returns the count.

        Polling a send completion frees its send-queue slot and those of the
        unsignaled WRs before it.
        """
        if not isinstance(arr, SimWCArray):
            raise foreign(arr, SimWCArray, "ibv_poll_cq")
        self._ensure_open("ibv_poll_cq")
        n = arr.n if max_entries is None else min(max_entries, arr.n)
        q, slots, count = self._queue, arr._wc, 0
        while count < n and q:
            c = slots[count] = q.popleft()
            count += 1
            if c.qp is not None and c.sq_seq > c.qp._sq_retired:
                c.qp._sq_retired = c.sq_seq
        self._fabric.counters["polls"] += 1
        self._fabric.counters["polled"] += count
        return count

    def poll_spin_into(self, arr: SimWCArray, spin_ns: int, max_entries: int | None = None) -> int:
        """Same as :meth:`poll_into`: nothing can arrive while spinning, the wire is synchronous."""
        return self.poll_into(arr, max_entries)

    def native_waker(self, channel: _o.CompletionChannel | None) -> Callable[..., int]:
        """``aiordma_wake``'s contract over this CQ: the completions are polled here, and
        processed by the native module's own C (``aiordma_chan_process``), as on a device."""
        if channel is not None and not isinstance(channel, SimCompletionChannel):
            raise foreign(channel, SimCompletionChannel, "aiordma_wake")
        from aiordma._rdma.fastpath import native_lib

        native = native_lib()
        if native is None:  # pragma: no cover - the provider offers no native path then
            raise RuntimeError("the native module is not built")
        ffi, lib = native
        raw = ffi.new("struct aiordma_wc[]", 32)
        used = ffi.new("uint64_t *")
        n_others = ffi.new("int *")
        with_imm = int(lib.IBV_WC_WITH_IMM)
        fabric = self._fabric

        def wake(read_event: int, arm: int, spin_ns: int, max_polled: int, chans: Any, nchans: int, others: Any,
                 others_cap: int, out: Any, out_cap: int, stamp: int, deliv: Any, deliv_cap: int, res: Any) -> int:  # fmt: skip
            res.events_read = res.polled = res.others = res.armed = res.more = res.err = 0
            res.deliv_used = res.spun_ns = 0
            if read_event and channel is not None:
                res.events_read = channel.drain_events(1)
            used[0] = 0
            n_others[0] = 0
            n_out = 0
            armed = False
            queue = self._queue
            while True:
                want = min(max_polled - res.polled, 32)
                if want <= 0:
                    res.more = 1
                    break
                got = 0
                while got < want and queue:
                    c = queue.popleft()
                    if c.qp is not None and c.sq_seq > c.qp._sq_retired:
                        c.qp._sq_retired = c.sq_seq
                    w = raw[got]
                    w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num = c.wr_id, c.status, c.opcode, c.byte_len, c.qp_num
                    w.src_qp, w.vendor_err = c.src_qp, 0
                    if c.imm >= 0:
                        w.imm_data, w.wc_flags = c.imm, with_imm
                    else:
                        w.imm_data, w.wc_flags = 0, 0
                    got += 1
                fabric.counters["polls"] += 1
                fabric.counters["polled"] += got
                if got:
                    res.polled += got
                    n_out = lib.aiordma_chan_process(chans, nchans, raw, got, out, out_cap, n_out, stamp, deliv,
                                                     deliv_cap, used, others, others_cap, n_others)  # fmt: skip
                    continue
                if arm and not armed:
                    self.req_notify(arm == 1)
                    armed = True
                    res.armed = 1
                    continue
                break
            res.others = n_others[0]
            res.deliv_used = used[0]
            lib.aiordma_chan_finish(chans, nchans, out, n_out)
            recorders = fabric._recorders
            for i in range(n_out):
                chan = chans[out[i].cid]
                if chan != ffi.NULL:
                    qp = recorders.get(int(ffi.cast("uintptr_t", chan)))
                    if qp is not None:
                        qp.post_records(chan)
            return n_out

        return wake

    def poll(self, max_entries: int = 16) -> list[SimWorkCompletion]:
        arr = self._scratch if max_entries <= self._scratch.n else SimWCArray(max_entries)
        return arr.decode(self.poll_into(arr, max_entries))

    def _push(self, c: _Completion) -> None:
        counters = self._fabric.counters
        if self.overrun:
            counters["dropped"] += 1
            return
        if len(self._queue) >= self.cqe:
            # overrun: the entry is lost, the CQ is in error, and so is every QP on it
            self.overrun = True
            counters["dropped"] += 1
            counters["cq_overruns"] += 1
            self.context._post_event(0, cq=self)
            for child in list(self._children):
                if isinstance(child, SimQueuePair):
                    child._enter_error()
            return
        self._queue.append(c)
        counters["completions"] += 1
        if c.status != _OK:
            counters["errors"] += 1
        if self._armed == 2 or (self._armed == 1 and c.solicited):
            self._armed = 0
            if self.channel is not None:
                self.channel._signal(self)

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_destroy_cq")
        self._queue.clear()
        self._mark_closed()


# --------------------------------------------------------------------------
# Queue pairs and the wire
# --------------------------------------------------------------------------


class _Endpoint(Protocol):
    qp_num: int
    gid: ipaddress.IPv6Address
    psn: int


class _Work:
    """One executing send WR."""

    __slots__ = ("op", "wr_id", "addr", "length", "lkey", "raddr", "rkey", "imm", "signaled", "solicited",
                 "data", "seq")  # fmt: skip

    def __init__(self, op: int, wr_id: int, addr: int, length: int, lkey: int, raddr: int, rkey: int, imm: int,
                 signaled: bool, solicited: bool, data: bytes | None, seq: int) -> None:  # fmt: skip
        self.op, self.wr_id, self.addr, self.length, self.lkey = op, wr_id, addr, length, lkey
        self.raddr, self.rkey, self.imm, self.signaled, self.solicited = raddr, rkey, imm, signaled, solicited
        self.data, self.seq = data, seq

    def copy_to(self, dst: int) -> None:
        """Copy the WR's payload (inline bytes or from ``addr``) to ``dst``."""
        if self.length:
            ctypes.memmove(dst, self.data if self.data is not None else self.addr, self.length)


class SimQueuePair(_SimResource):
    """A simulated RC queue pair: ``to_init`` / ``to_rtr`` / ``to_rts``, then post."""

    _kind = "qps"
    _label = "queue pair"

    def __init__(self, pd: SimProtectionDomain, send_cq: SimCompletionQueue, recv_cq: SimCompletionQueue | None,
                 *, max_send_wr: int = 64, max_recv_wr: int = 64, max_send_sge: int = 1, max_recv_sge: int = 1,
                 max_inline_data: int = 0, sq_sig_all: bool = False) -> None:  # fmt: skip
        recv_cq = recv_cq or send_cq
        for obj in (pd, send_cq, recv_cq):
            obj._ensure_open("ibv_create_qp")
        dev = pd.context._device
        asked = f"RC max_send_wr={max_send_wr} max_recv_wr={max_recv_wr} max_inline_data={max_inline_data}"
        if (send_cq.context is not pd.context or recv_cq.context is not pd.context
                or not (0 <= max_send_wr <= dev.max_qp_wr and 0 <= max_recv_wr <= dev.max_qp_wr)
                or not (0 <= max_send_sge <= _MAX_SGE and 0 <= max_recv_sge <= _MAX_SGE)
                or not 0 <= max_inline_data <= dev.max_inline_data):  # fmt: skip
            raise RDMAError(errno.EINVAL, "ibv_create_qp", asked)
        super().__init__(pd._fabric, (pd, send_cq) if recv_cq is send_cq else (pd, send_cq, recv_cq))
        fab = self._fabric
        self.pd, self.context, self.send_cq, self.recv_cq = pd, pd.context, send_cq, recv_cq
        self.caps = QPCaps(min(_pow2(max_send_wr), dev.max_qp_wr), min(_pow2(max_recv_wr), dev.max_qp_wr),
                           max_send_sge, max_recv_sge, max_inline_data)  # fmt: skip
        self.qp_num: int = fab._new_id(2, 1 << 24)
        self.port_num = 1
        self._sq_sig_all = sq_sig_all
        self._state = QPState.RESET
        self._access = 0
        self._dest_qp_num = 0
        self._dgid = b""
        self._recvs: deque[tuple[int, int, int, int]] = deque()  # (wr_id, addr, length, lkey)
        self._sq_posted = 0  # sequence number of the last send WR posted
        self._sq_retired = 0  # ... and of the last one whose slot a polled completion freed
        self._held = 0  # completions (and READs) of ours in fabric._held
        self._held_recvs = 0  # receive completions of ours in fabric._held_recvs
        fab._qps[self.qp_num] = self
        self.context._qps[self.qp_num] = self

    def __repr__(self) -> str:
        return f"<SimQueuePair qp_num={self.qp_num} {self._state.name}{' closed' if self._closed else ''}>"

    # state transitions ----------------------------------------------------
    @property
    def state(self) -> QPState:
        self._ensure_open("ibv_query_qp")
        return self._state

    def _transition(self, call: str, frm: QPState, to: QPState) -> None:
        self._ensure_open(call)
        if self._state != frm:
            raise RDMAError(errno.EINVAL, call, f"the QP is in {self._state.name}, not {frm.name}")
        self._state = to

    def to_init(self, port_num: int = 1, pkey_index: int = 0, access: int = DEFAULT_QP_ACCESS) -> None:
        self._ensure_open("ibv_modify_qp(INIT)")
        if port_num != 1 or pkey_index != 0:
            raise RDMAError(errno.EINVAL, "ibv_modify_qp(INIT)", f"port {port_num} pkey_index {pkey_index}")
        self._transition("ibv_modify_qp(INIT)", QPState.RESET, QPState.INIT)
        self._access = int(access)

    def to_rtr(self, dest_qp_num: int, dgid: str | bytes | ipaddress.IPv4Address | ipaddress.IPv6Address, *,
               sgid_index: int, rq_psn: int = 0, path_mtu: int = 1024, port_num: int | None = None,
               max_dest_rd_atomic: int = 1, min_rnr_timer: int = 12, **ignored: Any) -> None:  # fmt: skip
        """INIT -> RTR towards the remote QP; a ``dgid`` no device has comes up but reaches nobody."""
        if path_mtu not in MTU_TO_ENUM:
            raise ValueError(f"path_mtu must be one of {sorted(MTU_TO_ENUM)} (bytes), got {path_mtu}")
        call = "ibv_modify_qp(RTR)"
        self._ensure_open(call)
        gid = gid_bytes(dgid)
        if not 0 <= sgid_index < len(self.context._device.gids) or port_num not in (None, 1):
            raise RDMAError(errno.EINVAL, call, f"sgid_index={sgid_index} port_num={port_num}")
        self._transition(call, QPState.INIT, QPState.RTR)
        self._dest_qp_num, self._dgid = dest_qp_num, gid

    def to_rts(self, sq_psn: int = 0, *, timeout: int = 14, retry_cnt: int = 6, rnr_retry: int = 6,
               max_rd_atomic: int = 1) -> None:  # fmt: skip
        if not (0 <= retry_cnt <= 7 and 0 <= rnr_retry <= 7):
            raise ValueError("retry_cnt and rnr_retry are 0..7")
        self._transition("ibv_modify_qp(RTS)", QPState.RTR, QPState.RTS)

    def connect(self, remote: _Endpoint, *, sgid_index: int, sq_psn: int = 0, port_num: int = 1,
                path_mtu: int = 1024, access: int = DEFAULT_QP_ACCESS, rtr: dict[str, Any] | None = None,
                rts: dict[str, Any] | None = None) -> None:  # fmt: skip
        """RESET -> INIT -> RTR -> RTS in one call (``remote``: qp_num, gid, psn)."""
        self.to_init(port_num, access=access)
        self.to_rtr(remote.qp_num, remote.gid, sgid_index=sgid_index, rq_psn=remote.psn, path_mtu=path_mtu,
                    **(rtr or {}))  # fmt: skip
        self.to_rts(sq_psn, **(rts or {}))

    def to_error(self) -> None:
        """Move to ERROR: posted receives complete with WR_FLUSH_ERR; held send completions stay held.

        From RESET this is a silent no-op, as with the native binding.
        """
        self._ensure_open("ibv_modify_qp(ERR)")
        if self._state != QPState.RESET:
            self._enter_error()

    def to_reset(self) -> None:
        """Back to RESET: posted receives are discarded without completions."""
        self._ensure_open("ibv_modify_qp(RESET)")
        self._state = QPState.RESET
        self._recvs.clear()
        self._sq_retired = self._sq_posted

    def _enter_error(self) -> None:
        if self._state == QPState.ERR:
            return
        self._state = QPState.ERR
        fab = self._fabric
        if fab.flush_held_on_error and self._held:
            mine = [c for q, c in fab._held if q is self]
            fab._held = [(q, c) for q, c in fab._held if q is not self]
            self._held = 0
            for item in mine:
                if isinstance(item, _Work):
                    self._send_done(item, WCStatus.WR_FLUSH_ERR)
                else:
                    item.status = WCStatus.WR_FLUSH_ERR
                    self.send_cq._push(item)
        recvs, self._recvs = self._recvs, deque()
        for wr_id, _addr, _len, _lkey in recvs:
            self._recv_done(wr_id, WCStatus.WR_FLUSH_ERR)

    # posting --------------------------------------------------------------
    def post_recv(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self.post_recv_one(addr, length, lkey, wr_id)

    def post_recv_one(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self._ensure_open("ibv_post_recv")
        err = self._post_recv(wr_id, addr, length, lkey)
        if err:
            raise PostError(err, "ibv_post_recv", 0, 1)

    def post_recv_batch(self, addrs: Sequence[int], lens: Sequence[int], lkey: int, wr_ids: Sequence[int]) -> None:
        """Post receive buffers (same ``lkey``); :class:`PostError` says how many were posted."""
        self._ensure_open("ibv_post_recv")
        n = len(addrs)
        if not (len(lens) == len(wr_ids) == n):
            raise ValueError("addrs, lens and wr_ids must have the same length")
        for i in range(n):
            err = self._post_recv(wr_ids[i], addrs[i], lens[i], lkey)
            if err:
                raise PostError(err, "ibv_post_recv", i, n)

    def post_send_imm(self, wr_id: int, addr: int, length: int, lkey: int, imm_data: int, flags: int) -> None:
        """One SEND_WITH_IMM; ``flags`` is an int of SIGNALED | SOLICITED | INLINE bits."""
        if isinstance(flags, bool):
            raise TypeError("post_send_imm takes flags (SIGNALED | SOLICITED | INLINE bits), not a bool")
        self._ensure_open("ibv_post_send")
        err = self._post_send(Opcode.SEND_WITH_IMM, wr_id, addr, length, lkey, 0, 0, _imm(imm_data), flags)
        if err:
            raise PostError(err, "ibv_post_send", 0, 1)

    def post_send(self, wr: SendWR) -> None:
        self.post_send_batch((wr,))

    def set_access(self, access: int) -> None:
        """What the peer may do on this QP from now on (in RTR or RTS)."""
        self._ensure_open("ibv_modify_qp(access)")
        if self._state not in (QPState.INIT, QPState.RTR, QPState.RTS):
            raise RDMAError(errno.EINVAL, "ibv_modify_qp(access)", f"the QP is in {self._state.name}")
        self._access = int(access)

    def post_bind_mw(self, wr_id: int, mw: _o.Window, mr: _o.Region, addr: int, length: int,
                     access: int, signaled: bool = True) -> int:  # fmt: skip
        """A BIND_MW work request (executed in send-queue order): ``mw`` grants ``access`` to
        ``[addr, addr + length)`` of ``mr`` through this QP only.  Returns its new rkey.  A bind
        the rules refuse completes with ``MW_BIND_ERR`` (and the QP goes to ERROR)."""
        if not isinstance(mw, SimMemoryWindow):
            raise foreign(mw, SimMemoryWindow, "ibv_post_send(BIND_MW)")
        if not isinstance(mr, SimMemoryRegion):
            raise foreign(mr, SimMemoryRegion, "ibv_post_send(BIND_MW)")
        self._ensure_open("ibv_post_send")
        if self._state not in (QPState.RTS, QPState.ERR):
            raise PostError(errno.EINVAL, "ibv_post_send(BIND_MW)", 0, 1)
        if self._sq_posted - self._sq_retired >= self.caps.max_send_wr:
            raise PostError(errno.ENOMEM, "ibv_post_send(BIND_MW)", 0, 1)
        rkey = (mw.rkey & 0xFFFFFF00) | ((mw.rkey + 1) & 0xFF)
        self._sq_posted += 1
        self._fabric.counters["posts"] += 1
        w = _Work(_OP_BIND, wr_id, addr, length, 0, 0, rkey, 0, self._sq_sig_all or signaled, False, None,
                  self._sq_posted)  # fmt: skip
        if self._state == QPState.ERR:
            self._send_done(w, WCStatus.WR_FLUSH_ERR)
            return rkey
        ok = (not mw.closed and not mr.closed and mw.pd is self.pd and mr.pd is self.pd
              and mw._bound is None and bool(mr.access & Access.MW_BIND)
              and (not access & Access.REMOTE_WRITE or bool(mr.access & Access.LOCAL_WRITE))
              and mr.addr <= addr and addr + length <= mr.addr + mr.length)  # fmt: skip
        if ok:
            fab = self._fabric
            fab._mw_by_rkey.pop(mw.rkey, None)
            mw.rkey = rkey
            mw._bound = (self, mr, addr, length, int(access))
            fab._mw_by_rkey[rkey] = mw
            self._send_done(w, _OK)
        else:
            self._send_done(w, WCStatus.MW_BIND_ERR)
            self._enter_error()
        return rkey

    def post_records(self, chan: Any) -> None:
        """Post what the native path recorded for this QP (record mode: ``_native/aiordma_fast.h``).

        A refused post is recorded in the chan as the native code records its own
        (``AIORDMA_E_POST``): the session fails with it.
        """
        from aiordma._rdma.fastpath import native_lib

        native = native_lib()
        assert native is not None
        ffi, lib = native
        self._fabric._recorders[int(ffi.cast("uintptr_t", chan))] = self
        err = 0
        n = chan.rec_send_n
        if n:
            chan.rec_send_n = 0
            for i in range(n):
                w = chan.rec_send[i]
                flags = int(w.send_flags)
                data = ffi.buffer(ffi.cast("char *", w.addr), w.length)[:] if flags & INLINE else None
                if not err:
                    imm = int(w.imm_data) if w.opcode == Opcode.SEND_WITH_IMM else 0
                    err = self._post_send(int(w.opcode), int(w.wr_id), int(w.addr), int(w.length), int(w.lkey),
                                          int(w.remote_addr), int(w.rkey), imm, flags, inline_data=data)  # fmt: skip
        m = chan.rec_recv_n
        if m:
            chan.rec_recv_n = 0
            for i in range(m):
                wr_id = int(chan.rec_recv[i])
                if not err:
                    slot = wr_id & 0xFFFFFFFF
                    err = self._post_recv(wr_id, int(chan.raddr) + slot * int(chan.rslot), int(chan.buffer_size),
                                          int(chan.rlkey))  # fmt: skip
        if err and not chan.error:
            chan.error, chan.error_arg = lib.AIORDMA_E_POST, err
            chan.events |= lib.AIORDMA_EVT_ERROR

    def post_send_batch(self, wrs: Sequence[SendWR]) -> None:
        """Post (and at once execute) send WRs in order; :class:`PostError` says how many were posted."""
        self._ensure_open("ibv_post_send")
        imms = [_imm(w.imm_data or 0) for w in wrs]  # like the native binding: reject before posting any
        for i, w in enumerate(wrs):
            flags = (SIGNALED if w.signaled else 0) | (INLINE if w.inline else 0) | (SOLICITED if w.solicited else 0)
            err = self._post_send(w.opcode, w.wr_id, w.addr, w.length, w.lkey, w.remote_addr, w.rkey, imms[i], flags)
            if err:
                raise PostError(err, "ibv_post_send", i, len(wrs))

    def _post_recv(self, wr_id: int, addr: int, length: int, lkey: int) -> int:
        """Post one receive WR; returns 0 or the errno refusing it."""
        if self._state == QPState.RESET or length < 0:
            return errno.EINVAL
        if self._state == QPState.ERR:
            self._recv_done(wr_id, WCStatus.WR_FLUSH_ERR)
        elif len(self._recvs) >= self.caps.max_recv_wr:
            return errno.ENOMEM
        else:
            self._recvs.append((wr_id, addr, length, lkey))
        self._fabric.counters["recv_posts"] += 1
        return 0

    def _post_send(self, op: int, wr_id: int, addr: int, length: int, lkey: int, raddr: int, rkey: int,
                   imm: int, flags: int, inline_data: bytes | None = None) -> int:  # fmt: skip
        """Post one send WR and execute it; returns 0 or the errno refusing it."""
        fab = self._fabric
        if self._state not in (QPState.RTS, QPState.ERR) or op not in _WC_OF or length < 0:
            return errno.EINVAL
        if self._sq_posted - self._sq_retired >= self.caps.max_send_wr:
            return errno.ENOMEM
        data: bytes | None = None
        if flags & INLINE:  # copied at post time, from any memory (here: any registered memory)
            if op == Opcode.RDMA_READ or length > self.caps.max_inline_data:
                return errno.EINVAL
            if inline_data is not None:  # (record mode: the native path copied the bytes already)
                data = inline_data
            elif length and not fab._registered(addr, length):
                return errno.EFAULT
            else:
                data = ctypes.string_at(addr, length) if length else b""
        self._sq_posted += 1
        fab.counters["posts"] += 1
        w = _Work(op, wr_id, addr, length, lkey, raddr, rkey, imm, self._sq_sig_all or bool(flags & SIGNALED),
                  bool(flags & SOLICITED), data, self._sq_posted)  # fmt: skip
        if self.qp_num in fab._killed:
            # the dead host's side (in this process): its sends reach no one
            self._send_done(w, WCStatus.RETRY_EXC_ERR)
            self._enter_error()
        elif self._state == QPState.ERR:
            self._send_done(w, WCStatus.WR_FLUSH_ERR)
        else:
            self._execute(w)
        return 0

    # the wire: requester side ---------------------------------------------
    def _execute(self, w: _Work) -> None:
        fab = self._fabric
        if w.op == Opcode.RDMA_READ and fab._holding(self, "reads"):
            fab._held.append((self, w))  # (a slow response: it runs at release())
            self._held += 1
            return
        self._execute_now(w)

    def _release_item(self, item: _Completion | _Work) -> None:
        """A held completion or READ, now: a READ runs (or is flushed, if the QP went to ERROR)."""
        if self._closed:
            return
        if isinstance(item, _Completion):
            self.send_cq._push(item)
        elif self._state == QPState.ERR:
            self._send_done(item, WCStatus.WR_FLUSH_ERR)
        else:
            self._execute_now(item)

    def _execute_now(self, w: _Work) -> None:
        fab = self._fabric
        status = fab._fail_next.pop(self.qp_num, _OK)
        if status == _OK and w.length and w.data is None:
            if not fab._local_ok(self.pd, w.lkey, w.addr, w.length, write=w.op == Opcode.RDMA_READ):
                status = WCStatus.LOC_PROT_ERR
        if status == _OK:
            peer = fab._route(self)
            if peer is None:
                status = WCStatus.RETRY_EXC_ERR
            elif w.op in (Opcode.SEND, Opcode.SEND_WITH_IMM):
                status = peer._accept_send(self, w)
            elif w.op == Opcode.RDMA_READ:
                status = peer._accept_read(w)
            else:
                status = peer._accept_write(self, w)
        self._send_done(w, status)
        if status != _OK:
            self._enter_error()
        else:
            fab.counters["bytes"] += w.length

    def _send_done(self, w: _Work, status: int) -> None:
        if status == _OK and not w.signaled:
            return
        c = _Completion(w.wr_id, status, _WC_OP[w.op], w.length if status == _OK and w.op != _OP_BIND else 0, -1,
                        self.qp_num, qp=self, sq_seq=w.seq)  # fmt: skip
        self._fabric._deliver_send(self, c)

    # the wire: responder side (each returns the requester's status) --------
    def _take_recv(self) -> tuple[int, int, int, int] | None:
        if not self._recvs or self.qp_num in self._fabric._not_ready:
            self._fabric._not_ready.discard(self.qp_num)
            self._fabric.counters["rnr_errors"] += 1
            return None
        return self._recvs.popleft()

    def _accept_send(self, src: SimQueuePair, w: _Work) -> int:
        recv = self._take_recv()
        if recv is None:
            return WCStatus.RNR_RETRY_EXC_ERR
        wr_id, addr, room, lkey = recv
        forced = self._fabric._fail_next.pop(self.qp_num, _OK)
        if forced != _OK:
            return self._responder_error(wr_id, forced, WCStatus.REM_OP_ERR)
        if w.length > room:
            return self._responder_error(wr_id, WCStatus.LOC_LEN_ERR, WCStatus.REM_INV_REQ_ERR)
        if w.length and not self._fabric._local_ok(self.pd, lkey, addr, w.length, write=True):
            return self._responder_error(wr_id, WCStatus.LOC_PROT_ERR, WCStatus.REM_OP_ERR)
        w.copy_to(addr)
        imm = w.imm if w.op == Opcode.SEND_WITH_IMM else -1
        self._recv_done(wr_id, _OK, WCOpcode.RECV, w.length, imm, src.qp_num, w.solicited)
        return _OK

    def _accept_write(self, src: SimQueuePair, w: _Work) -> int:
        if not self._access & Access.REMOTE_WRITE or (
            w.length and not self._fabric._remote_ok(self, w.rkey, w.raddr, w.length, Access.REMOTE_WRITE)
        ):
            return self._responder_error(None, _OK, WCStatus.REM_ACCESS_ERR)
        if w.op != Opcode.RDMA_WRITE_WITH_IMM:
            w.copy_to(w.raddr)
            return _OK
        recv = self._take_recv()
        if recv is None:
            return WCStatus.RNR_RETRY_EXC_ERR
        forced = self._fabric._fail_next.pop(self.qp_num, _OK)
        if forced != _OK:
            return self._responder_error(recv[0], forced, WCStatus.REM_OP_ERR)
        w.copy_to(w.raddr)
        self._recv_done(recv[0], _OK, WCOpcode.RECV_RDMA_WITH_IMM, w.length, w.imm, src.qp_num, w.solicited)
        return _OK

    def _accept_read(self, w: _Work) -> int:
        if not self._access & Access.REMOTE_READ or (
            w.length and not self._fabric._remote_ok(self, w.rkey, w.raddr, w.length, Access.REMOTE_READ)
        ):
            return self._responder_error(None, _OK, WCStatus.REM_ACCESS_ERR)
        if w.length:
            ctypes.memmove(w.addr, w.raddr, w.length)
        return _OK

    def _responder_error(self, wr_id: int | None, local: int, remote: int) -> int:
        """Complete the consumed receive (if any) with ``local``, go to ERROR; ``remote`` goes to the requester."""
        if wr_id is not None:
            self._recv_done(wr_id, local)
        self._enter_error()
        return remote

    def _recv_done(self, wr_id: int, status: int, opcode: int = WCOpcode.RECV, byte_len: int = 0, imm: int = -1,
                   src_qp: int = 0, solicited: bool = False) -> None:  # fmt: skip
        if self.qp_num not in self._fabric._killed or status == WCStatus.WR_FLUSH_ERR:
            # a killed QP receives nothing any more; its own teardown still gets its flushes.
            # Like rxe, a receive completed in error (a flush) counts as solicited: it wakes a
            # CQ armed solicited-only (a send completed in error does not)
            self._fabric._deliver_recv(self, _Completion(wr_id, status, opcode, byte_len, imm, self.qp_num,
                                                         src_qp=src_qp, solicited=solicited or status != _OK))  # fmt: skip

    def close(self) -> None:
        """Destroy the QP: it becomes unknown to the fabric; its held completions are dropped."""
        if self._closed:
            return
        fab = self._fabric
        for key in [k for k, qp in fab._recorders.items() if qp is self]:
            del fab._recorders[key]
        fab._qps.pop(self.qp_num, None)
        self.context._qps.pop(self.qp_num, None)
        fab._fail_next.pop(self.qp_num, None)
        fab._not_ready.discard(self.qp_num)
        if self._held:
            fab._held = [(q, c) for q, c in fab._held if q is not self]
            self._held = 0
        if self._held_recvs:
            fab._held_recvs = [(q, c) for q, c in fab._held_recvs if q is not self]
            self._held_recvs = 0
        fab._holds.pop(self.qp_num, None)
        self._recvs.clear()
        self._mark_closed()


def _imm(value: int) -> int:
    if not 0 <= value <= 0xFFFFFFFF:
        raise OverflowError(f"immediate data must fit in 32 bits, got {value}")
    return value


if TYPE_CHECKING:  # mypy holds these objects to the interfaces the transport uses (aiordma._rdma.objects)

    def _held(ctx: SimContext, pd: SimProtectionDomain, mr: SimMemoryRegion, mw: SimMemoryWindow,
              channel: SimCompletionChannel, cq: SimCompletionQueue, wc: SimWCArray,
              qp: SimQueuePair) -> tuple[_o.Context, _o.Domain, _o.Region, _o.Window, _o.CompletionChannel,
              _o.CompletionQueue, _o.WorkCompletions, _o.QueuePair]:  # fmt: skip
        return ctx, pd, mr, mw, channel, cq, wc, qp
