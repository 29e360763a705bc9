"""The connection core shared by every front end and every transport.

A :class:`Core` owns one sans-IO :class:`~aiordma._proto.protocol.Connection` and
the receive buffers, and sits on a :class:`Link` that moves the bytes (a TCP
socket through an asyncio protocol, an anyio byte stream under trio, an
in-memory pipe in tests; the RDMA link later).  Front ends -- the anyio
``ByteStream`` / ``ObjectStream`` classes and the asyncio reader/writer -- only
talk to a Core.

Errors leave the Core as anyio's exceptions: ``ClosedResourceError`` (this
side closed it), ``BrokenResourceError`` (the link failed or the peer broke
the protocol; ``__cause__`` says how), ``EndOfStream`` (the peer sent EOF or
closed in order).  The asyncio front end translates those at its own boundary.

Link contract
-------------
* ``wait_incoming()`` returns once the link has fed the Core something (events
  or an error) -- or at once if the link is finished.  Several tasks may wait
  at once; each returns after a feed and re-checks the Core.  ``incoming()``
  returns an awaitable that does the same; by default the coroutine of
  ``wait_incoming()``, a push link may hand out its future itself (one
  coroutine frame fewer per wait on the hot path).
* ``send(chunks)`` writes the chunks in order, atomically with respect to other
  ``send`` calls, and returns when the link can take more (backpressure).
* ``consumed()`` is called when a reader took bytes out of the Core: a push
  link resumes reading when the buffer is low again.
* ``aclose(final)`` writes ``final`` (a CLOSE frame) if it can, within a short
  bound, then releases the link.  It is idempotent and safe under
  cancellation.

Received DATA payloads go straight into ``Core.rbuf`` (a
:class:`~aiordma._proto.receiving.StreamBuffer`: each read's payloads as one chunk
of ``bytes``, handed out whole to a reader that takes all of it): the Core makes it
the protocol's ``data_sink``, so a link that feeds bytes (``feed``, or the
protocol's ``get_buffer``/``buffer_updated``) finds them in ``rbuf`` and gets
no ``Data`` events for them.  ``rbuf`` is therefore never replaced, only
changed in place.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

from anyio import BrokenResourceError, ClosedResourceError, EndOfStream

from .._errors import AuthenticationError, BufferTooSmallError, HandshakeError, LocalProtocolError, ProtocolError, RemoteProtocolError
from .._io.backends import IOBackend, Watch, current_checkpoint, send_points
from .._proto.onesided import STREAM_RENDEZVOUS_MAX, OneSided, Rendezvous
from .._proto.protocol import (
    Chunk,
    CloseCode,
    Connection,
    ConnectionClosed,
    Data,
    EndOfStream as EndOfStreamEvent,
    Event,
    Half,
    MemoryFrame,
    Message,
    MessageSink,
    Mode,
)
from .._proto.receiving import SpareMessage, StreamBuffer
from .memory import find_registered
from .stats import Counts, retired

__all__ = ["Core", "Link", "ControlLink", "NicOps", "NicRegion"]

_OPEN = Half.OPEN

#: A push link stops reading from the socket when this many received bytes
#: wait in the Core, and reads again below a quarter of it.
RECEIVE_HIGH_WATER = 1 << 20


class Link(Protocol):
    """Moves bytes between a :class:`Core` and the peer (see module docs): what the Core asks of a
    link.  The links subclass it (its defaults are theirs); mypy holds them to it."""

    core: Core

    def attach(self, core: Core) -> None:
        self.core = core

    @abc.abstractmethod
    async def wait_incoming(self) -> None: ...

    def incoming(self) -> Awaitable[None]:
        """What ``wait_incoming()`` does, as an awaitable (see module docs)."""
        return self.wait_incoming()

    @abc.abstractmethod
    async def send(self, chunks: Sequence[Chunk]) -> None: ...

    #: whether readers must call :meth:`consumed` (a link may clear it while it has no use for
    #: the call: the RDMA native path between wakes that withheld no credit)
    needs_consumed: bool = True

    def consumed(self) -> None:
        """A reader took bytes out of the Core."""
        return None

    @abc.abstractmethod
    async def aclose(self, final: bytes) -> None: ...

    #: True for links whose bytes are read only while a task waits in ``wait_incoming`` (an
    #: exposure then keeps a task reading, so that the peer's one-sided requests are served)
    pulls: bool = False

    @abc.abstractmethod
    def send_nowait(self, chunks: Sequence[Chunk]) -> None:
        """Queue control frames (answers the Core makes while it is fed) to be sent in order,
        without waiting; raises if the link is gone."""

    @property
    @abc.abstractmethod
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]: ...

    @property
    def transport(self) -> Any:
        """The TCP connection's asyncio transport, for its socket and ``get_extra_info``; None if
        there is none.  (What asyncio's front ends need beyond this interface -- writing without
        waiting, closing in the background -- is :class:`~aiordma._conn.nowait.NowaitLink`.)"""
        return None



@runtime_checkable
class ControlLink(Link, Protocol):
    """A TCP link, which another link (RDMA) may take the Core over from."""

    def hand_over(self, io: IOBackend, on_control: Callable[[bytes | None], None]) -> Watch | None:
        """Another link (RDMA) takes the Core over; this one only watches the connection:
        ``on_control(data)`` gets whatever bytes it still carries (after the switch that is only
        a closing peer's goodbye), ``on_control(None)`` its end.  Returns the watch to close
        (``None`` when the link reports through its own callbacks)."""
        ...


class NicRegion(Protocol):
    """Registered memory the NIC reaches (a staging region, an exposure): where it starts, and
    a view of its bytes (release the view before the region goes back)."""

    @property
    def addr(self) -> int: ...

    def view(self, offset: int = 0, length: int | None = None) -> memoryview: ...


class NicOps(Protocol):
    """What the Core asks of a connection whose one-sided operations run on the NIC: the RDMA
    link's native path, once it carries the Core (it sets ``Core.nic``, and ``Core.rndv_min``
    when the peer READs what we stage).  Without one, MEMORY frames carry one-sided operations
    and no rendezvous is used.  Every wait is a cancel point; local memory handed to the NIC is
    the device's until its completion is polled, also when the wait is cancelled."""

    #: bytes staged for the peer to READ, and how many may be at once
    rndv_staged: int
    rndv_limit: int

    async def expose_region(self, view: memoryview, access: int) -> NicExposure:
        """Register ``view`` for the peer alone to reach (``READ``/``WRITE`` of ``_proto.onesided``)."""
        ...

    def release_region(self, exposed: NicExposure) -> None:
        """End an exposure: its rkey dies, its registration goes (idempotent)."""

    async def rdma(self, write: bool, view: memoryview, raddr: int, rkey: int) -> None:
        """RDMA WRITE ``view`` to the peer's ``[raddr, rkey]``, or READ into it; returns once completed."""

    async def rdma_read_bytes(self, n: int, raddr: int, rkey: int) -> bytes:
        """RDMA READ ``n`` bytes and return them."""
        ...

    def stream_fetch(self, rv: Rendezvous) -> None:
        """A byte stream's rendezvous: READ it (no task awaits it), then resume the protocol."""

    def rndv_take(self, n: int) -> NicRegion:
        """A region of at least ``n`` bytes to stage a message in."""
        ...

    async def rndv_grant(self, region: NicRegion, n: int) -> tuple[object, int]:
        """Let the peer READ the first ``n`` bytes of ``region``, through this connection only:
        ``(grant, rkey)``; on an error the region is given back."""
        ...

    def rndv_discard(self, region: NicRegion, grant: object) -> None:
        """A staged region that is not announced after all: the grant dies, the region goes back."""

    def rndv_hold(self, mid: int, region: NicRegion, grant: object) -> None:
        """Message ``mid`` was announced: its region stays granted until the peer's RNDV_DONE."""

    def rndv_release(self, mid: int) -> None:
        """The peer READ message ``mid`` (its RNDV_DONE): the grant dies, the region may be reused
        -- or, for a loan, the caller's memory is the caller's again."""

    async def rndv_lend(self, view: memoryview) -> NicExposure | None:
        """Let the peer READ ``view`` where it lies -- inside the caller's registered memory --
        through this connection only (zero copy): the loan to announce (its ``addr``, ``rkey``),
        or None when ``view`` is not inside registered memory (it is staged then).  The memory
        cannot be closed while the loan is out."""
        ...

    def rndv_hold_lent(self, mid: int, lent: NicExposure) -> None:
        """Message ``mid`` was announced from a loan: it stays out until the peer's RNDV_DONE."""

    def rndv_lent_out(self, mid: int) -> bool:
        """Whether message ``mid``'s loan is still out (no RNDV_DONE yet, no teardown)."""
        ...

    def rndv_take_back(self, lent: NicExposure, mid: int | None = None) -> None:
        """End a loan before the peer's RNDV_DONE (``mid``: its announced message): the grant dies
        now and the memory is the caller's again.  An announced message can then not be READ:
        the connection fails."""


class NicExposure(Protocol):
    """An exposure on the NIC: what the peer is told (its address and rkey)."""

    @property
    def addr(self) -> int: ...

    @property
    def rkey(self) -> int: ...


class Core:
    """One aiordma connection: protocol state and receive buffers over a link."""

    def __init__(self, proto: Connection, link: Link) -> None:
        self.proto = proto
        self.link = link
        #: received stream bytes; also the protocol's data sink (never replaced)
        self.rbuf = StreamBuffer()
        proto.data_sink = self.rbuf
        #: received messages; also the protocol's message sink (never replaced)
        self.messages = MessageSink()
        proto.message_sink = self.messages
        self.control: deque[Event] = deque()
        self.peer_eof = False
        self.peer_close: ConnectionClosed | None = None
        self.error: BaseException | None = None
        self.closed = False
        self.transport = "tcp"
        self.fallback_reason = ""
        #: a schedule point and cancel point of the running loop (asyncio.sleep(0) or trio's)
        self.checkpoint: Callable[[], Awaitable[None]] = current_checkpoint()
        #: a send's cancel point and schedule point (see send_points)
        self.before_send, self.after_send = send_points()
        #: one-sided memory (created on first use, see aiordma._proto.onesided)
        self._memory: OneSided | None = None
        #: messages of at least this many bytes go by rendezvous (the RDMA link sets it): lent
        #: where they lie when that is the caller's registered memory, else staged
        self.rndv_min = 1 << 62
        #: one-sided operations on the NIC, rendezvous (the RDMA link's native path sets it)
        self.nic: NicOps | None = None
        #: what the links count (aiordma.stats; the protocol and ``rbuf`` count the rest)
        self.counts = Counts()
        link.attach(self)

    @property
    def memory(self) -> OneSided:
        mem = self._memory
        if mem is None:
            proto = self.proto
            mem = self._memory = OneSided(max_out=proto.peer_max_frame, max_in=proto.max_frame_size)
            mem.max_message = proto.max_message_size if proto.mode is Mode.MESSAGES else STREAM_RENDEZVOUS_MAX
        return mem

    def _on_memory(self, payload: bytes) -> None:
        mem = self.memory
        try:
            answers = mem.receive(payload)
        except ProtocolError as exc:
            self.on_error(exc)
            return
        for answer in answers:
            self.send_memory_nowait(answer)
        if mem.rndv_arrived:
            arrived, mem.rndv_arrived = mem.rndv_arrived, []
            nic = self.nic
            if nic is None:
                self.on_error(RemoteProtocolError("a rendezvous message on a connection that cannot READ it"))
                return
            self.counts.rendezvous_received += len(arrived)
            if self.proto.mode is Mode.MESSAGES:
                self.messages.extend(arrived)  # type: ignore[arg-type]  # (in their place)
                proto = self.proto
                proto.received_messages += len(arrived)
                proto.received_message_bytes += sum(rv.length for rv in arrived)
            else:
                # (the protocol paused after it: one at a time; the link READs it into rbuf and
                # resumes the protocol, see resume_after_rendezvous)
                for rv in arrived:
                    nic.stream_fetch(rv)
        if mem.rndv_done:
            done, mem.rndv_done = mem.rndv_done, []
            nic = self.nic
            if nic is not None:
                for mid in done:
                    nic.rndv_release(mid)

    def send_memory_nowait(self, payload: bytes, *, after_peer_close: bool = False) -> None:
        """Send a MEMORY frame now (from a callback: an answer, a REVOKED).  Once the peer closed
        nobody acts on one -- except ``after_peer_close`` (a RNDV_DONE: the closing peer waits
        for it before it tears down, as it waits for its CLOSE to be taken)."""
        if self.closed or self.error is not None or (self.peer_close is not None and not after_peer_close):
            return  # the connection ends: nobody will act on it
        try:
            self.link.send_nowait([self.proto.send_memory(payload, after_peer_close=after_peer_close)])
        except Exception as exc:  # the link is gone: that is the connection's error
            self.on_error(exc)

    # -- fed by the link ----------------------------------------------------

    def on_events(self, events: list[Event]) -> None:
        for ev in events:
            kind = type(ev)
            if kind is Data:
                self.rbuf += ev.data  # type: ignore[union-attr]
            elif kind is Message:
                data: bytes = ev.data  # type: ignore[union-attr]
                self.messages.append(data)
                self.messages.nbytes += len(data)
            elif kind is EndOfStreamEvent:
                self.peer_eof = True
            elif kind is ConnectionClosed:
                self.peer_eof = True
                self.peer_close = ev  # type: ignore[assignment]
            elif kind is MemoryFrame:
                self._on_memory(ev.payload)  # type: ignore[union-attr]
            else:
                self.control.append(ev)

    def feed(self, data: bytes | bytearray | memoryview | int) -> None:
        """Bytes from the peer (pull links); protocol errors become the Core's error.  An ``int``:
        that many bytes were read into the view the protocol lent (``get_buffer``), no copy."""
        try:
            events = self.proto.buffer_updated(data) if data.__class__ is int else self.proto.receive_data(data)  # type: ignore[arg-type]
        except (ProtocolError, HandshakeError) as exc:
            self.on_events(exc.pending_events)
            self.on_error(exc)
        else:
            if events:  # (data and messages went to the sinks)
                self.on_events(events)
        if self.closed:
            self.discard()

    def discard(self) -> None:
        """Drop what was received and not read: this side closed and reads no more (what the peer
        sends meanwhile is parsed -- its CLOSE, its answers -- and dropped)."""
        self.rbuf.clear()
        messages = self.messages
        if messages:
            messages.clear()
            messages.nbytes = 0

    def resume_after_rendezvous(self) -> None:
        """A byte stream's rendezvous bytes were appended to ``rbuf``: parse what waited behind them."""
        try:
            events = self.proto.resume()
        except (ProtocolError, HandshakeError) as exc:
            self.on_events(exc.pending_events)
            self.on_error(exc)
        else:
            if events:
                self.on_events(events)
        if self.closed:
            self.discard()

    def feed_eof(self, exc: BaseException | None = None) -> None:
        """The byte transport ended, in order (``exc`` None) or not."""
        if exc is not None and self.proto.passed_through:
            self.on_error(exc)  # (unframed: a connection lost is not the data's end)
            return
        try:
            events = self.proto.receive_eof()  # (an EOF only when passed through: a FIN is the data's end)
        except (ProtocolError, HandshakeError) as perr:
            if exc is not None:
                perr.__cause__ = exc
            # the transport failed (reset, timed out: a dead peer host): say that, not "no CLOSE"
            # (anyio's streams raise BrokenResourceError from the OSError)
            if isinstance(exc, BrokenResourceError) and isinstance(exc.__cause__, OSError):
                exc = exc.__cause__
            self.on_error(exc if isinstance(exc, OSError) else perr)
        else:
            if events:
                self.on_events(events)
            if exc is not None and self.peer_close is None:
                self.on_error(exc)

    def on_error(self, exc: BaseException) -> None:
        if self.error is None and not self.closed:
            self.error = exc

    @property
    def buffered(self) -> int:
        return self.rbuf.nbytes + self.messages.nbytes

    @property
    def message_bytes(self) -> int:
        """Bytes of received messages not read yet."""
        return self.messages.nbytes

    # -- checks (raise anyio's exceptions) -----------------------------------

    def broken(self) -> BrokenResourceError:
        err = BrokenResourceError(f"the connection is broken: {self.error}")
        err.__cause__ = self.error
        return err

    def check_receive(self) -> None:
        """Raise what a receive with an empty buffer must raise, if anything."""
        if self.closed:
            raise ClosedResourceError
        if self.peer_eof:
            raise EndOfStream
        if self.error is not None:
            raise self.broken()

    async def receive_ended(self) -> None:
        """Raise what :meth:`check_receive` raises, after a checkpoint: a receive that ends (EOF,
        closed, broken) is a checkpoint too, as anyio's and trio's are -- a loop that reads to
        the end must let others run."""
        await self.checkpoint()
        self.check_receive()

    def check_send(self) -> None:
        if self.closed:
            raise ClosedResourceError
        if self.error is not None:
            raise self.broken()
        if self.peer_close is not None:
            raise BrokenResourceError(f"the peer closed the connection: {self.peer_close.reason or 'normal close'}")
        if self.proto.send_half is not Half.OPEN:
            raise ClosedResourceError("the sending side was closed (send_eof)")

    # -- used by front ends ---------------------------------------------------

    async def receive_bytes(self, max_bytes: int) -> bytes:
        rbuf = self.rbuf
        if rbuf:
            await self.checkpoint()  # trio's convention: every call is a checkpoint
        while not rbuf:
            if self.closed or self.peer_eof or self.error is not None:
                await self.receive_ended()
            await self.link.incoming()
        data = rbuf.take(max_bytes, some=True)  # (a chunk taken whole is not copied again)
        if self.link.needs_consumed:
            self.link.consumed()
        return data

    def _nic(self) -> NicOps:
        nic = self.nic
        if nic is None:  # (the protocol refuses rendezvous frames a link could not READ)
            raise BrokenResourceError("a rendezvous message on a connection that cannot READ it")
        return nic

    async def receive_message(self) -> bytes:
        messages = self.messages
        if messages:
            await self.checkpoint()
        while not messages:
            if self.closed or self.peer_eof or self.error is not None:
                await self.receive_ended()
            await self.link.incoming()
        data = messages.popleft()
        if data.__class__ is not bytes:
            if data.__class__ is SpareMessage:  # a long message in its spare buffer: copied once, now
                messages.nbytes -= len(data)
                if self.link.needs_consumed:
                    self.link.consumed()
                return data.take()
            # a rendezvous: READ it now
            got = await self._fetch_rendezvous(self._nic(), data)  # type: ignore[arg-type]  # (a Rendezvous)
            assert isinstance(got, bytes)
            return got
        messages.nbytes -= len(data)
        if self.link.needs_consumed:
            self.link.consumed()
        return data

    async def receive_bytes_into(self, view: memoryview) -> int:
        """Up to ``len(view)`` received stream bytes copied into ``view`` (at least one)."""
        rbuf = self.rbuf
        if rbuf:
            await self.checkpoint()
        while not rbuf:
            if self.closed or self.peer_eof or self.error is not None:
                await self.receive_ended()
            await self.link.incoming()
        n = rbuf.copy_into(view)
        if self.link.needs_consumed:
            self.link.consumed()
        return n

    async def receive_message_into(self, view: memoryview) -> int:
        """The next message copied into ``view``; its length.  A message larger than ``view``
        raises :class:`BufferTooSmallError` and stays first in line.

        While it waits, ``view`` is offered to the protocol for the next message
        (``Connection.offer_landing``): on TCP the socket reads a long message straight into it,
        a short one is copied into it once.  Cancelled, the offer is withdrawn; a message that
        landed meanwhile goes back first in line (nothing is lost), one half read goes on in the
        protocol's own memory.  ``view`` is written only up to the message's length."""
        messages = self.messages
        if messages:
            await self.checkpoint()
        else:
            landed = await self._wait_landing(view)
            if landed >= 0:
                return landed
        data = messages[0]
        if data.__class__ is SpareMessage:  # a long message in its spare buffer: copied once, now
            n = len(data)
            if n > view.nbytes:
                raise BufferTooSmallError(n, view.nbytes)
            messages.popleft()
            messages.nbytes -= n
            data.copy_into(view)
            if self.link.needs_consumed:
                self.link.consumed()
            return n
        if data.__class__ is not bytes:  # a rendezvous: READ it into the caller's buffer
            rv = cast(Rendezvous, data)  # (the sink holds a rendezvous in its message's place)
            if rv.length > view.nbytes:
                raise BufferTooSmallError(rv.length, view.nbytes)
            messages.popleft()
            n_got = await self._fetch_rendezvous(self._nic(), rv, view)
            assert isinstance(n_got, int)
            return n_got
        n = len(data)
        if n > view.nbytes:
            raise BufferTooSmallError(n, view.nbytes)
        messages.popleft()
        messages.nbytes -= n
        view[:n] = data
        if self.link.needs_consumed:
            self.link.consumed()
        return n

    async def _wait_landing(self, view: memoryview) -> int:
        """Wait for the next message with ``view`` offered to the protocol: its length if it landed
        there, -1 if it is in ``messages`` (or raises what a receive that ends raises)."""
        messages = self.messages
        proto = self.proto
        landing = proto.offer_landing(view)
        try:
            while True:
                if landing is not None and landing.length >= 0:
                    if self.link.needs_consumed:
                        self.link.consumed()
                    return landing.length
                if messages:
                    break
                if self.closed or self.peer_eof or self.error is not None:
                    await self.receive_ended()
                await self.link.incoming()
        except BaseException:
            if landing is not None:
                back = proto.withdraw_landing(landing)
                if back is not None and not self.closed:
                    messages.appendleft(back)  # (it landed, and its reader left: first in line again)
                    messages.nbytes += len(back)
            raise
        if landing is not None:
            proto.withdraw_landing(landing)  # (not landed: the sink has the next message)
        return -1

    async def send_data(self, data: bytes | bytearray | memoryview) -> None:
        await self.before_send()  # a cancel point: a cancelled scope sends nothing
        if self.closed or self.error is not None or self.peer_close is not None or self.proto.send_half is not _OPEN:
            self.check_send()
        if len(data) >= self.rndv_min:  # (a link that can READ-rendezvous: rndv_min is set then)
            await self._send_rendezvous(self._nic(), data)
        else:
            if self.proto.mode is Mode.MESSAGES:
                chunks = self.proto.send_message(data)
            else:
                chunks = self.proto.send_data(data)
            if chunks:
                await self.link.send(chunks)
        # the schedule point comes after the bytes went, not before: an answer leaves in the same
        # pass of the loop as the message it answers (a round trip's latency); a cancellation
        # that arrives here is kept for the next await (a send that returns was sent)
        await self.after_send()

    # -- rendezvous: large messages by RDMA READ (the NIC's: ``Core.nic``) --------------------------

    async def _lend_and_announce(self, nic: NicOps, view: memoryview) -> None:
        """Zero copy: the peer READs ``view`` from the caller's registered memory, through this
        connection's QP only; this returns once the peer's RNDV_DONE says it has everything.

        **Ownership**: the memory is the NIC's from the announcement until this returns -- the
        caller must not write it meanwhile, and cannot close it (``BufferBusyError``).  When this
        returns (also by an error), the grant is dead and the memory is the caller's again.
        **Cancelled** before the peer READ it all, the grant dies at once (the caller gets its
        memory back now, not when a paused reader gets to it) and, since the peer can no longer
        READ what was announced, the connection fails (``BrokenResourceError`` for its other
        users, a failure at the peer) -- as a cancelled ``aclose`` aborts.  Send ``bytes`` (staged:
        one copy) where a send must be cancellable without that.  A byte stream lends in pieces
        (``STREAM_RENDEZVOUS_MAX``), all announced at once."""
        n = view.nbytes
        proto = self.proto
        if proto.mode is Mode.MESSAGES:
            if n > proto.peer_max_message:
                raise LocalProtocolError(f"message of {n} bytes exceeds the peer's limit of {proto.peer_max_message}")
            piece = max(n, 1)
        else:
            piece = STREAM_RENDEZVOUS_MAX
        out: list[tuple[int, NicExposure]] = []
        try:
            for pos in range(0, n, piece):
                with view[pos : pos + piece] as part:  # (released: see _send_rendezvous)
                    lent = await nic.rndv_lend(part)
                assert lent is not None  # (inside registered memory: find_registered said so)
                try:
                    self.check_send()  # (the peer may have closed while the grant was made)
                except BaseException:
                    nic.rndv_take_back(lent)
                    raise
                mid, payload = self.memory.rendezvous(min(piece, n - pos), lent.addr, lent.rkey)
                nic.rndv_hold_lent(mid, lent)
                self.counts.rendezvous_sent += 1
                out.append((mid, lent))
                await self.link.send([self.proto.send_memory(payload)])
            while any(nic.rndv_lent_out(mid) for mid, _ in out):
                self.check_send()  # (failed, or the peer closed without READing it: raises)
                await self.link.incoming()
        except BaseException:
            for mid, lent in out:
                if nic.rndv_lent_out(mid):
                    nic.rndv_take_back(lent, mid)
            raise

    async def _send_rendezvous(self, nic: NicOps, data: bytes | bytearray | memoryview) -> None:
        """Stage ``data`` in a region the peer may READ and announce it in the message's place --
        or, when it lies inside the caller's registered memory, lend it where it is
        (:meth:`_lend_and_announce`: zero copy).

        Staged: one copy (into the staging region; the caller's buffer is free when this
        returns); the receiver READs it straight into its buffer.  The region is granted to the
        peer, through this connection's QP only, until its RNDV_DONE (then the grant dies); at
        most ``nic.rndv_limit`` bytes are staged at once (this waits beyond)."""
        # (every view of the caller's memory made here is released on the way out, also by an
        # error or a cancellation: a traceback that kept one would keep the caller's buffer from
        # closing -- BufferError -- long after the send)
        with memoryview(data) as whole:
            proto = self.proto
            proto.sent_bytes += whole.nbytes
            if proto.mode is Mode.MESSAGES:
                proto.sent_messages += 1
            if whole.format == "B" and whole.ndim == 1:
                await self._rendezvous_view(nic, whole)
            else:
                with whole.cast("B") as view:
                    await self._rendezvous_view(nic, view)

    async def _rendezvous_view(self, nic: NicOps, view: memoryview) -> None:
        if find_registered(view) is not None:
            await self._lend_and_announce(nic, view)
            return
        n = view.nbytes
        proto = self.proto
        if proto.mode is not Mode.MESSAGES:
            # a byte stream: in pieces of half the staging budget (so that the sender waits for the
            # reader as over a socket), at most STREAM_RENDEZVOUS_MAX (what the receiver accepts)
            piece = max(self.rndv_min, min(STREAM_RENDEZVOUS_MAX, nic.rndv_limit // 2))
            for pos in range(0, n, piece):
                with view[pos : pos + piece] as part:
                    await self._stage_and_announce(nic, part)
            return
        if n > proto.peer_max_message:
            raise LocalProtocolError(f"message of {n} bytes exceeds the peer's limit of {proto.peer_max_message}")
        await self._stage_and_announce(nic, view)

    async def _stage_and_announce(self, nic: NicOps, view: memoryview) -> None:
        n = view.nbytes
        while nic.rndv_staged and nic.rndv_staged + n > nic.rndv_limit:
            self.check_send()
            await self.link.incoming()
        self.check_send()  # (the peer may have closed while this waited: BrokenResourceError, not a protocol error)
        region = nic.rndv_take(n)
        stage = region.view(0, n)
        try:
            stage[:] = view
        finally:
            stage.release()
        grant, rkey = await nic.rndv_grant(region, n)  # (this QP only, until the peer's RNDV_DONE)
        try:
            self.check_send()  # (the peer may have closed while the grant was made)
        except BaseException:
            nic.rndv_discard(region, grant)
            raise
        mid, payload = self.memory.rendezvous(n, region.addr, rkey)
        nic.rndv_hold(mid, region, grant)
        self.counts.rendezvous_sent += 1
        await self.link.send([self.proto.send_memory(payload)])

    async def _fetch_rendezvous(self, nic: NicOps, rv: Rendezvous, view: memoryview | None = None) -> bytes | int:
        """READ a rendezvous message (into ``view``, else into new bytes), then tell the sender.

        Cancelled (or failed) before it completed, the message goes back to the head of the queue:
        nothing is lost, the next receive READs it again (the sender's region stays staged)."""
        try:
            if view is None:
                data: bytes | int = await nic.rdma_read_bytes(rv.length, rv.addr, rv.rkey)
            else:
                await nic.rdma(False, view[: rv.length], rv.addr, rv.rkey)
                data = rv.length
        except BaseException:
            if self.error is None and not self.closed:
                self.messages.appendleft(rv)  # type: ignore[arg-type]  # (in its place)
            raise
        self.send_memory_nowait(self.memory.rendezvous_done(rv), after_peer_close=True)
        return data

    async def send_eof(self) -> None:
        if self.closed:
            raise ClosedResourceError
        await self.checkpoint()  # a cancel point and a schedule point, as send_data (again: all the same)
        if self.proto.send_half is Half.EOF:
            return
        self.check_send()
        try:
            frame = self.proto.send_eof()
        except LocalProtocolError as exc:
            raise ClosedResourceError(str(exc)) from exc
        await self.link.send([frame])

    def begin_close(self) -> bytes:
        """This side closes: from now on nothing is read (what is buffered, or arrives, is
        dropped).  Returns the CLOSE frame to send after everything queued (``b""`` if none is due:
        the peer closed first, or the connection failed without a protocol error to report)."""
        error = self.error
        self.closed = True
        self.discard()
        retired(self)  # (its counts join the process's totals)
        if isinstance(error, AuthenticationError):
            return self.proto.close(CloseCode.REFUSED, str(error))
        if error is not None and isinstance(error, (ProtocolError, HandshakeError)):
            return self.proto.close(CloseCode.PROTOCOL_ERROR, str(error))
        if error is not None:
            return b""
        return self.proto.close(CloseCode.NORMAL, "")

    async def aclose(self) -> None:
        """Close in order: everything sent before is delivered, then CLOSE, then the link is
        released (``Link.aclose``: a slow peer is waited for as long as it is alive; a connection
        that breaks first raises ``BrokenResourceError``; the link's own teardown is shielded).  Cancelled while delivering, it aborts: the peer then sees the
        connection fail, never a stream that ends early in order.  Idempotent; a checkpoint."""
        if self.closed:
            await self.checkpoint()
            return
        await self.link.aclose(self.begin_close())
