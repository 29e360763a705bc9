"""Shared receive queues on the simulated RC wire (issue 23, item 1): the rules of rxe's SRQs.

What rxe does was checked with pyverbs in the guest (2026-12-07, Debian 12's kernel): posting to
a QP created with an SRQ is EINVAL; an empty SRQ is RNR at the requester; the limit goes back to
0 once a receive taken leaves fewer than it posted (armed above the count, it waits for the next
receive); a QP going to ERROR flushes none of the SRQ's buffers (and raises no "last WQE
reached"); max_wr 16 gives 31.
"""

from __future__ import annotations

import errno

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma._errors import PostError, RDMAError
from aiordma._rdma.constants import Opcode, QPState, SendWR, WCOpcode, WCStatus
from aiordma.testing._simsrq import SRQ_LIMIT_REACHED, SimSharedReceiveQueue
from aiordma.testing._simverbs import SimFabric

from ._sim_sides import Side, bring_up, side


def _fabric() -> SimFabric:
    f = SimFabric()
    f.add_device("simA", "10.0.0.1")
    f.add_device("simB", "10.0.0.2")
    return f


class Bed:
    """Two requesters on device A, each connected to its own responder QP on device B; both
    responders take their receive buffers from one SRQ."""

    def __init__(self, fab: SimFabric, max_wr: int = 16) -> None:
        self.fab = fab
        self.r = side(fab, "simB")  # (its QP stays unused: the PD, CQ and memory are shared)
        self.srq: SimSharedReceiveQueue = self.r.pd.create_srq(max_wr)
        self.a: list[Side] = []
        self.b: list[Side] = []
        for _ in range(2):
            a = side(fab, "simA")
            qp = self.r.pd.create_qp(self.r.cq, srq=self.srq)
            b = Side(self.r.ctx, self.r.pd, self.r.ch, self.r.cq, qp, self.r.mr, self.r.wc)
            bring_up(fab, a, b)
            self.a.append(a)
            self.b.append(b)

    def post(self, wr_id: int, length: int = 64) -> None:
        self.srq.post_recv(self.r.mr.addr + (wr_id % 64) * 64, length, self.r.mr.lkey, wr_id)

    def send(self, i: int, wr_id: int, data: bytes = b"") -> None:
        a = self.a[i]
        a.mr.write(0, data)
        a.qp.post_send(SendWR(Opcode.SEND, wr_id=wr_id, addr=a.mr.addr, length=len(data), lkey=a.mr.lkey))

    def close(self) -> None:
        for a in self.a:
            a.close()
        for b in self.b:
            b.qp.close()
        self.srq.close()
        self.r.close()
        assert self.fab.live_objects() == dict.fromkeys(self.fab.live_objects(), 0)


@pytest.fixture
def bed() -> Bed:
    return Bed(_fabric())


def test_sends_on_any_qp_take_the_srq_buffers_in_posting_order(bed: Bed) -> None:
    for wr_id in (10, 11, 12):
        bed.post(wr_id)
    bed.send(1, 1, b"one")
    bed.send(0, 2, b"two!")
    bed.send(1, 3, b"")
    got = bed.r.poll()
    assert [(e[0], e[1], e[2], e[3], e[5]) for e in got] == [
        (10, 0, WCOpcode.RECV, 3, bed.b[1].qp.qp_num),
        (11, 0, WCOpcode.RECV, 4, bed.b[0].qp.qp_num),
        (12, 0, WCOpcode.RECV, 0, bed.b[1].qp.qp_num),
    ]
    assert bed.r.mr.read(10 * 64, 3) == b"one" and bed.r.mr.read(11 * 64, 4) == b"two!"
    assert bed.srq.posted == 0
    bed.close()


def test_an_empty_srq_is_rnr_for_the_requester_only(bed: Bed) -> None:
    bed.post(1)
    bed.send(0, 1, b"x")
    bed.send(1, 2, b"y")  # (nothing left)
    assert bed.a[1].poll() == [(2, WCStatus.RNR_RETRY_EXC_ERR, WCOpcode.SEND, 0, -1, bed.a[1].qp.qp_num)]
    assert bed.a[1].qp.state == QPState.ERR
    assert bed.b[1].qp.state == QPState.RTS and bed.b[0].qp.state == QPState.RTS
    assert bed.fab.counters["rnr_errors"] == 1
    bed.post(2)  # the SRQ and the other QP go on
    bed.send(0, 3, b"z")
    assert [e[0] for e in bed.r.poll()] == [1, 2]
    bed.close()


def test_the_limit_event_fires_once_below_the_limit(bed: Bed) -> None:
    for wr_id in range(6):
        bed.post(wr_id)
    bed.srq.arm(5)
    assert bed.srq.limit == 5
    bed.send(0, 1, b"a")  # 5 left: not below 5
    assert bed.r.ctx.get_async_event() is None
    bed.send(1, 2, b"b")  # 4 left: below
    ev = bed.r.ctx.get_async_event()
    assert ev is not None and ev.event_type == SRQ_LIMIT_REACHED and ev.srq is bed.srq
    assert ev.name == "IBV_EVENT_SRQ_LIMIT_REACHED" and ev.element_kind == "srq"
    assert bed.srq.limit == 0  # (disarmed)
    bed.send(0, 3, b"c")
    assert bed.r.ctx.get_async_event() is None
    # armed above the count: nothing until the next receive taken
    bed.srq.arm(10)
    assert bed.r.ctx.get_async_event() is None
    bed.send(0, 4, b"d")
    ev = bed.r.ctx.get_async_event()
    assert ev is not None and ev.event_type == SRQ_LIMIT_REACHED
    with pytest.raises(RDMAError) as e:
        bed.srq.arm(bed.srq.max_wr + 1)
    assert e.value.errno == errno.EINVAL
    bed.r.poll()
    bed.close()


def test_a_qp_with_an_srq_has_no_receive_queue_and_flushes_none_of_it(bed: Bed) -> None:
    with pytest.raises(PostError) as e:
        bed.b[0].qp.post_recv(bed.r.mr.addr, 64, bed.r.mr.lkey, 99)
    assert e.value.errno == errno.EINVAL
    for wr_id in range(3):
        bed.post(wr_id)
    bed.b[0].qp.to_error()
    assert bed.r.poll() == []  # (no flush: the buffers are the SRQ's)
    assert bed.r.ctx.get_async_event() is None  # (no "last WQE reached": rxe raises none)
    assert bed.srq.posted == 3
    bed.send(1, 1, b"still")  # the other QP still takes them
    assert [(x[0], x[1]) for x in bed.r.poll()] == [(0, 0)]
    bed.close()


def test_sizes_limits_and_lifetime() -> None:
    fab = _fabric()
    r = side(fab, "simB")
    srq = r.pd.create_srq(16)
    assert srq.max_wr == 31  # (rxe: a power of two, minus one)
    with pytest.raises(PostError) as e:
        srq.post_recv_batch([r.mr.addr] * 40, [8] * 40, r.mr.lkey, list(range(40)))
    assert (e.value.errno, e.value.posted, e.value.total) == (errno.ENOMEM, 31, 40)
    for bad in ({"max_wr": 0}, {"max_wr": 4, "max_sge": 99}, {"max_wr": 4, "srq_limit": 5}):
        with pytest.raises(RDMAError) as err:
            r.pd.create_srq(**bad)
        assert err.value.errno == errno.EINVAL
    qp = r.pd.create_qp(r.cq, srq=srq)
    assert fab.live_objects()["srqs"] == 1
    with pytest.raises(RDMAError) as err:
        srq.close()
    assert err.value.errno == errno.EBUSY
    other_ctx = fab.open_context("simA")
    other, other_cq = other_ctx.alloc_pd(), other_ctx.create_cq(8)
    with pytest.raises(RDMAError):  # (an SRQ of another device's context)
        other.create_qp(other_cq, srq=srq)
    qp.close()
    srq.close()
    for obj in (other_cq, other, other_ctx):
        obj.close()
    r.close()
    assert fab.live_objects() == dict.fromkeys(fab.live_objects(), 0)


def test_the_buffers_keys_are_checked_against_the_srqs_domain(bed: Bed) -> None:
    foreign_pd = bed.r.ctx.alloc_pd()
    foreign = foreign_pd.reg_mr(4096)
    bed.srq.post_recv(foreign.addr, 64, foreign.lkey, 7)
    bed.send(0, 1, b"x")
    assert bed.a[0].poll()[0][:2] == (1, WCStatus.REM_OP_ERR)
    assert [(x[0], x[1]) for x in bed.r.poll()][0] == (7, WCStatus.LOC_PROT_ERR)
    foreign.close()
    foreign_pd.close()
    bed.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["post", "send0", "send1", "arm"]), st.integers(0, 8)), max_size=40))
def test_any_interleaving_matches_a_fifo_of_buffers(ops: list[tuple[str, int]]) -> None:
    """Posts, sends on either QP and armings in any order: each SEND takes the oldest buffer
    posted, an empty SRQ fails that requester (RNR), and the limit fires exactly when a take
    leaves fewer than the armed limit -- a FIFO and a number, the model."""
    bed = Bed(_fabric())
    fifo: list[int] = []
    limit = 0
    expected_events = 0
    broken = [False, False]
    next_id = 0
    taken: list[int] = []
    for op, n in ops:
        if op == "post":
            if len(fifo) < bed.srq.max_wr:
                bed.post(next_id)
                fifo.append(next_id)
                next_id += 1
        elif op == "arm":
            bed.srq.arm(n)
            limit = n
        else:
            i = int(op[-1])
            if broken[i]:
                continue
            bed.send(i, 1000 + next_id, b"m")
            if not fifo:
                broken[i] = True  # (RNR: that requester's QP is in ERROR now)
                continue
            taken.append(fifo.pop(0))
            if limit and len(fifo) < limit:
                limit = 0
                expected_events += 1
    got = [e[0] for e in bed.r.poll() if e[1] == 0]
    assert got == taken
    assert bed.srq.posted == len(fifo) and bed.srq.limit == limit
    events = 0
    while (ev := bed.r.ctx.get_async_event()) is not None:
        assert ev.event_type == SRQ_LIMIT_REACHED
        events += 1
    assert events == expected_events
    for i in (0, 1):
        assert (bed.a[i].qp.state == QPState.ERR) == broken[i]
    bed.close()
