"""Two sans-IO RDMA sessions driven against each other (hypothesis).

The harness is an RC wire reduced to what the session must respect: each
side's receive queue is a FIFO of posted buffers, a SEND consumes the head
(none posted: the test fails -- that is an RNR on a real NIC), its bytes are
read from the sender's send ring *when it is delivered* (so a slot reused
too early shows up as corrupted bytes), a send-queue entry is retired only
when a signaled completion at or after it is polled.  Random sizes, any legal
pair of window/buffer configurations, random interleavings of delivery,
polling, writing and reading, and a reader that stalls.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma._errors import RemoteProtocolError
from aiordma._rdma.constants import WCOpcode, WCStatus
from aiordma._rdma.params import RdmaParams
from aiordma._rdma.session import SQ_BIT, RdmaSession, Ring, detach_views, queue_views
from aiordma._rdma.states import LinkState

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RECV = int(WCOpcode.RECV)
FLUSH = int(WCStatus.WR_FLUSH_ERR)


@dataclass
class Side:
    name: str
    session: RdmaSession
    recv_mem: bytearray
    send_mem: bytearray
    sq_depth: int
    rq: deque[tuple[int, int, int]] = field(default_factory=deque)  # posted receives
    cq: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    sq: deque[tuple[int, bool]] = field(default_factory=deque)  # (wr_id, signaled) posted, not retired
    wire: deque[tuple[int, int, int, int, int]] = field(default_factory=deque)  # in flight to the peer
    unread: bytearray = field(default_factory=bytearray)
    received: bytearray = field(default_factory=bytearray)
    to_send: bytearray = field(default_factory=bytearray)
    sent: bytearray = field(default_factory=bytearray)
    qp_num: int = 0


def make_side(name: str, qp_num: int, window: int, control: int, buf: int, sq_extra: int) -> Side:
    recv_mem = bytearray((window + control) * buf)
    ring = Ring(memoryview(recv_mem), 0x10000, 1, buf, window + control)
    session = RdmaSession(window=window, control=control, buffer_size=buf, recv=ring, rq_depth=window + control)
    side = Side(name, session, recv_mem, bytearray(), window + control + sq_extra, qp_num=qp_num)
    for work in session.initial_receives():
        side.rq.append(work)
    return side


def start(side: Side, peer: Side, high_water: int) -> None:
    p = peer.session
    params = RdmaParams(b"\x01" * 16, peer.qp_num, 0, 5, p.window, p.control, p.buffer_size)
    slot = min(p.buffer_size, side.session.buffer_size)
    side.send_mem = bytearray(side.session.window * slot)
    ring = Ring(memoryview(side.send_mem), 0x900000, 2, slot, side.session.window)
    side.session.start(params, sq_depth=side.sq_depth, send=ring, signal_every=4, high_water=high_water)
    side.session.activate()


def post_sends(side: Side) -> None:
    for wr_id, addr, length, _lkey, imm, flags in side.session.flush():
        assert len(side.sq) < side.sq_depth, f"{side.name}: more send WRs than the send queue holds"
        side.sq.append((wr_id, bool(flags & 2)))
        side.wire.append((wr_id, addr, length, imm, flags))


def deliver(side: Side, peer: Side) -> None:
    """The oldest WR in flight from ``side`` lands at ``peer``."""
    wr_id, addr, length, imm, flags = side.wire.popleft()
    assert peer.rq, f"{side.name} sent a SEND with no receive buffer posted at {peer.name}"
    r_id, r_addr, r_len = peer.rq.popleft()
    assert length <= r_len
    off = addr - 0x900000
    data = bytes(side.send_mem[off : off + length]) if length else b""
    base = r_addr - 0x10000
    peer.recv_mem[base : base + length] = data
    peer.cq.append((r_id, 0, RECV, length, imm, peer.qp_num))
    if flags & 2:
        side.cq.append((wr_id, 0, 0, 0, -1, side.qp_num))


def poll(side: Side) -> None:
    entries, side.cq = side.cq, []
    for e in entries:
        if e[0] & SQ_BIT:  # retire in order up to a signaled one
            while side.sq and side.sq[0][0] != e[0]:
                side.sq.popleft()
            side.sq.popleft()
    views, reposts = side.session.on_completions(entries, len(side.unread))
    assert side.session.error is None, side.session.error
    for v in views:
        side.unread += v
        side.received += v
    for work in reposts:
        side.rq.append(work)
    assert len(side.rq) <= side.session.window + side.session.control
    post_sends(side)


def read(side: Side, n: int) -> None:
    del side.unread[:n]
    if side.session.consumed(len(side.unread)):
        post_sends(side)


def write(side: Side, n: int) -> None:
    chunk = bytes(side.to_send[:n])
    del side.to_send[:n]
    side.sent += chunk
    side.session.queue([chunk])
    post_sends(side)


configs = st.tuples(
    st.integers(1, 8),  # window
    st.integers(1, 3),  # control
    st.sampled_from([256, 512, 4096]),  # buffer size
    st.integers(0, 6),  # extra send-queue entries
)


@SETTINGS
@given(a_cfg=configs, b_cfg=configs, sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=6),
       seed=st.integers(0, 2**32), stall=st.booleans(), high_water=st.sampled_from([512, 4096, 1 << 20]))  # fmt: skip
def test_two_sessions_move_every_byte_once_in_order(
    a_cfg: tuple[int, int, int, int],
    b_cfg: tuple[int, int, int, int],
    sizes: list[int],
    seed: int,
    stall: bool,
    high_water: int,
) -> None:
    rnd = random.Random(seed)
    a = make_side("A", 11, *a_cfg)
    b = make_side("B", 22, *b_cfg)
    start(a, b, high_water)
    start(b, a, high_water)
    for side in (a, b):
        side.to_send = bytearray(rnd.randbytes(sum(sizes)))
    stall_until = rnd.randrange(200) if stall else 0
    for step in range(100_000):
        actions = []
        for side, peer in ((a, b), (b, a)):
            if side.wire:
                actions.append(lambda s=side, p=peer: deliver(s, p))
            if side.cq:
                actions.append(lambda s=side: poll(s))
            if side.to_send:
                actions.append(lambda s=side: write(s, min(len(s.to_send), rnd.choice(sizes) or 1)))
            if side.unread and not (side is a and step < stall_until):
                actions.append(lambda s=side: read(s, rnd.randrange(1, len(s.unread) + 1)))
        if not actions:
            if step < stall_until:  # only the stalled reader could go on: it wakes up
                stall_until = 0
                continue
            break
        rnd.choice(actions)()
    else:  # pragma: no cover
        pytest.fail("did not finish")
    for side, peer in ((a, b), (b, a)):
        # no deadlock: everything written was posted, delivered and read
        assert not side.session.backlog, f"{side.name} still has a backlog: a deadlock"
        assert peer.received == side.sent, f"bytes from {side.name} lost, duplicated or corrupted"
    # teardown returns every buffer: the QP goes to ERROR, posted receives come back flushed
    for side in (a, b):
        side.session.begin_drain()
        flushed = [(w[0], FLUSH, RECV, 0, -1, side.qp_num) for w in side.rq]
        side.session.on_completions(flushed, 0)
        assert side.session.error is None
        assert side.session.rq_posted == 0
        assert side.session.drained
        side.session.reclaim()
        assert side.session.state is LinkState.CLOSED


def _pair(window: int = 4, control: int = 2, buf: int = 256) -> tuple[Side, Side]:
    a = make_side("A", 11, window, control, buf, 2)
    b = make_side("B", 22, window, control, buf, 2)
    start(a, b, 1 << 20)
    start(b, a, 1 << 20)
    return a, b


def test_a_write_with_immediate_is_refused_and_the_batch_still_accounted() -> None:
    a, b = _pair()
    r0, r1 = b.rq.popleft(), b.rq.popleft()
    entries = [(r0[0], 0, int(WCOpcode.RECV_RDMA_WITH_IMM), 10, 0, 22), (r1[0], FLUSH, RECV, 0, -1, 22)]
    views, reposts = b.session.on_completions(entries, 0)
    assert isinstance(b.session.error, RemoteProtocolError)
    assert "RDMA WRITE" in str(b.session.error)
    assert views == [] and reposts == []
    # both buffers were accounted, although the first one was bad
    assert b.session.rq_posted == b.session.window + b.session.control - 2


def test_a_credit_send_with_payload_is_refused() -> None:
    a, b = _pair()
    r0 = b.rq.popleft()
    b.session.on_completions([(r0[0], 0, RECV, 5, 1 << 31 | 1, 22)], 0)
    assert isinstance(b.session.error, RemoteProtocolError)
    assert "credit-only SEND carried 5 bytes" in str(b.session.error)


def test_over_returned_credits_fail_cleanly_and_buffers_still_come_back() -> None:
    a, b = _pair()
    r0 = b.rq.popleft()
    # a DATA SEND that returns 5 credits nobody owed
    b.session.on_completions([(r0[0], 0, RECV, 3, 5, 22)], 0)
    assert isinstance(b.session.error, RemoteProtocolError)
    assert b.session.state is LinkState.DRAINING
    b.session.begin_drain()
    b.session.on_completions([(w[0], FLUSH, RECV, 0, -1, 22) for w in b.rq], 0)
    assert b.session.drained
    b.session.reclaim()


def test_a_send_without_immediate_and_an_unknown_wr_id_are_errors() -> None:
    a, b = _pair()
    r0 = b.rq.popleft()
    b.session.on_completions([(r0[0], 0, RECV, 3, -1, 22)], 0)
    assert "without immediate" in str(b.session.error)
    a.session.on_completions([(999, 0, RECV, 3, 0, 11)], 0)
    assert "not posted" in str(a.session.error)


def test_close_signals_the_last_send_and_waits_for_it() -> None:
    a, b = _pair()
    a.session.queue([b"x" * 10])
    post_sends(a)  # unsignaled (signal_every=4)
    assert a.sq and not a.sq[-1][1]
    a.session.begin_close()
    post_sends(a)  # the last one went unsignaled: a signaled zero-length WRITE follows
    assert a.sq[-1][1]
    assert not a.session.close_sent
    while a.wire:
        deliver(a, b)
    poll(a)
    assert a.session.close_sent
    assert a.session.state is LinkState.LINGER


def test_send_queue_never_overruns_with_a_small_granted_depth() -> None:
    """B2: the send queue is bounded by the granted depth, not by the peer's window."""
    a = make_side("A", 11, 2, 1, 4096, 0)
    b = make_side("B", 22, 64, 2, 256, 0)
    a.sq_depth = 3  # what a small grant would give
    start(a, b, 1 << 20)
    start(b, a, 1 << 20)
    a.session.queue([b"y" * 10_000])
    post_sends(a)
    assert len(a.sq) <= 3
    while a.session.backlog or a.wire or a.cq or b.cq:
        if a.wire:
            deliver(a, b)
        if b.cq:
            poll(b)
        if a.cq:
            poll(a)
        if b.wire:
            deliver(b, a)
    assert b.received == b"y" * 10_000


@given(st.lists(st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.booleans()), min_size=1, max_size=30),
       st.integers(0, 2000))  # fmt: skip
def test_detach_copies_only_the_calls_own_unposted_views(calls: list[tuple[list[int], bool]], posted: int) -> None:
    """Each write detaches its own views (and only those) from the caller's buffers: the bytes
    sent are what was written even if the caller reuses its buffer, and a write behind a long
    backlog does not walk (or copy again) what earlier writes queued."""
    class Counting(deque):  # type: ignore[type-arg]
        reads = 0

        def __getitem__(self, index: Any) -> Any:
            Counting.reads += 1
            return super().__getitem__(index)

    backlog: deque[memoryview] = Counting()
    enqueued = 0
    expected = bytearray()
    sources: list[bytearray] = []
    for sizes, mutable in calls:
        chunks: list[bytes | bytearray] = []
        for size in sizes:
            data = bytes(random.randrange(256) for _ in range(size))
            expected += data
            if mutable:
                buf = bytearray(data)
                sources.append(buf)
                chunks.append(buf)
            else:
                chunks.append(data)
        before_ids = [id(v) for v in backlog]
        added = queue_views(backlog, chunks)
        end = enqueued + added
        enqueued = end
        mark = min(posted, enqueued - added)  # (nothing this call queued is posted yet)
        Counting.reads = 0
        detach_views(backlog, enqueued, mark, end, added)
        assert Counting.reads <= len(sizes)  # its own views only: linear in the writes, not the backlog
        assert [id(v) for v in list(backlog)[: len(before_ids)]] == before_ids  # earlier views untouched
        for view in list(backlog)[len(before_ids) :]:
            assert isinstance(view.obj, bytes)  # this call's views no longer point at its buffers
    for buf in sources:
        buf[:] = b"\0" * len(buf)  # the callers reuse their buffers
    assert b"".join(bytes(v) for v in backlog) == bytes(expected)
