"""The checked session: the sans-IO :class:`~aiordma._rdma.session.RdmaSession` with the QP it posts on.

The reference implementation of :class:`~aiordma._rdma.datapath.DataPath`
(``RdmaConfig(hot_path="checked")``): every decision is the sans-IO session's, in Python; this
class only posts the work it returns.  A post the QP refuses (or one without a precise
``bad_wr``) leaves the QP in an unknown state: the session fails, and what was handed out stays
the device's until the QP is destroyed.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import RDMAError
from .constants import SIGNALED, SOLICITED, Opcode, SendWR
from .datapath import Chunk, Completion, Poster
from .session import KIND_PROBE, KIND_SHIFT, RdmaSession, RecvWork, Ring, SendWork

__all__ = ["CheckedSession"]


class CheckedSession(RdmaSession):
    """:class:`RdmaSession` posting on ``qp`` (see the module docs)."""

    #: (the checked path's completions all come to Python: no send completion is waited for apart)
    blocked_on_sends = False
    wants_send_completions = False

    def __init__(self, *, window: int, control: int, buffer_size: int, recv: Ring, rq_depth: int,
                 qp: Poster) -> None:  # fmt: skip
        super().__init__(window=window, control=control, buffer_size=buffer_size, recv=recv, rq_depth=rq_depth)
        self._qp = qp
        self._reposts: list[RecvWork] = []  # from complete(), posted by settle()

    def post_receives(self) -> None:
        work = self.initial_receives()
        if work:
            self._post_recv(work)
        if self.error is not None:
            raise self.error

    def post_probe(self) -> None:
        if self.error is None and self.sq_used < self.sq_depth:
            self._post_send([self.probe_work()])

    def send(self, chunks: Sequence[Chunk]) -> int:
        end = self.queue(chunks)
        self._flush()
        return 0 if self.error is None and self.posted_bytes >= end else end

    def complete(self, entries: Sequence[Completion], buffered: int) -> list[memoryview]:
        views, reposts = self.on_completions(entries, buffered)
        self._reposts += reposts
        return views

    def settle(self) -> None:
        reposts, self._reposts = self._reposts, []
        if reposts and self.error is None:
            self._post_recv(reposts)
        self._flush()

    def reader_took(self, buffered: int) -> None:
        if self.withheld and self.consumed(buffered):
            self._flush()

    def release_withheld(self) -> None:
        if self.withheld and self.consumed(0):
            self._flush()

    def close(self, final: bytes) -> None:
        if final:
            self.queue([final])
        self.begin_close()
        self._flush()

    # -- posting ------------------------------------------------------------------------------

    def _flush(self) -> None:
        if self.error is None:
            work = self.flush()
            if work:
                self._post_send(work)

    def _post_send(self, work: list[SendWork]) -> None:
        qp = self._qp
        try:
            if len(work) == 1:
                wr_id, addr, length, lkey, imm, flags = work[0]
                if wr_id >> KIND_SHIFT & 0x7F == KIND_PROBE:
                    qp.post_send(SendWR(Opcode.RDMA_WRITE, wr_id, signaled=True))
                else:
                    qp.post_send_imm(wr_id, addr, length, lkey, imm, flags)
            else:
                qp.post_send_batch(
                    [
                        SendWR(Opcode.RDMA_WRITE, wr_id, signaled=True)
                        if wr_id >> KIND_SHIFT & 0x7F == KIND_PROBE
                        else SendWR(Opcode.SEND_WITH_IMM, wr_id, addr, length, lkey, imm_data=imm,
                                    signaled=bool(flags & SIGNALED), solicited=bool(flags & SOLICITED))
                        for wr_id, addr, length, lkey, imm, flags in work
                    ]
                )  # fmt: skip
        except (RDMAError, OSError) as exc:
            self.fail(exc)

    def _post_recv(self, work: list[RecvWork]) -> None:
        qp = self._qp
        lkey = self.recv.lkey
        try:
            if len(work) == 1:
                wr_id, addr, length = work[0]
                qp.post_recv_one(addr, length, lkey, wr_id)
            else:
                qp.post_recv_batch([w[1] for w in work], [w[2] for w in work], lkey, [w[0] for w in work])
        except (RDMAError, OSError) as exc:
            self.fail(exc)
