"""What the tests of the verbs layer on a device share (test_native, test_mempool): the device
under test, the leak check of every test (all verbs objects closed), and a loop of two connected
RC QPs on that device.

Device selection: ``AIORDMA_TEST_DEVICE``, else the first of ``AIORDMA_VM_DEVICES``, else the
device of the first RoCEv2 IPv4 GID."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from aiordma._rdma import discovery
from aiordma._rdma import verbs as v


PORT = 1


@dataclass
class Dev:
    name: str
    gid_index: int
    gid: ipaddress.IPv6Address


def _pick_device() -> Dev:
    want = os.environ.get("AIORDMA_TEST_DEVICE") or next(
        (d for d in os.environ.get("AIORDMA_VM_DEVICES", "").split(",") if d), None
    )
    for dev in discovery.list_devices(query_verbs=False):
        if want and dev.name != want:
            continue
        for port in dev.ports:
            if port.port != PORT or port.state != "ACTIVE":
                continue
            for g in port.gids:
                if g.gid_type == "RoCEv2" and g.gid.ipv4_mapped is not None:
                    return Dev(dev.name, g.index, g.gid)
    pytest.skip("no ACTIVE port with a RoCEv2 IPv4 GID")


@pytest.fixture(scope="module")
def dev() -> Dev:
    return _pick_device()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    v.assert_no_live_objects()
    yield
    v.assert_no_live_objects()


def wait_wcs(cq: v.CompletionQueue, n: int, timeout: float = 10.0) -> list[v.WorkCompletion]:
    out: list[v.WorkCompletion] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        out += cq.poll_spin(n - len(out), spin_ns=2_000_000)
        if len(out) < n and time.monotonic() > deadline:
            raise AssertionError(f"timed out: {len(out)} of {n} completions: {out}")
    return out


@dataclass
class Side:
    cq: v.CompletionQueue
    qp: v.QueuePair
    mr: v.MemoryRegion
    channel: v.CompletionChannel | None = None


@dataclass
class Loop:
    """Two connected RC QPs on one device, each with its CQ and a 64 KiB MR."""

    dev: Dev
    ctx: v.Context
    pd: v.ProtectionDomain
    a: Side
    b: Side
    extra: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """The documented teardown order."""
        for s in (self.a, self.b):
            if not s.qp.closed:
                s.qp.to_error()
        for s in (self.a, self.b):  # flush completions (any left)
            while s.cq.poll(64):
                pass
            if s.channel is not None:
                s.channel.drain_events()
        for s in (self.a, self.b):
            s.qp.close()
        for s in (self.a, self.b):
            s.cq.close()
            if s.channel is not None:
                s.channel.close()
        for s in (self.a, self.b):
            s.mr.close()
        for obj in self.extra:
            obj.close()
        self.pd.close()
        self.ctx.close()


FULL_ACCESS = v.Access.LOCAL_WRITE | v.Access.REMOTE_WRITE | v.Access.REMOTE_READ


def make_loop(
    dev: Dev, *, with_channel: bool = False, connect: bool = True, max_send_wr: int = 64, cqe_a: int = 256
) -> Loop:
    ctx = v.Context(dev.name)
    pd = ctx.alloc_pd()
    sides = []
    for cqe in (cqe_a, 256):
        ch = ctx.create_comp_channel() if with_channel else None
        cq = ctx.create_cq(cqe, ch)
        qp = pd.create_qp(cq, max_send_wr=max_send_wr, max_recv_wr=64)
        mr = pd.reg_mr(65536, FULL_ACCESS)  # the one-sided tests need remote access (not the default)
        sides.append(Side(cq, qp, mr, ch))
    loop = Loop(dev, ctx, pd, sides[0], sides[1])
    if connect:
        a, b = loop.a.qp, loop.b.qp
        a.connect(v.RCEndpoint(b.qp_num, dev.gid, 0x2222), sgid_index=dev.gid_index, sq_psn=0x1111, access=FULL_ACCESS)
        b.connect(v.RCEndpoint(a.qp_num, dev.gid, 0x1111), sgid_index=dev.gid_index, sq_psn=0x2222, access=FULL_ACCESS)
        assert a.state == v.QPState.RTS and b.state == v.QPState.RTS
    return loop
