"""Shared receive queues of the verbs binding (``ibv_create_srq``): children of a protection
domain; the QPs created with one take their receive buffers from it (:mod:`aiordma._rdma.verbs`).

The rules it keeps are the device's (the simulated wire models rxe's: ``aiordma/testing/_simsrq.py``,
and ``tests/test_simsrq.py`` runs the same checks on both): buffers are taken in posting order by
whichever QP a SEND arrives on; an empty SRQ is "receiver not ready" for the sender; the limit
event (``IBV_EVENT_SRQ_LIMIT_REACHED``, on the context's async fd) fires once, when a receive taken
leaves fewer than the armed limit, and disarms; a QP going to ERROR flushes none of its buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._native import NativeDomain, RecvBatch, _Resource, _addr, _count, _fail, _ffi, _lib, _require_native

__all__ = ["SharedReceiveQueue"]


class SharedReceiveQueue(_Resource):
    """An SRQ (``ibv_create_srq``): ``post_recv*``, ``arm(limit)``, ``limit``, ``max_wr``.

    Close it (``ibv_destroy_srq``) after every QP created with it."""

    _kind = "srqs"
    _label = "shared receive queue"

    def __init__(self, pd: NativeDomain, *, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> None:
        _require_native("a SharedReceiveQueue")
        pd._ensure_open("ibv_create_srq")
        wr = _ffi.new("uint32_t *", max_wr)
        sge = _ffi.new("uint32_t *", max_sge)
        h = _lib.aiordma_create_srq(pd._h, wr, sge, srq_limit)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_create_srq", f"max_wr={max_wr} max_sge={max_sge} srq_limit={srq_limit}")
        super().__init__((pd,))
        self.pd = pd
        self.context = pd.context
        self._h: Any = h
        self._key = _addr(h)
        #: what the device granted
        self.max_wr = int(wr[0])
        self.max_sge = int(sge[0])
        self.context._srqs[self._key] = self
        self._recv = RecvBatch(self.max_wr)
        self._limit: Any = _ffi.new("uint32_t *")
        _count(self._kind, 1)

    def __repr__(self) -> str:
        return f"<SharedReceiveQueue max_wr={self.max_wr}{' closed' if self._closed else ''}>"

    @property
    def limit(self) -> int:
        """The armed limit (0: disarmed), read from the device (``ibv_query_srq``)."""
        self._ensure_open("ibv_query_srq")
        rc = int(_lib.aiordma_query_srq_limit(self._h, self._limit))
        if rc:
            raise _fail(rc, "ibv_query_srq")
        return int(self._limit[0])

    def arm(self, limit: int) -> None:
        """``ibv_modify_srq(IBV_SRQ_LIMIT)``: ``IBV_EVENT_SRQ_LIMIT_REACHED`` once, when a receive
        taken leaves fewer than ``limit`` posted (0 disarms)."""
        self._ensure_open("ibv_modify_srq")
        rc = int(_lib.aiordma_arm_srq(self._h, limit))
        if rc:
            raise _fail(rc, "ibv_modify_srq", f"srq_limit={limit}")

    def post_recv(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self.post_recv_batch([addr], [length], lkey, [wr_id])

    def post_recv_one(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self.post_recv_batch([addr], [length], lkey, [wr_id])

    def post_recv_batch(self, addrs: Sequence[int], lens: Sequence[int], lkey: int, wr_ids: Sequence[int]) -> None:
        """Post receive buffers (one sge each, same ``lkey``); :class:`PostError` says how many went."""
        self._ensure_open("ibv_post_srq_recv")
        self._recv.post(_lib.aiordma_post_srq_recv_batch, self._h, addrs, lens, lkey, wr_ids, "ibv_post_srq_recv")

    def close(self) -> None:
        """``ibv_destroy_srq``, after every QP created with it (``EBUSY`` before)."""
        if self._closed:
            return
        self._check_children("ibv_destroy_srq")
        rc = int(_lib.ibv_destroy_srq(self._h))
        if rc:
            raise _fail(rc, "ibv_destroy_srq")
        self.context._srqs.pop(self._key, None)
        self._h = None
        self._mark_closed()
