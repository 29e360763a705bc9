"""Links that carry the aiordma protocol over byte transports.

* :class:`AsyncioLink` -- an ``asyncio.BufferedProtocol`` on a TCP (or TLS)
  transport: the kernel's bytes are received straight into the protocol's
  buffer (``get_buffer``/``buffer_updated``), no ``StreamReader`` in between.
  Used under asyncio and uvloop by every front end.
* :class:`StreamLink` -- any ``anyio.abc.ByteStream``: trio's sockets (through
  anyio), TLS streams, the in-memory streams of :mod:`aiordma.testing`.  It
  pulls: a task that waits for data reads from the stream itself, so nothing
  runs in the background.

This module is the one boundary where OS and anyio transport errors become
the Core's error (and so ``BrokenResourceError`` on the anyio API).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import anyio
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.abc import ByteStream, SocketAttribute

from ._core import RECEIVE_HIGH_WATER, Core, Link
from ._errors import HandshakeError, ProtocolError
from ._io import IOBackend, Watch
from ._protocol import Chunk, CloseCode, Connection

__all__ = ["AsyncioLink", "StreamLink", "CLOSE_TIMEOUT", "DEFAULT_KEEPALIVE", "set_keepalive"]

log = logging.getLogger("aiordma")

#: How long closing may wait to flush the CLOSE frame before it aborts.
CLOSE_TIMEOUT = 5.0
#: The default bound (seconds) on noticing a peer host that died without a word (see set_keepalive).
DEFAULT_KEEPALIVE = 5.0


def set_keepalive(link: Link, seconds: float | None) -> bool:
    """Bound how long a dead peer host goes unnoticed on ``link``'s TCP connection.

    A crashed host, or a cable pulled, sends nothing: no FIN, no RST.  Idle, TCP would never
    notice; with unacknowledged bytes it retransmits for up to ~15 minutes.  So the socket gets
    keepalive probes (``TCP_KEEPIDLE`` + ``TCP_KEEPCNT`` x ``TCP_KEEPINTVL`` <= ``seconds`` - 1)
    and ``TCP_USER_TIMEOUT`` (bytes unacknowledged for ``seconds`` - 1 end the connection): the
    second left over covers the kernel's probe-interval granularity and a late timer.  An RDMA
    connection's TCP link carries no data but watches the connection: when it ends, the RDMA
    link fails too (with traffic the QP's own retries fail first, within about a second).
    ``None`` leaves the socket as the OS made it.  Returns whether it could be set (not on
    every platform or socket)."""
    if seconds is None:
        return False
    get = link.extra_attributes.get(SocketAttribute.raw_socket)
    sock = get() if get is not None else None
    if sock is None:
        return False
    import socket

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # the kernel checks once per probe interval (1 s) and its timers run late on a busy host:
        # aim a second early, so that the connection has ended within ``seconds`` (measured
        # across two TCG guests: 5.56 s with the kernel's budget at the full 5 s)
        budget = max(1.0, seconds - 1.0) if seconds >= 2 else seconds
        total = max(2, int(budget))
        idle = max(1, total // 2)
        count = max(1, total - idle)  # probes one second apart after ``idle`` quiet seconds
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(budget * 1000)))
    except (OSError, AttributeError, TypeError) as exc:  # (a socket wrapper without setsockopt)
        log.debug("aiordma: could not set TCP keepalive: %s", exc)
        return False
    return True
#: How much a pull link asks its stream for at once.
RECEIVE_SIZE = 256 << 10


def _socket_attributes(get: Callable[[str], Any]) -> dict[Any, Callable[[], Any]]:
    attrs: dict[Any, Callable[[], Any]] = {}
    sock = get("socket")
    if sock is not None:
        attrs[SocketAttribute.raw_socket] = lambda: sock
        attrs[SocketAttribute.family] = lambda: sock.family
    sockname = get("sockname")
    if sockname is not None:
        attrs[SocketAttribute.local_address] = lambda: sockname
        if isinstance(sockname, tuple):
            attrs[SocketAttribute.local_port] = lambda: sockname[1]
    peername = get("peername")
    if peername is not None:
        attrs[SocketAttribute.remote_address] = lambda: peername
        if isinstance(peername, tuple):
            attrs[SocketAttribute.remote_port] = lambda: peername[1]
    return attrs


def _ignore() -> None:
    pass


class AsyncioLink(asyncio.BufferedProtocol, Link):
    # plain attributes here (read-only properties on the Link interface)
    transport: asyncio.BaseTransport | None = None
    direct_writer: asyncio.Transport | None = None
    paused_writing: bool = False
    lost: bool = False
    #: set by the asyncio Transport front end (aiordma._transport): called, instead of waking
    #: waiters, after every feed of the Core and when the connection ends; and
    #: ``write_listener(paused)`` when the TCP transport pauses or resumes writing
    listener: Callable[[], None] | None = None
    write_listener: Callable[[bool], None] | None = None

    """The protocol side of an asyncio TCP connection (see module docs).

    ``on_made`` (servers) is called with the link once the transport exists.

    This is the hot path of every asyncio connection, kept short on purpose:
    DATA payloads land in the Core's ``rbuf`` inside the protocol's
    ``buffer_updated`` (the data sink), ``incoming()`` hands out the waiter's
    future itself, and the asyncio front end writes to ``direct_writer`` and reads
    ``_paused_reading`` / ``paused_writing`` directly (package-internal).
    """

    def __init__(
        self,
        proto: Connection,
        loop: asyncio.AbstractEventLoop,
        on_made: Callable[[AsyncioLink], None] | None = None,
    ) -> None:
        self._loop = loop
        self._on_made = on_made
        self.transport: asyncio.BaseTransport | None = None
        self.direct_writer: asyncio.Transport | None = None
        # tasks in wait_incoming(): the first in _waiter (the common case, one
        # reader), any others in _waiters (never used while _waiter is None)
        self._waiter: asyncio.Future[None] | None = None
        self._waiters: list[asyncio.Future[None]] = []
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.paused_writing = False
        self._paused_reading = False
        self.lost = False
        self._closed_future: asyncio.Future[None] = loop.create_future()
        self._create_future = loop.create_future
        self._proto = proto
        self._on_lost: Callable[[], None] | None = None  # set once another link took the Core over
        # the loop calls get_buffer for every read: go to the protocol directly
        self.get_buffer = proto.get_buffer  # type: ignore[method-assign]
        Core(proto, self)

    # -- asyncio protocol callbacks ------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        # uvloop's transports are not subclasses of asyncio's: rely on the methods
        self.direct_writer = cast(asyncio.Transport, transport)
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced per instance in __init__
        return self._proto.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._on_lost is not None:  # handed over: any byte here means the peer is leaving
            self._lost_after_hand_over()
            return
        core = self.core
        try:
            events = self._proto.buffer_updated(nbytes)
        except (ProtocolError, HandshakeError) as exc:
            core.on_events(exc.pending_events)
            core.on_error(exc)
            self._fail(exc)
        else:
            if events:
                core.on_events(events)
            # DATA went into core.rbuf without events: check the level every time
            if not self._paused_reading and len(core.rbuf) + core.messages.nbytes > RECEIVE_HIGH_WATER:
                self._pause_reading()
        listener = self.listener
        if listener is not None:
            listener()
            return
        fut = self._waiter  # self._wake(), inlined
        if fut is not None:
            self._waiter = None
            if not fut.done():
                fut.set_result(None)
            if self._waiters:
                self._wake_more()

    def eof_received(self) -> bool:
        if self._on_lost is not None:
            self._lost_after_hand_over()
            return False
        self.core.feed_eof()
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._on_lost is not None:
            self._lost_after_hand_over()
            if not self._closed_future.done():
                self._closed_future.set_result(None)
            return
        core = self.core
        if not core.closed and core.error is None and core.peer_close is None:
            core.feed_eof(exc)
        self._wake()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        if not self._closed_future.done():
            self._closed_future.set_result(None)
        self._on_made = None

    def pause_writing(self) -> None:
        self.paused_writing = True
        if self.write_listener is not None:
            self.write_listener(True)

    def resume_writing(self) -> None:
        self.paused_writing = False
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        if self.write_listener is not None:
            self.write_listener(False)

    # -- internals -----------------------------------------------------------

    def hand_over(self, io: IOBackend, on_lost: Callable[[], None]) -> Watch | None:
        self._on_lost = on_lost
        return None

    def _lost_after_hand_over(self) -> None:
        on_lost, self._on_lost = self._on_lost, _ignore
        if on_lost is not None:
            on_lost()

    def _wake(self) -> None:
        if self.listener is not None:
            self.listener()
        fut = self._waiter
        if fut is not None:
            self._waiter = None
            if not fut.done():  # a waiter that was cancelled is done
                fut.set_result(None)
            if self._waiters:
                self._wake_more()

    def _wake_more(self) -> None:
        for fut in self._waiters:
            if not fut.done():
                fut.set_result(None)
        self._waiters.clear()

    def _pause_reading(self) -> None:
        if self.direct_writer is not None and not self.lost:
            self.direct_writer.pause_reading()
            self._paused_reading = True

    def _resume_reading(self) -> None:
        self._paused_reading = False
        if self.direct_writer is not None and not self.lost:
            self.direct_writer.resume_reading()

    def _fail(self, exc: Exception) -> None:
        """The peer broke the protocol: tell it why and hang up."""
        writer = self.direct_writer
        if writer is not None and not writer.is_closing():
            final = self.core.proto.close(CloseCode.PROTOCOL_ERROR, str(exc))
            if final:
                writer.write(final)
            writer.close()

    # -- Link ------------------------------------------------------------------

    async def wait_incoming(self) -> None:
        if self.lost or self.core.closed:
            return
        await self.incoming()

    def incoming(self) -> Awaitable[None]:
        if self.lost or self.core.closed:
            return self.wait_incoming()  # returns at once
        if self._paused_reading:
            self._resume_reading()
        fut = self._create_future()
        first = self._waiter
        if first is None or first.done():  # done: that wait was cancelled
            self._waiter = fut
        else:
            waiters = self._waiters
            if len(waiters) >= 8:
                # futures of cancelled waits stay until the next wake; drop
                # them, so that waits cancelled on an idle connection cannot
                # pile up
                waiters[:] = [w for w in waiters if not w.done()]
            waiters.append(fut)
        return fut

    def consumed(self) -> None:
        if self._paused_reading and self.core.buffered <= RECEIVE_HIGH_WATER // 4:
            self._resume_reading()

    def write_nowait(self, chunks: Sequence[Chunk]) -> None:
        writer = self.direct_writer
        if writer is None or writer.is_closing():
            raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")
        if len(chunks) == 1:
            writer.write(chunks[0])
        else:
            for chunk in chunks:
                writer.write(chunk)

    async def drain(self) -> None:
        if not self.paused_writing or self.lost:
            return
        fut = self._loop.create_future()
        self._drain_waiters.append(fut)
        try:
            await fut
        finally:
            self._drain_waiters.remove(fut)

    async def send(self, chunks: Sequence[Chunk]) -> None:
        self.write_nowait(chunks)
        if self.paused_writing:
            await self.drain()
            if self.lost:
                raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")

    def close_nowait(self, final: bytes) -> None:
        """Write ``final`` and start closing the transport (flushes first)."""
        writer = self.direct_writer
        if writer is not None and not writer.is_closing():
            if final:
                writer.write(final)
            writer.close()
        elif writer is None and self.transport is not None:
            self.transport.close()
        self._wake()

    def abort(self) -> None:
        if self.direct_writer is not None:
            self.direct_writer.abort()
        self._wake()

    async def wait_closed(self) -> None:
        """Wait until the transport is gone; abort it after ``CLOSE_TIMEOUT``."""
        if self.transport is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._closed_future), CLOSE_TIMEOUT)
        except asyncio.TimeoutError:
            self.abort()
            await self._closed_future
        except asyncio.CancelledError:
            self.abort()
            raise

    async def aclose(self, final: bytes) -> None:
        self.close_nowait(final)
        await self.wait_closed()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        transport = self.transport
        if transport is None:
            return {}
        return _socket_attributes(transport.get_extra_info)


class StreamLink(Link):
    """A link over an ``anyio.abc.ByteStream`` (pull model, see module docs)."""

    def __init__(self, stream: ByteStream, proto: Connection) -> None:
        self.stream = stream
        # fast_acquire: no extra trip through the scheduler when the lock is
        # free; the stream operation inside is the checkpoint
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._receive_lock = anyio.Lock(fast_acquire=True)
        self._feeds = 0
        self.ended = False
        self.closed = False
        self._outbox: list[Chunk] = []  # control frames made while fed (send_nowait)
        Core(proto, self)

    pulls = True

    def send_nowait(self, chunks: Sequence[Chunk]) -> None:
        """Queued; sent by the task that fed them (after the feed) or by the next ``send``."""
        if self.closed or self.ended:
            raise ClosedResourceError
        self._outbox.extend(chunks)

    async def _flush_outbox(self) -> None:
        # shielded (a frame cut by a cancellation would corrupt the stream), and bounded
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(CLOSE_TIMEOUT):
                try:
                    async with self._send_lock:
                        while self._outbox:
                            chunks, self._outbox = self._outbox, []
                            await self.stream.send(b"".join(chunks))
                except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                    self._outbox.clear()
                    self.core.on_error(exc)

    async def wait_incoming(self) -> None:
        core = self.core
        seen = self._feeds
        async with self._receive_lock:
            if self._feeds != seen or self.ended or core.closed:
                return
            try:
                data = await self.stream.receive(RECEIVE_SIZE)
            except EndOfStream:
                self.ended = True
                core.feed_eof()
            except ClosedResourceError as exc:
                self.ended = True
                if not core.closed:
                    core.feed_eof(exc)
            except (BrokenResourceError, OSError) as exc:
                self.ended = True
                core.feed_eof(exc)
            else:
                core.feed(data)
                if self._outbox:
                    await self._flush_outbox()
                if core.error is not None and isinstance(core.error, (ProtocolError, HandshakeError)):
                    self.ended = True
                    with anyio.CancelScope(shield=True):
                        await self.aclose(core.proto.close(CloseCode.PROTOCOL_ERROR, str(core.error)))
            finally:
                self._feeds += 1

    async def send(self, chunks: Sequence[Chunk]) -> None:
        if len(chunks) > 1 and sum(len(c) for c in chunks) <= RECEIVE_SIZE:
            chunks = [b"".join(chunks)]
        try:
            async with self._send_lock:
                if self._outbox:  # (answers queued while fed go first: they were made first)
                    chunks = [*self._outbox, *chunks]
                    self._outbox = []
                for chunk in chunks:
                    await self.stream.send(chunk)  # type: ignore[arg-type]
        except (BrokenResourceError, ClosedResourceError, OSError) as exc:
            if self.core.closed:
                raise ClosedResourceError from exc
            self.core.on_error(exc)
            raise self.core.broken() from exc

    async def aclose(self, final: bytes) -> None:
        if self.closed:
            return
        self.closed = True
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(CLOSE_TIMEOUT):
                try:
                    if final:
                        async with self._send_lock:
                            await self.stream.send(final)
                except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                    log.debug("could not send CLOSE: %r", exc)
            closed = False
            with anyio.move_on_after(CLOSE_TIMEOUT):
                try:
                    await self.stream.aclose()
                    closed = True
                except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                    log.debug("closing the stream failed: %r", exc)
            if not closed:
                await anyio.aclose_forcefully(self.stream)

    def hand_over(self, io: IOBackend, on_lost: Callable[[], None]) -> Watch | None:
        """Watch the raw socket: nothing reads the stream any more; readable means EOF or stray bytes."""
        attrs: Mapping[Any, Callable[[], Any]] = self.stream.extra_attributes
        get_sock = attrs.get(SocketAttribute.raw_socket)
        if get_sock is None:
            raise NotImplementedError("this stream has no socket to watch for liveness")
        return io.watch(int(get_sock().fileno()), on_lost)

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.stream.extra_attributes
