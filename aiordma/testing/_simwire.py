"""The simulated RC wire: queue pairs, and the wire between them (:class:`_Wire`: which QP a
requester reaches, what is held back and released, the faults asked for) -- the theory of
operation is :mod:`aiordma.testing._simverbs`'s."""

from __future__ import annotations

import ctypes
import errno
import ipaddress
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import PostError, RDMAError
from .._rdma.lifetime import foreign
from .._rdma.constants import (
    DEFAULT_QP_ACCESS,
    INLINE,
    MTU_TO_ENUM,
    SIGNALED,
    SOLICITED,
    Access,
    Opcode,
    QPCaps,
    QPState,
    SendWR,
    WCOpcode,
    WCStatus,
    gid_bytes,
)
from ._simbase import (
    _MAX_SGE,
    _OK,
    _OP_BIND,
    _WC_OF,
    _WC_OP,
    _Accounts,
    _Completion,
    _SimDomainBase,
    _SimResource,
    _post_recvs,
    _pow2,
)
from ._simcq import SimCompletionQueue
from ._simmemory import SimMemoryRegion, SimMemoryWindow, _Memory
from ._simsrq import SimSharedReceiveQueue

if TYPE_CHECKING:
    from .._rdma import objects as _o

__all__ = ["SimQueuePair"]


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


class _Wire:
    """The RC wire between the fabric's QPs: which responder a requester reaches
    (:meth:`route`), the completions and READs held back and their release, and the faults
    asked for (the knobs of :class:`~aiordma.testing._simverbs.SimFabric`, which documents
    them)."""

    def __init__(self, accounts: _Accounts, memory: _Memory) -> None:
        self.accounts = accounts
        self.memory = memory
        self.hold_acks = False
        self.flush_held_on_error = False
        self.qps: dict[int, SimQueuePair] = {}
        #: held send-side items in order: completions (late ACKs) and RDMA READs not executed yet
        self.held: list[tuple[SimQueuePair, _Completion | _Work]] = []
        self.held_recvs: list[tuple[SimQueuePair, _Completion]] = []  # late receive completions
        self.holds: dict[int, frozenset[str]] = {}  # qp_num -> what is held for it (see hold())
        self.killed: set[int] = set()
        self.failing: dict[int, int] = {}  # qp_num -> the status its next work request fails with
        self.not_ready_qps: set[int] = set()  # QPs whose next incoming message finds no receive

    # the knobs --------------------------------------------------------------
    def release_acks(self) -> int:
        held, self.held = self.held, []
        for qp, _item in held:
            qp._held = 0
        for qp, item in held:
            qp._release_item(item)
        return len(held)

    def hold(self, qp_num: int, *, acks: bool, recvs: bool, reads: bool) -> None:
        what = {name for name, on in (("acks", acks), ("recvs", recvs), ("reads", reads)) if on}
        self.holds[qp_num] = self.holds.get(qp_num, frozenset()) | what

    def release(self, qp_num: int | None) -> int:
        if qp_num is None:
            self.holds.clear()
        else:
            self.holds.pop(qp_num, None)
        mine = [(q, i) for q, i in self.held if qp_num is None or q.qp_num == qp_num]
        self.held = [(q, i) for q, i in self.held if not (qp_num is None or q.qp_num == qp_num)]
        recvs = [(q, c) for q, c in self.held_recvs if qp_num is None or q.qp_num == qp_num]
        self.held_recvs = [(q, c) for q, c in self.held_recvs if not (qp_num is None or q.qp_num == qp_num)]
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

    def kill_qp(self, qp_num: int) -> None:
        self.killed.add(qp_num)
        qp = self.qps.get(qp_num)
        if qp is not None and qp._held:
            self.held = [(q, c) for q, c in self.held if q is not qp]
            qp._held = 0
        if qp is not None and qp._held_recvs:
            self.held_recvs = [(q, c) for q, c in self.held_recvs if q is not qp]
            qp._held_recvs = 0

    def fail_next(self, qp_num: int, status: int) -> None:
        if int(status) == _OK:
            raise ValueError("fail_next needs an error status")
        self.failing[qp_num] = int(status)

    def not_ready(self, qp_num: int) -> None:
        self.not_ready_qps.add(qp_num)

    # what the QPs ask -------------------------------------------------------
    def holding(self, qp: SimQueuePair, what: str) -> bool:
        held = self.holds.get(qp.qp_num)
        return held is not None and what in held

    def route(self, qp: SimQueuePair) -> SimQueuePair | None:
        """The responder QP a requester's packets reach, or ``None`` (they are lost)."""
        peer = self.qps.get(qp._dest_qp_num)
        if peer is None or peer.qp_num in self.killed or peer._state not in (QPState.RTR, QPState.RTS):
            return None
        if qp._dgid not in (g.packed for g in peer.context._device.gids):
            return None
        return peer

    def deliver_send(self, qp: SimQueuePair, c: _Completion) -> None:
        # FIFO per send queue: once one is held, everything after it waits behind it
        if ((self.hold_acks or self.holding(qp, "acks")) and c.status == _OK) or qp._held:
            self.held.append((qp, c))
            qp._held += 1
        else:
            qp.send_cq._push(c)

    def deliver_recv(self, qp: SimQueuePair, c: _Completion) -> None:
        if qp._held_recvs or (self.holding(qp, "recvs") and c.status == _OK):
            self.held_recvs.append((qp, c))
            qp._held_recvs += 1
        else:
            qp.recv_cq._push(c)

    def forget(self, qp: SimQueuePair) -> None:
        """``qp`` is destroyed: it becomes unknown to the wire; its held completions are dropped."""
        self.qps.pop(qp.qp_num, None)
        self.failing.pop(qp.qp_num, None)
        self.not_ready_qps.discard(qp.qp_num)
        if qp._held:
            self.held = [(q, c) for q, c in self.held if q is not qp]
            qp._held = 0
        if qp._held_recvs:
            self.held_recvs = [(q, c) for q, c in self.held_recvs if q is not qp]
            qp._held_recvs = 0
        self.holds.pop(qp.qp_num, None)


class SimQueuePair(_SimResource):
    """A simulated RC queue pair: ``to_init`` / ``to_rtr`` / ``to_rts``, then post."""

    _kind = "qps"
    _label = "queue pair"

    def __init__(self, wire: _Wire, pd: _SimDomainBase, send_cq: SimCompletionQueue,
                 recv_cq: SimCompletionQueue | None, *, max_send_wr: int = 64, max_recv_wr: int = 64, max_send_sge: int = 1, max_recv_sge: int = 1,
                 max_inline_data: int = 0, sq_sig_all: bool = False,
                 srq: SimSharedReceiveQueue | None = None) -> None:  # fmt: skip
        recv_cq = recv_cq or send_cq
        for obj in (pd, send_cq, recv_cq, *((srq,) if srq is not None else ())):
            obj._ensure_open("ibv_create_qp")
        dev = pd.context._device
        asked = f"RC max_send_wr={max_send_wr} max_recv_wr={max_recv_wr} max_inline_data={max_inline_data}"
        if (send_cq.context is not pd.context or recv_cq.context is not pd.context
                or not (0 <= max_send_wr <= dev.max_qp_wr and 0 <= max_recv_wr <= dev.max_qp_wr)
                or not (0 <= max_send_sge <= _MAX_SGE and 0 <= max_recv_sge <= _MAX_SGE)
                or not 0 <= max_inline_data <= dev.max_inline_data
                or (srq is not None and srq.context is not pd.context)):  # fmt: skip
            raise RDMAError(errno.EINVAL, "ibv_create_qp", asked)
        parents: tuple[_SimResource, ...] = (pd, send_cq) if recv_cq is send_cq else (pd, send_cq, recv_cq)
        super().__init__(pd._accounts, parents + ((srq,) if srq is not None else ()))
        #: the shared receive queue its SENDs land in (None: its own receive queue)
        self.srq = srq
        if srq is not None:
            max_recv_wr = 0  # (ignored with an SRQ, as by ibv_create_qp)
        self._wire = wire
        self.pd, self.context, self.send_cq, self.recv_cq = pd, pd.context, send_cq, recv_cq
        self.caps = QPCaps(min(_pow2(max_send_wr), dev.max_qp_wr), min(_pow2(max_recv_wr), dev.max_qp_wr),
                           max_send_sge, max_recv_sge, max_inline_data)  # fmt: skip
        self.qp_num: int = self._accounts.new_id(2, 1 << 24)
        self.port_num = 1
        self._sq_sig_all = sq_sig_all
        self._state = QPState.RESET
        self._access = 0
        self._dest_qp_num = 0
        self._dgid = b""
        self._recvs: deque[tuple[int, int, int, int]] = deque()  # (wr_id, addr, length, lkey)
        self._sq_posted = 0  # sequence number of the last send WR posted
        self._sq_retired = 0  # ... and of the last one whose slot a polled completion freed
        self._held = 0  # completions (and READs) of ours in wire.held
        self._held_recvs = 0  # receive completions of ours in wire.held_recvs
        wire.qps[self.qp_num] = self
        self.context._qps[self.qp_num] = self
        for cq in {send_cq, recv_cq}:
            cq._qps.append(self)

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
        wire = self._wire
        if wire.flush_held_on_error and self._held:
            mine = [c for q, c in wire.held if q is self]
            wire.held = [(q, c) for q, c in wire.held if q is not self]
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
        # (a QP with an SRQ flushes nothing: the SRQ's buffers stay posted for its other QPs.  No
        # "last WQE reached" event either: rxe (Linux 6.1) raises none, so nothing may wait for it)

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
        _post_recvs(self._post_recv, addrs, lens, lkey, wr_ids, "ibv_post_recv")

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
        self._accounts.counters["posts"] += 1
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
            by_rkey = self._wire.memory.mw_by_rkey
            by_rkey.pop(mw.rkey, None)
            mw.rkey = rkey
            mw._bound = (self, mr, addr, length, int(access))
            by_rkey[rkey] = mw
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
        self._accounts.recorders[int(ffi.cast("uintptr_t", chan))] = self
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
        if self._state == QPState.RESET or length < 0 or self.srq is not None:
            return errno.EINVAL  # (a QP with an SRQ has no receive queue of its own)
        if self._state == QPState.ERR:
            self._recv_done(wr_id, WCStatus.WR_FLUSH_ERR)
        elif len(self._recvs) >= self.caps.max_recv_wr:
            return errno.ENOMEM
        else:
            self._recvs.append((wr_id, addr, length, lkey))
        self._accounts.counters["recv_posts"] += 1
        return 0

    def _post_send(self, op: int, wr_id: int, addr: int, length: int, lkey: int, raddr: int, rkey: int,
                   imm: int, flags: int, inline_data: bytes | None = None) -> int:  # fmt: skip
        """Post one send WR and execute it; returns 0 or the errno refusing it."""
        wire = self._wire
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
            elif length and not wire.memory.registered(addr, length):
                return errno.EFAULT
            else:
                data = ctypes.string_at(addr, length) if length else b""
        self._sq_posted += 1
        self._accounts.counters["posts"] += 1
        w = _Work(op, wr_id, addr, length, lkey, raddr, rkey, imm, self._sq_sig_all or bool(flags & SIGNALED),
                  bool(flags & SOLICITED), data, self._sq_posted)  # fmt: skip
        if self.qp_num in wire.killed:
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
        wire = self._wire
        if w.op == Opcode.RDMA_READ and wire.holding(self, "reads"):
            wire.held.append((self, w))  # (a slow response: it runs at release())
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
        wire = self._wire
        status = wire.failing.pop(self.qp_num, _OK)
        if status == _OK and w.length and w.data is None:
            if not wire.memory.local_ok(self.pd, w.lkey, w.addr, w.length, write=w.op == Opcode.RDMA_READ):
                status = WCStatus.LOC_PROT_ERR
        if status == _OK:
            peer = wire.route(self)
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
            self._accounts.counters["bytes"] += w.length

    def _send_done(self, w: _Work, status: int) -> None:
        if status == _OK and not w.signaled:
            return
        c = _Completion(w.wr_id, status, _WC_OP[w.op], w.length if status == _OK and w.op != _OP_BIND else 0, -1,
                        self.qp_num, qp=self, sq_seq=w.seq)  # fmt: skip
        self._wire.deliver_send(self, c)

    # the wire: responder side (each returns the requester's status) --------
    def _take_recv(self) -> tuple[int, int, int, int] | None:
        srq = self.srq
        if (not srq.posted if srq is not None else not self._recvs) or self.qp_num in self._wire.not_ready_qps:
            self._wire.not_ready_qps.discard(self.qp_num)
            self._accounts.counters["rnr_errors"] += 1
            return None
        if srq is not None:
            return srq._take()
        return self._recvs.popleft()

    @property
    def _recv_pd(self) -> _SimDomainBase:
        """Where the receive buffers' keys are checked: the SRQ's domain, else the QP's."""
        return self.srq.pd if self.srq is not None else self.pd

    def _accept_send(self, src: SimQueuePair, w: _Work) -> int:
        recv = self._take_recv()
        if recv is None:
            return WCStatus.RNR_RETRY_EXC_ERR
        wr_id, addr, room, lkey = recv
        forced = self._wire.failing.pop(self.qp_num, _OK)
        if forced != _OK:
            return self._responder_error(wr_id, forced, WCStatus.REM_OP_ERR)
        if w.length > room:
            return self._responder_error(wr_id, WCStatus.LOC_LEN_ERR, WCStatus.REM_INV_REQ_ERR)
        if w.length and not self._wire.memory.local_ok(self._recv_pd, lkey, addr, w.length, write=True):
            return self._responder_error(wr_id, WCStatus.LOC_PROT_ERR, WCStatus.REM_OP_ERR)
        w.copy_to(addr)
        imm = w.imm if w.op == Opcode.SEND_WITH_IMM else -1
        self._recv_done(wr_id, _OK, WCOpcode.RECV, w.length, imm, src.qp_num, w.solicited)
        return _OK

    def _accept_write(self, src: SimQueuePair, w: _Work) -> int:
        if not self._access & Access.REMOTE_WRITE or (
            w.length and not self._wire.memory.remote_ok(self, self.pd, w.rkey, w.raddr, w.length, Access.REMOTE_WRITE)
        ):
            return self._responder_error(None, _OK, WCStatus.REM_ACCESS_ERR)
        if w.op != Opcode.RDMA_WRITE_WITH_IMM:
            w.copy_to(w.raddr)
            return _OK
        recv = self._take_recv()
        if recv is None:
            return WCStatus.RNR_RETRY_EXC_ERR
        forced = self._wire.failing.pop(self.qp_num, _OK)
        if forced != _OK:
            return self._responder_error(recv[0], forced, WCStatus.REM_OP_ERR)
        w.copy_to(w.raddr)
        self._recv_done(recv[0], _OK, WCOpcode.RECV_RDMA_WITH_IMM, w.length, w.imm, src.qp_num, w.solicited)
        return _OK

    def _accept_read(self, w: _Work) -> int:
        if not self._access & Access.REMOTE_READ or (
            w.length and not self._wire.memory.remote_ok(self, self.pd, w.rkey, w.raddr, w.length, Access.REMOTE_READ)
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
        if self.qp_num not in self._wire.killed or status == WCStatus.WR_FLUSH_ERR:
            # a killed QP receives nothing any more; its own teardown still gets its flushes.
            # Like rxe, a receive completed in error (a flush) counts as solicited: it wakes a
            # CQ armed solicited-only (a send completed in error does not)
            self._wire.deliver_recv(self, _Completion(wr_id, status, opcode, byte_len, imm, self.qp_num,
                                                         src_qp=src_qp, solicited=solicited or status != _OK))  # fmt: skip

    def close(self) -> None:
        """Destroy the QP: it becomes unknown to the fabric; its held completions are dropped."""
        if self._closed:
            return
        recorders = self._accounts.recorders
        for key in [k for k, qp in recorders.items() if qp is self]:
            del recorders[key]
        self._wire.forget(self)
        self.context._qps.pop(self.qp_num, None)
        for cq in {self.send_cq, self.recv_cq}:
            cq._qps.remove(self)
        self._recvs.clear()
        self._mark_closed()


def _imm(value: int) -> int:
    if not 0 <= value <= 0xFFFFFFFF:
        raise OverflowError(f"immediate data must fit in 32 bits, got {value}")
    return value

