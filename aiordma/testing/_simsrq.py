"""A simulated shared receive queue (``ibv_srq``), as rxe behaves (checked with pyverbs in the guest).

One queue of posted receive buffers that every QP created with it takes from, in order of
posting, whichever QP the SEND arrives on.  What a NIC enforces, and the simulated wire with it:

* **Empty is RNR.**  A SEND (or WRITE_WITH_IMM) that finds the SRQ empty is "receiver not
  ready": as everywhere on this wire, the requester's work request fails at once with
  ``RNR_RETRY_EXC_ERR`` (as if ``rnr_retry`` ran out) and its QP goes to ERROR; the responder's QP
  and the SRQ stay as they are.
* **The limit event is one shot.**  :meth:`arm` (``ibv_modify_srq`` with ``IBV_SRQ_LIMIT``) sets the
  limit; when a receive taken leaves fewer than ``limit`` posted, the context gets
  ``IBV_EVENT_SRQ_LIMIT_REACHED`` and the limit goes back to 0 (disarmed) -- rxe's
  ``get_srq_wqe``.  Arming does not look at the count (rxe accepts a limit above it, and fires
  only at the next receive taken).  ``limit`` reads it back (``ibv_query_srq``).
* **QPs do not own its buffers.**  ``post_recv`` on a QP created with an SRQ is ``EINVAL``; a QP
  that goes to ERROR flushes none of the SRQ's buffers (they stay posted for the other QPs).  It
  raises no ``IBV_EVENT_QP_LAST_WQE_REACHED`` either: rxe on Linux 6.1 does not (other devices
  do), so the transport may never wait for one.
* **Sizes as rxe's.**  ``max_wr`` is rounded up to a power of two minus one (16 -> 31), posting
  beyond it is ``ENOMEM``; the receive buffers' keys are checked against the SRQ's protection
  domain when a SEND lands in them.
* **Lifetime.**  It closes only after every QP created with it (``EBUSY`` before), and is counted
  in ``live_objects()["srqs"]``.
"""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Sequence
from typing import Final

from .._errors import PostError, RDMAError
from ._simbase import _MAX_SGE, _SimDomainBase, _SimResource, _post_recvs, _pow2

__all__ = ["SimSharedReceiveQueue"]

#: ``ibv_event_type`` of the SRQ's limit event
SRQ_LIMIT_REACHED: Final = 15


class SimSharedReceiveQueue(_SimResource):
    """A simulated SRQ: ``post_recv*``, ``arm(limit)``, ``limit``, ``posted``; QPs take from it."""

    _kind = "srqs"
    _label = "shared receive queue"

    def __init__(self, pd: _SimDomainBase, *, max_wr: int, max_sge: int = 1, srq_limit: int = 0) -> None:
        pd._ensure_open("ibv_create_srq")
        dev = pd.context._device
        if not (1 <= max_wr <= dev.max_qp_wr and 1 <= max_sge <= _MAX_SGE and 0 <= srq_limit <= max_wr):
            raise RDMAError(errno.EINVAL, "ibv_create_srq", f"max_wr={max_wr} max_sge={max_sge} srq_limit={srq_limit}")
        super().__init__(pd._accounts, (pd,))
        self.pd, self.context = pd, pd.context
        self.max_wr = min(_pow2(max_wr + 1) - 1, dev.max_qp_wr)
        self.max_sge = max_sge
        self._limit = srq_limit
        self._recvs: deque[tuple[int, int, int, int]] = deque()  # (wr_id, addr, length, lkey)

    def __repr__(self) -> str:
        return f"<SimSharedReceiveQueue posted={len(self._recvs)}/{self.max_wr} limit={self._limit}>"

    @property
    def limit(self) -> int:
        """The armed limit (0: disarmed), as ``ibv_query_srq`` reads it."""
        self._ensure_open("ibv_query_srq")
        return self._limit

    @property
    def posted(self) -> int:
        """Receive buffers posted and not taken yet."""
        return len(self._recvs)

    def arm(self, limit: int) -> None:
        """``ibv_modify_srq(IBV_SRQ_LIMIT)``: raise ``IBV_EVENT_SRQ_LIMIT_REACHED`` once, when a
        receive taken leaves fewer than ``limit`` posted (0 disarms)."""
        self._ensure_open("ibv_modify_srq")
        if not 0 <= limit <= self.max_wr:
            raise RDMAError(errno.EINVAL, "ibv_modify_srq", f"srq_limit={limit} (max_wr {self.max_wr})")
        self._limit = limit

    def post_recv(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self.post_recv_one(addr, length, lkey, wr_id)

    def post_recv_one(self, addr: int, length: int, lkey: int, wr_id: int) -> None:
        self._ensure_open("ibv_post_srq_recv")
        err = self._post(wr_id, addr, length, lkey)
        if err:
            raise PostError(err, "ibv_post_srq_recv", 0, 1)

    def post_recv_batch(self, addrs: Sequence[int], lens: Sequence[int], lkey: int, wr_ids: Sequence[int]) -> None:
        """Post receive buffers (same ``lkey``); :class:`PostError` says how many were posted."""
        self._ensure_open("ibv_post_srq_recv")
        _post_recvs(self._post, addrs, lens, lkey, wr_ids, "ibv_post_srq_recv")

    def _post(self, wr_id: int, addr: int, length: int, lkey: int) -> int:
        if length < 0:
            return errno.EINVAL
        if len(self._recvs) >= self.max_wr:
            return errno.ENOMEM
        self._recvs.append((wr_id, addr, length, lkey))
        self._accounts.counters["recv_posts"] += 1
        return 0

    def _take(self) -> tuple[int, int, int, int] | None:
        """The next posted buffer for a SEND that arrived (None: empty, RNR); fires the limit."""
        if not self._recvs:
            return None
        recv = self._recvs.popleft()
        if self._limit and len(self._recvs) < self._limit:
            self._limit = 0
            self.context._post_event(SRQ_LIMIT_REACHED, srq=self)
        return recv

    def close(self) -> None:
        """``ibv_destroy_srq``: after every QP created with it (``EBUSY`` before)."""
        if self._closed:
            return
        self._check_children("ibv_destroy_srq")
        self._recvs.clear()
        self._mark_closed()
