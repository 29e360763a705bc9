"""The asyncio link: an ``asyncio.BufferedProtocol`` on a TCP (or TLS) transport.

The kernel's bytes are received straight into the protocol's buffer (``get_buffer``/
``buffer_updated``), no ``StreamReader`` in between.  Used under asyncio and uvloop by every front
end.  With :mod:`aiordma._tcp.stream_link`, the one boundary where OS and transport errors become
the Core's error.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from anyio import BrokenResourceError

from .._conn.core import RECEIVE_HIGH_WATER, ControlLink, Core
from .._conn.nowait import NowaitLink, PassedThrough
from .._errors import HandshakeError, ProtocolError
from .._io.backends import IOBackend, Watch
from .._proto.protocol import Chunk, CloseCode, Connection
from .common import CLOSE_TIMEOUT, Linger, closing_failed, ignore_control, receive_scratch, socket_attributes, unacknowledged, write_chunks
from .window import State as _WatchState
from .window import WindowWatch, apply_user_timeout, read_sample, set_user_timeout

__all__ = ["AsyncioLink"]

log = logging.getLogger("aiordma")


_IDLE = _WatchState.IDLE

#: a send larger than this writes its frames to the socket itself (see ``_send_paced``)
PACE = 256 << 10
#: at most this many buffers per gathered write (the kernel's IOV_MAX)
_IOV_MAX = 1024


class _Pace:
    """The frames of a paced send not handed to the kernel yet (views of the caller's buffers),
    and the future its sender waits on (the socket writable, or the pace ended)."""

    __slots__ = ("rest", "waiter", "failed")

    def __init__(self, rest: list[memoryview]) -> None:
        self.rest = rest
        self.waiter: asyncio.Future[None] | None = None
        #: a write failed (the transport meets the error too, and reports the connection's end)
        self.failed = False

    def consume(self, sent: int) -> None:
        """The kernel took ``sent`` bytes from the front."""
        rest = self.rest
        while sent and rest:
            view = rest[0]
            if view.nbytes <= sent:
                sent -= view.nbytes
                rest.pop(0)
            else:
                rest[0] = view[sent:]
                sent = 0

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class AsyncioLink(asyncio.BufferedProtocol, ControlLink):
    # plain attributes here (read-only properties on the Link interface)
    transport: asyncio.BaseTransport | None = None
    tcp_writer: asyncio.Transport | None = None
    #: the plain TCP socket's descriptor (-1: none, or TLS)
    fd: int = -1
    paused_writing: bool = False
    lost: bool = False
    #: large sends are paced (see _send_paced): plain sockets under asyncio's own transport
    _paces: bool = False
    #: readers call consumed() only while reading is paused (it resumes reading below the low mark)
    needs_consumed: bool = False
    #: the connection passed through and the link carries its bytes unframed (see unframe)
    unframed: bool = False
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
        self._linger: Linger | None = None  # closing in order: our CLOSE is out, waiting for the peer's end
        self._close_error: BrokenResourceError | None = None  # the peer may not have everything (wait_closed)
        self._abort_after_linger = False  # (TLS: see close_nowait)
        self._window: WindowWatch | None = None  # (set_keepalive): slow is not dead
        self._window_sock: Any = None
        self._window_timer: asyncio.TimerHandle | None = None
        self._pace: _Pace | None = None  # a large send writing its frames itself (see _send_paced)
        self._passed_eof = False  # passed through: the peer's EOF came before the handover
        self._in_order = False  # unframed: a _ClosingInOrder is closing the connection
        self._lost_error: Exception | None = None
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
            # reads into one buffer per thread while the connection holds nothing unparsed: the
            # transport calls get_buffer and buffer_updated back to back (issue 23: an idle
            # connection holds no receive buffer)
            self._proto.share_receive_buffer(receive_scratch())
            # large sends pace on asyncio's own transport only: uvloop's drops what the kernel
            # still holds unread when a write fails (the peer closed after our kernel took its
            # CLOSE), and a paced send writes on after the peer's CLOSE came -- the reader then
            # saw the write's EPIPE instead of the CLOSE (test_close, uvloop, 7 in 15 runs)
            self._paces = type(transport).__module__ == "asyncio.selector_events"
        else:
            # TLS: at the peer's end, asyncio's and uvloop's TLS protocols read what they hold
            # once more, into one view, and drop what does not fit it: lend no small views
            self._proto.lend_exact = False
        if self.fd < 0 and transport.get_extra_info("uvloop.sslproto") is not None:
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
                elif self._proto.passed_through and not self._paused_reading:
                    self._pause_reading()  # (what comes is the data's: it waits in the kernel until the handover)
            if core.closed:
                core.discard()  # (lingering after our CLOSE: what comes is dropped)
            # DATA went into core.rbuf without events: check the level every time
            elif not self._paused_reading and core.rbuf.nbytes + core.messages.nbytes > RECEIVE_HIGH_WATER:
                self._pause_reading()
        listener = self.listener
        if listener is not None:
            listener()
            return
        fut = self._waiter  # self._wake(), inlined
        if fut is not None and not self._proto.partial:  # (partial: a long message goes on landing)
            self._waiter = None
            if not fut.done():
                fut.set_result(None)
            if self._waiters:
                self._wake_more()

    def eof_received(self) -> bool:
        if self._on_control is not None:
            self._control_ended()
            return False
        if self._proto.passed_through:
            # the data's end: the new protocol's at the handover, or (unframed) the stream's EOF
            self._passed_eof = True
            core = self.core
            if not core.closed:
                core.feed_eof()
                self._wake()
            return True  # (the transport stays: our half may still send, and a close lingers)
        core = self.core
        if not core.closed:
            core.feed_eof()
        self._wake()
        return False  # (asyncio closes the transport: lingering after our CLOSE, that is its end)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._lost_error = exc
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
        if self._pace is not None:
            self._pace.wake()  # (a paced send waiting for the socket: it is gone)
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
                if self.unframed:
                    self.core.rbuf += data
                else:
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
        watch.begin(read_sample(sock))

    def written(self, nbytes: int | None = None) -> None:
        """``nbytes`` (None: some) went to the transport: start looking, if the watch rested --
        unless they fit in its room, or a sample taken now finds room again (no timer of ours
        waits in the loop meanwhile).  Every writer of ``tcp_writer`` calls this (one attribute
        test when the watch already looks)."""
        watch = self._window
        if watch is None or self._window_timer is not None or self.lost:
            return
        if nbytes is not None and watch.state is _IDLE:
            writer = self.tcp_writer
            pending = writer.get_write_buffer_size() if writer is not None else 0
            if watch.wrote_within(nbytes) or watch.resample(read_sample(self._window_sock), pending):
                return
        elif not watch.wrote():
            return
        self._window_timer = self._loop.call_later(watch.tick, self._look)

    def _look(self) -> None:
        self._window_timer = None
        watch = self._window
        if watch is None or self.lost:
            return
        step = watch.look(read_sample(self._window_sock), self._loop.time())
        apply_user_timeout(self._window_sock, watch, step)
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

    @property
    def can_pass_through(self) -> bool:
        """A plain socket (not TLS): its transport can take another protocol after the handshake."""
        return self.fd >= 0 and not self.lost

    def pass_through(self, protocol: asyncio.BaseProtocol) -> PassedThrough:
        """The connection passed through: ``protocol`` is the transport's from now on (see
        :class:`~aiordma._conn.nowait.PassThroughLink`); this link and its Core are done."""
        transport = self.tcp_writer
        if transport is None or not self._proto.passed_through:
            raise RuntimeError("the connection did not pass through")
        sock, watch = self._take_watch()
        self.listener = self.write_listener = None
        self._on_made = None
        first = self._proto.take_passed()
        self.core.closed = True  # (nothing reads or writes through the Core any more)
        if watch is not None:  # (keepalive set the user timeout)
            # no watch looks at the window any more: the user timeout must not end a connection
            # whose reader only paused (keepalive probes still find a dead host while idle; with
            # bytes unacknowledged TCP's retransmission timeout does, as for asyncio's transport)
            set_user_timeout(sock, 0)
        if not self.lost:
            transport.set_protocol(protocol)

        def close_in_order(done: Callable[[Exception | None], None]) -> None:
            _ClosingInOrder(transport, sock, watch, self._loop, done).start()

        return PassedThrough(transport, first, self._passed_eof, self.lost, self._lost_error, self._paused_reading,
                             close_in_order)  # fmt: skip

    def unframe(self) -> None:
        """The connection passed through: this link carries its bytes unframed from now on (see
        :class:`~aiordma._conn.nowait.PassThroughLink`).  The transport's protocol becomes
        :class:`_Unframed`: each read's ``bytes`` goes into the Core's ``rbuf`` as it is (no
        copy of ours, no parser); writes go as the protocol returns them (unframed); a close
        lingers after a FIN as a framed close does; the window watch keeps judging slow from
        dead."""
        if not self._proto.passed_through or self.unframed:
            raise RuntimeError("the connection did not pass through, or is unframed already")
        self.unframed = True
        core = self.core
        first = self._proto.take_passed()
        if first and not core.closed:
            core.rbuf += first
        transport = self.tcp_writer
        if transport is not None and not self.lost:
            transport.set_protocol(_Unframed(self))
        if self._paused_reading and core.buffered <= RECEIVE_HIGH_WATER // 4:
            self._resume_reading()  # (paused at the SELECT until this handover)

    def _unframed_data(self, data: bytes) -> None:
        """Unframed: one read's bytes (``_Unframed.data_received``)."""
        core = self.core
        if core.closed:
            return  # (lingering after our close: what comes is dropped)
        rbuf = core.rbuf
        rbuf += data
        if not self._paused_reading and rbuf.nbytes > RECEIVE_HIGH_WATER:
            self._pause_reading()
        self._wake()

    def _closing_in_order(self, transport: asyncio.Transport, done: Callable[[Exception | None], None],
                          eof_sent: bool) -> None:  # fmt: skip
        """Unframed: close in order (:class:`_ClosingInOrder`, the window watch going with it)."""
        sock, watch = self._take_watch()
        self._paused_reading = self.needs_consumed = False  # (the close reads on: see _ClosingInOrder)
        _ClosingInOrder(transport, sock, watch, self._loop, done, eof_sent=eof_sent).start()

    def _take_watch(self) -> tuple[Any, WindowWatch | None]:
        """The socket and the window watch, for a close in order that takes them over: this
        link's looks stop (the socket is the transport's, if no watch had it)."""
        if self._window_timer is not None:
            self._window_timer.cancel()
            self._window_timer = None
        sock, watch = self._window_sock, self._window
        self._window = self._window_sock = None
        if sock is None and self.tcp_writer is not None:
            sock = self.tcp_writer.get_extra_info("socket")
        return sock, watch

    def _closed_in_order(self, error: Exception | None) -> None:
        """Unframed, closing in order: done (``error``: why the peer may not have everything)."""
        if error is not None and self._close_error is None:
            self._close_error = closing_failed(error)
        self.connection_lost(error)

    def end_half(self) -> None:
        """Unframed: end our half after what is queued (the stream's EOF is TCP's FIN)."""
        if self._pace is not None:
            self._flush_pace()
        writer = self.tcp_writer
        if writer is None or writer.is_closing():
            raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")
        if not self._eof_sent:
            self._eof_sent = True
            writer.write_eof()

    def hand_over(self, io: IOBackend, on_control: Callable[[bytes | None], None]) -> Watch | None:
        # from now on the socket's bytes go to the RDMA link, not to the protocol object (they
        # still land in its lent buffer: uvloop keeps the get_buffer it found at the start)
        self._on_control = on_control
        return None

    def _control_ended(self) -> None:
        on_control, self._on_control = self._on_control, ignore_control
        if on_control is not None:
            on_control(None)

    def _half_close(self) -> None:
        """The peer's CLOSE came: it reads no more, and neither will we send; end our half (after
        what is queued), so that the peer's lingering close sees our FIN instead of waiting."""
        if self._pace is not None:
            self._flush_pace()
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
        if self._pace is not None:
            self._flush_pace()
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
        if self._pace is not None:
            self._flush_pace()
        writer = self.tcp_writer
        if writer is None or writer.is_closing():
            raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")
        if len(chunks) == 1 and type(chunks[0]) is bytes:
            writer.write(chunks[0])
        else:
            write_chunks(writer, chunks, self.fd)
        if self._window_timer is None and (watch := self._window) is not None:
            n = len(chunks[0]) if len(chunks) == 1 else sum(map(len, chunks))  # (byte views: len counts bytes)
            if watch.state is _IDLE and watch.room > n:
                watch.room -= n  # (WindowWatch.wrote_within, inline: they fit, nothing to do)
            else:
                self.written(n)

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
        if self._pace is not None:
            self._flush_pace()  # (another send's paced frames go first, whole)
        if len(chunks) > 1 and self._paces and not self.paused_writing:
            writer = self.tcp_writer
            if (
                writer is not None
                and writer.get_write_buffer_size() == 0
                and sum(len(c) for c in chunks) > PACE
                and not writer.is_closing()
            ):
                await self._send_paced(chunks)
                return
        self.write_nowait(chunks)
        if self.paused_writing:
            await self.drain()
            if self.lost:
                raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")

    # -- large sends, paced: the caller's buffer goes to the kernel, not into the transport ------
    #
    # asyncio's transport copies what the kernel does not take at once into its own buffer (and
    # uvloop's and 3.12's keep a reference, which write_chunks turns into a copy): a 64 MiB send
    # was copied almost whole.  A send larger than PACE instead writes its frames to the socket
    # itself (writev), as much as the kernel takes, and the rest from the loop's callback each
    # time the socket is writable again (the send wakes once, when all went) -- watching a
    # duplicate of its descriptor, which the loop lets us watch (it refuses a transport's own)
    # and which lives only while the send waits, so it never keeps a closed connection open.
    # Nothing is copied (before, each 256 KiB piece went through the transport and what the
    # kernel refused of it was copied: 928 KB of a 24 MiB send to a late reader).
    # The caller's buffer is the send's until it returns.  Frames stay whole: any other write
    # meanwhile (another send, an answer, the close) first hands the rest of the paced frames to
    # the transport (copied), and the send returns; so does a cancellation.

    async def _send_paced(self, chunks: Sequence[Chunk]) -> None:
        try:
            sent = os.writev(self.fd, chunks if len(chunks) <= _IOV_MAX else chunks[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self.write_nowait(chunks)  # (the transport reports the connection's end itself)
            return
        if self._window_timer is None:
            self.written()
        pace = _Pace([memoryview(chunk) for chunk in chunks])
        pace.consume(sent)
        if not pace.rest:
            await self.core.checkpoint()  # (a send yields, also when the kernel took it all)
            return
        if self.lost:
            raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")
        # the rest is written by the loop's writability callback (_write_paced), as the socket
        # takes it: one pass of the loop per write, and the send wakes once, at the end
        self._pace = pace
        loop = self._loop
        watched = os.dup(self.fd)
        waiter = pace.waiter = self._create_future()
        loop.add_writer(watched, self._write_paced, pace)
        try:
            await waiter
        except BaseException:
            if self._pace is pace:
                self._flush_pace()  # (the frames stay whole: their rest goes, copied)
            raise
        finally:
            pace.waiter = None
            loop.remove_writer(watched)
            os.close(watched)
            if self._pace is pace:
                self._pace = None
        if pace.failed and not self.lost:
            await self.core.checkpoint()  # (the transport's end comes in this pass: the send says so)
        if self.lost:
            raise self.core.broken() if self.core.error else BrokenResourceError("the connection was lost")

    def _write_paced(self, pace: _Pace) -> None:
        """The socket is writable while ``pace`` has frames left: write what it takes; wake the
        send when all went (or the pace ended: another write flushed it, or the connection)."""
        if self._pace is not pace or self.lost:
            pace.wake()
            return
        try:
            sent = os.writev(self.fd, pace.rest[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pace.failed = True
            self._flush_pace()  # (the transport meets the error and reports the end; wakes the send)
            return
        pace.consume(sent)
        if self._window_timer is None:
            self.written()
        if not pace.rest:
            pace.wake()

    def _flush_pace(self) -> None:
        """Another write comes while a paced send is on: the rest of its frames go first (copied
        into the transport); the send returns when it next wakes."""
        pace, self._pace = self._pace, None
        writer = self.tcp_writer
        if pace is not None:
            if pace.rest and writer is not None and not writer.is_closing():
                writer.write(b"".join(pace.rest))
            pace.rest.clear()
            pace.wake()

    def close_nowait(self, final: bytes) -> None:
        """Write ``final`` (our CLOSE) and start closing in order.

        With a CLOSE to deliver, the connection lingers (:class:`Linger`): our half ends after
        what is queued (a FIN), and reading goes on -- what arrives is dropped -- until the
        peer's half ends too (it does when it parses our CLOSE) or its kernel acknowledged all we
        sent: the socket never closes while the peer's kernel has yet to take bytes of ours (a
        close with unread bytes resets the connection, and the reset drops what is in flight).
        A slow reader is waited for as long as its host is alive (the window watch judges).
        :meth:`wait_closed` waits for it.  Without a CLOSE (the peer closed first, or the
        connection failed) the transport just closes (it flushes first)."""
        if self._pace is not None:
            self._flush_pace()
        writer = self.tcp_writer
        if writer is not None and not writer.is_closing():
            if final:
                writer.write(final)
            tls = writer.get_extra_info("ssl_object") is not None and writer.get_extra_info("socket") is not None
            if self.unframed:
                # no CLOSE to deliver, but the data: it closes in order all the same (also after
                # the user's own write_eof: a socket closed with unread bytes resets), on timers
                # of its own -- a stream's close may never be waited for
                self._in_order = True
                eof_sent, self._eof_sent = self._eof_sent, True
                self._closing_in_order(writer, self._closed_in_order, eof_sent)
            elif final and self._on_control is None and not self._eof_sent and (tls or writer.can_write_eof()):
                self._linger = Linger()
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
        self._pace = None  # (nothing more goes out)
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
                    # (closing in order unframed: its own timers end it, however long it takes)
                    timeout = linger.tick if linger is not None else None if self._in_order else CLOSE_TIMEOUT
                    await asyncio.wait_for(asyncio.shield(self._closed_future), timeout)
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
        return socket_attributes(transport.get_extra_info)


if TYPE_CHECKING:  # mypy holds the link to the interface asyncio's front ends use

    def _nowait(link: AsyncioLink) -> NowaitLink:
        return link


class _Unframed(asyncio.Protocol):
    """The transport's protocol once an :class:`AsyncioLink` carries its stream unframed
    (``AsyncioLink.unframe``): the transport calls the link's own methods, bound here (no call
    of ours in between)."""

    def __init__(self, link: AsyncioLink) -> None:
        self.data_received = link._unframed_data  # type: ignore[method-assign]
        self.eof_received = link.eof_received  # type: ignore[method-assign]
        self.connection_lost = link.connection_lost  # type: ignore[method-assign]
        self.pause_writing = link.pause_writing  # type: ignore[method-assign]
        self.resume_writing = link.resume_writing  # type: ignore[method-assign]


class _ClosingInOrder(asyncio.Protocol):
    """A passed-through connection's close, in order: the transport's protocol from the user's
    ``close()`` on (see :class:`Linger`, and ``AsyncioLink.close_nowait`` for the framed close).

    Our half ends after what is queued (``write_eof``: a FIN after the data); reading goes on and
    what comes is dropped (a socket closed with unread bytes resets the connection, and the reset
    drops what is in flight); the socket closes once the peer's kernel acknowledged every byte we
    sent -- however long a live reader takes: the window watch, when the connection has one
    (``keepalive``), tells a slow reader from a dead host.  Then ``done(error)``: None, or why
    the peer may not have everything (its host was found dead, it reset the connection)."""

    def __init__(self, transport: asyncio.Transport, sock: Any, watch: WindowWatch | None,
                 loop: asyncio.AbstractEventLoop, done: Callable[[Exception | None], None],
                 eof_sent: bool = False) -> None:  # fmt: skip
        self._eof_sent = eof_sent  # (our half ended already: the user's write_eof)
        self._transport = transport
        self._sock = sock
        self._watch = watch
        self._loop = loop
        self._done: Callable[[Exception | None], None] | None = done
        self._linger = Linger()
        self._timer: asyncio.TimerHandle | None = None
        self._error: Exception | None = None

    def start(self) -> None:
        transport = self._transport
        transport.set_protocol(self)
        if transport.is_closing() or not transport.can_write_eof() or self._sock is None:
            transport.close()  # (nothing to linger on: asyncio's own close)
            return
        try:
            if not self._eof_sent:
                transport.write_eof()
            transport.resume_reading()
        except (OSError, RuntimeError):  # (the connection is ending already)
            transport.close()
            return
        self._timer = self._loop.call_later(self._linger.tick, self._look)

    def data_received(self, data: bytes) -> None:
        pass  # (this side closed: what comes is dropped, as the framed close drops it)

    def eof_received(self) -> bool:
        return True  # (the peer's end: the linger still waits for its kernel's ACKs)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        done, self._done = self._done, None
        if done is not None:
            done(self._error or exc)

    def _look(self) -> None:
        self._timer = None
        transport = self._transport
        if transport.is_closing():
            return
        outstanding = transport.get_write_buffer_size() + unacknowledged(self._sock)
        if self._linger.look(outstanding):
            transport.close()  # (all acknowledged: connection_lost follows)
            return
        watch = self._watch
        if watch is not None:
            watch.wrote()  # (bytes wait for the peer: the watch looks, if it rested)
            step = watch.look(read_sample(self._sock), self._loop.time())
            apply_user_timeout(self._sock, watch, step)
            if step.dead is not None:
                log.info("aiordma: %s", step.dead)
                self._error = step.dead
                transport.abort()
                return
        self._timer = self._loop.call_later(self._linger.tick, self._look)

