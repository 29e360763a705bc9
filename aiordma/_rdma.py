"""The RDMA transport: an RC queue pair that carries the protocol's frames.

Theory of operation
-------------------
The handshake runs on TCP (``_negotiate.py``).  When both sides offer RDMA,
each side creates an :class:`RdmaEndpoint` -- context, PD, completion channel,
CQ, an RC QP and two registered pools -- posts its receive buffers, and sends
its :class:`~aiordma._rdma_params.RdmaParams` in its HELLO.  Both QPs move to
RTR/RTS; the client proves the path with a zero-length RDMA WRITE (it needs the
peer's ACK and consumes no receive buffer) and then SELECTs RDMA.  From then on
the Core's link is an :class:`RdmaLink`: the protocol's frames (DATA,
MESSAGE, EOF, CLOSE -- the same bytes as on TCP) travel in SENDs with
immediate data, and the TCP connection stays open, silent, as the liveness
channel: its end (or any byte on it) means the peer is gone.

* **Ownership.**  A buffer posted to the NIC belongs to the device until its
  completion is polled -- flushed completions after ``QP -> ERROR`` included.
  Receive slots go POSTED -> COMPLETED -> (their bytes are copied into the
  protocol's buffer) -> posted again; send slots go ACQUIRED (filled) ->
  POSTED -> FREE on their send completion.  ``aiordma._mempool`` enforces it.
* **Flow control.**  A SEND needs a posted receive buffer at the peer; the
  credits of ``_credits.py`` guarantee one.  A receive slot is re-posted (and
  its credit returned) only once its bytes were taken into the Core, and the
  link stops doing so while 1 MiB waits unread: a reader that does not read
  stalls the writer instead of growing memory.  ``rnr_retry`` is finite, so a
  broken accounting surfaces as an error, never as a hang.
* **Event loop.**  Nothing runs in the background.  A task that must wait
  (a receiver without data, a sender without credit) takes the progress lock,
  drains and acknowledges the completion channel's events, re-arms the CQ and
  then polls it until it is empty (arm-then-poll: a completion that arrives
  after the poll raises a new event), and sleeps in the event loop on one
  epoll fd that holds the completion channel, the device's async-event fd and
  the TCP socket.  No busy loop when idle.
* **Per message.**  The data path keeps Python work per SEND and per
  receive small: a data SEND is one C call (``QueuePair.post_send_imm``, no
  ``SendWR``), only every ``signal_every``-th one is signaled; completions
  are decoded in one pass (``WCArray.entries``); a received buffer is copied
  straight from the registered region into the Core (``MemoryPool.consume``:
  COMPLETED -> LENT -> FREE, no ``SlotView``), and the buffers delivered
  together are re-posted together (``MemoryPool.acquire_posted`` marks them
  POSTED right before the one post call; ``post_recv_one`` for one).  A wake
  that brought a CQ event costs one event read, no epoll scan.  The stream
  backlog is packed into slot-sized SENDs.
* **Teardown.**  Stop posting; send CLOSE (bounded); move the QP to ERROR;
  poll until every posted work request came back; acknowledge all CQ events;
  destroy QP, CQ, channel; deregister the pools; free PD and context; close
  the epoll fd and the TCP connection.  The same path runs on errors and under
  cancellation (shielded, bounded).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import select
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from anyio import BrokenResourceError, ClosedResourceError
from anyio.abc import SocketAttribute

from . import _verbs as verbs
from ._attributes import TransportAttribute
from ._core import RECEIVE_HIGH_WATER, Core, Link
from ._credits import CreditError, Credits, SendKind, pack_imm, unpack_imm
from ._errors import RDMAError, RemoteProtocolError
from ._mempool import MemoryPool, Slot, SlotState, pd_registrar
from ._protocol import Chunk
from ._rdma_params import MTU_BYTES, RdmaParams
from ._rdma_probe import Probe, probe

__all__ = ["RdmaConfig", "RdmaBackend", "RdmaEndpoint", "RdmaLink", "RdmaSetupError", "local_ip_of"]

log = logging.getLogger("aiordma")

SEND_TAG = 1 << 63  # wr_id bit: a send-queue work request
CREDIT_TAG = 1 << 62  # wr_id bit: a credit-only SEND (no slot)
PROBE_TAG = 1 << 61  # wr_id bit: the path probe (zero-length RDMA WRITE)
_TAGS = SEND_TAG | CREDIT_TAG | PROBE_TAG
_MTU_CODES = {v: k for k, v in MTU_BYTES.items()}
_FLUSH = verbs.WCStatus.WR_FLUSH_ERR
_SEND_WITH_IMM = verbs.Opcode.SEND_WITH_IMM
# the immediate data's layout (see _credits.pack_imm), decoded inline on the receive path
_IMM_DATA_BITS = 24
_IMM_DATA_MASK = (1 << _IMM_DATA_BITS) - 1
_IMM_CTRL_MASK = 0x7F
assert unpack_imm(pack_imm(SendKind.CREDIT, 5, 3)) == (SendKind.CREDIT, 5, 3)
assert pack_imm(SendKind.CREDIT, 5, 3) == 1 << 31 | 3 << _IMM_DATA_BITS | 5


@dataclass(frozen=True)
class RdmaConfig:
    """Sizes and timeouts of the RDMA transport (per connection)."""

    #: receive buffers for data SENDs (the peer's data credits)
    window: int = 32
    #: receive buffers for credit-only SENDs
    control: int = 2
    #: size of each receive (and send) buffer
    buffer_size: int = 64 << 10
    #: how long the path probe and the QP bring-up may take
    setup_timeout: float = 5.0
    #: QP ACK timeout exponent (4.096 us * 2**n) and retries: a dead peer is
    #: reported after about (retry_cnt + 1) * timeout
    qp_timeout: int = 14
    retry_cnt: int = 7
    rnr_retry: int = 6
    #: how long closing waits for the CLOSE to be delivered and for flushes
    close_timeout: float = 2.0
    #: adaptive busy polling before sleeping: at most this long (ns), and only
    #: while completions recently came that fast (0 disables it)
    max_spin_ns: int = 50_000
    #: request a send completion at least every this many SENDs (the others
    #: are unsignaled; a completion frees every slot posted before it)
    signal_every: int = 8


class RdmaSetupError(Exception):
    """A step of the RDMA setup failed; ``step`` names it, the message says why."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"RDMA setup failed at {step}: {detail}")
        self.step = step
        self.detail = detail


def local_ip_of(link: Link) -> str | None:
    """The local IP address of a link's TCP socket."""
    attrs = link.extra_attributes
    getter = attrs.get(SocketAttribute.local_address)
    if getter is None:
        return None
    address = getter()
    if isinstance(address, tuple) and address:
        return str(address[0])
    return None


def _socket_fd(link: Link) -> int | None:
    getter = link.extra_attributes.get(SocketAttribute.raw_socket)
    if getter is None:
        return None
    try:
        return int(getter().fileno())
    except (OSError, AttributeError, ValueError):
        return None


class RdmaBackend:
    """Opens RDMA endpoints for connections.  Injectable (``rdma_backend=``):
    tests subclass it to make a chosen step fail, and :meth:`probe` decides
    whether RDMA is offered at all."""

    def __init__(self, config: RdmaConfig | None = None) -> None:
        self.config = config or RdmaConfig()

    def probe(self) -> Probe:
        return probe()

    def before_step(self, step: str) -> None:
        """Called before each setup step (``device``, ``open``, ``resources``,
        ``init``, ``memory``, ``post``, ``params``, ``rtr``, ``rts``, ``probe``)."""

    async def probe_delay(self) -> None:
        """Called while the path probe is outstanding (tests make it hang)."""

    def open(self, local_ip: str | None) -> RdmaEndpoint:
        return RdmaEndpoint(self, local_ip)


class RdmaEndpoint:
    """The verbs resources of one connection, created in order and released in reverse."""

    def __init__(self, backend: RdmaBackend, local_ip: str | None) -> None:
        self.backend = backend
        self.config = cfg = backend.config
        self.ctx: verbs.Context | None = None
        self.pd: verbs.ProtectionDomain | None = None
        self.channel: verbs.CompletionChannel | None = None
        self.cq: verbs.CompletionQueue | None = None
        self.qp: verbs.QueuePair | None = None
        self.recv_pool: MemoryPool | None = None
        self.send_pool: MemoryPool | None = None
        self.peer: RdmaParams | None = None
        self.closed = False
        self.credit_sends = 0  # credit-only SENDs outstanding (no slot)
        self.probe_outstanding = False
        self.sent: deque[Slot] = deque()  # posted data SENDs, oldest first
        self.signaled: set[int] = set()  # wr_ids of the signaled ones among them
        self.epoll: select.epoll | None = None
        try:
            self._step("device")
            if local_ip is None:
                raise RdmaSetupError("device", "the TCP socket has no IP address")
            entry = verbs.gid_for_ip(local_ip)
            if entry is None:
                raise RdmaSetupError("device", f"no RDMA device has the local address {local_ip}")
            self.gid_entry = entry
            self._step("open")
            self.ctx = verbs.Context(entry.device)
            self._step("resources")
            self.pd = self.ctx.alloc_pd()
            self.channel = self.ctx.create_comp_channel()
            self.buffers = cfg.window + cfg.control
            self.send_slots = cfg.window
            depth = self.send_slots + cfg.control + 2
            self.cq = self.ctx.create_cq(self.buffers + depth + 8, self.channel)
            self.qp = verbs.QueuePair(self.pd, self.cq, max_send_wr=depth, max_recv_wr=self.buffers)
            self._step("init")
            self.qp.to_init(entry.port)
            self._step("memory")
            register = pd_registrar(self.pd)
            self.recv_pool = MemoryPool(
                register,
                cfg.buffer_size,
                slots_per_region=self.buffers,
                max_bytes=self.buffers * cfg.buffer_size + (64 << 10),
                initial_slots=self.buffers,
            )
            self._step("post")
            self._post_receives(self.buffers)
            port = self.ctx.query_port(entry.port)
            self.mtu = min(4096, int(getattr(port, "active_mtu", 1024)) or 1024)
            self.psn = random.randrange(1 << 24)
            self.wc = verbs.WCArray(64)
        except RdmaSetupError:
            self.close_now()
            raise
        except (RDMAError, OSError, ValueError) as exc:
            self.close_now()
            raise RdmaSetupError(self._current, str(exc)) from exc
        except BaseException:
            self.close_now()
            raise

    _current = "device"

    def _step(self, name: str) -> None:
        self._current = name
        self.backend.before_step(name)

    @property
    def device(self) -> str:
        return self.gid_entry.device

    @property
    def params(self) -> RdmaParams:
        assert self.qp is not None
        return RdmaParams(
            gid=self.gid_entry.gid.packed,
            qp_num=self.qp.qp_num,
            psn=self.psn,
            mtu=_MTU_CODES.get(self.mtu, 3),
            window=self.config.window,
            control=self.config.control,
            buffer_size=self.config.buffer_size,
        )

    def _post_receives(self, count: int) -> None:
        """Post ``count`` free receive slots (FREE -> POSTED, then one C call)."""
        qp, pool = self.qp, self.recv_pool
        assert qp is not None and pool is not None
        slots = pool.acquire_posted(count)
        try:
            if count == 1:
                slot = slots[0]
                qp.post_recv_one(slot.addr, slot.size, slot.lkey, slot.wr_id)
            else:
                qp.post_recv_batch([s.addr for s in slots], [s.size for s in slots], slots[0].lkey,
                                   [s.wr_id for s in slots])  # fmt: skip
        except verbs.PostError as exc:
            for slot in slots[exc.posted :]:
                pool.unpost(slot)
                pool.free(slot)
            raise

    def repost(self, slots: Sequence[Slot]) -> None:
        """Post completed receive slots again (their bytes were consumed)."""
        assert self.qp is not None and self.recv_pool is not None
        pool = self.recv_pool
        for slot in slots:
            pool.free(slot)
        self._post_receives(len(slots))

    def connect(self, peer_raw: bytes | None) -> None:
        """RTR and RTS towards the peer's QP (steps ``params``, ``rtr``, ``rts``)."""
        assert self.qp is not None and self.pd is not None
        try:
            self._step("params")
            if peer_raw is None:
                raise RdmaSetupError("params", "the peer sent no RDMA parameters")
            peer = RdmaParams.decode(peer_raw)
            self.peer = peer
            self._step("rtr")
            mtu = min(self.mtu, MTU_BYTES[peer.mtu])
            self.qp.to_rtr(peer.qp_num, peer.gid, sgid_index=self.gid_entry.index, rq_psn=peer.psn, path_mtu=mtu,
                           port_num=self.gid_entry.port)  # fmt: skip
            self._step("rts")
            cfg = self.config
            self.qp.to_rts(self.psn, timeout=cfg.qp_timeout, retry_cnt=cfg.retry_cnt, rnr_retry=cfg.rnr_retry)
            # sends may not exceed the peer's buffers; our slots are that size at most
            self.send_pool = MemoryPool(
                pd_registrar(self.pd),
                min(peer.buffer_size, cfg.buffer_size),
                slots_per_region=self.send_slots,
                max_bytes=self.send_slots * cfg.buffer_size + (64 << 10),
                initial_slots=self.send_slots,
            )
        except RdmaSetupError:
            raise
        except RemoteProtocolError as exc:
            raise RdmaSetupError("params", str(exc)) from exc
        except (RDMAError, OSError, ValueError) as exc:
            raise RdmaSetupError(self._current, str(exc)) from exc

    async def probe_path(self) -> None:
        """Prove the path to the peer: a zero-length RDMA WRITE must be ACKed."""
        assert self.qp is not None and self.cq is not None and self.channel is not None
        self._step("probe")
        try:
            self.probe_outstanding = True
            self.qp.post_send(verbs.SendWR(verbs.Opcode.RDMA_WRITE, wr_id=SEND_TAG | PROBE_TAG, length=0))
            with anyio.fail_after(self.config.setup_timeout):
                await self.backend.probe_delay()
                while self.probe_outstanding:
                    self.channel.drain_events()
                    self.cq.req_notify()
                    n = self.cq.poll_into(self.wc)
                    for i in range(n):
                        if self.wc.wr_id(i) != SEND_TAG | PROBE_TAG:  # pragma: no cover - nothing else is posted
                            raise RdmaSetupError("probe", f"unexpected completion {self.wc[i]}")
                        self.probe_outstanding = False
                        status = self.wc.status(i)
                        if status != verbs.WCStatus.SUCCESS:
                            raise RdmaSetupError("probe", f"the path to the peer failed ({verbs.wc_status_name(status)})")
                    if self.probe_outstanding and n == 0:
                        await anyio.wait_readable(self.channel.fileno())
        except TimeoutError:
            raise RdmaSetupError("probe", f"no answer from the peer's QP within {self.config.setup_timeout} s") from None
        except (RDMAError, OSError) as exc:
            raise RdmaSetupError("probe", str(exc)) from exc

    def outstanding(self) -> int:
        """Work requests whose completion is still to come.

        Unsignaled sends are not counted: no completion of their own is
        promised.  Their slots stay the device's until a later signaled
        completion (RC completes in order) or the QP is destroyed.
        """
        n = self.credit_sends + (1 if self.probe_outstanding else 0) + len(self.signaled)
        if self.recv_pool is not None and not self.recv_pool.closed:
            n += self.recv_pool.stats().posted
        return n

    def account(self, wr_id: int, byte_len: int, status: int) -> Slot | None:
        """POSTED -> COMPLETED for the slot of a completion; None for slot-less requests."""
        if wr_id & SEND_TAG:
            if wr_id & CREDIT_TAG:
                self.credit_sends -= 1
                return None
            if wr_id & PROBE_TAG:
                self.probe_outstanding = False
                return None
            pool = self.send_pool
            assert pool is not None
            target = pool.slot_for(wr_id & ~_TAGS)
            self.signaled.discard(wr_id)
            # in order: every SEND posted before this one is complete as well
            while self.sent:
                slot = self.sent.popleft()
                pool.free(pool.complete(slot.wr_id, 0, status if slot is target else 0))
                if slot is target:
                    break
            return None
        assert self.recv_pool is not None
        return self.recv_pool.complete(wr_id, byte_len, status)

    async def aclose(self) -> None:
        """Teardown in order (see the module docs); bounded, safe under cancellation."""
        if self.closed:
            return
        with anyio.CancelScope(shield=True):
            if self.qp is not None and self.cq is not None and self.channel is not None:
                try:
                    self.qp.to_error()
                    with anyio.move_on_after(self.config.close_timeout):
                        while self.outstanding():
                            self.channel.drain_events()
                            self.cq.req_notify()
                            n = self.cq.poll_into(self.wc)
                            if n:
                                self._free_flushed(n)
                            else:
                                await anyio.wait_readable(self.channel.fileno())
                except RDMAError as exc:
                    log.warning("aiordma: RDMA teardown: %s", exc)
            self.close_now()

    def _free_flushed(self, n: int) -> None:
        for i in range(n):
            slot = self.account(self.wc.wr_id(i), self.wc.byte_len(i), self.wc.status(i))
            if slot is not None:
                slot.pool.free(slot)

    def close_now(self) -> None:
        """Destroy everything now (QP first, so the device can no longer touch the buffers)."""
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []

        def attempt(action: Callable[[], Any]) -> None:
            try:
                action()
            except (RDMAError, OSError, ValueError) as exc:  # pragma: no cover - reported below
                errors.append(exc)

        if self.qp is not None:
            attempt(self.qp.close)
        if self.channel is not None and not self.channel.closed:
            attempt(lambda: self.channel.drain_events() if self.channel else 0)  # ack what is left
        if self.cq is not None:
            attempt(self.cq.close)
        if self.channel is not None:
            attempt(self.channel.close)
        self.sent.clear()
        self.signaled.clear()
        for pool in (self.send_pool, self.recv_pool):
            if pool is not None and not pool.closed:
                pool.reclaim_posted()  # the QP is gone: the device cannot touch them any more
                attempt(pool.close)
        if self.pd is not None:
            attempt(self.pd.close)
        if self.ctx is not None:
            attempt(self.ctx.close)
        if self.epoll is not None:
            self.epoll.close()
        for exc in errors:
            log.warning("aiordma: RDMA teardown: %s", exc)


class RdmaLink(Link):
    """Carries a Core's frames over an :class:`RdmaEndpoint` (see module docs).

    ``control`` is the TCP link the handshake ran on; it stays open, silent,
    as the liveness channel, and is closed last.
    """

    def __init__(self, ep: RdmaEndpoint, control: Link, core: Core) -> None:
        assert ep.peer is not None and ep.qp is not None and ep.channel is not None and ep.ctx is not None
        self.ep = ep
        self.control = control
        self.credits = Credits(
            ep.peer.window,
            ep.peer.control,
            local_window=ep.config.window,
            local_control=ep.config.control,
        )
        self.pending: deque[Slot] = deque()  # received, not yet taken into the Core
        self.closed = False
        self.failed = False
        self.tcp_ended = False
        # fast_acquire: an uncontended lock costs no trip through the event loop
        self._progress_lock = anyio.Lock(fast_acquire=True)
        self._generation = 0
        self._armed = False
        self._spin_ns = 0
        self._unsignaled = 0
        self._backlog: deque[memoryview] = deque()
        self._enqueued = 0  # bytes ever put in the backlog
        self._posted_bytes = 0  # bytes ever posted from it
        self._close_task: Any = None
        self._teardown_started = False
        self._tcp_fd = _socket_fd(control)
        ep.epoll = select.epoll()
        ep.epoll.register(ep.channel.fileno(), select.EPOLLIN)
        ep.epoll.register(ep.ctx.fileno(), select.EPOLLIN)
        if self._tcp_fd is not None:
            ep.epoll.register(self._tcp_fd, select.EPOLLIN | select.EPOLLRDHUP)
        self._epfd = ep.epoll.fileno()
        transport = getattr(control, "transport", None)
        if transport is not None and hasattr(transport, "pause_reading"):
            transport.pause_reading()  # asyncio: the transport must not read the socket we now watch
        # take over from the TCP link
        core.link = self
        self.attach(core)
        core.transport = "rdma"
        core.fallback_reason = ""

    # -- progress ------------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        """The link is broken.  A broken credit accounting is the peer's protocol error."""
        self.failed = True
        self.core.on_error(RemoteProtocolError(str(exc)) if isinstance(exc, CreditError) else exc)

    def _after_wake(self) -> None:
        """The epoll fd was readable: ack CQ events (the CQ is then disarmed), read the other fds.

        One CQ on the channel, armed once per sleep: at most one event is
        pending, so one read does (an event left over would only make the
        level-triggered epoll fd readable again).  When it was the CQ, the
        other fds are looked at on a later wake that brings no CQ event
        (epoll is level-triggered: a readable TCP socket or async fd keeps
        waking us until read) -- one syscall less per message.
        """
        ep = self.ep
        assert ep.channel is not None and ep.epoll is not None
        if ep.channel.drain_events(1):
            self._armed = False
            return
        for fd, _ in ep.epoll.poll(0):
            if fd == self._tcp_fd:
                self._read_control()
            elif ep.ctx is not None and fd == ep.ctx.fileno():
                self._read_async_events()

    def _progress(self, first: int = 0) -> int:
        """Poll the CQ until empty and handle everything; returns the completions seen.

        ``first`` completions are already in the array (from a spinning poll).
        """
        ep = self.ep
        assert ep.cq is not None
        total = first
        try:
            if first:
                self._handle(first)
            while n := ep.cq.poll_into(ep.wc):
                total += n
                self._handle(n)
            self._deliver()
            self._maybe_send_credit()
            if self._backlog and not self.closed:
                self._flush()
        except (RDMAError, CreditError) as exc:
            self._fail(exc)
        if self.tcp_ended and not self.pending and self.core.peer_close is None and self.core.error is None:
            self.core.feed_eof()  # the peer went away without a CLOSE: an error, said by the protocol
        return total

    def _handle(self, n: int) -> None:
        ep, wc, credits = self.ep, self.ep.wc, self.credits
        recv_pool = ep.recv_pool
        assert recv_pool is not None
        for i, (wr_id, status, byte_len, imm) in enumerate(wc.entries(n)):
            if wr_id & SEND_TAG:
                ep.account(wr_id, byte_len, status)
                if status and not (status == _FLUSH and (self.closed or self.failed)):
                    self._fail(wc[i].error("RDMA send"))
                continue
            slot = recv_pool.complete(wr_id, byte_len, status)  # POSTED -> COMPLETED
            if status:
                recv_pool.free(slot)
                if not (status == _FLUSH and (self.closed or self.failed)):
                    self._fail(wc[i].error("RDMA receive"))
                continue
            if imm < 0:
                recv_pool.free(slot)
                self._fail(RemoteProtocolError("an RDMA SEND arrived without immediate data"))
                continue
            # the layout of _credits.pack_imm, without building a SendKind per message
            if imm >> 31:
                credits.on_receive(SendKind.CREDIT, imm & _IMM_DATA_MASK, imm >> _IMM_DATA_BITS & _IMM_CTRL_MASK)
                ep.repost([slot])
                credits.on_repost(SendKind.CREDIT)
            else:
                credits.on_receive(SendKind.DATA, imm & _IMM_DATA_MASK, imm >> _IMM_DATA_BITS & _IMM_CTRL_MASK)
                self.pending.append(slot)

    def _deliver(self, *, force: bool = False) -> None:
        """Take pending receive buffers into the Core while it has room (``force``:
        at least one, for a reader that waits although much is buffered); re-post them."""
        core, pending = self.core, self.pending
        if not pending:
            return
        pool = self.ep.recv_pool
        assert pool is not None
        feed = core.feed
        done = 0
        try:
            while pending and (force or core.buffered < RECEIVE_HIGH_WATER) and core.error is None:
                force = False
                # COMPLETED -> LENT (the Core copies the bytes) -> FREE
                pool.consume(pending.popleft(), feed)
                done += 1
        finally:
            if done and not (self.closed or self.failed):
                self.ep._post_receives(done)  # all of them in one post
                credits = self.credits
                for _ in range(done):
                    credits.on_repost(SendKind.DATA)

    def _maybe_send_credit(self) -> None:
        if self.closed or self.failed or not self.credits.should_send_credit():
            return
        assert self.ep.qp is not None
        imm = pack_imm(SendKind.CREDIT, *self.credits.on_send_credit())
        self.ep.credit_sends += 1
        try:
            self.ep.qp.post_send_imm(SEND_TAG | CREDIT_TAG, 0, 0, 0, imm, True)
        except RDMAError:
            self.ep.credit_sends -= 1
            raise

    def _read_control(self) -> None:
        """The TCP socket is readable: after the switch that means the peer is leaving."""
        assert self._tcp_fd is not None and self.ep.epoll is not None
        try:
            data = os.read(self._tcp_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            log.debug("aiordma: %d unexpected bytes on the TCP control connection", len(data))
        self.ep.epoll.unregister(self._tcp_fd)
        self.tcp_ended = True

    def _read_async_events(self) -> None:
        assert self.ep.ctx is not None
        while (event := self.ep.ctx.get_async_event()) is not None:
            if event.qp is self.ep.qp or event.cq is self.ep.cq or event.element_kind == "device":
                self._fail(RDMAError(errno.EIO, "async event", f"{event.name}: {event.description}"))

    def _finished(self) -> bool:
        return self.closed or self.failed or self.core.error is not None or self.tcp_ended

    async def _wait_progress(self) -> None:
        """Make progress, sleeping on the epoll fd while nothing happens.

        Arm-then-poll: the CQ is armed (``req_notify``) only when a poll found
        it empty, and polled once more after arming, so a completion that
        arrives in between raises an event instead of being missed; events
        are acknowledged after each wake.  Before sleeping it may busy-poll
        (GIL released) for as long as completions recently took to come.
        """
        seen = self._generation
        ep = self.ep
        assert ep.cq is not None
        async with self._progress_lock:
            if self._generation != seen:
                return
            try:
                while not self._progress() and not self._finished():
                    if self.pending and self.core.buffered >= RECEIVE_HIGH_WATER:
                        break  # only a reader can make room
                    if not self._armed:
                        ep.cq.req_notify()
                        self._armed = True
                        continue  # poll again: what came before the arm raises no event
                    if self._spin_ns:
                        got = ep.cq.poll_spin_into(ep.wc, self._spin_ns)
                        if got:
                            self._progress(got)
                            break
                    started = time.perf_counter()
                    await anyio.wait_readable(self._epfd)
                    self._adapt_spin(time.perf_counter() - started)
                    self._after_wake()
            finally:
                self._generation += 1

    def _adapt_spin(self, waited: float) -> None:
        """Spin next time only if this wait was short enough to have been caught spinning."""
        waited_ns = int(waited * 1e9)
        limit = self.ep.config.max_spin_ns
        self._spin_ns = min(limit, 2 * waited_ns) if waited_ns < limit else 0

    # -- Link ------------------------------------------------------------------------

    async def wait_incoming(self) -> None:
        if self.closed:
            return
        if self.pending:
            # a waiting reader wants more, however much is buffered (a long
            # line, a large message): hand it at least one more buffer
            try:
                self._deliver(force=True)
                self._maybe_send_credit()
            except (RDMAError, CreditError) as exc:
                self._fail(exc)
            return
        await self._wait_progress()

    def consumed(self) -> None:
        if self.pending and not self.closed:
            try:
                self._deliver()
                self._maybe_send_credit()
            except (RDMAError, CreditError) as exc:
                self._fail(exc)

    # -- sending -------------------------------------------------------------------
    #
    # Every send goes through one ordered backlog of memoryviews.  ``_flush``
    # (synchronous) packs it into send slots, as many as credits and free slots
    # allow, and posts them; it runs on each send and after each progress, so
    # whoever makes progress also moves the backlog.  Bytes are counted: a send
    # is done when everything up to its last byte was posted.  The async
    # ``send`` (anyio API) waits for that; ``write_nowait`` (asyncio API)
    # returns at once and ``drain`` waits.  A view into the caller's buffer
    # never outlives the call that put it there: what is left is copied.

    def _check_usable(self) -> None:
        if self.closed:
            raise ClosedResourceError
        if self.core.error is not None:
            raise self.core.broken()
        if self.failed or self.tcp_ended:
            raise BrokenResourceError("the RDMA connection failed")

    def _enqueue(self, chunks: Sequence[Chunk]) -> int:
        """Append to the backlog; returns the byte count that marks the end of these chunks."""
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            if len(view):
                self._backlog.append(view)
                self._enqueued += len(view)
        return self._enqueued

    def _detach_backlog(self, owner_end: int) -> None:
        """Copy the unposted views of a call (whose bytes end at ``owner_end``) out of the caller's buffer."""
        remaining = owner_end - self._posted_bytes
        index = len(self._backlog) - 1
        tail = self._enqueued - owner_end  # bytes enqueued after this call (by others)
        while remaining > 0 and index >= 0:
            view = self._backlog[index]
            if tail >= len(view):
                tail -= len(view)
            else:
                self._backlog[index] = memoryview(bytes(view))
                remaining -= len(view) - tail
                tail = 0
            index -= 1

    def _flush(self, *, signal_last: bool = False) -> None:
        """Post as much of the backlog as credits and free slots allow (synchronous)."""
        backlog = self._backlog
        pool = self.ep.send_pool
        assert pool is not None
        if not backlog or self.failed:
            return
        # fill as many slots as credits allow, then post them with one call
        credit = self.credits.available
        batch: list[tuple[Slot, int]] = []
        while backlog and len(batch) < credit:
            slot = pool.try_acquire()
            if slot is None:
                break
            filled = 0
            size = slot.size
            while backlog and filled < size:
                view = backlog[0]
                take = min(len(view), size - filled)
                pool.fill(slot, view[:take] if take < len(view) else view, filled)
                filled += take
                if take == len(view):
                    backlog.popleft()
                else:
                    backlog[0] = view[take:]
            batch.append((slot, filled))
        if batch:
            self._post_sends(batch, signal=signal_last and not backlog)

    async def _wait_posted(self, end: int) -> None:
        """Wait until the backlog was posted up to byte ``end``."""
        try:
            self._flush()
            while self._posted_bytes < end:
                self._check_usable()
                await self._wait_progress()
                self._flush()
        except BaseException:
            self._detach_backlog(end)
            raise

    async def send(self, chunks: Sequence[Chunk]) -> None:
        self._check_usable()
        await self._wait_posted(self._enqueue(chunks))

    def write_nowait(self, chunks: Sequence[Chunk]) -> None:
        """asyncio API: queue and post what can be posted now; ``drain`` waits for the rest."""
        self._check_usable()
        end = self._enqueue(chunks)
        try:
            self._flush()
        finally:
            self._detach_backlog(end)

    @property
    def _paused_writing(self) -> bool:
        """asyncio API: ``drain`` has something to wait for."""
        return bool(self._backlog)

    @property
    def lost(self) -> bool:
        return self.failed or self.tcp_ended or self.closed

    _writer = None  # asyncio API: no transport to write to directly

    async def drain(self) -> None:
        """asyncio API: wait until everything written was posted."""
        await self._wait_posted(self._enqueued)

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """The TCP transport of the control connection (asyncio), for ``get_extra_info``."""
        transport: asyncio.BaseTransport | None = getattr(self.control, "transport", None)
        return transport

    def close_nowait(self, final: bytes) -> None:
        """asyncio API: start the teardown (flushes what was written first) in a task."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self.aclose(final))
            self._close_task.add_done_callback(self._closed_callback)

    @staticmethod
    def _closed_callback(task: Any) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.warning("aiordma: closing an RDMA connection failed: %r", task.exception())

    async def wait_closed(self) -> None:
        if self._close_task is not None:
            await asyncio.shield(self._close_task)

    def _post_sends(self, batch: Sequence[tuple[Slot, int]], *, signal: bool = False) -> None:
        """Post filled send slots (``(slot, length)``, in order) as data SENDs, in one call.

        Only every ``signal_every``-th SEND (or the last of a batch that
        leaves few slots free, or, with ``signal``, the last before closing)
        asks for a completion; RC completes in order, so that completion frees
        every slot posted before it too.  One SEND goes through the scalar
        ``post_send_imm``; more through one chained ``post_send_batch``: one
        doorbell for the lot.
        """
        ep, credits = self.ep, self.credits
        qp, pool = ep.qp, ep.send_pool
        assert qp is not None and pool is not None
        every = ep.config.signal_every
        last = len(batch) - 1
        low = pool.free_count <= ep.send_slots // 2
        flags: list[bool] = []
        imms: list[int] = []
        for i, (slot, _length) in enumerate(batch):
            imms.append(pack_imm(SendKind.DATA, *credits.on_send_data()))
            self._unsignaled += 1
            signaled = self._unsignaled >= every or (i == last and (signal or low))
            if signaled:
                self._unsignaled = 0
            flags.append(signaled)
            pool.mark_posted(slot)  # the device's from here
        try:
            if last == 0:
                slot, length = batch[0]
                qp.post_send_imm(SEND_TAG | slot.wr_id, slot.addr, length, slot.lkey, imms[0], flags[0])
            else:
                qp.post_send_batch([
                    verbs.SendWR(_SEND_WITH_IMM, SEND_TAG | slot.wr_id, slot.addr, length, slot.lkey,
                                 imm_data=imm, signaled=signaled)
                    for (slot, length), imm, signaled in zip(batch, imms, flags, strict=True)
                ])  # fmt: skip
            posted = len(batch)
            error: RDMAError | None = None
        except RDMAError as exc:  # PostError says how many went; another error: none did
            posted, error = (exc.posted if isinstance(exc, verbs.PostError) else 0), exc
        for (slot, length), signaled in zip(batch[:posted], flags, strict=False):
            ep.sent.append(slot)
            if signaled:
                ep.signaled.add(SEND_TAG | slot.wr_id)
            self._posted_bytes += length
        if error is not None:
            for slot, _length in batch[posted:]:  # refused: ours again
                pool.unpost(slot)
                pool.free(slot)
            self._fail(error)
            raise self.core.broken() from error

    async def _flush_sends(self) -> None:
        """Wait until every data SEND we posted has completed (the peer has it).

        The last SEND posted is signaled by the caller, so its completion
        comes, and frees all the others."""
        while self.ep.sent and not self._finished():
            await self._wait_progress()

    async def aclose(self, final: bytes) -> None:
        if self.closed and self._teardown_started:
            return
        self._teardown_started = True
        with anyio.CancelScope(shield=True):
            if not self.failed and self.core.error is None and not self.tcp_ended:
                with anyio.move_on_after(self.ep.config.close_timeout):
                    try:
                        end = self._enqueue([final]) if final else self._enqueued
                        self._flush(signal_last=True)
                        while self._posted_bytes < end and not self._finished():
                            await self._wait_progress()
                            self._flush(signal_last=True)
                        await self._flush_sends()
                    except (BrokenResourceError, ClosedResourceError, RDMAError) as exc:
                        log.debug("aiordma: could not send CLOSE over RDMA: %r", exc)
            self.closed = True
            self._backlog.clear()
            for slot in self.pending:
                slot.pool.free(slot)
            self.pending.clear()
            await self.ep.aclose()
            await self.control.aclose(b"")

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        attrs = dict(self.control.extra_attributes)
        qp = self.ep.qp
        qp_num = qp.qp_num if qp is not None else 0
        device = self.ep.device
        attrs[TransportAttribute.device] = lambda: device
        attrs[TransportAttribute.qp_num] = lambda: qp_num
        return attrs

