"""The native data path (``_native/aiordma_fast.c``) driven against itself on the host (hypothesis).

Two :class:`NativeSession` objects in record mode (no device: C writes the work
requests it would post into arrays) over an RC wire reduced to what the
session must respect, as ``test_rdma_session.py`` does for the checked
session: each side's receive queue is a FIFO of posted buffers, a SEND
consumes its head (none posted: the test fails -- an RNR on a real NIC), its
bytes are read from the sender's memory *when it is delivered* (a send slot
reused too early shows up as corrupted bytes; an inline send was copied at
post), a send-queue entry is retired only when a signaled completion at or
after it is polled, and completions are processed by the same C function the
poller's wake calls (``aiordma_chan_process`` / ``aiordma_chan_finish``).
Random sizes, random pairs of window/buffer/inline configurations, random
interleavings, a reader that stalls.
"""

from __future__ import annotations

import ctypes
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma._errors import RemoteProtocolError
from aiordma._rdma.fastpath import NativeSession, native_lib
from aiordma._rdma.params import RdmaParams
from aiordma._rdma.session import Ring
from aiordma._rdma.states import LinkState

NATIVE = native_lib()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the native module is not built here")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Recorder:
    """The QP of record mode: what C recorded moves to the side's queues."""

    def __init__(self, side: Side) -> None:
        self.side = side

    def post_records(self, c: Any) -> None:
        ffi, lib = NATIVE  # type: ignore[misc]
        side = self.side
        for i in range(c.rec_send_n):
            w = c.rec_send[i]
            flags = int(w.send_flags)
            data = ffi.buffer(ffi.cast("char *", w.addr), w.length)[:] if flags & lib.IBV_SEND_INLINE else None
            assert len(side.sq) < side.sq_depth, f"{side.name}: more send WRs than the send queue holds"
            side.sq.append((int(w.wr_id), bool(flags & lib.IBV_SEND_SIGNALED)))
            side.wire.append((int(w.wr_id), int(w.opcode), int(w.addr), int(w.length), int(w.imm_data), flags, data))
        c.rec_send_n = 0
        for i in range(c.rec_recv_n):
            wr_id = int(c.rec_recv[i])
            slot = wr_id & 0xFFFFFFFF
            side.rq.append((wr_id, int(c.raddr) + slot * int(c.rslot), int(c.buffer_size)))
        c.rec_recv_n = 0
        assert len(side.rq) <= side.session.window + side.session.control


@dataclass
class Side:
    name: str
    cid: int
    window: int
    control: int
    buf: int
    sq_depth: int
    max_inline: int
    session: NativeSession = field(init=False)
    keep: list[Any] = field(default_factory=list)
    rq: deque[tuple[int, int, int]] = field(default_factory=deque)
    cq: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    sq: deque[tuple[int, bool]] = field(default_factory=deque)
    wire: deque[tuple[int, int, int, int, int, int, bytes | None]] = field(default_factory=deque)
    unread: bytearray = field(default_factory=bytearray)
    received: bytearray = field(default_factory=bytearray)
    to_send: bytearray = field(default_factory=bytearray)
    sent: bytearray = field(default_factory=bytearray)


def _ring(side: Side, count: int, slot: int) -> Ring:
    ffi = NATIVE[0]  # type: ignore[index]
    mem = bytearray(count * slot)
    ptr = ffi.from_buffer(mem)
    side.keep += [mem, ptr]
    return Ring(memoryview(mem), int(ffi.cast("uintptr_t", ptr)), 7, slot, count)


def make_side(name: str, cid: int, window: int, control: int, buf: int, sq_extra: int, max_inline: int) -> Side:
    side = Side(name, cid, window, control, buf, window + control + sq_extra, max_inline)
    ring = _ring(side, window + control, buf)
    side.session = NativeSession(window=window, control=control, buffer_size=buf, recv=ring,
                                 rq_depth=window + control, qp=Recorder(side), cid=cid)  # fmt: skip
    assert side.session.initial_receives() == []
    return side


def start(side: Side, peer: Side, high_water: int) -> None:
    params = RdmaParams(b"\x01" * 16, peer.cid, 0, 5, peer.window, peer.control, peer.buf)
    slot = min(peer.buf, side.buf)
    ring = _ring(side, side.window, slot)
    side.session.start(params, sq_depth=side.sq_depth, send=ring, max_inline=side.max_inline, signal_every=4,
                       high_water=high_water)  # fmt: skip
    side.session.activate()


class Wire:
    """Both sides, their chans table and one delivery buffer, like one poller."""

    def __init__(self, a: Side, b: Side) -> None:
        ffi, _lib = NATIVE  # type: ignore[misc]
        self.sides = {a.cid: a, b.cid: b}
        self.chans = ffi.new("struct aiordma_chan *[]", 8)
        for side in (a, b):
            self.chans[side.cid] = side.session.c
        self.out = ffi.new("struct aiordma_delivery[]", 32)
        self.others = ffi.new("struct aiordma_wc[]", 32)
        self.wcs = ffi.new("struct aiordma_wc[]", 32)
        self.deliv = bytearray(32 * max(a.buf, b.buf))
        self.deliv_c = ffi.from_buffer(self.deliv)
        self.used = ffi.new("uint64_t *")
        self.n_others = ffi.new("int *")
        self.stamp = 0

    def deliver(self, side: Side, peer: Side) -> None:
        """The oldest WR in flight from ``side`` lands at ``peer``."""
        _ffi, lib = NATIVE  # type: ignore[misc]
        wr_id, opcode, addr, length, imm, flags, data = side.wire.popleft()
        if opcode == lib.IBV_WR_SEND_WITH_IMM:
            assert peer.rq, f"{side.name} sent a SEND with no receive buffer posted at {peer.name}"
            r_id, r_addr, r_len = peer.rq.popleft()
            assert length <= r_len
            if data is None:  # read from the send slot now: a slot reused early shows
                data = ctypes.string_at(addr, length) if length else b""
            if length:
                ctypes.memmove(r_addr, data, length)
            peer.cq.append((r_id, 0, int(lib.IBV_WC_RECV), length, imm, int(lib.IBV_WC_WITH_IMM)))
        if flags & lib.IBV_SEND_SIGNALED:
            side.cq.append((wr_id, 0, 0, 0, 0, 0))

    def poll(self, side: Side, n: int) -> None:
        _ffi, lib = NATIVE  # type: ignore[misc]
        entries, side.cq = side.cq[:n], side.cq[n:]
        for i, (wr_id, status, opcode, byte_len, imm, flags) in enumerate(entries):
            w = self.wcs[i]
            w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data, w.wc_flags = wr_id, status, opcode, byte_len, imm, flags
            if wr_id >> 63:  # retire in order up to a signaled one
                while side.sq and side.sq[0][0] != wr_id:
                    side.sq.popleft()
                side.sq.popleft()
        self.stamp += 1
        self.used[0] = 0
        self.n_others[0] = 0
        n_out = lib.aiordma_chan_process(self.chans, 8, self.wcs, len(entries), self.out, 32, 0, self.stamp,
                                         self.deliv_c, len(self.deliv), self.used, self.others, 32, self.n_others)  # fmt: skip
        assert self.n_others[0] == 0
        lib.aiordma_chan_finish(self.chans, 8, self.out, n_out)
        for i in range(n_out):
            d = self.out[i]
            target = self.sides[d.cid]
            chunk = bytes(self.deliv[d.offset : d.offset + d.length])
            target.unread += chunk
            target.received += chunk
            c = target.session.c
            events, c.events = c.events, 0
            target.session.on_events(events)
            target.session._posted()
            assert target.session.error is None, target.session.error

    def read(self, side: Side, n: int) -> None:
        del side.unread[:n]
        if side.session.consumed(len(side.unread)):
            side.session.flush()

    def write(self, side: Side, n: int) -> None:
        chunk = bytes(side.to_send[:n])
        del side.to_send[:n]
        side.sent += chunk
        side.session.send_now([chunk[:3], chunk[3:]] if len(chunk) > 3 else [chunk])
        assert side.session.error is None, side.session.error


configs = st.tuples(
    st.integers(1, 8),  # window
    st.integers(1, 3),  # control
    st.sampled_from([256, 512, 4096]),  # buffer size
    st.integers(0, 6),  # extra send-queue entries
    st.sampled_from([0, 64, 256]),  # granted inline size
)


@SETTINGS
@given(a_cfg=configs, b_cfg=configs, sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=6),
       seed=st.integers(0, 2**32), stall=st.booleans(), high_water=st.sampled_from([512, 4096, 1 << 20]))  # fmt: skip
def test_two_native_sessions_move_every_byte_once_in_order(
    a_cfg: tuple[int, int, int, int, int],
    b_cfg: tuple[int, int, int, int, int],
    sizes: list[int],
    seed: int,
    stall: bool,
    high_water: int,
) -> None:
    rnd = random.Random(seed)
    a = make_side("A", 1, *a_cfg)
    b = make_side("B", 2, *b_cfg)
    start(a, b, high_water)
    start(b, a, high_water)
    wire = Wire(a, b)
    for side in (a, b):
        side.to_send = bytearray(rnd.randbytes(sum(sizes)))
    stall_until = rnd.randrange(200) if stall else 0
    for step in range(100_000):
        actions = []
        for side, peer in ((a, b), (b, a)):
            if side.wire:
                actions.append(lambda s=side, p=peer: wire.deliver(s, p))
            if side.cq:
                actions.append(lambda s=side: wire.poll(s, rnd.randrange(1, len(s.cq) + 1)))
            if side.to_send:
                actions.append(lambda s=side: wire.write(s, min(len(s.to_send), rnd.choice(sizes) or 1)))
            if side.unread and not (side is a and step < stall_until):
                actions.append(lambda s=side: wire.read(s, rnd.randrange(1, len(s.unread) + 1)))
        if not actions:
            if step < stall_until:
                stall_until = 0
                continue
            break
        rnd.choice(actions)()
    else:  # pragma: no cover
        pytest.fail("did not finish")
    for side, peer in ((a, b), (b, a)):
        assert not side.session.backlog, f"{side.name} still has a backlog: a deadlock"
        assert peer.received == side.sent, f"bytes from {side.name} lost, duplicated or corrupted"
    # teardown returns every buffer: posted receives come back flushed
    _ffi, lib = NATIVE  # type: ignore[misc]
    for side in (a, b):
        side.session.begin_drain()
        side.cq = [(w[0], int(lib.IBV_WC_WR_FLUSH_ERR), int(lib.IBV_WC_RECV), 0, 0, 0) for w in side.rq]
        side.rq.clear()
        wire.poll(side, len(side.cq))
        assert side.session.rq_posted == 0
        assert side.session.drained or side.session.signaled_out > 0
        side.session.reclaim()
        assert side.session.state is LinkState.CLOSED


def _pair(window: int = 4, control: int = 2, buf: int = 256, max_inline: int = 0) -> tuple[Side, Side, Wire]:
    a = make_side("A", 1, window, control, buf, 2, max_inline)
    b = make_side("B", 2, window, control, buf, 2, max_inline)
    start(a, b, 1 << 20)
    start(b, a, 1 << 20)
    return a, b, Wire(a, b)


def _inject(wire: Wire, side: Side, entry: tuple[int, int, int, int, int, int]) -> BaseException | None:
    """Process one completion of the peer's making at ``side``; returns the session's error."""
    side.cq.append(entry)
    ffi, lib = NATIVE  # type: ignore[misc]
    try:
        wire.poll(side, 1)
    except AssertionError:
        pass
    return side.session.error


def test_hostile_completions_are_typed_errors_and_buffers_still_come_back() -> None:
    _ffi, lib = NATIVE  # type: ignore[misc]
    recv, imm_flag = int(lib.IBV_WC_RECV), int(lib.IBV_WC_WITH_IMM)
    cases = [
        # an RDMA WRITE with immediate into our memory
        ((int(lib.IBV_WC_RECV_RDMA_WITH_IMM), 0, 1, imm_flag), "RDMA WRITE with immediate"),
        # a credit-only SEND with a payload
        ((recv, 10, 1 << 31 | 1, imm_flag), "credit-only SEND carried 10 bytes"),
        # a SEND without immediate data
        ((recv, 4, 0, 0), "without immediate data"),
        # a SEND larger than our buffers
        ((recv, 100_000, 0, imm_flag), "exceeds our buffers"),
        # more credits back than could be owed
        ((recv, 4, 50, imm_flag), "more credits"),
    ]
    for (opcode, length, imm, flags), text in cases:
        a, b, wire = _pair()
        wr_id, _addr, _len = b.rq[0]
        error = _inject(wire, b, (wr_id, 0, opcode, length, imm, flags))
        assert isinstance(error, RemoteProtocolError), (text, error)
        assert text in str(error), (text, error)
        # the consumed receive is not re-posted once failed: nothing is lost track of
        assert b.session.rq_posted == len(b.rq) - 1
    # a completion naming a buffer that is not posted
    a, b, wire = _pair()
    wr_id = (2 << 40) | 3
    b.rq.clear()
    b.session.c.rposted[3] = 0
    error = _inject(wire, b, (wr_id, 0, recv, 4, 0, imm_flag))
    assert error is not None and "nothing outstanding" in str(error)


def test_inline_sends_take_no_slot_and_large_ones_do() -> None:
    a, b, wire = _pair(max_inline=64)
    a.session.send_now([b"x" * 10])
    a.session.send_now([b"y" * 200])
    kinds = [(w[5] & int(NATIVE[1].IBV_SEND_INLINE), w[3]) for w in a.wire]  # type: ignore[index]
    assert kinds[0][0] and kinds[0][1] == 10
    assert not kinds[1][0] and kinds[1][1] == 200
    assert a.session.c.slots_used == 1
    stats = a.session.stats()
    assert stats["inline_sends"] == 1 and stats["sends"] == 2


def test_close_signals_the_last_send_and_a_fence_follows_an_unsignaled_one() -> None:
    a, b, wire = _pair()
    a.session.send_now([b"last"])
    a.session.begin_close()
    assert a.session.state is LinkState.CLOSING
    # the last send went unsignaled (signal_every=4): a signaled zero-length WRITE fences it
    assert a.wire[-1][1] == NATIVE[1].IBV_WR_RDMA_WRITE  # type: ignore[index]
    while a.wire:
        wire.deliver(a, b)
    wire.poll(a, len(a.cq))
    assert a.session.close_sent
    assert a.session.state is LinkState.LINGER


def test_a_completion_of_an_earlier_generation_of_the_cid_is_not_taken() -> None:
    """A cid is reused with a new generation: a late completion of the QP that had it before (a
    flushed unsignaled send, after its drain) goes to the caller as foreign, never into the chan."""
    ffi, lib = NATIVE  # type: ignore[misc]
    side = Side("A", 1, 4, 2, 256, 2, 0)
    ring = _ring(side, 6, 256)
    side.session = NativeSession(window=4, control=2, buffer_size=256, recv=ring, rq_depth=6, qp=Recorder(side),
                                 cid=1, gen=2)  # fmt: skip
    side.session.initial_receives()
    assert all((wr_id >> 32) & 0xFF == 2 for wr_id, _a, _l in side.rq)
    chans = ffi.new("struct aiordma_chan *[]", 4)
    chans[1] = side.session.c
    wcs = ffi.new("struct aiordma_wc[]", 1)
    stale = (1 << 63) | (1 << 40) | (1 << 32) | 5  # cid 1, generation 1, a send
    wcs[0].wr_id, wcs[0].status = stale, int(lib.IBV_WC_WR_FLUSH_ERR)
    out = ffi.new("struct aiordma_delivery[]", 4)
    others = ffi.new("struct aiordma_wc[]", 4)
    used, n_others = ffi.new("uint64_t *"), ffi.new("int *")
    deliv = bytearray(4096)
    n = lib.aiordma_chan_process(chans, 4, wcs, 1, out, 4, 0, 1, ffi.from_buffer(deliv), len(deliv), used, others, 4,
                                 n_others)  # fmt: skip
    assert n == 0 and n_others[0] == 1 and others[0].wr_id == stale
    assert side.session.c.error == 0 and side.session.rq_posted == 6
