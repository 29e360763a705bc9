"""An RC wire reduced to what a session must respect, for both data paths' sessions.

Two sessions -- the checked one (``aiordma._rdma.session.RdmaSession``) or the native one (the C
of ``_native/aiordma_fast.c`` in record mode, ``aiordma._rdma.fastpath.NativeSession``) -- are
driven against each other over one model of the wire (test_rdma_session, test_native_session):

* each side's receive queue is a FIFO of posted buffers; a SEND consumes its head (none posted:
  the test fails -- an RNR on a real NIC); an RDMA WRITE (the probe, the close fence) consumes none;
* a SEND's bytes are read from the sender's memory *when it is delivered* (a send slot reused too
  early shows up as corrupted bytes; an inline send was copied when it was posted);
* a send-queue entry is retired only when a signaled completion at or after it is polled, and
  the send queue never holds more than its depth;
* memory is real: the rings are bytearrays and the work requests carry their addresses.

A :class:`Flavor` adapts one session to the model: how it is built and started, how it takes
writes and reads, what its work requests and completions look like, and how it processes
completions (the checked session's ``on_completions``; for the native one the same C function
the poller's wake calls, ``aiordma_chan_process``).
"""

from __future__ import annotations

import ctypes
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import pytest

from aiordma._rdma.constants import WCOpcode, WCStatus
from aiordma._rdma.params import RdmaParams
from aiordma._rdma.session import KIND_PROBE, SQ_BIT, RdmaSession, Ring, wr_kind
from aiordma._rdma.states import LinkState

#: (wr_id, status, opcode, byte_len, imm, qp_num or wc_flags): a completion as a session takes it
WC = tuple[int, int, int, int, int, int]


@dataclass
class Send:
    """A send work request on the wire."""

    wr_id: int
    write: bool  # an RDMA WRITE (consumes no receive) rather than a SEND with immediate
    addr: int
    length: int
    imm: int
    signaled: bool
    data: bytes | None = None  # an inline send's bytes, copied at post


@dataclass
class Side:
    name: str
    ident: int  # the QP number (checked) or the chan id (native)
    window: int
    control: int
    buf: int
    sq_depth: int
    max_inline: int = 0
    session: Any = None
    keep: list[Any] = field(default_factory=list)  # memory the work requests point into
    rq: deque[tuple[int, int, int]] = field(default_factory=deque)  # (wr_id, addr, length) posted
    cq: list[WC] = field(default_factory=list)
    sq: deque[tuple[int, bool]] = field(default_factory=deque)  # (wr_id, signaled) posted, not retired
    wire: deque[Send] = field(default_factory=deque)  # in flight to the peer
    unread: bytearray = field(default_factory=bytearray)
    received: bytearray = field(default_factory=bytearray)
    to_send: bytearray = field(default_factory=bytearray)
    sent: bytearray = field(default_factory=bytearray)

    def post_send(self, send: Send) -> None:
        assert len(self.sq) < self.sq_depth, f"{self.name}: more send WRs than the send queue holds"
        self.sq.append((send.wr_id, send.signaled))
        self.wire.append(send)


def ring(side: Side, count: int, slot: int, lkey: int) -> Ring:
    """``count`` slots of ``slot`` bytes of real memory (kept alive by the side)."""
    mem = bytearray(count * slot)
    anchor = (ctypes.c_char * len(mem)).from_buffer(mem)
    side.keep += [mem, anchor]
    return Ring(memoryview(mem), ctypes.addressof(anchor), lkey, slot, count)


class Flavor(Protocol):
    """One session implementation on the model (see the module docs)."""

    name: str

    def make_side(self, name: str, ident: int, window: int, control: int, buf: int, sq_extra: int,
                  max_inline: int) -> Side: ...  # fmt: skip

    def start(self, side: Side, peer: Side, high_water: int) -> None: ...

    def bind(self, a: Side, b: Side) -> None:
        """Both sides exist and are started (the native flavor builds its poller's table)."""

    def write(self, side: Side, chunk: bytes) -> None: ...

    def read(self, side: Side, n: int) -> None: ...

    def process(self, side: Side, entries: list[WC]) -> None:
        """The session takes polled completions: what it delivers goes to ``side.unread`` and
        ``side.received``; receives it re-posts and sends it posts go on the queues."""

    def recv_wc(self, side: Side, wr_id: int, length: int, imm: int) -> WC: ...

    def send_wc(self, side: Side, wr_id: int) -> WC: ...

    def flush_wc(self, side: Side, wr_id: int) -> WC: ...


# -- the wire ----------------------------------------------------------------------------------


def deliver(flavor: Flavor, side: Side, peer: Side) -> None:
    """The oldest work request in flight from ``side`` lands at ``peer``."""
    send = side.wire.popleft()
    if not send.write:
        assert peer.rq, f"{side.name} sent a SEND with no receive buffer posted at {peer.name}"
        r_id, r_addr, r_len = peer.rq.popleft()
        assert send.length <= r_len
        data = send.data
        if data is None:  # read from the send slot now: a slot reused early shows
            data = ctypes.string_at(send.addr, send.length) if send.length else b""
        if send.length:
            ctypes.memmove(r_addr, data, send.length)
        peer.cq.append(flavor.recv_wc(peer, r_id, send.length, send.imm))
    if send.signaled:
        side.cq.append(flavor.send_wc(side, send.wr_id))


def poll(flavor: Flavor, side: Side, n: int | None = None) -> None:
    """The session polls ``n`` completions (all by default)."""
    n = len(side.cq) if n is None else n
    entries, side.cq = side.cq[:n], side.cq[n:]
    for e in entries:
        if e[0] & SQ_BIT:  # retire in order up to a signaled one
            while side.sq and side.sq[0][0] != e[0]:
                side.sq.popleft()
            side.sq.popleft()
    flavor.process(side, entries)


def connected(flavor: Flavor, a_cfg: tuple[int, int, int, int, int], b_cfg: tuple[int, int, int, int, int],
              high_water: int) -> tuple[Side, Side]:  # fmt: skip
    """Two sides (configs: window, control, buffer size, extra send-queue entries, inline size),
    started against each other."""
    a = flavor.make_side("A", 1, *a_cfg)
    b = flavor.make_side("B", 2, *b_cfg)
    flavor.start(a, b, high_water)
    flavor.start(b, a, high_water)
    flavor.bind(a, b)
    return a, b


def pair(flavor: Flavor, window: int = 4, control: int = 2, buf: int = 256, max_inline: int = 0,
         high_water: int = 1 << 20) -> tuple[Side, Side]:  # fmt: skip
    cfg = (window, control, buf, 2, max_inline)
    return connected(flavor, cfg, cfg, high_water)


def exchange(flavor: Flavor, a_cfg: tuple[int, int, int, int, int], b_cfg: tuple[int, int, int, int, int],
             sizes: list[int], seed: int, stall: bool, high_water: int) -> None:  # fmt: skip
    """Both sides write random amounts in random sizes while the wire delivers, completions are
    polled and readers read, all in a random order (a reader that stalls for a while); every byte
    must arrive once and in order, nothing may deadlock, and the teardown must give back every
    receive buffer."""
    rnd = random.Random(seed)
    a, b = connected(flavor, a_cfg, b_cfg, high_water)
    for side in (a, b):
        side.to_send = bytearray(rnd.randbytes(sum(sizes)))
    stall_until = rnd.randrange(200) if stall else 0
    for step in range(100_000):
        actions = []
        for side, peer in ((a, b), (b, a)):
            if side.wire:
                actions.append(lambda s=side, p=peer: deliver(flavor, s, p))
            if side.cq:
                actions.append(lambda s=side: poll(flavor, s, rnd.randrange(1, len(s.cq) + 1)))
            if side.to_send:
                actions.append(lambda s=side: _write(flavor, s, min(len(s.to_send), rnd.choice(sizes) or 1)))
            if side.unread and not (side is a and step < stall_until):
                actions.append(lambda s=side: flavor.read(s, rnd.randrange(1, len(s.unread) + 1)))
        if not actions:
            if step < stall_until:  # only the stalled reader could go on: it wakes up
                stall_until = 0
                continue
            break
        rnd.choice(actions)()
    else:  # pragma: no cover
        pytest.fail("did not finish")
    for side, peer in ((a, b), (b, a)):
        assert not side.session.backlog, f"{side.name} still has a backlog: a deadlock"
        assert peer.received == side.sent, f"bytes from {side.name} lost, duplicated or corrupted"
    # teardown returns every buffer: the QP goes to ERROR, posted receives come back flushed
    for side in (a, b):
        side.session.begin_drain()
        side.cq = [flavor.flush_wc(side, w[0]) for w in side.rq]
        side.rq.clear()
        poll(flavor, side)
        assert side.session.error is None, side.session.error
        assert side.session.rq_posted == 0
        assert side.session.drained or side.session.signaled_out > 0
        side.session.reclaim()
        assert side.session.state is LinkState.CLOSED


def _write(flavor: Flavor, side: Side, n: int) -> None:
    chunk = bytes(side.to_send[:n])
    del side.to_send[:n]
    side.sent += chunk
    flavor.write(side, chunk)


# -- the checked session -----------------------------------------------------------------------

RECV = int(WCOpcode.RECV)
FLUSH = int(WCStatus.WR_FLUSH_ERR)
_SIGNALED = 2  # IBV_SEND_SIGNALED


class Checked:
    """The checked (Python) session: completions carry the QP number, ``imm`` -1 means none."""

    name = "checked"

    def make_side(self, name: str, ident: int, window: int, control: int, buf: int, sq_extra: int,
                  max_inline: int = 0) -> Side:  # fmt: skip
        side = Side(name, ident, window, control, buf, window + control + sq_extra)
        recv = ring(side, window + control, buf, 1)
        side.session = RdmaSession(window=window, control=control, buffer_size=buf, recv=recv,
                                   rq_depth=window + control)  # fmt: skip
        side.rq.extend(side.session.initial_receives())
        return side

    def start(self, side: Side, peer: Side, high_water: int) -> None:
        p = peer.session
        params = RdmaParams(b"\x01" * 16, peer.ident, 0, 5, p.window, p.control, p.buffer_size)
        slot = min(p.buffer_size, side.session.buffer_size)
        send = ring(side, side.session.window, slot, 2)
        side.session.start(params, sq_depth=side.sq_depth, send=send, signal_every=4, high_water=high_water)
        side.session.activate()

    def bind(self, a: Side, b: Side) -> None:
        pass

    def post(self, side: Side) -> None:
        """What the session has to post now goes on the send queue."""
        for wr_id, addr, length, _lkey, imm, flags in side.session.flush():
            side.post_send(Send(wr_id, wr_kind(wr_id) == KIND_PROBE, addr, length, imm, bool(flags & _SIGNALED)))

    def write(self, side: Side, chunk: bytes) -> None:
        side.session.queue([chunk])
        self.post(side)

    def read(self, side: Side, n: int) -> None:
        del side.unread[:n]
        if side.session.consumed(len(side.unread)):
            self.post(side)

    def process(self, side: Side, entries: list[WC]) -> None:
        views, reposts = side.session.on_completions(entries, len(side.unread))
        assert side.session.error is None, side.session.error
        for view in views:
            side.unread += view
            side.received += view
        side.rq.extend(reposts)
        assert len(side.rq) <= side.session.window + side.session.control
        self.post(side)

    def recv_wc(self, side: Side, wr_id: int, length: int, imm: int) -> WC:
        return (wr_id, 0, RECV, length, imm, side.ident)

    def send_wc(self, side: Side, wr_id: int) -> WC:
        return (wr_id, 0, 0, 0, -1, side.ident)

    def flush_wc(self, side: Side, wr_id: int) -> WC:
        return (wr_id, FLUSH, RECV, 0, -1, side.ident)


# -- the native session ------------------------------------------------------------------------


class Native:
    """The native session in record mode: C records the work requests it would post, and the
    completions go through ``aiordma_chan_process``/``aiordma_chan_finish`` as on a wake."""

    name = "native"

    def __init__(self) -> None:
        from aiordma._rdma.fastpath import native_lib

        native = native_lib()
        if native is None:
            pytest.skip("the native module is not built here")
        self.ffi, self.lib = native
        self.sides: dict[int, Side] = {}

    def make_side(self, name: str, ident: int, window: int, control: int, buf: int, sq_extra: int,
                  max_inline: int = 0, gen: int = 0) -> Side:  # fmt: skip
        from aiordma._rdma.fastpath import NativeSession

        side = Side(name, ident, window, control, buf, window + control + sq_extra, max_inline)
        recv = ring(side, window + control, buf, 7)
        extra = {"gen": gen} if gen else {}
        side.session = NativeSession(window=window, control=control, buffer_size=buf, recv=recv,
                                     rq_depth=window + control, qp=_Recorder(self, side), cid=ident, **extra)  # fmt: skip
        side.session.post_receives()  # (C posts them: the recorder has them)
        return side

    def start(self, side: Side, peer: Side, high_water: int) -> None:
        params = RdmaParams(b"\x01" * 16, peer.ident, 0, 5, peer.window, peer.control, peer.buf)
        send = ring(side, side.window, min(peer.buf, side.buf), 7)
        side.session.start(params, sq_depth=side.sq_depth, send=send, max_inline=side.max_inline, signal_every=4,
                           high_water=high_water)  # fmt: skip
        side.session.activate()

    def bind(self, a: Side, b: Side) -> None:
        ffi = self.ffi
        self.sides = {a.ident: a, b.ident: b}
        self.chans = ffi.new("struct aiordma_chan *[]", 8)
        for side in (a, b):
            self.chans[side.ident] = side.session.c
        self.out = ffi.new("struct aiordma_delivery[]", 32)
        self.others = ffi.new("struct aiordma_wc[]", 32)
        self.wcs = ffi.new("struct aiordma_wc[]", 32)
        self.deliv = bytearray(32 * max(a.buf, b.buf))
        self.deliv_c = ffi.from_buffer(self.deliv)
        self.used = ffi.new("uint64_t *")
        self.n_others = ffi.new("int *")
        self.stamp = 0

    def write(self, side: Side, chunk: bytes) -> None:
        side.session.send([chunk[:3], chunk[3:]] if len(chunk) > 3 else [chunk])
        assert side.session.error is None, side.session.error

    def read(self, side: Side, n: int) -> None:
        del side.unread[:n]
        if side.session.consumed(len(side.unread)):
            side.session.flush()

    def process(self, side: Side, entries: list[WC]) -> None:
        lib = self.lib
        for i, (wr_id, status, opcode, byte_len, imm, flags) in enumerate(entries):
            w = self.wcs[i]
            w.wr_id, w.status, w.opcode, w.byte_len, w.imm_data, w.wc_flags = wr_id, status, opcode, byte_len, imm, flags
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

    def recv_wc(self, side: Side, wr_id: int, length: int, imm: int) -> WC:
        return (wr_id, 0, int(self.lib.IBV_WC_RECV), length, imm, int(self.lib.IBV_WC_WITH_IMM))

    def send_wc(self, side: Side, wr_id: int) -> WC:
        return (wr_id, 0, 0, 0, 0, 0)

    def flush_wc(self, side: Side, wr_id: int) -> WC:
        return (wr_id, int(self.lib.IBV_WC_WR_FLUSH_ERR), int(self.lib.IBV_WC_RECV), 0, 0, 0)


class _Recorder:
    """The QP of record mode: what C recorded moves to the side's queues."""

    def __init__(self, flavor: Native, side: Side) -> None:
        self.flavor = flavor
        self.side = side

    def post_records(self, c: Any) -> None:
        ffi, lib = self.flavor.ffi, self.flavor.lib
        side = self.side
        for i in range(c.rec_send_n):
            w = c.rec_send[i]
            flags = int(w.send_flags)
            inline = bool(flags & lib.IBV_SEND_INLINE)
            data = ffi.buffer(ffi.cast("char *", w.addr), w.length)[:] if inline else None
            side.post_send(Send(int(w.wr_id), int(w.opcode) != int(lib.IBV_WR_SEND_WITH_IMM), int(w.addr),
                                int(w.length), int(w.imm_data), bool(flags & lib.IBV_SEND_SIGNALED), data))  # fmt: skip
        c.rec_send_n = 0
        for i in range(c.rec_recv_n):
            wr_id = int(c.rec_recv[i])
            slot = wr_id & 0xFFFFFFFF
            side.rq.append((wr_id, int(c.raddr) + slot * int(c.rslot), int(c.buffer_size)))
        c.rec_recv_n = 0
        assert len(side.rq) <= side.session.window + side.session.control


FLAVORS = [pytest.param(Checked, id="checked"), pytest.param(Native, id="native")]
