"""The pull link: the aiordma protocol over any ``anyio.abc.ByteStream``.

trio's sockets (through anyio), TLS streams, the in-memory streams of :mod:`aiordma.testing`.  It
pulls: a task that waits for data reads from the stream itself, so nothing runs in the background.
With :mod:`aiordma._tcp.asyncio_link`, the one boundary where OS and anyio transport errors become
the Core's error (and so ``BrokenResourceError`` on the anyio API).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.abc import ByteStream, SocketAttribute, SocketStream

from .._conn.core import ControlLink, Core
from .._errors import HandshakeError, ProtocolError
from .._io.backends import IOBackend, Watch
from .._proto.protocol import Chunk, CloseCode, Connection
from .common import CLOSE_TIMEOUT, RECEIVE_SIZE, Linger, closing_failed, receive_scratch, unacknowledged
from .window import State, Step, WindowWatch, apply_user_timeout, read_sample

__all__ = ["StreamLink", "SocketWriter", "wrap_tls"]

log = logging.getLogger("aiordma")

_IDLE, _KERNEL = State.IDLE, State.KERNEL
#: the most buffers one sendmsg takes (Linux's UIO_MAXIOV is 1024)
_IOV_MAX = 512


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
        # as trio's own socket sends: a cancel point before, a schedule point after the bytes went
        await anyio.lowlevel.checkpoint_if_cancelled()
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
        await anyio.lowlevel.cancel_shielded_checkpoint()

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


class StreamLink(ControlLink):
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
        self._yield_after_feed = False  # (a read found its bytes at once: see _pull)
        if self._raw is not None:
            # reads go into one buffer per thread while nothing is held unparsed (issue 23): the
            # read and its parse run with no schedule point between them (_pull, wait_incoming)
            proto.share_receive_buffer(receive_scratch())
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
                    data = await self._pull()
                elif watch.state is _IDLE and not self._duplex:  # (nothing to look at: no scope)
                    self._plain_reader = True
                    try:
                        data = await self._pull()
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
                if self._yield_after_feed:  # (the read's schedule point, after its parse: others run)
                    self._yield_after_feed = False
                    await anyio.lowlevel.cancel_shielded_checkpoint()
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
        watch.begin(read_sample(sock))

    def _apply(self, step: Step) -> None:
        watch = self._window
        assert watch is not None
        apply_user_timeout(self._window_sock, watch, step)
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

    async def _pull(self) -> bytes | int:
        """Read what the peer sent: on a plain TCP socket straight into the protocol's buffer
        (``get_buffer``; returns the count, for ``Core.feed``), so that a long message lands
        where its reader wants it with no copy in between; else ``bytes`` from the stream.

        As trio's own ``receive``: a cancel point before the read, none after it (what was read
        is fed, whatever happens)."""
        sock = self._raw
        if sock is None:
            return await self.stream.receive(RECEIVE_SIZE)
        await anyio.lowlevel.checkpoint_if_cancelled()
        get_buffer = self.core.proto.get_buffer
        waited = False
        while True:
            if sock.fileno() < 0:
                raise ClosedResourceError
            view = get_buffer(-1)
            try:
                n: int = sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                del view
                await anyio.wait_readable(sock)
                waited = True
                continue
            del view
            if not n:
                raise EndOfStream
            # (a schedule point comes after the parse -- see wait_incoming -- not here: the bytes
            # may be in the thread's shared receive buffer, which another connection's read
            # would overwrite; see Connection.share_receive_buffer)
            self._yield_after_feed = not waited
            return n

    async def _watched_receive(self, watch: WindowWatch) -> bytes | int:
        """A reader's wait in a scope whose deadline brings it back to look while the watch looks."""
        try:
            while True:
                with anyio.CancelScope() as scope:
                    self._receive_scope = scope
                    if watch.looking:
                        scope.deadline = anyio.current_time() + watch.tick
                    try:
                        return await self._pull()
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
        if self._raw is None and len(chunks) > 1 and sum(len(c) for c in chunks) <= RECEIVE_SIZE:
            chunks = [b"".join(chunks)]  # (a stream's send per chunk: one TLS record, not two)
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
        sock = self._raw  # (the send's schedule point is the Core's, after it: Core.send_data)
        # one gathered write (sendmsg) for all of them: header and payload, never joined
        views = [memoryview(c).cast("B") if type(c) is not bytes else memoryview(c) for c in chunks]
        index = 0
        started = False
        try:
            while index < len(views):
                try:
                    sent = sock.sendmsg(views[index : index + _IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    await self._wait_writable(sock)
                    continue
                started = True
                while sent:
                    n = views[index].nbytes
                    if sent < n:
                        views[index] = views[index][sent:]
                        break
                    sent -= n
                    index += 1
                while index < len(views) and not views[index].nbytes:
                    index += 1
        except anyio.get_cancelled_exc_class():
            if started:
                self._outbox[0:0] = [bytes(v) for v in views[index:]]
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
        kernel acknowledged everything we sent (see :class:`Linger`), as long as the peer is
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
        linger = Linger()
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
