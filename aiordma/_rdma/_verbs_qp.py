"""Queue pairs of the verbs binding: reliable-connected QPs (``ibv_create_qp``), children of a
protection domain and its completion queues (:mod:`aiordma._rdma.verbs`)."""

from __future__ import annotations

import errno as _errno
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import PostError
from .constants import (
    DEFAULT_QP_ACCESS,
    FENCE as _FENCE,
    INLINE as _INLINE,
    SIGNALED as _SIGNALED,
    SOLICITED as _SOLICITED,
    QPCaps,
    QPState,
    SendWR,
    gid_bytes as _gid_bytes,
)
from .lifetime import foreign
from ._native import (
    NativeDomain,
    RecvBatch,
    _Resource,
    _addr,
    _check,
    _count,
    _fail,
    _ffi,
    _lib,
    _mtu_enum,
    _require_native,
)
from ._verbs_cq import CompletionQueue
from ._verbs_memory import MemoryRegion, MemoryWindow, next_rkey
from ._verbs_srq import SharedReceiveQueue

if TYPE_CHECKING:
    from . import objects as _o

__all__ = ["QueuePair", "RCEndpoint"]


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
        pd: NativeDomain,
        send_cq: CompletionQueue,
        recv_cq: CompletionQueue | None = None,
        *,
        max_send_wr: int = 64,
        max_recv_wr: int = 64,
        max_send_sge: int = 1,
        max_recv_sge: int = 1,
        max_inline_data: int = 0,
        sq_sig_all: bool = False,
        srq: SharedReceiveQueue | None = None,
    ) -> None:
        _require_native("a QueuePair")
        recv_cq = recv_cq or send_cq
        if srq is not None and not isinstance(srq, SharedReceiveQueue):
            raise foreign(srq, SharedReceiveQueue, "ibv_create_qp")
        for obj in (pd, send_cq, recv_cq, *((srq,) if srq is not None else ())):
            obj._ensure_open("ibv_create_qp")
        caps = _ffi.new("struct aiordma_qp_caps *")
        caps.max_send_wr = max_send_wr
        caps.max_recv_wr = max_recv_wr
        caps.max_send_sge = max_send_sge
        caps.max_recv_sge = max_recv_sge
        caps.max_inline_data = max_inline_data
        h = _lib.aiordma_create_rc_qp(pd._h, send_cq._h, recv_cq._h, srq._h if srq is not None else _ffi.NULL, caps,
                                      1 if sq_sig_all else 0)  # fmt: skip
        if h == _ffi.NULL:
            raise _fail(
                int(_ffi.errno),
                "ibv_create_qp",
                f"RC max_send_wr={max_send_wr} max_recv_wr={max_recv_wr} max_inline_data={max_inline_data}",
            )
        parents: tuple[_Resource, ...] = (pd, send_cq) if recv_cq is send_cq else (pd, send_cq, recv_cq)
        super().__init__(parents + ((srq,) if srq is not None else ()))
        #: the shared receive queue its SENDs land in (None: its own receive queue)
        self.srq = srq
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
        self._recv = RecvBatch(self.caps.max_recv_wr)
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
        self._recv.post(_lib.aiordma_post_recv_batch, self._h, addrs, lens, lkey, wr_ids, "ibv_post_recv")

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
