"""Shared receive queues: the same rules checked on the simulated wire and on rxe (the guest).

A bed of two requester QPs, each connected to a responder QP; both responders take their
receive buffers from one SRQ (all on one device, through its loopback).  Each rule below holds on
``sim`` (aiordma.testing's wire, ``_simsrq.py``) and on ``rdma`` (the native binding on a real
device): a gap between them is a gap in the simulated wire.  (``tests/test_simsrq.py`` adds the
simulated wire's property test.)
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aiordma._errors import PostError, RDMAError
from aiordma._rdma.constants import Access, Opcode, QPState, SendWR, WCOpcode, WCStatus
from aiordma.testing._simverbs import SimFabric

SRQ_LIMIT_REACHED = 15
SLOT = 256


class Bed:
    def __init__(self, ctx: Any, gid: Any, gid_index: int, *, rnr_retry: int = 1) -> None:
        self.ctx = ctx
        self.pd = ctx.alloc_pd()
        self.cq_a = ctx.create_cq(256)
        self.cq_r = ctx.create_cq(256)
        self.mr_a = self.pd.reg_mr(1 << 16, Access.LOCAL_WRITE)
        self.mr_r = self.pd.reg_mr(1 << 16, Access.LOCAL_WRITE)
        self.srq = self.pd.create_srq(16)
        self.a = [self.pd.create_qp(self.cq_a) for _ in range(2)]
        self.b = [self.pd.create_qp(self.cq_r, srq=self.srq) for _ in range(2)]
        from aiordma._rdma.verbs import RCEndpoint

        for a, b in zip(self.a, self.b):
            a.connect(RCEndpoint(b.qp_num, gid, 0x200), sgid_index=gid_index, sq_psn=0x100,
                      rts={"rnr_retry": rnr_retry, "retry_cnt": 1})  # fmt: skip
            b.connect(RCEndpoint(a.qp_num, gid, 0x100), sgid_index=gid_index, sq_psn=0x200)

    def post(self, wr_id: int, length: int = SLOT) -> None:
        self.srq.post_recv(self.mr_r.addr + (wr_id % 200) * SLOT, length, self.mr_r.lkey, wr_id)

    def send(self, i: int, wr_id: int, data: bytes) -> None:
        self.mr_a.write(0, data)
        self.a[i].post_send(SendWR(Opcode.SEND, wr_id=wr_id, addr=self.mr_a.addr, length=len(data), lkey=self.mr_a.lkey))

    def wait(self, cq: Any, n: int, timeout: float = 20.0) -> list[Any]:
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            out += cq.poll(n - len(out))
            if len(out) < n:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{len(out)} of {n} completions: {out}")
                time.sleep(0.001)
        return out

    def event(self, timeout: float = 5.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            ev = self.ctx.get_async_event()
            if ev is not None or time.monotonic() > deadline:
                return ev
            time.sleep(0.005)

    def close(self) -> None:
        for qp in (*self.a, *self.b):
            if qp.state != QPState.ERR:
                qp.to_error()
        for cq in (self.cq_a, self.cq_r):
            while cq.poll(64):
                pass
        for qp in (*self.a, *self.b):
            qp.close()
        self.srq.close()
        for obj in (self.cq_a, self.cq_r, self.mr_a, self.mr_r, self.pd):
            obj.close()


@pytest.fixture(params=["sim", pytest.param("rdma", marks=pytest.mark.rdma)])
def bed(request: pytest.FixtureRequest) -> Iterator[Bed]:
    if request.param == "sim":
        fab = SimFabric()
        fab.add_device("sim0", "10.0.0.1")
        ctx = fab.open_context("sim0")
        entry = fab.gid_for_ip("10.0.0.1")
        assert entry is not None
        b = Bed(ctx, entry.gid, entry.index)
        yield b
        b.close()
        ctx.close()
        assert fab.live_objects() == dict.fromkeys(fab.live_objects(), 0)
    else:
        from aiordma._rdma import verbs as v

        from .rdma._native import _pick_device

        dev = _pick_device()
        ctx = v.Context(dev.name)
        b = Bed(ctx, dev.gid, dev.gid_index)
        yield b
        b.close()
        ctx.close()
        v.assert_no_live_objects()


def test_buffers_are_taken_in_posting_order_by_either_qp(bed: Bed) -> None:
    assert bed.srq.max_wr >= 16
    for wr_id in (10, 11, 12):
        bed.post(wr_id)
    for qp, wr_id, data in ((1, 1, b"one"), (0, 2, b"two!"), (1, 3, b"")):
        bed.send(qp, wr_id, data)
        bed.wait(bed.cq_a, 1)
    got = bed.wait(bed.cq_r, 3)
    assert [(w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num) for w in got] == [
        (10, 0, WCOpcode.RECV, 3, bed.b[1].qp_num),
        (11, 0, WCOpcode.RECV, 4, bed.b[0].qp_num),
        (12, 0, WCOpcode.RECV, 0, bed.b[1].qp_num),
    ]


def test_an_empty_srq_fails_the_requester_with_rnr(bed: Bed) -> None:
    bed.send(0, 1, b"x")
    (w,) = bed.wait(bed.cq_a, 1)
    assert (w.wr_id, w.status) == (1, WCStatus.RNR_RETRY_EXC_ERR)
    assert bed.a[0].state == QPState.ERR and bed.b[0].state == QPState.RTS
    bed.post(5)  # the SRQ serves the other QP still
    bed.send(1, 2, b"y")
    assert bed.wait(bed.cq_a, 1)[0].status == 0
    assert [w.wr_id for w in bed.wait(bed.cq_r, 1)] == [5]


def test_the_limit_event_fires_once_and_disarms(bed: Bed) -> None:
    for wr_id in range(6):
        bed.post(wr_id)
    bed.srq.arm(5)
    assert bed.srq.limit == 5
    bed.send(0, 1, b"a")  # 5 left: not below the limit
    bed.wait(bed.cq_a, 1)
    assert bed.event(timeout=0.3) is None
    bed.send(1, 2, b"b")  # 4 left
    bed.wait(bed.cq_a, 1)
    ev = bed.event()
    assert ev is not None and ev.event_type == SRQ_LIMIT_REACHED and ev.srq is bed.srq, ev
    assert bed.srq.limit == 0
    bed.send(0, 3, b"c")
    bed.wait(bed.cq_a, 1)
    assert bed.event(timeout=0.3) is None
    bed.srq.arm(10)  # above the count: nothing until the next receive taken
    assert bed.event(timeout=0.3) is None
    bed.send(0, 4, b"d")
    bed.wait(bed.cq_a, 1)
    ev = bed.event()
    assert ev is not None and ev.event_type == SRQ_LIMIT_REACHED
    bed.wait(bed.cq_r, 4)


def test_a_qp_with_an_srq_has_no_receive_queue_and_flushes_none_of_it(bed: Bed) -> None:
    with pytest.raises(PostError) as e:
        bed.b[0].post_recv_one(bed.mr_r.addr, 64, bed.mr_r.lkey, 99)
    assert e.value.errno == errno.EINVAL
    for wr_id in range(3):
        bed.post(wr_id)
    bed.b[0].to_error()
    time.sleep(0.2)
    assert bed.cq_r.poll(16) == []  # (no flush: the buffers are the SRQ's)
    # no "last WQE reached" on rxe (Linux 6.1; other devices raise one): nothing may wait for it
    assert bed.event(timeout=0.5) is None
    bed.send(1, 1, b"still")
    assert bed.wait(bed.cq_a, 1)[0].status == 0
    assert [(w.wr_id, w.status) for w in bed.wait(bed.cq_r, 1)] == [(0, 0)]


def test_an_srq_closes_after_its_qps(bed: Bed) -> None:
    with pytest.raises(RDMAError) as e:
        bed.srq.close()
    assert e.value.errno == errno.EBUSY
