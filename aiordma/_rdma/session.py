"""The RDMA session of one connection, sans I/O.

The session decides everything about an RC queue pair that does not need a
device: what to post, when to ask for a completion, what a completion means,
when to return credits.  It takes events in (bytes to send, completions
polled from the CQ, "the reader consumed") and gives work out (send and
receive work requests as plain tuples, memoryviews of received bytes to hand
to the protocol, an error).  The link (``link.py``) does the I/O: it posts
what the session returns, feeds the views to the Core and wakes tasks.
Nothing here imports verbs or an event loop; ``tests/test_rdma_session.py``
drives two sessions against each other with hypothesis.

Theory of operation
-------------------
* **Buffers.**  Each side has a receive ring of ``window + control``
  registered slots of ``buffer_size`` bytes, all posted, and a send ring of
  ``window`` slots (each SEND at most the peer's ``buffer_size``).  A slot
  the NIC may touch belongs to the device from post until its completion is
  polled; a send slot is retired by the first *signaled* completion at or
  after it (RC completes a send queue in order), never earlier.
* **Budgets.**  Three bounds hold at every post, each from what was granted,
  not from our own configuration: a data SEND needs a data credit (a receive
  buffer the peer posted, ``Credits``), every work request a send-queue entry
  (``sq_depth``: the QP's granted ``max_send_wr``), and a non-inline data
  SEND a free send slot.  Receive work never exceeds the ring, which is never
  larger than the granted ``max_recv_wr``.  The CQ is sized by the device for
  the sum of its QPs' queues.
* **Signaling.**  Most sends are unsignaled (no completion, no wake-up).  A
  send is signaled when ``signal_every`` sends went unsignaled, when it fills
  the send queue or the send ring, or when it is the last one before close.
  So a full queue always holds a signaled request whose completion frees it:
  a sender that waits for room always has something to wait for.
* **Completions** are checked before any state changes: the work request id
  must name something outstanding, a receive must be a SEND with immediate
  data (an RDMA WRITE with immediate is refused), a credit-only SEND must
  carry no payload, the credits it returns must be owed.  A bad completion
  fails the session, but the rest of the batch is still accounted (buffer
  ownership never depends on the peer behaving).
* **Flow control.**  A received buffer is handed over and re-posted at once;
  its credit is returned to the peer only while the reader keeps up (the
  Core holds less than ``high_water`` bytes).  A reader that does not read
  therefore stops the peer's sender, which then waits -- it never spins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .._errors import RDMAError, RemoteProtocolError
from .constants import SIGNALED, SOLICITED, WCOpcode, WCStatus, wc_status_name
from .credits import CreditError, Credits, SendKind, pack_imm
from .params import RdmaParams
from .states import LinkInput, LinkState, next_state

__all__ = [
    "Ring",
    "RdmaSession",
    "SendWork",
    "RecvWork",
    "SQ_BIT",
    "KIND_DATA",
    "KIND_CREDIT",
    "KIND_PROBE",
    "wr_kind",
]

#: wr_id layout.  Receive: the slot index (bit 63 clear).  Send: bit 63 set,
#: the kind in bits 56-62, a sequence number in bits 0-47.
SQ_BIT: Final = 1 << 63
KIND_SHIFT: Final = 56
SEQ_MASK: Final = (1 << 48) - 1
KIND_DATA: Final = 0
KIND_CREDIT: Final = 1
KIND_PROBE: Final = 2

_RECV: Final = int(WCOpcode.RECV)
#: the states in which the QP carries traffic (a flush then is an error, not the teardown's)
_LIVE: Final = frozenset({LinkState.OPEN, LinkState.CLOSING, LinkState.LINGER})
_FLUSH: Final = int(WCStatus.WR_FLUSH_ERR)
_IMM_DATA_MASK: Final = (1 << 24) - 1
_IMM_CTRL_MASK: Final = 0x7F
_KIND_MASK: Final = 0x7F

#: (wr_id, addr, length, lkey, imm, send_flags): a SEND_WITH_IMM (or, for
#: the probe, a zero-length RDMA WRITE) to post; ``addr`` is in the send ring
#: (or, with INLINE in the flags, anywhere: the bytes are copied at post).
SendWork = tuple[int, int, int, int, int, int]
#: (wr_id, addr, length): a receive buffer to post (lkey: the ring's).
RecvWork = tuple[int, int, int]


def wr_kind(wr_id: int) -> int:
    return wr_id >> KIND_SHIFT & _KIND_MASK


def queue_views(backlog: deque[memoryview], chunks: Sequence[bytes | bytearray | memoryview]) -> int:
    """Append chunks to a backlog as flat byte views (empty ones dropped); returns the bytes added."""
    added = 0
    for chunk in chunks:
        view = chunk if type(chunk) is memoryview else memoryview(chunk)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = len(view)
        if n:
            backlog.append(view)
            added += n
    return added


def detach_views(backlog: deque[memoryview], enqueued: int, posted: int, end: int, count: int | None = None) -> None:
    """Copy the unposted part of the bytes queued up to ``end`` out of the callers' buffers.

    For a send that returns before its bytes were posted (asyncio's ``write``, a cancelled
    ``send``): its views must not outlive the call.  What it queued is still sent, whole and in
    order.  ``enqueued``/``posted``: the byte marks of everything queued and posted so far;
    ``count``: how many bytes before ``end`` the call queued (its own views: the walk stops
    there, so that many writes behind a long backlog stay linear), else all unposted ones.
    """
    remaining = end - posted
    if count is not None and count < remaining:
        remaining = count
    if remaining <= 0:
        return
    tail = enqueued - end  # bytes queued after ``end`` (by others)
    index = len(backlog) - 1
    while remaining > 0 and index >= 0:
        view = backlog[index]
        if tail >= len(view):
            tail -= len(view)
        else:
            if not view.readonly or not isinstance(view.obj, bytes):
                backlog[index] = memoryview(bytes(view))
            remaining -= len(view) - tail
            tail = 0
        index -= 1


@dataclass(frozen=True)
class Ring:
    """A registered region cut into ``count`` slots of ``slot_size`` bytes."""

    mem: memoryview  # writable, format "B"
    addr: int
    lkey: int
    slot_size: int
    count: int


class RdmaSession:
    """The sans-IO state of one RDMA connection (see the module docs).

    Built at setup with the local receive side (:meth:`initial_receives`
    gives the work to post before the HELLO goes out); :meth:`start` adds
    what the peer's HELLO and the granted QP caps say.
    """

    def __init__(self, *, window: int, control: int, buffer_size: int, recv: Ring, rq_depth: int) -> None:
        buffers = window + control
        if recv.count != buffers or recv.slot_size < buffer_size:
            raise ValueError("the receive ring must have window + control slots of buffer_size bytes")
        if rq_depth < buffers:
            raise ValueError(f"the receive queue holds {rq_depth} work requests, the ring needs {buffers}")
        self.window = window
        self.control = control
        self.buffer_size = buffer_size
        self.recv = recv
        self.state = LinkState.SETUP
        self.error: BaseException | None = None
        self._rposted = bytearray(buffers)
        self.rq_posted = 0
        # filled in by start()
        self.credits: Credits | None = None
        self.peer: RdmaParams | None = None
        self.sq_depth = 0
        self.sq_used = 0  # send work requests not yet retired
        self.max_inline = 0
        self.send_ring: Ring | None = None
        self.send_size = 0
        self._every = 1
        self._run = 0  # sends posted since the last signaled one
        self._seq = 0
        #: posted sends not yet retired, oldest first: (seq, signaled, slot or -1)
        self._outstanding: deque[tuple[int, bool, int]] = deque()
        self.signaled_out = 0
        self._slot_head = 0  # next send slot to fill
        self.slots_used = 0
        self._backlog: deque[memoryview] = deque()
        self.enqueued = 0  # bytes ever queued
        self.posted_bytes = 0  # bytes ever posted
        self.recvs = 0  # receive completions ever polled
        self.high_water = 1 << 20
        self.withheld = 0  # data buffers re-posted whose credit waits for the reader
        self._close_seq = -1  # seq of the signaled last send before close
        self.close_sent = False
        self.probe_status: int | None = None
        self._probe_seq = -1
        self._deferred: list[tuple[int, int, int, int, int, int]] = []
        self._need_fence = False
        #: post nothing more (the peer said goodbye: its QP is going away); receives go on
        self.quiet = False

    # -- set-up ------------------------------------------------------------------

    def initial_receives(self) -> list[RecvWork]:
        """Every receive slot, to post before the peer may send."""
        ring = self.recv
        out: list[RecvWork] = []
        for i in range(ring.count):
            if not self._rposted[i]:
                self._rposted[i] = 1
                out.append((i, ring.addr + i * ring.slot_size, self.buffer_size))
        self.rq_posted += len(out)
        return out

    def start(
        self,
        peer: RdmaParams,
        *,
        sq_depth: int,
        send: Ring,
        max_inline: int = 0,
        signal_every: int = 8,
        high_water: int = 1 << 20,
    ) -> None:
        """The peer's parameters and the granted send side are known."""
        if sq_depth < 2:
            raise ValueError("the send queue needs at least 2 entries")
        self.peer = peer
        self.credits = Credits(peer.window, peer.control, local_window=self.window, local_control=self.control)
        self.sq_depth = sq_depth
        self.send_ring = send
        self.send_size = min(peer.buffer_size, send.slot_size)
        self.max_inline = min(max_inline, self.send_size)  # (inline sends: not used yet)
        self._every = max(1, min(signal_every, sq_depth // 2, max(1, send.count // 2)))
        self.high_water = high_water

    def activate(self) -> None:
        self.state = next_state(self.state, LinkInput.ACTIVATE)

    # -- the life cycle -------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """The connection is broken: remember the first reason; post nothing more but teardown."""
        if self.error is None:
            self.error = exc
        self.state = next_state(self.state, LinkInput.FAIL)
        self._backlog.clear()

    def begin_close(self) -> None:
        """Take no more sends; the last one posted from now on is signaled."""
        self.state = next_state(self.state, LinkInput.CLOSE)
        if self.state is LinkState.CLOSING and not self._backlog:
            self._close_reached()

    def _close_reached(self) -> None:
        """Everything queued was posted while closing: wait for the last one's completion
        (a signaled zero-length WRITE follows when the last one went unsignaled)."""
        if not self._outstanding:
            self.close_sent = True
            self.state = next_state(self.state, LinkInput.CLOSE_SENT)
        elif self._outstanding[-1][1]:
            self._close_seq = self._outstanding[-1][0]
        else:
            self._need_fence = True

    def begin_drain(self) -> None:
        """The QP goes to ERROR now: what is posted comes back flushed."""
        self.state = next_state(self.state, LinkInput.DRAIN)
        self._backlog.clear()

    @property
    def drained(self) -> bool:
        """Every posted receive and every signaled send came back."""
        return self.rq_posted == 0 and self.signaled_out == 0

    def reclaim(self) -> None:
        """The QP was destroyed: the device can touch nothing any more; every buffer is ours."""
        self._outstanding.clear()
        self.signaled_out = 0
        self.sq_used = 0
        self.slots_used = 0
        self.rq_posted = 0
        self._rposted[:] = bytes(len(self._rposted))
        self.state = next_state(self.state, LinkInput.DRAINED)

    # -- sending -----------------------------------------------------------------

    def queue(self, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        """Append chunks to the backlog; returns the byte count that ends them."""
        self.enqueued += queue_views(self._backlog, chunks)
        return self.enqueued

    def detach(self, end: int, count: int | None = None) -> None:
        """Copy the unposted part of the bytes queued up to ``end`` out of the caller's buffers
        (see :func:`detach_views`)."""
        detach_views(self._backlog, self.enqueued, self.posted_bytes, end, count)

    @property
    def backlog(self) -> bool:
        return bool(self._backlog)

    def flush(self) -> list[SendWork]:
        """The sends that may be posted now: credit messages due, then the backlog."""
        state = self.state
        if (state is not LinkState.OPEN and state is not LinkState.CLOSING and state is not LinkState.LINGER) or self.quiet:
            return []
        credits = self.credits
        assert credits is not None
        out: list[SendWork] = []
        if credits.to_return and credits.should_send_credit() and self.sq_used < self.sq_depth:
            out.append(self._credit_work(credits))
        backlog = self._backlog
        if not backlog:
            if self._need_fence and self.sq_used < self.sq_depth:
                out.append(self._fence_work())
            return out
        ring = self.send_ring
        assert ring is not None
        size = self.send_size
        mem = ring.mem
        slot_size = ring.slot_size
        count = ring.count
        while backlog and credits.available and self.sq_used < self.sq_depth:
            if self.slots_used >= count:
                break
            slot = self._slot_head
            base = slot * slot_size
            filled = 0
            while backlog and filled < size:
                view = backlog[0]
                take = len(view)
                if take > size - filled:
                    take = size - filled
                    mem[base + filled : base + filled + take] = view[:take]
                    backlog[0] = view[take:]
                else:
                    mem[base + filled : base + filled + take] = view
                    backlog.popleft()
                filled += take
            self._slot_head = slot + 1 if slot + 1 < count else 0
            self.slots_used += 1
            imm = pack_imm(SendKind.DATA, *credits.on_send_data())
            seq = self._seq = self._seq + 1
            self._run += 1
            signal = (
                self._run >= self._every
                or self.sq_used + 1 >= self.sq_depth
                or self.slots_used >= count
                or (self.state is LinkState.CLOSING and not backlog)
            )
            if signal:
                self._run = 0
                self.signaled_out += 1
                flags = SIGNALED | SOLICITED
            else:
                flags = SOLICITED
            self.sq_used += 1
            self._outstanding.append((seq, signal, slot))
            self.posted_bytes += filled
            out.append((SQ_BIT | seq, ring.addr + base, filled, ring.lkey, imm, flags))
        if self.state is LinkState.CLOSING and not backlog:
            self._close_reached()
            if self._need_fence and self.sq_used < self.sq_depth:
                out.append(self._fence_work())
        return out

    def _fence_work(self) -> SendWork:
        """A signaled zero-length RDMA WRITE whose completion says every send before it arrived."""
        self._need_fence = False
        seq = self._seq = self._seq + 1
        self._close_seq = seq
        self.signaled_out += 1
        self.sq_used += 1
        self._outstanding.append((seq, True, -1))
        return (SQ_BIT | KIND_PROBE << KIND_SHIFT | seq, 0, 0, 0, 0, SIGNALED)

    def _credit_work(self, credits: Credits) -> SendWork:
        imm = pack_imm(SendKind.CREDIT, *credits.on_send_credit())
        seq = self._seq = self._seq + 1
        self._run += 1
        signal = self._run >= self._every or self.sq_used + 1 >= self.sq_depth
        flags = SOLICITED
        if signal:
            self._run = 0
            self.signaled_out += 1
            flags |= SIGNALED
        self.sq_used += 1
        self._outstanding.append((seq, signal, -1))
        return (SQ_BIT | KIND_CREDIT << KIND_SHIFT | seq, 0, 0, 0, imm, flags)

    @property
    def progress(self) -> int:
        """A mark that moves whenever a receive completes or bytes are posted (the liveness
        plan's look; probes do not move it)."""
        return self.recvs + self.posted_bytes

    @property
    def probe_outstanding(self) -> bool:
        """A probe is posted and has not completed (its retry budget runs)."""
        return self._probe_seq >= 0 and self.probe_status is None

    def probe_work(self) -> SendWork:
        """The path probe: a signaled zero-length RDMA WRITE (needs no receive buffer); also the
        liveness probe of a connection a task waits on.  ``probe_status`` is None until it completed."""
        seq = self._seq = self._seq + 1
        self._probe_seq = seq
        self.probe_status = None
        self.signaled_out += 1
        self.sq_used += 1
        self._outstanding.append((seq, True, -1))
        return (SQ_BIT | KIND_PROBE << KIND_SHIFT | seq, 0, 0, 0, 0, SIGNALED)

    # -- receiving -------------------------------------------------------------

    def on_completions(
        self, entries: Sequence[tuple[int, int, int, int, int, int]], buffered: int
    ) -> tuple[list[memoryview], list[RecvWork]]:
        """Account polled completions; returns the received payloads (in order) and the
        receive work to post *after* those views were consumed.

        ``buffered`` is what the Core holds unread; credits for re-posted data
        buffers are returned only below ``high_water``.  Call :meth:`flush`
        afterwards: credits that came back, and slots retired, may let more go.
        A bad completion sets :attr:`error` (and the state) but the batch is
        accounted to the end.
        """
        views: list[memoryview] = []
        reposts: list[RecvWork] = []
        ring = self.recv
        rposted = self._rposted
        credits = self.credits
        active = self.state in _LIVE and self.error is None
        nbuf = ring.count
        slot_size = ring.slot_size
        for wr_id, status, opcode, byte_len, imm, _qp in entries:
            if wr_id & SQ_BIT:
                self._retire(wr_id, status)
                continue
            self.recvs += 1
            if wr_id >= nbuf or not rposted[wr_id]:
                self._bad(RDMAError(5, "ibv_poll_cq", f"a receive completion for a buffer that is not posted (wr_id={wr_id})"))
                continue
            rposted[wr_id] = 0
            self.rq_posted -= 1
            if status:
                if status != _FLUSH or active:
                    self._bad(_wc_error("RDMA receive", wr_id, status))
                continue
            if not active or credits is None:
                if self.state is LinkState.SETUP and self.error is None:
                    # the peer sent before our side switched over: keep it for activate()
                    self._deferred.append((wr_id, status, opcode, byte_len, imm, _qp))
                    rposted[wr_id] = 1
                    self.rq_posted += 1
                continue  # draining or failed: the slot just comes back
            if opcode != _RECV:
                self._bad(RemoteProtocolError("the peer wrote into our memory with RDMA WRITE with immediate"))
                continue
            if imm < 0:
                self._bad(RemoteProtocolError("an RDMA SEND arrived without immediate data"))
                continue
            ctrl = imm >> 24 & _IMM_CTRL_MASK
            returned = imm & _IMM_DATA_MASK
            addr = ring.addr + wr_id * slot_size
            try:
                if imm >> 31:
                    if byte_len:
                        raise RemoteProtocolError(f"a credit-only SEND carried {byte_len} bytes")
                    credits.on_receive(SendKind.CREDIT, returned, ctrl)
                    rposted[wr_id] = 1
                    self.rq_posted += 1
                    reposts.append((wr_id, addr, self.buffer_size))
                    credits.on_repost(SendKind.CREDIT)
                    continue
                if byte_len > self.buffer_size:
                    raise RemoteProtocolError(f"an RDMA SEND of {byte_len} bytes exceeds our buffers of {self.buffer_size}")
                credits.on_receive(SendKind.DATA, returned, ctrl)
            except (CreditError, RemoteProtocolError) as exc:
                self._bad(exc if isinstance(exc, RemoteProtocolError) else RemoteProtocolError(str(exc)))
                continue
            base = wr_id * slot_size
            views.append(ring.mem[base : base + byte_len])
            buffered += byte_len
            rposted[wr_id] = 1
            self.rq_posted += 1
            reposts.append((wr_id, addr, self.buffer_size))
            if buffered < self.high_water and not self.withheld:
                credits.on_repost(SendKind.DATA)
            else:
                self.withheld += 1
        return views, reposts

    def take_deferred(self) -> list[tuple[int, int, int, int, int, int]]:
        """Receive completions that came before :meth:`start` (the peer was faster than our SELECT)."""
        out, self._deferred = self._deferred, []
        return out

    def consumed(self, buffered: int) -> bool:
        """The reader took bytes; returns whether withheld credits were released (then :meth:`flush`)."""
        if not self.withheld or buffered >= self.high_water // 4 or self.error is not None:
            return False
        credits = self.credits
        assert credits is not None
        for _ in range(self.withheld):
            credits.on_repost(SendKind.DATA)
        self.withheld = 0
        return True

    def _retire(self, wr_id: int, status: int) -> None:
        seq = wr_id & SEQ_MASK
        outstanding = self._outstanding
        if not outstanding or not outstanding[0][0] <= seq <= outstanding[-1][0]:
            self._bad(RDMAError(5, "ibv_poll_cq", f"a send completion for nothing outstanding "
                                                   f"(wr_id={wr_id:#x}, {wc_status_name(status)})"))  # fmt: skip
            return
        if status and (status != _FLUSH or self.state in _LIVE):
            kind = wr_kind(wr_id)
            what = "RDMA path probe" if kind == KIND_PROBE else "RDMA send"
            self._bad(_wc_error(what, wr_id, status))
        # in order: everything posted up to this one is done
        while outstanding and outstanding[0][0] <= seq:
            s, signaled, slot = outstanding.popleft()
            self.sq_used -= 1
            if signaled:
                self.signaled_out -= 1
            if slot >= 0:
                self.slots_used -= 1
            if s == self._probe_seq:
                self.probe_status = status
        if self._close_seq >= 0 and seq >= self._close_seq and not self.close_sent:
            self.close_sent = True
            if self.state is LinkState.CLOSING:
                self.state = next_state(self.state, LinkInput.CLOSE_SENT)

    def _bad(self, exc: BaseException) -> None:
        if self.error is None:
            self.fail(exc)


def _wc_error(what: str, wr_id: int, status: int) -> RDMAError:
    return RDMAError(5, what, f"wr_id={wr_id:#x} {wc_status_name(status)}", wc_status=wc_status_name(status))
