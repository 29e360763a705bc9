"""The native hot path: one connection's session state in a C struct.

:class:`NativeSession` is a :class:`~aiordma._rdma.datapath.DataPath`, like the
checked :class:`~aiordma._rdma.checked.CheckedSession`, but its
per-message work is C (``_native/aiordma_fast.c``): a send is one call that
copies the bytes into the next send-ring slot (or inline into the work
request) and posts; completions are processed inside the poller's one call
per wake (:mod:`aiordma._rdma.poller`), which copies payloads into the
poller's delivery buffer, re-posts the receive buffers in one batch and posts
the credit SENDs that became due.  Python keeps the backlog (what could not be
posted yet), the life cycle (``states.py``) and the cold paths -- probe,
close, drain -- which read and write the struct's fields.

The checked session stays the reference: ``RdmaConfig(hot_path="checked")``
runs it, tests run both (on the simulated wire the very same C code runs in
*record mode*: it writes the work requests it would post into arrays, and the
simulated QP posts them).

Buffer ownership is the device's from post until the completion is polled,
as in the checked session: C retires a send slot only at the first signaled
completion at or after it, and a receive slot is re-posted only after its
bytes were copied out.
"""

from __future__ import annotations

import errno as _errno

import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from anyio import BrokenResourceError

from .._errors import RDMAError, RemoteProtocolError
from .constants import wc_status_name
from .objects import QueuePair
from .params import RdmaParams
from .session import Ring, SendWork, detach_views, queue_views
from .states import LinkInput, LinkState, next_state

__all__ = ["NativeSession", "native_lib", "CS_OPEN", "EVT_DATA", "EVT_ROOM", "EVT_ERROR", "EVT_CLOSE_SENT",
           "EVT_ONESIDED"]


def native_lib() -> tuple[Any, Any] | None:
    """``(ffi, lib)`` of the native module, or None when it was not built (then only "checked" runs)."""
    from . import _native

    if _native._lib is None:
        return None
    return _native._ffi, _native._lib


_NATIVE = native_lib()
if _NATIVE is not None:
    _L = _NATIVE[1]
    CS_SETUP, CS_OPEN, CS_CLOSING, CS_DRAINING = _L.AIORDMA_CS_SETUP, _L.AIORDMA_CS_OPEN, _L.AIORDMA_CS_CLOSING, _L.AIORDMA_CS_DRAINING
    EVT_DATA, EVT_ROOM, EVT_ERROR = _L.AIORDMA_EVT_DATA, _L.AIORDMA_EVT_ROOM, _L.AIORDMA_EVT_ERROR
    EVT_PROBE, EVT_CLOSE_SENT, EVT_DRAIN = _L.AIORDMA_EVT_PROBE, _L.AIORDMA_EVT_CLOSE_SENT, _L.AIORDMA_EVT_DRAIN
    EVT_ONESIDED = _L.AIORDMA_EVT_ONESIDED
    BLOCK_SQ = _L.AIORDMA_BLOCK_SQ
    KIND_PROBE, KIND_FENCE = _L.AIORDMA_KIND_PROBE, _L.AIORDMA_KIND_FENCE
else:  # pragma: no cover - without the native module nothing here is used
    CS_SETUP, CS_OPEN, CS_CLOSING, CS_DRAINING = 0, 1, 2, 3
    EVT_DATA, EVT_ROOM, EVT_ERROR, EVT_PROBE, EVT_CLOSE_SENT, EVT_DRAIN = 1, 2, 4, 8, 16, 32
    EVT_ONESIDED = 64
    BLOCK_SQ = 2
    KIND_PROBE, KIND_FENCE = 2, 3

_C_STATE = {
    LinkState.SETUP: CS_SETUP,
    LinkState.OPEN: CS_OPEN,
    LinkState.CLOSING: CS_CLOSING,
    LinkState.LINGER: CS_CLOSING,  # (C: receives, returns credits; Python queues nothing more)
    LinkState.DRAINING: CS_DRAINING,
    LinkState.CLOSED: CS_DRAINING,
}

_CREDIT_ERRORS = {
    1: "the peer sent data without a credit",
    2: "the peer sent a credit message without a control credit",
    3: "the peer sent a credit message that returns nothing",
    4: "the peer returned more credits than it could owe",
}


def chan_error(c: Any, buffer_size: int) -> BaseException:
    """The error C recorded in ``c``, as the exception the checked session raises for it."""
    code, arg, wr_id = int(c.error), int(c.error_arg), int(c.error_wr_id)
    if code == 1:
        what = "send" if arg else "receive"
        return RDMAError(5, "ibv_poll_cq", f"a {what} completion for nothing outstanding (wr_id={wr_id:#x})")
    if code == 2:
        kind = wr_id >> 56 & 0x7F
        if not wr_id >> 63:
            what = "RDMA receive"
        elif kind in (KIND_PROBE, KIND_FENCE):
            what = "RDMA path probe"
        else:
            what = "RDMA send"
        name = wc_status_name(arg)
        return RDMAError(5, what, f"wr_id={wr_id:#x} {name}", wc_status=name)
    if code == 3:
        return RemoteProtocolError("the peer wrote into our memory with RDMA WRITE with immediate")
    if code == 4:
        return RemoteProtocolError("an RDMA SEND arrived without immediate data")
    if code == 5:
        return RemoteProtocolError(f"a credit-only SEND carried {arg} bytes")
    if code == 6:
        return RemoteProtocolError(f"an RDMA SEND of {arg} bytes exceeds our buffers of {buffer_size}")
    if code == 7:
        return RemoteProtocolError(_CREDIT_ERRORS.get(arg, "the peer broke the credit rules"))
    if code == 8:
        return RDMAError(arg, "ibv_post_send/ibv_post_recv", os.strerror(arg))
    if code == 9:
        return RemoteProtocolError("an RDMA SEND arrived before the connection was set up")
    return RDMAError(5, "aiordma native path", f"unknown error code {code}")


class NativeSession:
    """The session of one connection with its state in a ``struct aiordma_chan`` (see the module
    docs); a :class:`~aiordma._rdma.datapath.OneSidedPath`.

    ``qp`` is the native QP (its ``_h`` handle is what C posts on) or the
    simulated wire's QP (record mode: ``qp.post_records(chan)`` posts what C
    recorded).  ``cid`` is the index the poller routes completions by.
    """

    native = True

    def __init__(self, *, window: int, control: int, buffer_size: int, recv: Ring, rq_depth: int, qp: QueuePair,
                 cid: int, gen: int = 0) -> None:  # fmt: skip
        buffers = window + control
        if recv.count != buffers or recv.slot_size < buffer_size:
            raise ValueError("the receive ring must have window + control slots of buffer_size bytes")
        if rq_depth < buffers:
            raise ValueError(f"the receive queue holds {rq_depth} work requests, the ring needs {buffers}")
        lib = native_lib()
        if lib is None:
            raise RuntimeError("the native module is not built: use RdmaConfig(hot_path='checked')")
        self._ffi, self._lib = ffi, clib = lib
        self.window, self.control, self.buffer_size, self.recv = window, control, buffer_size, recv
        self.c = c = ffi.new("struct aiordma_chan *")
        self._keep: list[Any] = []
        handle = getattr(qp, "_h", None)
        self.record: Callable[[Any], None] | None = None
        if handle is None:  # the simulated wire: record mode (its QP posts what C recorded)
            c.qp = ffi.NULL
            self.record = getattr(qp, "post_records")
        else:
            c.qp = handle
        c.cid = cid
        c.gen = gen & 0xFF
        c.state = CS_SETUP
        c.raddr, c.rlkey, c.rslot, c.rcount, c.buffer_size = recv.addr, recv.lkey, recv.slot_size, buffers, buffer_size
        c.rposted = self._array("uint8_t[]", buffers)
        c.pend = self._array("uint32_t[]", buffers)
        if self.record is not None:
            c.rec_recv = self._array("uint64_t[]", buffers)
            c.rec_recv_cap = buffers
        self.state = LinkState.SETUP
        self.error: BaseException | None = None
        self.peer: RdmaParams | None = None
        self.send_ring: Ring | None = None
        self.high_water = 1 << 20
        self._quarter = self.high_water // 4
        #: the bytes queued and not posted yet, in order (the caller's views until ``detach``)
        self.queued: deque[memoryview] = deque()
        self.enqueued = 0
        #: closing waits to post a signaled marker after an unsignaled last send
        self.need_fence = False
        self._from_buffer = ffi.from_buffer
        self._send = clib.aiordma_chan_send

    def _array(self, ctype: str, n: int) -> Any:
        arr = self._ffi.new(ctype, max(1, n))
        self._keep.append(arr)
        return arr

    def _posted(self) -> None:
        """Record mode: hand what C recorded to the simulated QP."""
        if self.record is not None:
            self.record(self.c)

    def _check_c(self) -> None:
        """C recorded an error: the session fails with it (once)."""
        c = self.c
        if c.error and self.error is None:
            self.fail(chan_error(c, self.buffer_size))

    # -- set-up ------------------------------------------------------------------

    def post_receives(self) -> None:
        """Post every receive slot (C does); raises what the QP refused."""
        self._lib.aiordma_chan_repost_all(self.c)
        self._posted()
        self._check_c()
        if self.error is not None:
            raise self.error

    def start(self, peer: RdmaParams, *, sq_depth: int, send: Ring, max_inline: int = 0, signal_every: int = 8,
              high_water: int = 1 << 20) -> None:  # fmt: skip
        if sq_depth < 2:
            raise ValueError("the send queue needs at least 2 entries")
        c = self.c
        self.peer, self.send_ring = peer, send
        send_size = min(peer.buffer_size, send.slot_size)
        c.saddr, c.slkey, c.sslot, c.scount, c.send_size = send.addr, send.lkey, send.slot_size, send.count, send_size
        c.sq_depth = sq_depth
        c.o_seq = self._array("uint64_t[]", sq_depth)
        c.o_slot = self._array("int32_t[]", sq_depth)
        c.o_sig = self._array("uint8_t[]", sq_depth)
        c.os_done = self._array("uint64_t[]", sq_depth)
        c.every = max(1, min(signal_every, sq_depth // 2, max(1, send.count // 2)))
        c.max_inline = min(max_inline, send_size, 1024)
        if self.record is not None:
            c.rec_send = self._array("struct aiordma_send_wr[]", sq_depth)
            c.rec_send_cap = sq_depth
            c.rec_inline = self._array("uint8_t[]", sq_depth * max(1, c.max_inline))
        c.window, c.control = peer.window, peer.control
        c.local_window, c.local_control = self.window, self.control
        c.threshold = max(1, self.window // 2)
        c.available, c.control_available = peer.window, peer.control
        c.peer_available, c.peer_control_available = self.window, self.control
        c.high_water = high_water
        self.high_water = high_water
        self._quarter = high_water // 4
        c.probe_status = -1
        c.started = 1

    def activate(self) -> None:
        self._set_state(next_state(self.state, LinkInput.ACTIVATE))
        self._lib.aiordma_chan_credit(self.c)  # credits freed by early SENDs
        self._posted()
        self._check_c()

    def _set_state(self, state: LinkState) -> None:
        self.state = state
        self.c.state = _C_STATE[state]

    @property
    def max_inline(self) -> int:
        return int(self.c.max_inline)

    @property
    def quiet(self) -> bool:
        """Post nothing more (the peer said goodbye); receives are still delivered."""
        return bool(self.c.quiet)

    @quiet.setter
    def quiet(self, value: bool) -> None:
        self.c.quiet = int(value)

    # -- life cycle ------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._set_state(next_state(self.state, LinkInput.FAIL))
        self.queued.clear()

    def begin_close(self) -> None:
        self._set_state(next_state(self.state, LinkInput.CLOSE))
        if self.state is LinkState.CLOSING and not self.queued:
            self._close_reached()

    def _close_reached(self) -> None:
        c = self.c
        if c.o_len == 0:
            self._close_done()
            return
        last = (c.o_head + c.o_len - 1) % c.sq_depth
        if c.o_sig[last]:
            c.close_seq = c.o_seq[last]
        elif self._lib.aiordma_chan_marker(c, KIND_FENCE) == 0:
            self._posted()
        else:
            self.need_fence = True
            self._check_c()

    def _close_done(self) -> None:
        self.c.close_sent = 1
        if self.state is LinkState.CLOSING:
            self._set_state(next_state(self.state, LinkInput.CLOSE_SENT))

    @property
    def close_sent(self) -> bool:
        return bool(self.c.close_sent)

    def begin_drain(self) -> None:
        self._set_state(next_state(self.state, LinkInput.DRAIN))
        self.queued.clear()

    @property
    def drained(self) -> bool:
        c = self.c
        return bool(c.rq_posted == 0 and c.signaled_out == 0)

    @property
    def rq_posted(self) -> int:
        return int(self.c.rq_posted)

    @property
    def signaled_out(self) -> int:
        return int(self.c.signaled_out)

    def reclaim(self) -> None:
        """The QP was destroyed: every buffer is ours."""
        c = self.c
        c.o_len = c.o_head = 0
        c.signaled_out = c.sq_used = c.slots_used = c.rq_posted = c.npend = 0
        self._ffi.memmove(c.rposted, bytes(self.window + self.control), self.window + self.control)
        self._set_state(next_state(self.state, LinkInput.DRAINED))

    # -- probe --------------------------------------------------------------------

    def post_probe(self) -> None:
        """Post a probe (a signaled zero-length RDMA WRITE); with the send queue full it does not
        (what fills it completes, or times out, by itself)."""
        if self._lib.aiordma_chan_marker(self.c, KIND_PROBE) == 0:
            self._posted()
        self._check_c()

    @property
    def progress(self) -> int:
        """A mark that moves whenever data arrives or bytes are posted (the liveness plan's look;
        probes do not move it)."""
        c = self.c
        return int(c.recvs) + int(c.posted_bytes)

    @property
    def probe_outstanding(self) -> bool:
        """A probe is posted and has not completed (its retry budget runs)."""
        c = self.c
        return bool(c.probe_seq) and int(c.probe_status) < 0

    @property
    def probe_status(self) -> int | None:
        c = self.c
        status = int(c.probe_status)
        return None if not c.probe_seq or status < 0 else status

    # -- sending -------------------------------------------------------------------

    @property
    def posted_bytes(self) -> int:
        return int(self.c.posted_bytes)

    @property
    def backlog(self) -> bool:
        return bool(self.queued)

    @property
    def blocked_on_sends(self) -> bool:
        """The last send stopped for the send queue or the send ring (a send completion frees them)."""
        return bool(self.c.blocked == BLOCK_SQ)

    @property
    def wants_send_completions(self) -> bool:
        c = self.c
        return (
            self.error is None
            and c.blocked == BLOCK_SQ
            and bool(self.queued or c.to_return > 0 or self.need_fence)
        )

    def send(self, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        """Post ``chunks`` at once where credits and slots allow (one C call); queue the rest.
        Returns 0 when all of it was posted, else the byte mark that ends it (compare with
        :attr:`posted_bytes`); a refused post sets :attr:`error`."""
        n_chunks = len(chunks)
        if self.queued or n_chunks > 2 or not n_chunks:
            end = self.queue(chunks)
            self.flush()
            return 0 if self.error is None and self.c.posted_bytes >= end else end
        a = chunks[0]
        c = self.c
        if n_chunks == 1 and type(a) is bytes:  # the hot path: a small frame, header and payload joined
            total = len(a)
            self.enqueued += total
            taken = self._send(c, a, total, b"", 0, 0)
            b: bytes | bytearray | memoryview = b""
        else:
            b = chunks[1] if n_chunks == 2 else b""
            na = len(a) if type(a) is bytes else memoryview(a).nbytes
            nb = len(b) if type(b) is bytes else memoryview(b).nbytes
            total = na + nb
            self.enqueued += total
            from_buffer = self._from_buffer
            taken = self._send(
                c, a if type(a) is bytes else from_buffer(a), na, b if type(b) is bytes else from_buffer(b), nb, 0
            )
        if self.record is not None:  # the simulated wire posts what C recorded
            self.record(c)
            if c.error:
                self._check_c()
                return self.enqueued
        if taken == total:
            return 0
        return self.after_partial(a, total, taken, b)

    def after_partial(self, a: bytes | bytearray | memoryview, total: int, taken: int,
                      b: bytes | bytearray | memoryview = b"") -> int:  # fmt: skip
        """A send took ``taken`` of ``total`` bytes (already counted in :attr:`enqueued`): the rest
        waits in the backlog, in order (or the post failed).  Returns the byte mark that ends it."""
        if taken < 0:
            self._check_c()
            return self.enqueued
        self.enqueued -= total - taken
        na = memoryview(a).nbytes
        if taken < na:
            rest = memoryview(a).cast("B")[taken:]
            self.queue([rest, b] if len(b) else [rest])
        else:
            self.queue([memoryview(b).cast("B")[taken - na :]])
        return self.enqueued

    def queue(self, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        """Append chunks to the backlog; returns the byte count that ends them."""
        self.enqueued += queue_views(self.queued, chunks)
        return self.enqueued

    def detach(self, end: int, count: int | None = None) -> None:
        """Copy the unposted part of the bytes queued up to ``end`` out of the caller's buffers
        (see :func:`~aiordma._rdma.session.detach_views`)."""
        detach_views(self.queued, self.enqueued, self.posted_bytes, end, count)

    def flush(self) -> list[SendWork]:
        """Post what the backlog and the credits allow (C posts); nothing is left for the link."""
        state = self.state
        if state is not LinkState.OPEN and state is not LinkState.CLOSING and state is not LinkState.LINGER:
            return []
        c = self.c
        backlog = self.queued
        send = self._send
        closing = state is LinkState.CLOSING
        while backlog:
            a = backlog[0]
            b = backlog[1] if len(backlog) > 1 else None
            na = len(a)
            nb = len(b) if b is not None else 0
            last = closing and len(backlog) <= 2
            taken = send(c, self._from_buffer(a), na, self._from_buffer(b) if b is not None else b"", nb, last)
            if taken < 0:
                break
            if taken >= na:
                backlog.popleft()
                if b is not None:
                    if taken - na >= nb:
                        backlog.popleft()
                    else:
                        backlog[0] = b[taken - na :]
                        break
                continue
            backlog[0] = a[taken:]
            break
        self._lib.aiordma_chan_credit(c)
        self._posted()
        self._check_c()
        if self.error is None and self.state is LinkState.CLOSING and not backlog:
            if self.need_fence:
                if self._lib.aiordma_chan_marker(c, KIND_FENCE) == 0:
                    self.need_fence = False
                    self._posted()
            elif not c.close_seq and not c.close_sent:
                self._close_reached()
        return []

    def close(self, final: bytes) -> None:
        if final:
            self.queue([final])
        self.begin_close()
        self.flush()

    # -- receiving (the poller processes completions in C; see link.on_native) ------------------

    def on_events(self, events: int) -> None:
        """Account what C reported for this connection in a wake (``c.events``, already cleared)."""
        if events & EVT_ERROR:
            self._check_c()
        if events & EVT_CLOSE_SENT and self.state is LinkState.CLOSING:
            self._set_state(next_state(self.state, LinkInput.CLOSE_SENT))
        if events & EVT_ROOM and (self.queued or self.need_fence):
            self.flush()

    @property
    def withheld(self) -> int:
        return int(self.c.withheld)

    def consumed(self, buffered: int) -> bool:
        """The reader took bytes; returns whether withheld credits were released (then :meth:`flush`)."""
        c = self.c
        if c.unread > buffered:
            c.unread = buffered
        if not c.withheld or buffered >= self._quarter or self.error is not None:
            return False
        c.to_return += c.withheld
        c.withheld = 0
        return True

    def reader_took(self, buffered: int) -> None:
        c = self.c
        if (c.unread >= self._quarter or c.withheld) and self.consumed(buffered):
            self.flush()

    def release_withheld(self) -> None:
        if self.c.withheld and self.consumed(0):
            self.flush()

    def take_deferred(self) -> list[tuple[int, int, int, int, int, int]]:
        return []  # early bytes are delivered by C and kept by the link

    def complete(self, entries: Sequence[tuple[int, int, int, int, int, int]], buffered: int) -> list[memoryview]:
        """Completions polled in Python: C routes every one of ours by the cid in its wr_id, so
        one here names no work request of ours -- something posted behind our back, and the
        QP's state is unknown: the session fails."""
        wr_id, status = entries[0][0], entries[0][1]
        if status:
            name = wc_status_name(status)
            self.fail(RDMAError(5, "RDMA send", f"wr_id={wr_id:#x} {name}", wc_status=name))
        else:
            self.fail(RDMAError(5, "ibv_poll_cq", f"a completion for nothing outstanding (wr_id={wr_id:#x})"))
        return []

    def settle(self) -> None:
        self.flush()

    # -- one-sided RDMA READ / WRITE --------------------------------------------------------

    def post_onesided(self, write: bool, laddr: int, length: int, lkey: int, raddr: int, rkey: int) -> int:
        """Post a signaled RDMA READ or WRITE (bounds and keys checked by the caller); returns its
        sequence number, or 0 while the send queue is full (wait for a send completion)."""
        lib = self._lib
        opcode = lib.IBV_WR_RDMA_WRITE if write else lib.IBV_WR_RDMA_READ
        seq = int(lib.aiordma_chan_onesided(self.c, opcode, laddr, length, lkey, raddr, rkey))
        if seq == -_errno.EAGAIN:
            return 0
        if seq < 0:
            raise self._refused(seq, "posting an RDMA READ/WRITE failed")
        self._posted()
        self._check_c()
        return seq

    def reserve_wr(self) -> tuple[int, int]:
        """A send-queue entry for a signaled work request the link posts itself (a BIND_MW):
        ``(sequence number, wr_id)``, or ``(0, 0)`` while the send queue is full.  Its completion
        comes back as a one-sided one (:meth:`take_onesided`)."""
        wr_id = self._ffi.new("uint64_t *")
        seq = int(self._lib.aiordma_chan_reserve(self.c, wr_id))
        if seq == -_errno.EAGAIN:
            return 0, 0
        if seq < 0:
            raise self._refused(seq, "the connection cannot post")
        return seq, int(wr_id[0])

    def _refused(self, rc: int, what: str) -> BaseException:
        """Why C refused a one-sided post of ours (``rc`` < 0).  The session's error, if it has
        one (C's first); ``-ENOTCONN`` without one is no failure -- the peer said goodbye (its
        QP is going away) or the connection is closing: it posts nothing more, and the caller's
        operation is over (``BrokenResourceError``) while the session goes on delivering what
        arrives.  Anything else: the post failed, and the session with it."""
        self._check_c()
        if self.error is None:
            if rc == -_errno.ENOTCONN:
                why = "the peer closed it" if self.c.quiet else "it is closing"
                return BrokenResourceError(f"the RDMA connection takes no more operations: {why}")
            self.fail(RDMAError(-rc, "ibv_post_send", what))
        assert self.error is not None
        return self.error

    def take_onesided(self) -> list[tuple[int, int]]:
        """The one-sided WRs completed since the last call: (sequence number, wc status)."""
        c = self.c
        n = c.os_n
        if not n:
            return []
        done = c.os_done
        out = [(int(done[i]) >> 8, int(done[i]) & 0xFF) for i in range(n)]
        c.os_n = 0
        return out

    def stats(self) -> dict[str, int]:
        c = self.c
        return {
            "sends": int(c.sends), "inline_sends": int(c.inline_sends), "credit_sends": int(c.credit_sends),
            "recvs": int(c.recvs), "posted_bytes": int(c.posted_bytes), "received_bytes": int(c.received_bytes),
            "max_inline": int(c.max_inline),
        }  # fmt: skip
