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
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import anyio
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.abc import ByteStream, SocketAttribute, SocketStream

from .._conn.core import RECEIVE_HIGH_WATER, Core, Link
from .._conn.nowait import NowaitLink
from .._errors import HandshakeError, ProtocolError
from .._io.backends import IOBackend, Watch, asyncio_loop
from .._proto.protocol import Chunk, CloseCode, Connection
from .window import State, Step, WindowWatch, read_sample, set_user_timeout

__all__ = ["AsyncioLink", "StreamLink", "CLOSE_TIMEOUT", "DEFAULT_KEEPALIVE", "set_keepalive", "open_tcp_link"]

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
    The user timeout would also end a connection whose peer only stopped reading (its window
    closed): the link's :class:`~aiordma._tcp.window.WindowWatch` turns it off while that lasts
    and judges the peer by its kernel's answers instead.  ``None`` leaves the socket as the OS
    made it.  Returns whether it could be set (not on every platform or socket)."""
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
            if isinstance(link, (AsyncioLink, StreamLink)):
                # a peer whose window is closed is slow, not dead: see aiordma._tcp.window
                link.watch_window(sock, WindowWatch(budget))
    except (OSError, AttributeError, TypeError) as exc:  # (a socket wrapper without setsockopt)
        log.debug("aiordma: could not set TCP keepalive: %s", exc)
        return False
    return True
_IDLE, _KERNEL = State.IDLE, State.KERNEL
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


def _ignore_control(data: bytes | None) -> None:
    pass


def _immutable(chunk: Chunk) -> bool:
    """Whether a chunk's bytes can never change (``bytes``, or a read-only view of ``bytes``)."""
    if type(chunk) is bytes:
        return True
    return type(chunk) is memoryview and chunk.readonly and type(chunk.obj) is bytes


def write_chunks(writer: asyncio.WriteTransport, chunks: Sequence[Chunk], fd: int) -> None:
    """Write ``chunks`` to an asyncio transport, in order, so that it keeps no reference to a
    buffer of the caller's that could still change: on Python 3.12+ (and on uvloop) a transport
    keeps a reference to what it could not send at once, and a reused ``bytearray`` would change
    bytes not yet on the wire.

    Immutable chunks go to the transport as they are.  Otherwise, while the transport holds
    nothing (its buffer is empty), the chunks go to the socket at once in one gathered write
    (``writev``: header and payload, never joined) and only what the kernel did not take is
    copied into the transport; with data already buffered, mutable chunks are copied first.
    ``fd`` is the plain socket's descriptor, or -1 (TLS: the transport encrypts, always copy)."""
    if len(chunks) == 1 and type(chunks[0]) is bytes:
        writer.write(chunks[0])
        return
    if all(_immutable(c) for c in chunks):
        for chunk in chunks:
            writer.write(chunk)
        return
    sent = 0
    if fd >= 0 and writer.get_write_buffer_size() == 0:
        try:
            sent = os.writev(fd, chunks)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0  # (the transport reports the connection's end itself)
    for chunk in chunks:
        n = len(chunk) if type(chunk) is bytes else memoryview(chunk).nbytes
        if sent >= n:
            sent -= n
            continue
        rest = memoryview(chunk)[sent:] if sent else chunk
        sent = 0
        writer.write(rest if _immutable(rest) else bytes(rest))


def unacknowledged(sock: Any) -> int:
    """Bytes the kernel still holds for the peer on a TCP socket (queued or sent but not
    acknowledged: ``SIOCOUTQ``); 0 where it cannot tell."""
    try:
        import fcntl
        import termios

        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError, AttributeError, ImportError):
        return 0
    return int.from_bytes(raw, "little", signed=True)


class _Linger:
    """How a closing TCP connection waits for its peer (see ``AsyncioLink.close_nowait``).

    Our CLOSE is out and our half is ending (a FIN after it).  The wait ends in order when the
    peer's half ends (its FIN: it parsed our CLOSE), or once the peer's kernel has acknowledged
    every byte we sent, the CLOSE included: the peer has everything, and learns of our close
    at its next receive -- or at its next send, since closing a socket that still receives
    resets the connection (what the peer's kernel holds for its application stays readable).
    So a producer that never reads stops our linger at once, and learns of it from the reset.

    While bytes are unacknowledged it waits, however long: a slow reader is waited for as long
    as its kernel answers.  Whether the peer is alive is the link's window watch's to judge
    (:mod:`aiordma._tcp.window`), or without keepalive the kernel's retransmission timeout --
    never a timer on progress.  Looks back off from 10 ms to 0.5 s."""

    def __init__(self) -> None:
        self.tick = 0.01

    def look(self, outstanding: int) -> bool:
        """Whether everything was delivered (``outstanding``: bytes not yet acknowledged)."""
        self.tick = min(self.tick * 2, 0.5)
        return outstanding == 0


def closing_failed(exc: BaseException) -> BrokenResourceError:
    """What a close raises when the peer may not have everything (its host died, it reset)."""
    err = BrokenResourceError(f"the connection broke before the peer had everything: {exc}")
    err.__cause__ = exc
    return err


class AsyncioLink(asyncio.BufferedProtocol, Link):
    # plain attributes here (read-only properties on the Link interface)
    transport: asyncio.BaseTransport | None = None
    tcp_writer: asyncio.Transport | None = None
    #: the plain TCP socket's descriptor (-1: none, or TLS)
    fd: int = -1
    paused_writing: bool = False
    lost: bool = False
    #: readers call consumed() only while reading is paused (it resumes reading below the low mark)
    needs_consumed: bool = False
    #: set by the asyncio Transport front end (aiordma._transport, through set_callbacks):
    #: called, instead of waking waiters, after every feed of the Core and when the connection
    #: ends; and ``write_listener(paused)`` when the TCP transport pauses or resumes writing
    listener: Callable[[], None] | None = None
    write_listener: Callable[[bool], None] | None = None

    """The protocol side of an asyncio TCP connection (see module docs).

    ``on_made`` (servers) is called with the link once the transport exists.

    This is the hot path of every asyncio connection, kept short on purpose:
    DATA payloads land in the Core's ``rbuf`` inside the protocol's
    ``buffer_updated`` (the data sink), ``incoming()`` hands out the waiter's
    future itself, and readers call ``consumed()`` only while reading is paused
    (``needs_consumed``).  It is a :class:`~aiordma._conn.nowait.NowaitLink`: asyncio's front
    ends write through it without waiting.
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
        self.tcp_writer: asyncio.Transport | None = None
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
        #: set once another link (RDMA) took the Core over: it gets what the socket still carries
        self._on_control: Callable[[bytes | None], None] | None = None
        self._eof_sent = False  # our half is closed (write_eof)
        self._linger: _Linger | None = None  # closing in order: our CLOSE is out, waiting for the peer's end
        self._close_error: BrokenResourceError | None = None  # the peer may not have everything (wait_closed)
        self._abort_after_linger = False  # (TLS: see close_nowait)
        self._window: WindowWatch | None = None  # (set_keepalive): slow is not dead
        self._window_sock: Any = None
        self._window_timer: asyncio.TimerHandle | None = None
        # the loop calls get_buffer for every read: go to the protocol directly
        self.get_buffer = proto.get_buffer  # type: ignore[method-assign]
        Core(proto, self)

    # -- asyncio protocol callbacks ------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        # uvloop's transports are not subclasses of asyncio's: rely on the methods
        self.tcp_writer = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("sslcontext") is None:
            self.fd = int(sock.fileno())  # (a plain socket: gathered writes go to it directly)
        elif transport.get_extra_info("uvloop.sslproto") is not None:
            # uvloop's TLS drops what it holds undecrypted when the connection ends while we
            # have paused reading (asyncio's keeps it for us): with these limits it stops reading
            # the socket as soon as it holds anything we have not taken, so the peer's end stays
            # in the kernel, behind its data, until we read again
            limits: Any = transport
            limits.set_read_buffer_limits(high=1, low=0)
        if self._on_made is not None:
            self._on_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced per instance in __init__
        return self._proto.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._on_control is not None:  # handed over: the RDMA link reads the TCP connection
            self._on_control(self._proto.peek_lent(nbytes))
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
                if core.peer_close is not None:
                    self._half_close()
            if core.closed:
                core.discard()  # (lingering after our CLOSE: what comes is dropped)
            # DATA went into core.rbuf without events: check the level every time
            elif not self._paused_reading and len(core.rbuf) + core.messages.nbytes > RECEIVE_HIGH_WATER:
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
        if self._on_control is not None:
            self._control_ended()
            return False
        core = self.core
        if not core.closed:
            core.feed_eof()
        self._wake()
        return False  # (asyncio closes the transport: lingering after our CLOSE, that is its end)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._linger is not None and exc is not None and self.core.peer_close is None and self._close_error is None:
            self._close_error = closing_failed(exc)  # (lingering: what we sent may not all be there)
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        if self._on_control is not None:
            self._control_ended()
            if not self._closed_future.done():
                self._closed_future.set_result(None)
            return
        core = self.core
        if exc is not None and not core.closed and core.error is None and core.peer_close is None:
            self._read_what_is_left()
        if not core.closed and core.error is None and core.peer_close is None:
            core.feed_eof(exc)
        self._wake()
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)
        if not self._closed_future.done():
            self._closed_future.set_result(None)
        self._on_made = None

    def _read_what_is_left(self) -> None:
        """asyncio's socket transport drops a connection whose write failed (the peer closed and
        reset it) without reading what the kernel still holds -- the peer's last bytes and its
        CLOSE, perhaps.  Its socket is still open during ``connection_lost``: read that now,
        without blocking.  (uvloop closes the socket first; there nothing can be read.)"""
        transport = self.transport
        if transport is None or type(transport).__module__ != "asyncio.selector_events":
            return
        sock = transport.get_extra_info("socket")
        if sock is None:
            return
        import os

        try:
            fd = sock.fileno()
            while fd >= 0:
                data = os.read(fd, RECEIVE_HIGH_WATER)
                if not data:
                    break
                self.core.feed(data)
        except OSError:  # (BlockingIOError: nothing more; ECONNRESET after the last bytes)
            pass

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

    # -- the window watch (aiordma._tcp.window) -------------------------------

    def watch_window(self, sock: Any, watch: WindowWatch) -> None:
        """Look at ``sock`` with ``watch`` while it holds bytes for the peer."""
        self._window, self._window_sock = watch, sock

    def written(self) -> None:
        """Bytes went to the transport: start looking, if the watch was idle.  Every writer of
        ``tcp_writer`` calls this (one attribute test when the watch already looks)."""
        watch = self._window
        if watch is not None and self._window_timer is None and not self.lost and watch.wrote():
            self._window_timer = self._loop.call_later(watch.tick, self._look)

    def _look(self) -> None:
        self._window_timer = None
        watch = self._window
        if watch is None or self.lost:
            return
        step = watch.look(read_sample(self._window_sock), self._loop.time())
        if step.user_timeout is not None:
            set_user_timeout(self._window_sock, int(watch.budget * 1000) if step.user_timeout else 0)
        if step.dead is not None:
            self._peer_dead(step.dead)
        elif step.again:
            self._window_timer = self._loop.call_later(watch.tick, self._look)

    def _peer_dead(self, exc: OSError) -> None:
        core = self.core
        log.info("aiordma: %s", exc)
        if self._linger is not None and self._close_error is None:
            self._close_error = closing_failed(exc)
        if not core.closed and core.error is None:
            core.feed_eof(exc)
        self.abort()  # (connection_lost follows; the Core already has its error)
        for fut in self._drain_waiters:
            if not fut.done():
                fut.set_result(None)

    # -- internals -----------------------------------------------------------

    def hand_over(self, io: IOBackend, on_control: Callable[[bytes | None], None]) -> Watch | None:
        # from now on the socket's bytes go to the RDMA link, not to the protocol object (they
        # still land in its lent buffer: uvloop keeps the get_buffer it found at the start)
        self._on_control = on_control
        return None

    def _control_ended(self) -> None:
        on_control, self._on_control = self._on_control, _ignore_control
        if on_control is not None:
            on_control(None)

    def _half_close(self) -> None:
        """The peer's CLOSE came: it reads no more, and neither will we send; end our half (after
        what is queued), so that the peer's lingering close sees our FIN instead of waiting."""
        writer = self.tcp_writer
        if self._eof_sent or writer is None or writer.is_closing():
            return
        self._eof_sent = True
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError, NotImplementedError) as exc:  # (a transport that cannot)
            log.debug("aiordma: could not half-close after the peer's CLOSE: %r", exc)

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
        if self.tcp_writer is not None and not self.lost:
            self.tcp_writer.pause_reading()
            self._paused_reading = self.needs_consumed = True

    def _resume_reading(self) -> None:
        self._paused_reading = self.needs_consumed = False
        if self.tcp_writer is not None and not self.lost:
            self.tcp_writer.resume_reading()

    def _fail(self, exc: Exception) -> None:
        """The peer broke the protocol: tell it why and hang up."""
        writer = self.tcp_writer
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
        """Queue ``chunks`` on the transport (see :func:`write_chunks`: nothing of a caller's
        mutable buffer is kept once this returns)."""
        writer = self.tcp_writer
        if writer is None or writer.is_closing():
            raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")
        if len(chunks) == 1 and type(chunks[0]) is bytes:
            writer.write(chunks[0])
        else:
            write_chunks(writer, chunks, self.fd)
        if self._window_timer is None:
            self.written()

    def send_nowait(self, chunks: Sequence[Chunk]) -> None:
        self.write_nowait(chunks)

    def unsent(self) -> int:
        writer = self.tcp_writer
        return writer.get_write_buffer_size() if writer is not None else 0

    def set_callbacks(
        self, on_data: Callable[[], None] | None, on_write_paused: Callable[[bool], None] | None
    ) -> bool:
        """Call ``on_data()`` after every feed of the Core (and when the connection ends) instead
        of waking waiters, and ``on_write_paused(paused)`` as the TCP transport pauses or resumes."""
        self.listener, self.write_listener = on_data, on_write_paused
        return True

    async def drain(self, low: int = 0) -> None:
        """Wait while the TCP transport has paused writing (its own low mark: ``low`` is not used)."""
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
        """Write ``final`` (our CLOSE) and start closing in order.

        With a CLOSE to deliver, the connection lingers (:class:`_Linger`): our half ends after
        what is queued (a FIN), and reading goes on -- what arrives is dropped -- until the
        peer's half ends too (it does when it parses our CLOSE) or its kernel acknowledged all we
        sent: the socket never closes while the peer's kernel has yet to take bytes of ours (a
        close with unread bytes resets the connection, and the reset drops what is in flight).
        A slow reader is waited for as long as its host is alive (the window watch judges).
        :meth:`wait_closed` waits for it.  Without a CLOSE (the peer closed first, or the
        connection failed) the transport just closes (it flushes first)."""
        writer = self.tcp_writer
        if writer is not None and not writer.is_closing():
            if final:
                writer.write(final)
            tls = writer.get_extra_info("ssl_object") is not None and writer.get_extra_info("socket") is not None
            if final and self._on_control is None and not self._eof_sent and (tls or writer.can_write_eof()):
                self._linger = _Linger()
                self.written()  # (the watch judges the peer while it has bytes of ours to take)
                if self._paused_reading:
                    self._resume_reading()
                if tls:
                    # no half-close in TLS: the linger ends on the ACKs (or the peer's end), then
                    # the transport is aborted -- TLS's own shutdown would wait for the peer's
                    # close_notify, which a peer that closes later sends late or never (our CLOSE,
                    # inside the encrypted stream, is the authenticated end)
                    self._abort_after_linger = True
                else:
                    self._eof_sent = True
                    try:
                        writer.write_eof()
                    except OSError:  # (the peer reset the connection already: nothing to linger for)
                        self._linger = None
                        writer.close()
            else:
                writer.close()
        elif writer is None and self.transport is not None:
            self.transport.close()
        self._wake()

    def abort(self) -> None:
        if self.tcp_writer is not None:
            self.tcp_writer.abort()
        self._wake()

    async def wait_closed(self) -> None:
        """Wait until the transport is gone.  Lingering (see :meth:`close_nowait`): until the
        peer's half ended or its kernel has everything we sent, however long that takes while
        the peer is alive; raises ``BrokenResourceError`` when it may not have everything (the
        watch found its host dead, the connection was reset or timed out first).  Not lingering:
        within ``CLOSE_TIMEOUT`` (then it aborts).  Cancelled, it aborts."""
        if self.transport is None:
            return
        try:
            while True:
                linger = self._linger
                try:
                    await asyncio.wait_for(asyncio.shield(self._closed_future),
                                           linger.tick if linger is not None else CLOSE_TIMEOUT)  # fmt: skip
                    break
                except asyncio.TimeoutError:
                    writer = self.tcp_writer
                    if linger is None or writer is None:
                        self.abort()
                        await self._closed_future
                        break
                    outstanding = writer.get_write_buffer_size() + unacknowledged(writer.get_extra_info("socket"))
                    if linger.look(outstanding):
                        self._linger = None
                        if self._abort_after_linger:
                            writer.abort()  # (TLS: see close_nowait; a reset now drops nothing of ours)
                        else:
                            writer.close()  # (all acknowledged: a FIN, or a reset that drops nothing of ours)
        except asyncio.CancelledError:
            self.abort()
            raise
        if self._close_error is not None:
            raise self._close_error

    async def aclose(self, final: bytes) -> None:
        self.close_nowait(final)
        await self.wait_closed()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        transport = self.transport
        if transport is None:
            return {}
        return _socket_attributes(transport.get_extra_info)


class SocketWriter(ByteStream):
    """A TCP ``SocketStream`` whose sends write the socket themselves, non-blocking, waiting for
    room with ``wait_writable`` -- the transport under a TLS stream, so that a TLS send that waits
    for a closed window can still look at it (a :class:`StreamLink` sets ``wait_writable`` to its
    watched wait).  Everything else is the socket stream's."""

    def __init__(self, stream: SocketStream) -> None:
        self.stream = stream
        self.sock: Any = stream.extra(SocketAttribute.raw_socket)
        self.wait_writable: Callable[[Any], Awaitable[None]] = anyio.wait_writable

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        view = memoryview(item).cast("B")
        sock = self.sock
        while view:
            try:
                sent = sock.send(view)
            except (BlockingIOError, InterruptedError):
                await self.wait_writable(sock)
                continue
            except OSError as exc:
                raise BrokenResourceError(str(exc)) from exc
            view = view[sent:]

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.stream.receive(max_bytes)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.stream.extra_attributes


async def wrap_tls(stream: SocketStream, *, server_side: bool, ssl_context: Any, hostname: str | None = None) -> ByteStream:
    """TLS over ``stream``, on a :class:`SocketWriter` (see there), as anyio makes it -- without
    close_notify on either side (``standard_compatible=False``): the protocol's CLOSE frame,
    inside the encrypted stream, is the authenticated end (a stream that ends without one is
    broken, so a truncation is never taken for an end), and the close lingers on the socket's
    ACKs as plain TCP does (:meth:`StreamLink._linger`) instead of waiting for the peer's
    close_notify, which a peer that closes later sends late or never."""
    from anyio.streams.tls import TLSStream

    return await TLSStream.wrap(SocketWriter(stream), server_side=server_side, hostname=hostname,
                                ssl_context=ssl_context, standard_compatible=False)  # fmt: skip


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
        self._eof_sent = False  # our half is closed
        self._send_error: BaseException | None = None  # a write failed: sends fail, reading goes on
        #: a plain TCP stream: sends write its socket here, so that the bytes of a send that is
        #: cancelled after its frame started are known to the byte (see ``send``)
        self._raw: Any = stream.extra(SocketAttribute.raw_socket, None) if isinstance(stream, SocketStream) else None
        self._window: WindowWatch | None = None  # (set_keepalive): slow is not dead
        self._window_sock: Any = None
        self._receive_scope: anyio.CancelScope | None = None  # a reader waiting on the socket
        self._plain_reader = False  # a reader waits without a scope (nobody can make it look)
        self._duplex = False  # a send came while a reader waited: readers wait in scopes from then on
        self._dead: OSError | None = None  # the watch found the peer's host dead
        below = getattr(stream, "transport_stream", None)
        if isinstance(below, SocketWriter):  # (TLS: its sends wait for room through the watch)
            below.wait_writable = self._wait_writable
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
                    self._send_error = exc

    async def wait_incoming(self) -> None:
        core = self.core
        seen = self._feeds
        async with self._receive_lock:
            if self._feeds != seen or self.ended or core.closed:
                return
            watch = self._window
            try:
                if watch is None:
                    data = await self.stream.receive(RECEIVE_SIZE)
                elif watch.state is _IDLE and not self._duplex:  # (nothing to look at: no scope)
                    self._plain_reader = True
                    try:
                        data = await self.stream.receive(RECEIVE_SIZE)
                    finally:
                        self._plain_reader = False
                        if watch.state is _KERNEL and not self._send_lock.locked():
                            self._leave(watch)
                else:
                    data = await self._watched_receive(watch)
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
                if core.peer_close is not None and not self._eof_sent and not core.closed:
                    await self._half_close()
                if core.error is not None and isinstance(core.error, (ProtocolError, HandshakeError)):
                    self.ended = True
                    with anyio.CancelScope(shield=True):
                        await self.aclose(core.proto.close(CloseCode.PROTOCOL_ERROR, str(core.error)))
            finally:
                self._feeds += 1

    # -- the window watch (aiordma._tcp.window) -------------------------------
    #
    # Nothing runs in the background here: the tasks that wait on the socket look.  A sender
    # waiting for room looks between waits; a reader waiting in ``wait_incoming`` wakes every
    # tick while bytes are queued (its wait has a deadline, which a sender sets when it leaves
    # bytes behind).  When the last of them leaves with bytes that may meet a closed window, the
    # watch stops the kernel from judging it meanwhile (``unattended``); the next wait judges.
    #
    # A cancel scope costs a trio wait about 7 us, so a reader waits in one only while the watch
    # looks, or once sends have come while a reader waited (a full-duplex connection): a reader
    # that alternates with its sends (request, answer) costs one TCP_INFO per send.  (The first
    # send that finds a reader waiting without a scope cannot make it look: until that reader
    # or a sender waits again, a peer host that dies behind a closed window is the kernel's to
    # find, in minutes.)

    def watch_window(self, sock: Any, watch: WindowWatch) -> None:
        """Look at ``sock`` with ``watch`` while it holds bytes for the peer."""
        self._window, self._window_sock = watch, sock

    def _apply(self, step: Step) -> None:
        watch = self._window
        assert watch is not None
        if step.user_timeout is not None:
            set_user_timeout(self._window_sock, int(watch.budget * 1000) if step.user_timeout else 0)
        if step.dead is not None and self._dead is None:
            self._dead = step.dead
            log.info("aiordma: %s", step.dead)
            if self._receive_scope is not None:
                self._receive_scope.cancel()  # (the reader ends the receiving side with the error)
            elif not self.ended:
                self.ended = True
                self.core.feed_eof(step.dead)

    def _look(self) -> None:
        """One look (a task waiting on the socket); raises the error if the peer is dead."""
        if self._dead is None and self._window is not None:
            self._apply(self._window.look(read_sample(self._window_sock), anyio.current_time()))
        if self._dead is not None:
            raise self._dead

    def _leave(self, watch: WindowWatch) -> None:
        """A sender leaves, or a reader while no sender is in, with the watch in KERNEL: unless a
        reader still waits (it looks: its wait gets a deadline), nobody looks until the next wait."""
        scope = self._receive_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, anyio.current_time() + watch.tick)
        else:
            if self._plain_reader:
                self._duplex = True
            self._apply(watch.unattended(read_sample(self._window_sock)))

    async def _watched_receive(self, watch: WindowWatch) -> bytes:
        """A reader's wait in a scope whose deadline brings it back to look while the watch looks."""
        try:
            while True:
                with anyio.CancelScope() as scope:
                    self._receive_scope = scope
                    if watch.looking:
                        scope.deadline = anyio.current_time() + watch.tick
                    try:
                        return await self.stream.receive(RECEIVE_SIZE)
                    finally:
                        self._receive_scope = None
                self._look()  # (the deadline passed: a look is due; or the peer is dead)
        finally:
            if watch.state is _KERNEL and not self._send_lock.locked():
                self._leave(watch)

    async def _wait_writable(self, sock: Any) -> None:
        watch = self._window
        if watch is None:
            await anyio.wait_writable(sock)
            return
        while True:
            with anyio.move_on_after(watch.tick):
                await anyio.wait_writable(sock)
                return
            self._look()

    def _wrote(self, watch: WindowWatch) -> None:
        """Bytes are about to go out (the watch was idle): it looks -- the sender while it waits
        for room, a reader waiting on the socket from the next tick on."""
        if watch.wrote() and self._receive_scope is not None:
            self._receive_scope.deadline = anyio.current_time() + watch.tick

    def _broken_send(self, exc: BaseException) -> BrokenResourceError:
        err = BrokenResourceError(f"the connection is broken: {exc}")
        err.__cause__ = exc
        return err

    async def send(self, chunks: Sequence[Chunk]) -> None:
        """Write ``chunks`` (see the Link contract).  A failed write fails this send and every
        later one, but not the receiving side: a peer that closed (or reset the connection) may
        have sent its last bytes and its CLOSE before, and those are still read, in order.

        Cancellation never leaves a cut frame on the wire for the next send to complete with
        its own bytes.  Cancelled before its first byte left, a send wrote nothing.  Cancelled
        after, on a plain TCP stream: the rest of its bytes (copied) go first with the next
        write -- another send, a reader's answer, or the close -- so the peer receives that
        message whole, as asyncio's ``write`` would have queued it.  On other streams (TLS: a
        record may be cut inside the TLS layer) the connection is broken for every sender with
        an error that says so; receiving goes on."""
        if self._send_error is not None:
            raise self._broken_send(self._send_error)
        if len(chunks) > 1 and sum(len(c) for c in chunks) <= RECEIVE_SIZE:
            chunks = [b"".join(chunks)]
        try:
            async with self._send_lock:
                if self._send_error is not None:  # (a sender before us was cut)
                    raise self._broken_send(self._send_error)
                if self._dead is not None:
                    raise self._dead
                queued = len(self._outbox)
                if queued:  # (answers queued while fed, or a cancelled send's rest, go first)
                    chunks = [*self._outbox, *chunks]
                    self._outbox = []
                watch = self._window
                if watch is None:
                    if self._raw is not None:
                        await self._write_socket(chunks, queued)
                    else:
                        await self._write_stream(chunks, queued)
                    return
                if watch.state is _IDLE:
                    self._wrote(watch)
                try:
                    if self._raw is not None:
                        await self._write_socket(chunks, queued)
                    else:
                        await self._write_stream(chunks, queued)
                finally:
                    if watch.state is _KERNEL:
                        self._leave(watch)
        except (BrokenResourceError, ClosedResourceError, OSError) as exc:
            if self.core.closed:
                raise ClosedResourceError from exc
            self._send_error = exc
            raise self._broken_send(exc) from exc

    async def _write_socket(self, chunks: Sequence[Chunk], queued: int) -> None:
        """Write ``chunks`` to the plain socket, non-blocking, waiting while it is full.  On
        cancellation, what did not leave goes back to the front of the outbox: all of it once a
        byte left (a frame is never cut), else only the first ``queued`` chunks (the outbox's)."""
        sock = self._raw
        await anyio.lowlevel.checkpoint()  # (a send always yields, also when the socket takes it all)
        index = 0
        view = memoryview(b"")
        started = False
        try:
            for index, chunk in enumerate(chunks):
                view = memoryview(chunk).cast("B")
                while view:
                    try:
                        sent = sock.send(view)
                    except (BlockingIOError, InterruptedError):
                        await self._wait_writable(sock)
                        continue
                    started = True
                    view = view[sent:]
        except anyio.get_cancelled_exc_class():
            if started:
                rest = [bytes(view)] if view else []
                self._outbox[0:0] = rest + [bytes(c) for c in chunks[index + 1 :]]
            else:
                self._outbox[0:0] = list(chunks[:queued])
            raise

    async def _write_stream(self, chunks: Sequence[Chunk], queued: int) -> None:
        """Write ``chunks`` to a stream.  A stream whose ``send`` is atomic (``atomic_sends``:
        an item goes whole or not at all, as the in-memory pipe's) keeps a cancelled frame whole
        as the socket path does; on any other (TLS: a record may be cut inside the TLS layer),
        a cancellation once a write began breaks the connection's sending side (see ``send``)."""
        done = 0
        try:
            for chunk in chunks:
                await self.stream.send(chunk)  # type: ignore[arg-type]
                done += 1
        except anyio.get_cancelled_exc_class():
            if getattr(self.stream, "atomic_sends", False):
                rest = chunks[done:] if done else chunks[:queued]
                self._outbox[0:0] = [bytes(c) for c in rest]
            else:  # (a write began: it may have been cut)
                self._send_error = BrokenResourceError(
                    "a send was cancelled in the middle of its frame; this stream (TLS) cannot finish it, so "
                    "nothing more can be sent on this connection"
                )
            raise

    async def _half_close(self) -> None:
        """The peer's CLOSE came: end our half (see ``AsyncioLink._half_close``)."""
        self._eof_sent = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            try:
                async with self._send_lock:
                    await self.stream.send_eof()
            except (BrokenResourceError, ClosedResourceError, OSError, NotImplementedError) as exc:
                log.debug("aiordma: could not half-close after the peer's CLOSE: %r", exc)

    async def _linger(self) -> None:
        """After our CLOSE: end our half, and read (dropping it) until the peer's half ends or its
        kernel acknowledged everything we sent (see :class:`_Linger`), as long as the peer is
        alive.  Raises ``BrokenResourceError`` when the peer may not have everything: the window
        watch found its host dead, or the connection was reset or timed out first.
        Cancellable: the caller aborts then."""
        try:
            async with self._send_lock:
                await self.stream.send_eof()
            self._eof_sent = True
        except NotImplementedError:
            pass  # (TLS has no half-close: the linger ends on the ACKs, or the peer's end)
        except (BrokenResourceError, ClosedResourceError, OSError):
            return
        attrs: Mapping[Any, Callable[[], Any]] = self.stream.extra_attributes
        get_sock = attrs.get(SocketAttribute.raw_socket)
        if get_sock is None:
            return  # (not a socket: an in-memory pipe cannot reset what it carried)
        sock = get_sock()
        linger = _Linger()
        watch = self._window
        if watch is not None and watch.state is _IDLE:
            self._wrote(watch)  # (it judges the peer while it has bytes of ours to take)
        look_at = anyio.current_time() + linger.tick
        while not self.ended:
            with anyio.move_on_after(look_at - anyio.current_time()):
                async with self._receive_lock:  # (a reader still in wait_incoming gets the end first)
                    if self.ended:
                        return
                    try:
                        data = await self.stream.receive(RECEIVE_SIZE)
                    except EndOfStream:
                        self.ended = True
                        return
                    except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                        self.ended = True
                        if self.core.peer_close is None:  # (a reset purges what the kernel held)
                            raise closing_failed(exc) from exc
                        return
                    finally:
                        self._feeds += 1
                    self.core.feed(data)  # (parsed -- the peer's CLOSE -- and dropped)
                if anyio.current_time() < look_at:
                    continue  # (bytes keep coming: read on until the look is due)
            if linger.look(unacknowledged(sock)):
                return
            look_at = anyio.current_time() + linger.tick
            if watch is not None:
                try:
                    self._look()
                except OSError as exc:  # (the watch: the peer's host is dead)
                    raise closing_failed(exc) from exc

    async def aclose(self, final: bytes) -> None:
        if self.closed:
            return
        self.closed = True
        delivered = False
        try:
            if final:
                try:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
                        async with self._send_lock:
                            if self._send_error is None:
                                # (a cancelled send's rest, and answers queued while fed, first)
                                chunks, self._outbox = [*self._outbox, final], []
                                await self.stream.send(b"".join(chunks))
                                delivered = True
                except (BrokenResourceError, ClosedResourceError, EndOfStream, OSError) as exc:
                    log.debug("could not send CLOSE: %r", exc)  # (TLS: EndOfStream once the peer's end came)
                if delivered and not self.ended:
                    await self._linger()
        finally:
            await self._release()

    async def _release(self) -> None:
        with anyio.CancelScope(shield=True):
            closed = False
            with anyio.move_on_after(CLOSE_TIMEOUT):
                try:
                    await self.stream.aclose()
                    closed = True
                except (BrokenResourceError, ClosedResourceError, EndOfStream, OSError) as exc:
                    # (TLS: the peer's end came during the unwrap -- EndOfStream)
                    log.debug("closing the stream failed: %r", exc)
            if not closed:
                await anyio.aclose_forcefully(self.stream)

    def hand_over(self, io: IOBackend, on_control: Callable[[bytes | None], None]) -> Watch | None:
        """Watch the raw socket: nothing reads the stream any more; what it still carries (a
        goodbye, stray bytes) or its end goes to ``on_control`` (read here, without blocking)."""
        import socket

        attrs: Mapping[Any, Callable[[], Any]] = self.stream.extra_attributes
        get_sock = attrs.get(SocketAttribute.raw_socket)
        if get_sock is None:
            raise NotImplementedError("this stream has no socket to watch for liveness")
        sock = get_sock()
        watch: Watch | None = None

        def readable() -> None:
            nonlocal watch
            try:
                data: bytes | None = sock.recv(256, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = None
            if not data:
                data = None
                if watch is not None:
                    watch.close()  # (an ended socket stays readable)
            on_control(data)

        watch = io.watch(int(sock.fileno()), readable)
        return watch

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.stream.extra_attributes


async def open_tcp_link(
    host: str, port: int, make_protocol: Callable[[float], Connection], *, ssl: Any = None,
    server_hostname: str | None = None, keepalive: float | None = None,
) -> Link:
    """Connect over TCP (TLS with ``ssl``): the link of this event loop (asyncio: an
    :class:`AsyncioLink`; trio: a :class:`StreamLink` on anyio's socket) with a Core on the
    protocol object ``make_protocol(now)`` makes, and ``keepalive`` set (:func:`set_keepalive`)."""
    link: Link
    loop = asyncio_loop()
    if loop is not None:
        proto = make_protocol(loop.time())
        _, link = await loop.create_connection(
            lambda: AsyncioLink(proto, loop), host, port, ssl=ssl,
            server_hostname=server_hostname if ssl is not None else None,
        )  # fmt: skip
    else:
        stream: ByteStream
        stream = await anyio.connect_tcp(host, port)
        if ssl is not None:
            try:
                stream = await wrap_tls(stream, server_side=False, ssl_context=ssl, hostname=server_hostname or host)
            except BaseException:
                await anyio.aclose_forcefully(stream)
                raise
        link = StreamLink(stream, make_protocol(anyio.current_time()))
    set_keepalive(link, keepalive)
    return link


if TYPE_CHECKING:  # mypy holds the links to the interfaces they serve

    def _nowait(link: AsyncioLink) -> NowaitLink:
        return link
