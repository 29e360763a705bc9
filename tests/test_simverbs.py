"""The simulated RC wire (aiordma.testing._simverbs): verbs semantics without an RNIC."""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import select
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from aiordma._errors import PostError, RDMAError
from aiordma._rdma.constants import (
    INLINE,
    SIGNALED,
    SOLICITED,
    Access,
    Opcode,
    QPState,
    SendWR,
    WCOpcode,
    WCStatus,
)
from aiordma.testing._simverbs import (
    SimCompletionChannel,
    SimCompletionQueue,
    SimContext,
    SimFabric,
    SimMemoryRegion,
    SimProtectionDomain,
    SimQueuePair,
    SimWCArray,
)

from ._sim_sides import ALL_ACCESS, QP_RW, Side, _ip_of, bring_up, side


@pytest.fixture
def fab() -> SimFabric:
    f = SimFabric()
    f.add_device("simA", "10.0.0.1")
    f.add_device("simB", "10.0.0.2")
    return f


@pytest.fixture
def pair(fab: SimFabric) -> Iterator[tuple[Side, Side]]:
    a, b = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, a, b)
    yield a, b
    a.close()
    b.close()
    assert fab.live_objects() == dict.fromkeys(fab.live_objects(), 0)


def send(a: Side, wr_id: int, off: int, length: int, imm: int | None = None, **kw: bool) -> None:
    op = Opcode.SEND if imm is None else Opcode.SEND_WITH_IMM
    a.qp.post_send(SendWR(op, wr_id=wr_id, addr=a.mr.addr + off, length=length, lkey=a.mr.lkey, imm_data=imm, **kw))


def recv(b: Side, wr_id: int, off: int, length: int) -> None:
    b.qp.post_recv(b.mr.addr + off, length, b.mr.lkey, wr_id)


# --------------------------------------------------------------------------
# bring-up
# --------------------------------------------------------------------------


def test_bring_up_on_two_devices(fab: SimFabric) -> None:
    assert fab.device_names() == ["simA", "simB"]
    g = fab.gid_for_ip("10.0.0.2")
    assert g is not None and (g.device, g.port, g.index, g.gid_type) == ("simB", 1, 1, "RoCEv2")
    assert g.gid == ipaddress.IPv6Address("::ffff:10.0.0.2") and g.ip == ipaddress.IPv4Address("10.0.0.2")
    assert fab.gid_for_ip("10.9.9.9") is None
    a, b = side(fab, "simA"), side(fab, "simB")
    assert a.qp.state == QPState.RESET
    assert a.qp.qp_num != b.qp.qp_num and all(0 < q < 1 << 24 for q in (a.qp.qp_num, b.qp.qp_num))
    assert len({a.mr.lkey, a.mr.rkey, b.mr.lkey, b.mr.rkey}) == 4
    assert a.ctx.query_port().active_mtu == 4096 and a.ctx.query_port().state == 4
    assert a.ctx.query_gid(1, 1) == ipaddress.IPv6Address("::ffff:10.0.0.1")
    assert a.ctx.query_device().max_qp_wr == 4096
    bring_up(fab, a, b)
    assert a.qp.state == b.qp.state == QPState.RTS
    recv(b, 1, 0, 16)
    a.mr.write(0, b"hi")
    send(a, 2, 0, 2)
    assert b.poll() == [(1, 0, WCOpcode.RECV, 2, -1, b.qp.qp_num)]
    assert a.poll() == [(2, 0, WCOpcode.SEND, 2, -1, a.qp.qp_num)]
    assert b.mr.read(0, 2) == b"hi"
    a.close()
    b.close()


def test_bring_up_on_one_device_shared_cq(fab: SimFabric) -> None:
    ctx = fab.open_context("simA")
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(16)
    q1, q2 = pd.create_qp(cq), pd.create_qp(cq)
    mr = pd.reg_mr(4096)
    gid = ctx.query_gid(1, 1)
    for me, peer in ((q1, q2), (q2, q1)):
        me.to_init()
        me.to_rtr(peer.qp_num, gid, sgid_index=1)
        me.to_rts()
    q2.post_recv(mr.addr + 100, 100, mr.lkey, 7)
    mr.write(0, b"loop")
    q1.post_send_imm(8, mr.addr, 4, mr.lkey, 0xDEADBEEF, SIGNALED)
    wc = SimWCArray(8)
    n = cq.poll_into(wc)
    # the receive completes first, then the requester's completion (its ACK)
    assert wc.entries(n) == [(7, 0, WCOpcode.RECV, 4, 0xDEADBEEF, q2.qp_num), (8, 0, WCOpcode.SEND, 4, -1, q1.qp_num)]
    assert wc[0].imm_data == 0xDEADBEEF and wc[0].src_qp == q1.qp_num and wc[1].imm_data is None
    assert mr.read(100, 4) == b"loop"
    for obj in (q1, q2, cq, mr, pd, ctx):
        obj.close()
    fab.assert_no_live_objects()


def test_state_transitions_in_order(fab: SimFabric) -> None:
    a = side(fab, "simA")
    gid = a.ctx.query_gid(1, 1)
    with pytest.raises(RDMAError) as e:
        a.qp.to_rtr(5, gid, sgid_index=1)
    assert e.value.errno == errno.EINVAL
    with pytest.raises(RDMAError):
        a.qp.to_rts()
    a.qp.to_error()  # from RESET: a silent no-op, as with the native binding
    assert a.qp.state == QPState.RESET
    a.qp.to_init()
    with pytest.raises(RDMAError):
        a.qp.to_init()
    with pytest.raises(RDMAError):
        a.qp.to_rts()
    with pytest.raises(ValueError):
        a.qp.to_rtr(5, gid, sgid_index=1, path_mtu=1500)
    with pytest.raises(RDMAError):
        a.qp.to_rtr(5, gid, sgid_index=9)
    a.qp.to_rtr(5, gid, sgid_index=1)
    a.qp.to_rts()
    a.qp.to_error()
    assert a.qp.state == QPState.ERR
    with pytest.raises(RDMAError):
        a.qp.to_rts()
    a.close()


def test_caps_rounding_and_limits(fab: SimFabric) -> None:
    fab.add_device("small", "10.0.0.3", max_qp_wr=128, max_inline_data=64, max_cqe=32)
    ctx = fab.open_context("small")
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(32)
    with pd.create_qp(cq, max_send_wr=100, max_recv_wr=3, max_inline_data=64) as qp:
        assert (qp.caps.max_send_wr, qp.caps.max_recv_wr, qp.caps.max_inline_data) == (128, 4, 64)
    for kw in ({"max_send_wr": 129}, {"max_recv_wr": 1000}, {"max_inline_data": 65}):
        with pytest.raises(RDMAError) as e:
            pd.create_qp(cq, **kw)  # type: ignore[arg-type]
        assert e.value.errno == errno.EINVAL
    with pytest.raises(RDMAError):
        ctx.create_cq(33)
    with pytest.raises(RDMAError) as e2:
        fab.open_context("nope")
    assert e2.value.errno == errno.ENODEV
    cq.close()
    pd.close()
    ctx.close()
    fab.assert_no_live_objects()


def test_posting_before_rts_is_einval(fab: SimFabric) -> None:
    a = side(fab, "simA")
    with pytest.raises(PostError) as e:
        recv(a, 1, 0, 8)  # RESET: no receives yet
    assert (e.value.errno, e.value.posted) == (errno.EINVAL, 0)
    a.qp.to_init()
    recv(a, 1, 0, 8)  # INIT accepts receives ...
    with pytest.raises(PostError) as e:
        send(a, 2, 0, 8)  # ... but not sends
    assert (e.value.errno, e.value.posted, e.value.total) == (errno.EINVAL, 0, 1)
    a.close()


# --------------------------------------------------------------------------
# SEND
# --------------------------------------------------------------------------


def test_send_with_imm_arrives(pair: tuple[Side, Side]) -> None:
    a, b = pair
    for i in range(3):
        recv(b, 10 + i, i * 1000, 1000)
    payloads = [b"alpha", b"", b"x" * 1000]
    for i, p in enumerate(payloads):
        a.mr.write(i * 1000, p)
        send(a, 20 + i, i * 1000, len(p), imm=i + 0x100, solicited=True)
    assert b.poll() == [(10 + i, 0, WCOpcode.RECV, len(p), i + 0x100, b.qp.qp_num) for i, p in enumerate(payloads)]
    assert [b.mr.read(i * 1000, len(p)) for i, p in enumerate(payloads)] == payloads
    assert [e[:4] for e in a.poll()] == [(20 + i, 0, WCOpcode.SEND, len(p)) for i, p in enumerate(payloads)]


def test_unsignaled_sends_are_retired_by_a_signaled_one(fab: SimFabric) -> None:
    a, b = side(fab, "simA", max_send_wr=4), side(fab, "simB")
    bring_up(fab, a, b)
    assert a.qp.caps.max_send_wr == 4
    for i in range(8):
        recv(b, i, i * 8, 8)
    wrs = [SendWR(Opcode.SEND, wr_id=i, addr=a.mr.addr, length=8, lkey=a.mr.lkey, signaled=i == 2) for i in range(6)]
    with pytest.raises(PostError) as e:
        a.qp.post_send_batch(wrs)
    assert (e.value.errno, e.value.posted, e.value.total) == (errno.ENOMEM, 4, 6)
    assert len(b.poll()) == 4  # the four that fitted were posted (and delivered)
    with pytest.raises(PostError):  # the slots are not free until the signaled completion is polled
        send(a, 9, 0, 8)
    assert a.poll() == [(2, 0, WCOpcode.SEND, 8, -1, a.qp.qp_num)]  # only the signaled one completes
    # polling it retired WRs 0..2; WR 3 (unsignaled, after it) still holds its slot
    a.qp.post_send_batch([SendWR(Opcode.SEND, wr_id=i, addr=a.mr.addr, length=8, lkey=a.mr.lkey) for i in (4, 5, 6)])
    with pytest.raises(PostError) as e:
        send(a, 7, 0, 8)
    assert e.value.posted == 0
    assert fab.counters["posts"] == 7
    a.close()
    b.close()


def test_rnr_when_no_receive_is_posted(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    send(a, 1, 0, 4, signaled=False)  # failures complete even when unsignaled
    assert a.poll() == [(1, WCStatus.RNR_RETRY_EXC_ERR, WCOpcode.SEND, 0, -1, a.qp.qp_num)]
    assert a.qp.state == QPState.ERR and b.qp.state == QPState.RTS
    assert fab.counters["rnr_errors"] == 1
    assert b.poll() == []


def test_payload_longer_than_the_receive_buffer(pair: tuple[Side, Side]) -> None:
    a, b = pair
    recv(b, 1, 0, 10)
    recv(b, 2, 10, 10)
    send(a, 3, 0, 11)
    assert a.poll() == [(3, WCStatus.REM_INV_REQ_ERR, WCOpcode.SEND, 0, -1, a.qp.qp_num)]
    got = b.poll()
    assert [(e[0], e[1]) for e in got] == [(1, WCStatus.LOC_LEN_ERR), (2, WCStatus.WR_FLUSH_ERR)]
    assert a.qp.state == b.qp.state == QPState.ERR


def test_local_protection(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, a, b)
    other_pd = a.ctx.alloc_pd()
    foreign = other_pd.reg_mr(4096)
    recv(b, 1, 0, 64)
    send(a, 2, 8190, 4)  # runs past the end of the MR
    assert a.poll()[0][:2] == (2, WCStatus.LOC_PROT_ERR)
    assert a.qp.state == QPState.ERR
    assert b.poll() == []  # nothing was sent; the receive is still posted
    # an MR of another PD is no good either, nor an unknown lkey
    for bad in ((foreign.addr, foreign.lkey), (a.mr.addr, 0x1234)):
        c, d = side(fab, "simA"), side(fab, "simB")
        bring_up(fab, c, d)
        recv(d, 1, 0, 64)
        c.qp.post_send(SendWR(Opcode.SEND, wr_id=3, addr=bad[0], length=4, lkey=bad[1]))
        assert c.poll()[0][:2] == (3, WCStatus.LOC_PROT_ERR)
        c.close()
        d.close()
    # a receive buffer outside its MR fails at the responder when it is consumed
    c, d = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, c, d)
    d.qp.post_recv(d.mr.addr + 8180, 64, d.mr.lkey, 5)
    send(c, 6, 0, 32)
    assert d.poll()[0][:2] == (5, WCStatus.LOC_PROT_ERR)
    assert c.poll()[0][:2] == (6, WCStatus.REM_OP_ERR)
    foreign.close()
    other_pd.close()
    for s in (a, b, c, d):
        s.close()
    fab.assert_no_live_objects()


def test_inline_limit(fab: SimFabric) -> None:
    a, b = side(fab, "simA", max_inline_data=64), side(fab, "simB")
    bring_up(fab, a, b)
    recv(b, 1, 0, 128)
    recv(b, 2, 128, 128)
    a.mr.write(0, b"i" * 64)
    # inline needs no lkey: the data is copied at post time
    a.qp.post_send(SendWR(Opcode.SEND, wr_id=3, addr=a.mr.addr, length=64, lkey=0, inline=True))
    a.mr.write(0, b"changed after posting")
    assert b.poll() == [(1, 0, WCOpcode.RECV, 64, -1, b.qp.qp_num)] and b.mr.read(0, 64) == b"i" * 64
    with pytest.raises(PostError) as e:
        a.qp.post_send(SendWR(Opcode.SEND, wr_id=4, addr=a.mr.addr, length=65, inline=True))
    assert (e.value.errno, e.value.posted) == (errno.EINVAL, 0)
    a.qp.post_send_imm(5, a.mr.addr, 10, 0, 42, SIGNALED | INLINE)
    assert b.poll() == [(2, 0, WCOpcode.RECV, 10, 42, b.qp.qp_num)]
    with pytest.raises(TypeError):
        a.qp.post_send_imm(6, a.mr.addr, 10, 0, 42, True)  # flags, not the old `signaled` bool
    assert [e[0] for e in a.poll()] == [3, 5]
    a.close()
    b.close()


# --------------------------------------------------------------------------
# WRITE and READ
# --------------------------------------------------------------------------


def write(a: Side, b: Side, wr_id: int, off: int, length: int, *, rkey: int | None = None, imm: int | None = None,
          roff: int = 0) -> None:  # fmt: skip
    op = Opcode.RDMA_WRITE if imm is None else Opcode.RDMA_WRITE_WITH_IMM
    a.qp.post_send(SendWR(op, wr_id=wr_id, addr=a.mr.addr + off, length=length, lkey=a.mr.lkey,
                          remote_addr=b.mr.addr + roff, rkey=b.mr.rkey if rkey is None else rkey, imm_data=imm))


def test_write_with_granted_rkey(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.mr.write(0, b"written")
    write(a, b, 1, 0, 7, roff=100)
    assert b.mr.read(100, 7) == b"written"
    assert a.poll() == [(1, 0, WCOpcode.RDMA_WRITE, 7, -1, a.qp.qp_num)]
    assert b.poll() == []  # a plain WRITE completes nothing at the responder


@pytest.mark.parametrize("why", ["mr-not-granted", "bad-rkey", "out-of-range", "qp-not-granted"])
def test_write_refused(fab: SimFabric, why: str) -> None:
    a = side(fab, "simA")
    b = side(fab, "simB", mr_access=Access.LOCAL_WRITE if why == "mr-not-granted" else ALL_ACCESS)
    bring_up(fab, a, b, access=Access.LOCAL_WRITE if why == "qp-not-granted" else QP_RW)
    recv(b, 9, 0, 8)
    write(a, b, 1, 0, 16, rkey=0x42 if why == "bad-rkey" else None, roff=8180 if why == "out-of-range" else 0)
    assert a.poll() == [(1, WCStatus.REM_ACCESS_ERR, WCOpcode.RDMA_WRITE, 0, -1, a.qp.qp_num)]
    assert a.qp.state == QPState.ERR
    # the responder detected a remote access error: it goes to ERROR too (as rxe does)
    assert b.qp.state == QPState.ERR and b.poll()[0][:2] == (9, WCStatus.WR_FLUSH_ERR)
    assert b.mr.read(0, 16) == bytes(16)
    a.close()
    b.close()


def test_zero_length_write_probe_needs_no_rkey(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB", mr_access=Access.LOCAL_WRITE)  # no remote-access MR at all
    bring_up(fab, a, b)
    a.qp.post_send(SendWR(Opcode.RDMA_WRITE, wr_id=77, length=0))
    assert a.poll() == [(77, 0, WCOpcode.RDMA_WRITE, 0, -1, a.qp.qp_num)]
    assert b.qp.state == QPState.RTS and b.poll() == []
    a.close()
    b.close()


def test_write_with_imm_consumes_a_receive(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.mr.write(0, b"imm-write")
    write(a, b, 1, 0, 9, imm=5)  # no receive posted yet: RNR
    assert a.poll()[0][:2] == (1, WCStatus.RNR_RETRY_EXC_ERR)
    assert b.mr.read(0, 9) == bytes(9)  # and nothing was written


def test_write_with_imm_completes_at_the_responder(pair: tuple[Side, Side]) -> None:
    a, b = pair
    recv(b, 3, 4000, 0)  # its buffer is not used: the data goes to remote_addr
    a.mr.write(0, b"imm-write")
    write(a, b, 1, 0, 9, imm=0xFFFFFFFF, roff=16)
    assert b.poll() == [(3, 0, WCOpcode.RECV_RDMA_WITH_IMM, 9, 0xFFFFFFFF, b.qp.qp_num)]
    assert b.mr.read(16, 9) == b"imm-write"
    assert a.poll() == [(1, 0, WCOpcode.RDMA_WRITE, 9, -1, a.qp.qp_num)]
    with pytest.raises(OverflowError):
        write(a, b, 2, 0, 1, imm=1 << 32)


def test_read(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, a, b)
    b.mr.write(500, b"remote bytes")
    a.qp.post_send(SendWR(Opcode.RDMA_READ, wr_id=1, addr=a.mr.addr + 8, length=12, lkey=a.mr.lkey,
                          remote_addr=b.mr.addr + 500, rkey=b.mr.rkey))  # fmt: skip
    assert a.poll() == [(1, 0, WCOpcode.RDMA_READ, 12, -1, a.qp.qp_num)]
    assert a.mr.read(8, 12) == b"remote bytes"
    # READ refused: the responder MR lacks REMOTE_READ
    c, d = side(fab, "simA"), side(fab, "simB", mr_access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)
    bring_up(fab, c, d)
    c.qp.post_send(SendWR(Opcode.RDMA_READ, wr_id=2, addr=c.mr.addr, length=4, lkey=c.mr.lkey,
                          remote_addr=d.mr.addr, rkey=d.mr.rkey))  # fmt: skip
    assert c.poll()[0][:2] == (2, WCStatus.REM_ACCESS_ERR)
    # READ into a local MR without LOCAL_WRITE: local protection error
    e_, f_ = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, e_, f_)
    ro = e_.pd.reg_mr(64, 0)
    e_.extra.append(ro)
    e_.qp.post_send(SendWR(Opcode.RDMA_READ, wr_id=3, addr=ro.addr, length=4, lkey=ro.lkey,
                           remote_addr=f_.mr.addr, rkey=f_.mr.rkey))  # fmt: skip
    assert e_.poll()[0][:2] == (3, WCStatus.LOC_PROT_ERR)
    for s in (a, b, c, d, e_, f_):
        s.close()
    fab.assert_no_live_objects()


# --------------------------------------------------------------------------
# ERROR state and flushing
# --------------------------------------------------------------------------


def test_to_error_flushes_receives_in_order(pair: tuple[Side, Side]) -> None:
    a, b = pair
    for i in range(5):
        recv(b, i, i * 10, 10)
    b.qp.to_error()
    assert b.poll() == [(i, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, -1, b.qp.qp_num) for i in range(5)]
    # a QP in ERROR takes no traffic: the requester sees a transport retry error
    send(a, 9, 0, 1)
    assert a.poll()[0][:2] == (9, WCStatus.RETRY_EXC_ERR)
    # posting to a QP in ERROR completes at once, flushed, signaled or not
    recv(b, 20, 0, 8)
    send(a, 21, 0, 8, signaled=False)
    assert b.poll() == [(20, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, -1, b.qp.qp_num)]
    assert a.poll() == [(21, WCStatus.WR_FLUSH_ERR, WCOpcode.SEND, 0, -1, a.qp.qp_num)]


def test_receive_queue_limit(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB", max_recv_wr=3)
    bring_up(fab, a, b)
    assert b.qp.caps.max_recv_wr == 4
    with pytest.raises(PostError) as e:
        b.qp.post_recv_batch([b.mr.addr] * 6, [8] * 6, b.mr.lkey, list(range(6)))
    assert (e.value.errno, e.value.posted, e.value.total) == (errno.ENOMEM, 4, 6)
    send(a, 1, 0, 8)  # consuming one frees its slot at once
    recv(b, 7, 0, 8)
    with pytest.raises(PostError):
        recv(b, 8, 0, 8)
    a.close()
    b.close()


# --------------------------------------------------------------------------
# Notification
# --------------------------------------------------------------------------


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_channel_fd_becomes_readable_when_armed(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    fd = b.ch.fileno()
    recv(b, 1, 0, 8)
    recv(b, 2, 0, 8)
    send(a, 3, 0, 8)  # not armed: no event
    assert not readable(fd) and b.ch.drain_events() == 0
    b.cq.req_notify()
    assert not readable(fd)  # an entry already queued does not fire
    send(a, 4, 0, 8)
    assert readable(fd)
    assert b.ch.drain_events() == 1  # one event per arming
    assert not readable(fd)
    assert [e[0] for e in b.poll()] == [1, 2]
    assert fab.counters["events"] == 1 and fab.counters["req_notify"] == 1


def test_arming_does_not_fire_for_queued_entries(pair: tuple[Side, Side]) -> None:
    a, b = pair
    recv(b, 1, 0, 8)
    send(a, 2, 0, 8)
    b.cq.req_notify()
    assert b.ch.drain_events() == 0  # hence: poll after arming, or sleep forever
    assert len(b.poll()) == 1
    b.cq.req_notify()
    recv(b, 3, 0, 8)
    send(a, 4, 0, 8)
    assert b.ch.drain_events() == 1


def test_solicited_only_arming(pair: tuple[Side, Side]) -> None:
    a, b = pair
    for i in range(4):
        recv(b, i, i * 8, 8)
    b.cq.req_notify(solicited_only=True)
    send(a, 10, 0, 8)  # not solicited: no event
    assert b.ch.drain_events() == 0
    send(a, 11, 0, 8, solicited=True)
    assert b.ch.drain_events() == 1
    b.cq.req_notify(solicited_only=True)
    a.qp.post_send_imm(12, a.mr.addr, 8, a.mr.lkey, 1, SIGNALED | SOLICITED)
    assert b.ch.drain_events() == 1
    # an error completion qualifies too
    b.cq.req_notify(solicited_only=True)
    send(a, 13, 0, 9)  # longer than the buffer: LOC_LEN_ERR at b
    assert b.ch.drain_events() == 1
    assert [e[1] for e in b.poll()] == [0, 0, 0, WCStatus.LOC_LEN_ERR]


def test_asyncio_add_reader_on_the_channel_fd(pair: tuple[Side, Side]) -> None:
    a, b = pair

    async def main() -> int:
        loop = asyncio.get_running_loop()
        woke: asyncio.Future[int] = loop.create_future()

        def on_readable() -> None:
            if not woke.done():
                woke.set_result(b.ch.drain_events())

        loop.add_reader(b.ch.fileno(), on_readable)
        try:
            recv(b, 1, 0, 8)
            b.cq.req_notify()
            assert b.poll() == []  # the verbs idiom: arm, then poll once more
            loop.call_soon(a.qp.post_send_imm, 2, a.mr.addr, 8, a.mr.lkey, 99, SIGNALED)
            return await asyncio.wait_for(woke, 5)
        finally:
            loop.remove_reader(b.ch.fileno())

    assert asyncio.run(main()) == 1
    assert b.poll() == [(1, 0, WCOpcode.RECV, 8, 99, b.qp.qp_num)]


def test_cq_overflow_raises_an_async_event(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB", cqe=4)
    bring_up(fab, a, b)
    assert b.cq.cqe == 4
    for i in range(8):
        recv(b, i, i * 8, 8)
    assert b.ctx.get_async_event() is None
    for i in range(5):
        send(a, 100 + i, 0, 8)
    assert b.cq.overrun
    assert readable(b.ctx.fileno())
    ev = b.ctx.get_async_event()
    assert ev is not None and (ev.event_type, ev.name, ev.element_kind) == (0, "IBV_EVENT_CQ_ERR", "cq")
    assert ev.cq is b.cq and ev.description == "CQ error"
    assert b.ctx.get_async_event() is None and not readable(b.ctx.fileno())
    assert b.qp.state == QPState.ERR  # every QP on the CQ
    assert [e[0] for e in b.poll()] == [0, 1, 2, 3]  # the fifth and the flushes were lost
    assert fab.counters["cq_overruns"] == 1
    a.close()
    b.close()


def test_post_async_event(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    fab.post_async_event("simA", 1, qp_num=a.qp.qp_num)
    ev = a.ctx.get_async_event()
    assert ev is not None and (ev.name, ev.element_kind, ev.qp) == ("IBV_EVENT_QP_FATAL", "qp", a.qp)
    fab.post_async_event("simB", 10)
    ev = b.ctx.get_async_event()
    assert ev is not None and (ev.name, ev.element_kind, ev.port) == ("IBV_EVENT_PORT_ERR", "port", 1)
    assert a.ctx.get_async_event() is None


# --------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------


def test_unreachable_gid(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB")
    a.qp.to_init()
    a.qp.to_rtr(b.qp.qp_num, "10.0.0.99", sgid_index=1)  # right QP number, wrong GID
    a.qp.to_rts()
    b.qp.to_init()
    b.qp.to_rtr(a.qp.qp_num, "10.0.0.1", sgid_index=1)
    b.qp.to_rts()
    assert a.qp.state == QPState.RTS  # it comes up ...
    recv(b, 1, 0, 8)
    send(a, 2, 0, 8)  # ... but reaches nobody
    assert a.poll() == [(2, WCStatus.RETRY_EXC_ERR, WCOpcode.SEND, 0, -1, a.qp.qp_num)]
    assert a.qp.state == QPState.ERR and b.poll() == []
    a.close()
    b.close()


def test_kill_qp(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    recv(b, 1, 0, 8)
    recv(a, 2, 0, 8)
    fab.kill_qp(b.qp.qp_num)
    send(a, 3, 0, 8)
    assert a.poll() == [(3, WCStatus.RETRY_EXC_ERR, WCOpcode.SEND, 0, -1, a.qp.qp_num),
                        (2, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, -1, a.qp.qp_num)]  # fmt: skip
    assert a.qp.state == QPState.ERR
    # the dead side receives nothing; its own sends fail and its teardown gets its flushes
    b.qp.post_send(SendWR(Opcode.SEND, wr_id=4, addr=b.mr.addr, length=8, lkey=b.mr.lkey))
    b.qp.to_error()
    assert [(w[0], w[1]) for w in b.poll()] == [(4, WCStatus.RETRY_EXC_ERR), (1, WCStatus.WR_FLUSH_ERR)]


def test_closed_qp_is_unknown_to_the_fabric(pair: tuple[Side, Side]) -> None:
    a, b = pair
    b.qp.close()
    send(a, 1, 0, 8)
    assert a.poll()[0][:2] == (1, WCStatus.RETRY_EXC_ERR)
    with pytest.raises(RDMAError) as e:
        recv(b, 1, 0, 8)
    assert e.value.errno == errno.EBADF


def test_fail_next_on_the_send_side(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    recv(b, 1, 0, 8)
    recv(a, 9, 0, 8)
    fab.fail_next(a.qp.qp_num, WCStatus.LOC_QP_OP_ERR)
    send(a, 2, 0, 8, signaled=False)
    assert a.poll() == [(2, WCStatus.LOC_QP_OP_ERR, WCOpcode.SEND, 0, -1, a.qp.qp_num),
                        (9, WCStatus.WR_FLUSH_ERR, WCOpcode.RECV, 0, -1, a.qp.qp_num)]  # fmt: skip
    assert a.qp.state == QPState.ERR and b.qp.state == QPState.RTS
    assert b.poll() == []  # the failed WR did not take effect
    wc = a.wc
    err = wc[0].error("ibv_poll_cq")  # the record from the last poll is still in the array
    assert isinstance(err, RDMAError) and err.errno == errno.EIO and err.wc_status == "IBV_WC_LOC_QP_OP_ERR"


def test_fail_next_on_the_receive_side(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    recv(b, 1, 0, 8)
    recv(b, 2, 8, 8)
    send(a, 3, 0, 8)
    fab.fail_next(b.qp.qp_num, WCStatus.LOC_PROT_ERR)
    send(a, 4, 0, 8)
    assert [e[:2] for e in b.poll()] == [(1, 0), (2, WCStatus.LOC_PROT_ERR)]
    assert [e[:2] for e in a.poll()] == [(3, 0), (4, WCStatus.REM_OP_ERR)]
    assert a.qp.state == b.qp.state == QPState.ERR


def test_hold_acks(pair: tuple[Side, Side], fab: SimFabric) -> None:
    a, b = pair
    fab.hold_acks = True
    for i in range(3):
        recv(b, i, i * 8, 8)
    send(a, 10, 0, 8)
    send(a, 11, 8, 8)
    assert len(b.poll()) == 2  # the data arrived ...
    assert a.poll() == []  # ... but the ACKs did not yet
    a.qp.to_error()  # to_error leaves held completions as they were
    send(a, 12, 0, 8)  # flushed, and queued behind the held ones (FIFO per send queue)
    assert a.poll() == []
    assert fab.release_acks() == 3
    assert [e[:2] for e in a.poll()] == [(10, 0), (11, 0), (12, WCStatus.WR_FLUSH_ERR)]
    assert fab.release_acks() == 0


def test_hold_acks_keeps_sq_slots_busy(fab: SimFabric) -> None:
    a, b = side(fab, "simA", max_send_wr=2), side(fab, "simB")
    bring_up(fab, a, b)
    fab.hold_acks = True
    for i in range(3):
        recv(b, i, 0, 8)
    send(a, 1, 0, 8)
    send(a, 2, 0, 8)
    with pytest.raises(PostError):
        send(a, 3, 0, 8)
    fab.hold_acks = False
    assert fab.release_acks() == 2
    assert len(a.poll()) == 2
    send(a, 3, 0, 8)
    assert a.poll()[0][:2] == (3, 0)
    a.close()
    b.close()


# --------------------------------------------------------------------------
# Lifetimes
# --------------------------------------------------------------------------


def test_parents_refuse_to_close_before_children(fab: SimFabric) -> None:
    a = side(fab, "simA")
    for parent in (a.ctx, a.pd, a.cq, a.ch):
        with pytest.raises(RDMAError) as e:
            parent.close()
        assert e.value.errno == errno.EBUSY
        assert not parent.closed
    a.close()
    for obj in (a.qp, a.cq, a.ch, a.mr, a.pd, a.ctx):
        assert obj.closed
        obj.close()  # idempotent
    with pytest.raises(RDMAError) as e:
        a.qp.post_send(SendWR(Opcode.SEND))
    assert e.value.errno == errno.EBADF


def test_objects_of_another_provider_are_refused(fab: SimFabric) -> None:
    """An object handed back to the provider (a CQ to create_qp, an array to poll_into, a window
    to bind) must be its own: anything else is a TypeError naming the call, and nothing is made."""

    class Impostor:
        rkey = 0
        cqe = 8

    a, b = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, a, b)
    mw = a.pd.alloc_mw()
    live = fab.live_objects()
    calls = [
        ("ibv_create_qp", lambda: a.pd.create_qp(Impostor())),  # type: ignore[arg-type]
        ("ibv_create_qp", lambda: a.pd.create_qp(a.cq, Impostor())),  # type: ignore[arg-type]
        ("ibv_create_cq", lambda: a.ctx.create_cq(8, Impostor())),  # type: ignore[arg-type]
        ("ibv_poll_cq", lambda: a.cq.poll_into(Impostor())),  # type: ignore[arg-type]
        ("aiordma_wake", lambda: a.cq.native_waker(Impostor())),  # type: ignore[arg-type]
        ("BIND_MW", lambda: a.qp.post_bind_mw(1, Impostor(), a.mr, a.mr.addr, 8, Access.REMOTE_READ)),  # type: ignore[arg-type]
        ("BIND_MW", lambda: a.qp.post_bind_mw(1, mw, Impostor(), 0, 8, Access.REMOTE_READ)),  # type: ignore[arg-type]
    ]
    for call, attempt in calls:
        with pytest.raises(TypeError, match=call):
            attempt()
    assert fab.live_objects() == live
    assert a.qp.state == QPState.RTS and not a.cq.poll()  # (a refused bind posted nothing)
    mw.close()
    a.close()
    b.close()
    assert fab.live_objects() == dict.fromkeys(live, 0)


def test_everything_released(fab: SimFabric) -> None:
    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before = fds()
    buf = bytearray(1000)
    with fab.open_context("simA") as ctx, ctx.alloc_pd() as pd, ctx.create_comp_channel() as ch:
        with ctx.create_cq(8, ch) as cq, pd.create_qp(cq) as qp, pd.reg_mr(5000) as mr:
            with pd.reg_buffer(buf, Access.LOCAL_WRITE) as bmr:
                live = fab.live_objects()
                assert live == {"contexts": 1, "pds": 1, "mrs": 2, "mws": 0, "cqs": 1, "channels": 1, "qps": 1, "srqs": 0,
                                "registered_bytes": 6000}  # fmt: skip
                assert fds() - before  # the context and the channel own real fds
                bmr.write(10, b"abc")
                assert buf[10:13] == b"abc" and mr.read(0, 3) == bytes(3)
                with pytest.raises(BufferError):
                    buf.extend(b"x")  # exported (pinned) while registered
                assert qp.state == QPState.RESET
                with pytest.raises(TypeError):
                    pd.reg_buffer(b"read-only")
    assert fab.live_objects() == dict.fromkeys(live, 0)
    buf.extend(b"x")  # released
    assert fds() == before


def test_deterministic_numbers_and_sq_sig_all() -> None:
    def build() -> tuple[SimFabric, Side, Side]:
        f = SimFabric(seed=7)
        f.add_device("simA", "10.0.0.1")
        f.add_device("simB", "10.0.0.2")
        a, b = side(f, "simA", sq_sig_all=True), side(f, "simB")
        bring_up(f, a, b)
        return f, a, b

    f1, a1, b1 = build()
    f2, a2, b2 = build()
    assert (a1.qp.qp_num, b1.qp.qp_num, a1.mr.lkey, b1.mr.rkey) == (a2.qp.qp_num, b2.qp.qp_num, a2.mr.lkey, b2.mr.rkey)
    recv(b1, 1, 0, 8)
    send(a1, 2, 0, 8, signaled=False)  # sq_sig_all: signaled anyway
    assert a1.poll() == [(2, 0, WCOpcode.SEND, 8, -1, a1.qp.qp_num)]
    for s in (a1, b1, a2, b2):
        s.close()
    f1.assert_no_live_objects()
    f2.assert_no_live_objects()


# --------------------------------------------------------------------------
# memory windows (type 2) and QP access: what a NIC enforces
# --------------------------------------------------------------------------


def _read(a: Side, wr_id: int, raddr: int, rkey: int, length: int = 16) -> None:
    a.qp.post_send(SendWR(Opcode.RDMA_READ, wr_id=wr_id, addr=a.mr.addr, length=length, lkey=a.mr.lkey,
                          remote_addr=raddr, rkey=rkey))  # fmt: skip


def test_a_window_is_reachable_only_through_the_qp_that_bound_it(fab: SimFabric) -> None:
    """B's QP 1 binds a window on its memory; A's READ through QP 1's peer works; a third QP
    (same device, same PD as B's QP 1) refuses the same rkey; dealloc kills it at once."""
    a, b = side(fab, "simA"), side(fab, "simB", mr_access=Access.LOCAL_WRITE | Access.MW_BIND)
    bring_up(fab, a, b)
    b.mr.write(0, b"window contents.")
    mw = b.pd.alloc_mw()
    rkey = b.qp.post_bind_mw(7, mw, b.mr, b.mr.addr, 16, Access.REMOTE_READ)
    assert b.poll() == [(7, 0, WCOpcode.BIND_MW, 0, -1, b.qp.qp_num)]
    assert rkey != b.mr.rkey and mw.rkey == rkey
    _read(a, 1, b.mr.addr, rkey)
    assert a.poll() == [(1, 0, WCOpcode.RDMA_READ, 16, -1, a.qp.qp_num)]
    assert a.mr.read(0, 16) == b"window contents."
    # the region's own rkey grants nothing (MW_BIND, no remote access)
    _read(a, 2, b.mr.addr, b.mr.rkey)
    assert a.poll()[0][:2] == (2, WCStatus.REM_ACCESS_ERR)
    # a second connection to the same PD of B: its QP may not use the window bound to B's first
    c = side(fab, "simA")
    d_qp = b.pd.create_qp(b.cq)
    gid_b, gid_a = fab.gid_for_ip("10.0.0.2"), fab.gid_for_ip("10.0.0.1")
    assert gid_a is not None and gid_b is not None
    c.qp.to_init(1, access=QP_RW)
    c.qp.to_rtr(d_qp.qp_num, gid_b.gid, sgid_index=1, path_mtu=4096)
    c.qp.to_rts(0)
    d_qp.to_init(1, access=QP_RW)
    d_qp.to_rtr(c.qp.qp_num, gid_a.gid, sgid_index=1, path_mtu=4096)
    d_qp.to_rts(0)
    _read(c, 3, b.mr.addr, rkey)
    assert c.poll()[0][:2] == (3, WCStatus.REM_ACCESS_ERR)
    mw.close()
    d_qp.close()
    c.close()
    a.close()
    b.close()
    assert fab.live_objects() == dict.fromkeys(fab.live_objects(), 0)


def test_a_deallocated_window_and_a_qp_without_read_access_refuse(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB", mr_access=Access.LOCAL_WRITE | Access.MW_BIND)
    bring_up(fab, a, b, access=Access.LOCAL_WRITE | Access.REMOTE_WRITE)  # no REMOTE_READ on the QPs
    mw = b.pd.alloc_mw()
    rkey = b.qp.post_bind_mw(7, mw, b.mr, b.mr.addr, 64, Access.REMOTE_READ)
    _read(a, 1, b.mr.addr, rkey)
    assert a.poll()[0][:2] == (1, WCStatus.REM_ACCESS_ERR)  # the QP's own flags come first
    mw.close()
    a.close()
    b.close()
    a, b = side(fab, "simA"), side(fab, "simB", mr_access=Access.LOCAL_WRITE | Access.MW_BIND)
    bring_up(fab, a, b)
    mw = b.pd.alloc_mw()
    rkey = b.qp.post_bind_mw(7, mw, b.mr, b.mr.addr, 64, Access.REMOTE_READ)
    mw.close()  # invalidated now
    _read(a, 2, b.mr.addr, rkey)
    assert a.poll()[0][:2] == (2, WCStatus.REM_ACCESS_ERR)
    a.close()
    b.close()


def test_a_bind_the_rules_refuse_fails(fab: SimFabric) -> None:
    """A region without MW_BIND, a range outside it, remote write on memory without local write."""
    for access, grant, length in (
        (Access.LOCAL_WRITE, Access.REMOTE_READ, 16),
        (Access.LOCAL_WRITE | Access.MW_BIND, Access.REMOTE_READ, 9000),
        (Access.MW_BIND, Access.REMOTE_WRITE, 16),
    ):
        a, b = side(fab, "simA"), side(fab, "simB", mr_access=access)
        bring_up(fab, a, b)
        mw = b.pd.alloc_mw()
        b.qp.post_bind_mw(7, mw, b.mr, b.mr.addr, length, grant)
        assert b.poll()[0][:2] == (7, WCStatus.MW_BIND_ERR)
        assert b.qp.state == QPState.ERR
        mw.close()
        a.close()
        b.close()


def test_a_device_without_windows_says_so(fab: SimFabric) -> None:
    fab.add_device("siw0", "10.0.0.3", memory_windows=False)
    with fab.open_context("siw0") as ctx, ctx.alloc_pd() as pd:
        with pytest.raises(RDMAError) as ei:
            pd.alloc_mw()
        assert ei.value.errno == errno.EOPNOTSUPP


def test_read_only_memory_can_be_registered_for_remote_reads(fab: SimFabric) -> None:
    a, b = side(fab, "simA"), side(fab, "simB")
    bring_up(fab, a, b)
    data = bytes(range(64))
    with b.pd.reg_buffer(data, Access.REMOTE_READ) as ro:
        _read(a, 1, ro.addr, ro.rkey, 64)
        assert a.poll()[0][:2] == (1, 0)
        assert a.mr.read(0, 64) == data
    with pytest.raises(TypeError):
        b.pd.reg_buffer(data, Access.LOCAL_WRITE)
    a.close()
    b.close()
