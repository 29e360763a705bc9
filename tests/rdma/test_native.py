"""The native verbs layer (aiordma._verbs over aiordma._verbs_cffi) on a real device.

Runs in the Soft-RoCE guest (``python -m tools.vm -- python -m
pytest -m rdma tests/rdma``) or on a host with an RNIC.  Two of our own RC QPs
talk through the device's loopback; a pyverbs QP serves as an independent
oracle.  Every test ends with all verbs objects closed (live counters at 0).

Device selection: ``AIORDMA_TEST_DEVICE``, else the first of
``AIORDMA_VM_DEVICES``, else the device of the first RoCEv2 IPv4 GID.
"""

from __future__ import annotations

import errno
import ipaddress
import mmap
import os
import select
import sys
import threading
import time
from collections.abc import Iterator

from typing import Any

import pytest

from aiordma._rdma import discovery
from aiordma._rdma import verbs as v
from aiordma._errors import RDMAError

pytestmark = pytest.mark.rdma

if not v.native_available()[0]:
    pytest.skip(f"verbs unavailable: {v.native_available()[1]}", allow_module_level=True)

# the device under test (dev), the leak check of every test (no_leaks, autouse), the QP loop
from ._native import FULL_ACCESS, PORT, Dev, Loop, Side, dev, make_loop, no_leaks, wait_wcs  # noqa: E402,F401

DIST_PACKAGES = "/usr/lib/python3/dist-packages"


# --------------------------------------------------------------------------
# device / fixtures
# --------------------------------------------------------------------------


def test_default_access_is_local_only(dev: Dev) -> None:
    """Least privilege: a memory region is local-only unless a caller grants more."""
    with v.Context(dev.name) as ctx, ctx.alloc_pd() as pd, pd.reg_mr(4096) as mr:
        assert mr.access == v.Access.LOCAL_WRITE


@pytest.fixture
def loop(dev: Dev) -> Iterator[Loop]:
    lp = make_loop(dev)
    try:
        yield lp
    finally:
        lp.close()


# --------------------------------------------------------------------------
# discovery and queries
# --------------------------------------------------------------------------


def test_constants_match_the_headers() -> None:
    lib = v._lib
    for op in v.Opcode:
        assert getattr(lib, "IBV_WR_" + op.name) == op.value
    for name in ("SUCCESS", "WR_FLUSH_ERR", "RETRY_EXC_ERR", "RNR_RETRY_EXC_ERR"):
        assert getattr(lib, "IBV_WC_" + name) == v.WCStatus[name].value
    for name in ("RECV", "RECV_RDMA_WITH_IMM"):
        assert getattr(lib, "IBV_WC_" + name) == v.WCOpcode[name].value
    for st in ("RESET", "INIT", "RTR", "RTS"):
        assert getattr(lib, "IBV_QPS_" + st) == v.QPState[st].value
    assert lib.IBV_QPS_ERR == v.QPState.ERR
    for flag in v.Access:
        assert getattr(lib, "IBV_ACCESS_" + str(flag.name)) == flag.value
    for sflag in v.SendFlags:
        assert getattr(lib, "IBV_SEND_" + str(sflag.name)) == sflag.value
    assert lib.IBV_WC_WITH_IMM == v._WC_WITH_IMM
    assert lib.IBV_PORT_ACTIVE == 4 and lib.IBV_MTU_256 == 1 and lib.IBV_MTU_4096 == 5
    assert lib.IBV_EVENT_QP_FATAL == v.EVENT_NAMES.index("IBV_EVENT_QP_FATAL")
    assert lib.IBV_EVENT_QP_LAST_WQE_REACHED == v.EVENT_NAMES.index("IBV_EVENT_QP_LAST_WQE_REACHED")
    for status in v.WCStatus:  # our names agree with libibverbs' descriptions existing
        assert v.WorkCompletion(0, status, 0, 0, None, 0, 0, 0, 0).status_str


def test_native_available_and_list_devices(dev: Dev) -> None:
    ok, why = v.native_available()
    assert ok and dev.name in why
    devices = {d.name: d for d in discovery.list_devices()}
    info = devices[dev.name]
    port = info.ports[0]
    assert port.port == PORT and port.state == "ACTIVE" and port.link_layer == "Ethernet"
    assert port.active_mtu in (256, 512, 1024, 2048, 4096)
    gids = {g.index: g for g in port.gids}
    g = gids[dev.gid_index]
    assert g.gid_type == "RoCEv2" and g.netdev and g.ip == dev.gid.ipv4_mapped
    # the verbs GID table (ibv_query_gid_table) and the sysfs walk agree
    sysfs = {d.name: d for d in discovery.list_devices(query_verbs=False)}[dev.name]
    assert sysfs.ports[0].gids == port.gids
    assert sysfs.ports[0].active_mtu is None
    found = discovery.gid_for_ip(str(g.ip))
    assert found is not None and (found.device, found.port, found.index) == (dev.name, PORT, dev.gid_index)
    assert discovery.gid_for_ip("198.19.255.254") is None


@pytest.mark.skipif(os.environ.get("AIORDMA_IN_VM") != "1", reason="the guest's address plan")
def test_guest_address_plan() -> None:
    g = discovery.gid_for_ip("198.18.0.1")
    assert g is not None and (g.device, g.index, g.netdev) == ("rxe0", 1, "veth0")


def test_context_queries(dev: Dev) -> None:
    with v.Context(dev.name) as ctx:
        assert v.live_objects()["contexts"] == 1
        attr = ctx.query_device()
        assert attr.phys_port_cnt >= 1 and attr.max_qp_wr > 0 and attr.max_cqe > 0
        pa = ctx.query_port(PORT)
        assert pa.state_name == "ACTIVE" and pa.link_layer == "Ethernet" and pa.active_mtu >= 256
        assert ctx.query_gid(PORT, dev.gid_index) == dev.gid
        assert (dev.gid_index, dev.gid) in list(v.iter_gids(ctx, PORT))
        assert os.get_blocking(ctx.fileno()) is False
        assert ctx.get_async_event() is None  # non-blocking: nothing pending
        with ctx.create_comp_channel() as ch:
            assert os.get_blocking(ch.fileno()) is False
            assert ch.drain_events() == 0
    assert ctx.closed
    with pytest.raises(RDMAError) as ei:
        ctx.query_port()
    assert ei.value.errno == errno.EBADF


def test_open_unknown_device_raises() -> None:
    with pytest.raises(RDMAError) as ei:
        v.Context("no-such-dev0")
    assert ei.value.errno == errno.ENODEV and ei.value.call == "ibv_open_device"


def test_memory_region(dev: Dev) -> None:
    with v.Context(dev.name) as ctx, ctx.alloc_pd() as pd:
        with pd.reg_mr(10000) as mr:
            assert mr.addr % mmap.PAGESIZE == 0 and mr.length == 10000
            assert mr.lkey and mr.rkey is not None
            assert v.live_objects()["registered_bytes"] == 10000
            mr.write(100, b"hello")
            assert mr.read(100, 5) == b"hello"
            view = mr.view(0, 16)
        assert v.live_objects()["registered_bytes"] == 0
        assert view[0] == 0  # a view outlives the registration safely
        view.release()
        buf = bytearray(8192)
        with pd.reg_buffer(buf) as mr2:
            assert mr2.length == 8192
            mr2.write(0, b"xy")
        assert buf[:2] == b"xy"


def test_close_order_is_enforced(dev: Dev) -> None:
    ctx = v.Context(dev.name)
    pd = ctx.alloc_pd()
    mr = pd.reg_mr(4096)
    with pytest.raises(RDMAError) as ei:
        pd.close()
    assert ei.value.errno == errno.EBUSY and "memory region" in str(ei.value)
    with pytest.raises(RDMAError) as ei:
        ctx.close()
    assert ei.value.errno == errno.EBUSY and "protection domain" in str(ei.value)
    mr.close()
    pd.close()
    ctx.close()


def test_verbs_failures_raise_rdmaerror(dev: Dev) -> None:
    with v.Context(dev.name) as ctx, ctx.alloc_pd() as pd, ctx.create_cq(16) as cq:
        too_many = ctx.query_device().max_qp_wr + 1
        with pytest.raises(RDMAError) as ei:
            pd.create_qp(cq, max_send_wr=too_many)
        assert ei.value.call == "ibv_create_qp" and ei.value.errno
        with pd.create_qp(cq) as qp:
            assert qp.state == v.QPState.RESET
            with pytest.raises(RDMAError) as ei:
                qp.to_rts()  # RESET -> RTS is not a legal transition
            assert ei.value.call == "ibv_modify_qp(RTS)" and ei.value.errno == errno.EINVAL
            qp.to_init(PORT)
            with pytest.raises(RDMAError) as ei:
                qp.to_rtr(qp.qp_num, dev.gid, sgid_index=250)
            assert ei.value.call == "ibv_modify_qp(RTR)" and ei.value.errno
            with pytest.raises(ValueError):
                qp.to_rtr(qp.qp_num, dev.gid, sgid_index=dev.gid_index, path_mtu=1500)


# --------------------------------------------------------------------------
# traffic through the loopback
# --------------------------------------------------------------------------


def test_send_recv(loop: Loop) -> None:
    a, b = loop.a, loop.b
    b.qp.post_recv(b.mr.addr, 4096, b.mr.lkey, wr_id=7)
    payload = b"ping over rxe" * 10
    a.mr.write(0, payload)
    a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=9, addr=a.mr.addr, length=len(payload), lkey=a.mr.lkey))
    (s,) = wait_wcs(a.cq, 1)
    (r,) = wait_wcs(b.cq, 1)
    assert s.ok and s.wr_id == 9 and s.opcode == v.WCOpcode.SEND and s.qp_num == a.qp.qp_num
    assert r.ok and r.wr_id == 7 and r.opcode == v.WCOpcode.RECV and r.byte_len == len(payload)
    assert r.imm_data is None and r.status_name == "IBV_WC_SUCCESS" and r.is_recv
    assert b.mr.read(0, len(payload)) == payload


def test_send_with_imm_and_zero_length(loop: Loop) -> None:
    a, b = loop.a, loop.b
    b.qp.post_recv_batch([b.mr.addr, b.mr.addr + 4096], [4096, 4096], b.mr.lkey, [1, 2])
    a.mr.write(0, b"imm!")
    a.qp.post_send_batch(
        [
            v.SendWR(v.Opcode.SEND_WITH_IMM, wr_id=10, addr=a.mr.addr, length=4, lkey=a.mr.lkey, imm_data=0xDEADBEEF),
            v.SendWR(v.Opcode.SEND_WITH_IMM, wr_id=11, imm_data=0x01020304),  # no payload at all
        ]
    )
    assert [w.wr_id for w in wait_wcs(a.cq, 2)] == [10, 11]
    r1, r2 = wait_wcs(b.cq, 2)
    assert (r1.wr_id, r1.byte_len, r1.imm_data, r1.opcode) == (1, 4, 0xDEADBEEF, v.WCOpcode.RECV)
    assert (r2.wr_id, r2.byte_len, r2.imm_data) == (2, 0, 0x01020304)
    assert b.mr.read(0, 4) == b"imm!"


def test_rdma_write_read_and_write_with_imm(loop: Loop) -> None:
    a, b = loop.a, loop.b
    data = os.urandom(20000)
    a.mr.write(0, data)
    # RDMA WRITE: no receive consumed on b
    a.qp.post_send(
        v.SendWR(v.Opcode.RDMA_WRITE, wr_id=1, addr=a.mr.addr, length=len(data), lkey=a.mr.lkey,
                 remote_addr=b.mr.addr + 1000, rkey=b.mr.rkey)  # fmt: skip
    )
    (w,) = wait_wcs(a.cq, 1)
    assert w.ok and w.opcode == v.WCOpcode.RDMA_WRITE
    assert b.mr.read(1000, len(data)) == data
    assert b.cq.poll() == []
    # RDMA READ it back into another part of a's MR
    a.qp.post_send(
        v.SendWR(v.Opcode.RDMA_READ, wr_id=2, addr=a.mr.addr + 32768, length=len(data), lkey=a.mr.lkey,
                 remote_addr=b.mr.addr + 1000, rkey=b.mr.rkey)  # fmt: skip
    )
    (r,) = wait_wcs(a.cq, 1)
    assert r.ok and r.opcode == v.WCOpcode.RDMA_READ and r.byte_len == len(data)
    assert a.mr.read(32768, len(data)) == data
    # RDMA WRITE WITH IMM consumes a receive on b and carries the immediate
    b.qp.post_recv(0, 0, b.mr.lkey, wr_id=55)
    a.qp.post_send(
        v.SendWR(v.Opcode.RDMA_WRITE_WITH_IMM, wr_id=3, addr=a.mr.addr, length=100, lkey=a.mr.lkey,
                 remote_addr=b.mr.addr, rkey=b.mr.rkey, imm_data=42)  # fmt: skip
    )
    (w3,) = wait_wcs(a.cq, 1)
    (r3,) = wait_wcs(b.cq, 1)
    assert w3.ok and r3.ok and r3.wr_id == 55 and r3.imm_data == 42
    assert r3.opcode == v.WCOpcode.RECV_RDMA_WITH_IMM
    assert b.mr.read(0, 100) == data[:100]


def test_wrong_rkey_is_a_failed_completion(loop: Loop) -> None:
    a, b = loop.a, loop.b
    a.qp.post_send(
        v.SendWR(v.Opcode.RDMA_WRITE, wr_id=5, addr=a.mr.addr, length=64, lkey=a.mr.lkey,
                 remote_addr=b.mr.addr, rkey=b.mr.rkey ^ 0xFFFF00)  # fmt: skip
    )
    (w,) = wait_wcs(a.cq, 1)
    assert not w.ok and w.status_name == "IBV_WC_REM_ACCESS_ERR"
    err = w.error()
    assert isinstance(err, RDMAError) and err.errno == errno.EIO and err.wc_status == "IBV_WC_REM_ACCESS_ERR"
    with pytest.raises(RDMAError):
        w.raise_for_status()


def test_batches_and_poll_counts(loop: Loop) -> None:
    a, b = loop.a, loop.b
    n, size = 40, 1024  # > 32: the C helper posts several chained chunks
    b.qp.post_recv_batch([b.mr.addr + i * size for i in range(n)], [size] * n, b.mr.lkey, range(1000, 1000 + n))
    for i in range(n):
        a.mr.write(i * size, bytes([i]) * (i + 1))
    a.qp.post_send_batch(
        [v.SendWR(v.Opcode.SEND, wr_id=i, addr=a.mr.addr + i * size, length=i + 1, lkey=a.mr.lkey,
                  signaled=(i % 8 == 7)) for i in range(n)]  # fmt: skip
    )
    arr = v.WCArray(64)
    got = 0
    deadline = time.monotonic() + 10
    ids: list[int] = []
    while got < n and time.monotonic() < deadline:
        c = b.cq.poll_into(arr)
        assert 0 <= c <= 64
        for i in range(c):
            assert arr.status(i) == 0
            ids.append(arr.wr_id(i))
            assert arr.byte_len(i) == arr.wr_id(i) - 1000 + 1
        got += c
    assert ids == list(range(1000, 1000 + n))
    sends = wait_wcs(a.cq, n // 8)  # only every 8th send was signaled
    assert [w.wr_id for w in sends] == [i for i in range(n) if i % 8 == 7]
    assert a.cq.poll() == [] and b.cq.poll_into(arr) == 0
    for i in range(n):
        assert b.mr.read(i * size, i + 1) == bytes([i]) * (i + 1)


def test_post_error_reports_how_many_were_posted(dev: Dev) -> None:
    lp = make_loop(dev, max_send_wr=4)
    try:
        a = lp.a
        room = a.qp.caps.max_send_wr
        wrs = [v.SendWR(v.Opcode.RDMA_WRITE, wr_id=i, addr=a.mr.addr, length=8, lkey=a.mr.lkey,
                        remote_addr=lp.b.mr.addr, rkey=lp.b.mr.rkey) for i in range(room + 8)]  # fmt: skip
        with pytest.raises(v.PostError) as ei:
            a.qp.post_send_batch(wrs)
        assert ei.value.errno == errno.ENOMEM and ei.value.call == "ibv_post_send"
        assert 0 < ei.value.posted <= room + 8 and ei.value.total == room + 8
        wait_wcs(a.cq, ei.value.posted)
    finally:
        lp.close()


def test_completion_channel_becomes_readable(dev: Dev) -> None:
    lp = make_loop(dev, with_channel=True)
    try:
        a, b = lp.a, lp.b
        assert b.channel is not None
        fd = b.channel.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        b.cq.req_notify()
        assert poller.poll(50) == []  # armed, nothing arrived
        b.qp.post_recv(b.mr.addr, 4096, b.mr.lkey, wr_id=1)
        a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=2, addr=a.mr.addr, length=10, lkey=a.mr.lkey))
        assert poller.poll(5000) == [(fd, select.POLLIN)]
        per_cq = b.channel.drain_events_per_cq()
        assert per_cq == {b.cq: 1}
        assert b.channel.drain_events() == 0  # drained: EAGAIN, not blocking
        assert poller.poll(0) == []
        (r,) = b.cq.poll()
        assert r.ok and r.wr_id == 1
        # not re-armed: another completion does not wake the fd
        b.qp.post_recv(b.mr.addr, 4096, b.mr.lkey, wr_id=3)
        a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=4, addr=a.mr.addr, length=10, lkey=a.mr.lkey))
        wait_wcs(a.cq, 2)
        wait_wcs(b.cq, 1)
        assert poller.poll(100) == []
        # re-armed: wakes again
        b.cq.req_notify()
        b.qp.post_recv(b.mr.addr, 4096, b.mr.lkey, wr_id=5)
        a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=6, addr=a.mr.addr, length=10, lkey=a.mr.lkey))
        assert poller.poll(5000) == [(fd, select.POLLIN)]
        assert b.channel.drain_events() == 1
        wait_wcs(b.cq, 1)
        wait_wcs(a.cq, 1)
    finally:
        lp.close()


def test_poll_spin_releases_the_gil_and_returns_early(loop: Loop) -> None:
    arr = v.WCArray(4)
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(loop.b.cq.poll_spin_into(arr, spin_ns=400_000_000)))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.02)  # let the thread enter C
    ticks = 0
    while t.is_alive():
        ticks += 1
    elapsed = time.monotonic() - t0
    t.join()
    assert result == [0] and elapsed >= 0.35
    assert ticks > 1000, f"main thread made {ticks} steps while the other spun: GIL held?"
    # with something to find, a long spin returns at once
    loop.a.qp.post_send(v.SendWR(v.Opcode.RDMA_WRITE, wr_id=1, addr=loop.a.mr.addr, length=8, lkey=loop.a.mr.lkey,
                                 remote_addr=loop.b.mr.addr, rkey=loop.b.mr.rkey))  # fmt: skip
    t1 = time.monotonic()
    got = loop.a.cq.poll_spin(4, spin_ns=5_000_000_000)
    assert len(got) == 1 and got[0].ok and time.monotonic() - t1 < 4.0


# --------------------------------------------------------------------------
# failure paths
# --------------------------------------------------------------------------


def test_flush_after_to_error(loop: Loop) -> None:
    b = loop.b
    n = 8
    b.qp.post_recv_batch([b.mr.addr + i * 4096 for i in range(n)], [4096] * n, b.mr.lkey, range(n))
    b.qp.to_error()
    assert b.qp.state == v.QPState.ERR
    wcs = wait_wcs(b.cq, n)
    assert sorted(w.wr_id for w in wcs) == list(range(n))
    assert {w.status_name for w in wcs} == {"IBV_WC_WR_FLUSH_ERR"}
    assert all(w.qp_num == b.qp.qp_num for w in wcs)
    assert wcs[0].error().wc_status == "IBV_WC_WR_FLUSH_ERR"


def test_rnr_retry_is_finite(loop: Loop) -> None:
    """No receive posted on b: with the default finite rnr_retry a's send fails instead of hanging."""
    a = loop.a
    t0 = time.monotonic()
    a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=77, addr=a.mr.addr, length=16, lkey=a.mr.lkey))
    (w,) = wait_wcs(a.cq, 1, timeout=30)
    assert w.wr_id == 77 and w.status == v.WCStatus.RNR_RETRY_EXC_ERR
    assert w.status_name == "IBV_WC_RNR_RETRY_EXC_ERR"
    err = w.error()
    assert err.wc_status == "IBV_WC_RNR_RETRY_EXC_ERR" and "IBV_WC_RNR_RETRY_EXC_ERR" in str(err)
    assert time.monotonic() - t0 < 30
    assert a.qp.state == v.QPState.ERR


def test_dead_peer_ends_in_retry_exceeded(dev: Dev) -> None:
    """Connected to a QP number nobody owns: transport retries run out."""
    lp = make_loop(dev, connect=False)
    try:
        a = lp.a
        a.qp.connect(v.RCEndpoint(0xFFFF00, dev.gid), sgid_index=dev.gid_index, rts={"timeout": 8, "retry_cnt": 1})
        a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=1, addr=a.mr.addr, length=16, lkey=a.mr.lkey))
        (w,) = wait_wcs(a.cq, 1, timeout=30)
        assert w.status_name == "IBV_WC_RETRY_EXC_ERR"
    finally:
        lp.close()


def test_async_event_cq_overrun(dev: Dev) -> None:
    """rxe reports a CQ overrun as IBV_EVENT_CQ_ERR on the async fd; we get our CQ object back."""
    lp = make_loop(dev, cqe_a=1)
    try:
        a, b = lp.a, lp.b
        fd = lp.ctx.fileno()
        assert select.select([fd], [], [], 0)[0] == []
        assert a.cq.cqe < 32
        n = a.cq.cqe + 8
        wrs = [v.SendWR(v.Opcode.RDMA_WRITE, wr_id=i, addr=a.mr.addr, length=8, lkey=a.mr.lkey,
                        remote_addr=b.mr.addr, rkey=b.mr.rkey) for i in range(n)]  # fmt: skip
        a.qp.post_send_batch(wrs)
        assert select.select([fd], [], [], 10)[0] == [fd]
        ev = lp.ctx.get_async_event()
        assert ev is not None and ev.name == "IBV_EVENT_CQ_ERR" and ev.element_kind == "cq"
        assert ev.cq is a.cq and ev.qp is None and ev.description
        while lp.ctx.get_async_event() is not None:  # non-blocking: ends with None
            pass
    finally:
        lp.close()


# --------------------------------------------------------------------------
# pyverbs as an independent oracle
# --------------------------------------------------------------------------


def _pyverbs() -> Any:
    if DIST_PACKAGES not in sys.path:
        sys.path.append(DIST_PACKAGES)
    try:
        import pyverbs.device
    except ImportError:
        if os.environ.get("AIORDMA_IN_VM") == "1":
            raise
        pytest.skip("pyverbs is not installed")
    return pyverbs


def test_pyverbs_peer_exchanges_send_recv(dev: Dev) -> None:
    _pyverbs()
    import pyverbs.enums as e
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR

    pctx = Context(name=dev.name)
    try:
        ppd = PD(pctx)
        pcq = CQ(pctx, 16, None, None, 0)
        pqp = QP(ppd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=pcq, rcq=pcq, cap=QPCap(max_send_wr=8, max_recv_wr=8)),
                 QPAttr(port_num=PORT))  # fmt: skip
        pmr = MR(ppd, 4096, e.IBV_ACCESS_LOCAL_WRITE)
        with v.Context(dev.name) as ctx, ctx.alloc_pd() as pd, ctx.create_cq(16) as cq:
            qp = pd.create_qp(cq)
            mr = pd.reg_mr(4096)
            try:
                qp.connect(v.RCEndpoint(pqp.qp_num, dev.gid, 300), sgid_index=dev.gid_index, sq_psn=100)
                attr = QPAttr(port_num=PORT)
                attr.path_mtu = e.IBV_MTU_1024
                attr.max_dest_rd_atomic = 1
                attr.max_rd_atomic = 1
                attr.min_rnr_timer = 12
                attr.timeout = 14
                attr.retry_cnt = 7
                attr.rnr_retry = 6
                attr.dest_qp_num = qp.qp_num
                attr.rq_psn = 100
                attr.sq_psn = 300
                gr = GlobalRoute(dgid=pctx.query_gid(PORT, dev.gid_index), sgid_index=dev.gid_index)
                attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=0)
                pqp.to_rts(attr)
                assert ipaddress.IPv6Address(str(pctx.query_gid(PORT, dev.gid_index))) == dev.gid

                def ppoll() -> Any:
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:
                        n, wcs = pcq.poll(1)
                        if n:
                            return wcs[0]
                        time.sleep(0.0005)
                    raise AssertionError("pyverbs CQ: no completion")

                # ours -> pyverbs, with immediate
                pqp.post_recv(RecvWR(wr_id=21, num_sge=1, sg=[SGE(pmr.buf, 4096, pmr.lkey)]), None)
                msg = b"from aiordma to pyverbs"
                mr.write(0, msg)
                qp.post_send(v.SendWR(v.Opcode.SEND_WITH_IMM, wr_id=1, addr=mr.addr, length=len(msg), lkey=mr.lkey,
                                      imm_data=0x11223344))  # fmt: skip
                (s,) = wait_wcs(cq, 1)
                assert s.ok
                wc = ppoll()
                assert wc.status == e.IBV_WC_SUCCESS and wc.wr_id == 21 and wc.byte_len == len(msg)
                assert wc.opcode == e.IBV_WC_RECV and wc.wc_flags & e.IBV_WC_WITH_IMM
                assert wc.imm_data in (0x11223344, 0x44332211)  # pyverbs shows the raw big-endian field
                assert pmr.read(len(msg), 0) == msg
                # pyverbs -> ours
                qp.post_recv(mr.addr + 1024, 1024, mr.lkey, wr_id=31)
                reply = b"and back from pyverbs!"
                pmr.write(reply, len(reply))
                pqp.post_send(SendWR(wr_id=41, opcode=e.IBV_WR_SEND, num_sge=1,
                                     sg=[SGE(pmr.buf, len(reply), pmr.lkey)], send_flags=e.IBV_SEND_SIGNALED), None)  # fmt: skip
                (r,) = wait_wcs(cq, 1)
                assert r.ok and r.wr_id == 31 and r.byte_len == len(reply)
                assert mr.read(1024, len(reply)) == reply
                assert ppoll().wr_id == 41
            finally:
                qp.to_error()
                while cq.poll():
                    pass
                qp.close()
                mr.close()
    finally:
        pctx.close()


def test_scalar_fast_paths_post_send_imm_and_post_recv_one(loop: Loop) -> None:
    a, b = loop.a, loop.b
    b.qp.post_recv_one(b.mr.addr, 4096, b.mr.lkey, 21)
    b.qp.post_recv_one(b.mr.addr + 4096, 4096, b.mr.lkey, 22)
    a.mr.write(0, b"fast")
    a.qp.post_send_imm(31, a.mr.addr, 4, a.mr.lkey, 0xCAFEF00D, int(v.SendFlags.SIGNALED))
    a.qp.post_send_imm(32, 0, 0, 0, 0x80000001, int(v.SendFlags.SIGNALED))  # no payload: a credit-only SEND
    assert [(w.wr_id, w.opcode, w.ok) for w in wait_wcs(a.cq, 2)] == [(31, v.WCOpcode.SEND, True),
                                                                      (32, v.WCOpcode.SEND, True)]  # fmt: skip
    r1, r2 = wait_wcs(b.cq, 2)
    assert (r1.wr_id, r1.byte_len, r1.imm_data) == (21, 4, 0xCAFEF00D)
    assert (r2.wr_id, r2.byte_len, r2.imm_data) == (22, 0, 0x80000001)
    assert b.mr.read(0, 4) == b"fast"


def test_unsignaled_post_send_imm_is_completed_by_a_later_signaled_one(loop: Loop) -> None:
    a, b = loop.a, loop.b
    b.qp.post_recv_batch([b.mr.addr] * 2, [64, 64], b.mr.lkey, [1, 2])
    a.qp.post_send_imm(41, 0, 0, 0, 1, 0)
    a.qp.post_send_imm(42, 0, 0, 0, 2, int(v.SendFlags.SIGNALED))
    (s,) = wait_wcs(a.cq, 1)
    assert s.wr_id == 42 and s.ok
    assert [w.imm_data for w in wait_wcs(b.cq, 2)] == [1, 2]


def test_scalar_fast_paths_report_errors(dev: Dev) -> None:
    lp = make_loop(dev)
    qp = lp.a.qp
    lp.close()
    with pytest.raises(RDMAError) as es:
        qp.post_send_imm(1, 0, 0, 0, 0, int(v.SendFlags.SIGNALED))  # closed
    with pytest.raises(RDMAError) as er:
        qp.post_recv_one(0, 0, 0, 1)
    assert (es.value.call, er.value.call) == ("ibv_post_send", "ibv_post_recv")


def test_wcarray_entries_match_the_accessors(loop: Loop) -> None:
    a, b = loop.a, loop.b
    b.qp.post_recv_batch([b.mr.addr, b.mr.addr + 4096], [4096, 4096], b.mr.lkey, [(5 << 32) | 1, 2])
    a.qp.post_send_imm(7, a.mr.addr, 3, a.mr.lkey, 0xFFFFFFFF, int(v.SendFlags.SIGNALED))
    a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=8, addr=a.mr.addr, length=5, lkey=a.mr.lkey))
    wait_wcs(a.cq, 2)
    arr = v.WCArray(8)
    deadline = time.monotonic() + 10
    n = 0
    while n == 0 and time.monotonic() < deadline:
        n = b.cq.poll_spin_into(arr, 2_000_000, 2)
    entries = arr.entries(n)
    for i, (wr_id, status, opcode, byte_len, imm, qp_num) in enumerate(entries):
        assert (wr_id, status, opcode, byte_len) == (arr.wr_id(i), arr.status(i), arr.opcode(i), arr.byte_len(i))
        assert imm == (-1 if arr.imm_data(i) is None else arr.imm_data(i))
        assert qp_num == b.qp.qp_num
    rest = wait_wcs(b.cq, 2 - n)
    got = [(e[0], e[3], e[4]) for e in entries] + [(w.wr_id, w.byte_len, -1 if w.imm_data is None else w.imm_data)
                                                  for w in rest]  # fmt: skip
    assert got == [((5 << 32) | 1, 3, 0xFFFFFFFF), (2, 5, -1)]
    assert arr.entries(0) == []


def test_objects_of_another_provider_are_refused(loop: Loop) -> None:
    """The native verbs take back only their own objects: a simulated CQ, window or array is a
    TypeError naming the call (the C side never sees a foreign handle), and nothing is made."""
    from aiordma.testing import SimFabric

    fab = SimFabric()
    fab.add_device("simA", "10.0.0.1")
    with fab.open_context("simA") as sctx, sctx.alloc_pd() as spd, sctx.create_comp_channel() as sch:
        with sctx.create_cq(8, sch) as scq, spd.reg_mr(64) as smr:
            smw = spd.alloc_mw()
            a = loop.a
            nmw = loop.pd.alloc_mw()
            loop.extra.append(nmw)
            live = v.live_objects()
            calls = [
                ("ibv_create_qp", lambda: loop.pd.create_qp(scq)),
                ("ibv_create_cq", lambda: loop.ctx.create_cq(8, sch)),
                ("ibv_poll_cq", lambda: a.cq.poll_into(fab.WCArray(4))),
                ("aiordma_wake", lambda: a.cq.native_waker(sch)),
                ("BIND_MW", lambda: a.qp.post_bind_mw(1, smw, a.mr, a.mr.addr, 8, v.Access.REMOTE_READ)),
                ("BIND_MW", lambda: a.qp.post_bind_mw(1, nmw, smr, smr.addr, 8, v.Access.REMOTE_READ)),
            ]
            for call, attempt in calls:
                with pytest.raises(TypeError, match=call):
                    attempt()
            assert v.live_objects() == live
            smw.close()
