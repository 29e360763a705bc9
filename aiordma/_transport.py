"""asyncio's Transport/Protocol API over an aiordma connection (``aiordma.asyncio``).

:class:`AiordmaTransport` is an ``asyncio.Transport`` on a :class:`~aiordma._conn.core.Core`, TCP or
RDMA alike.  It calls its protocol as asyncio's own TCP transport does:

* ``connection_made(transport)`` first (before ``create_connection`` returns; on a server, once
  the aiordma handshake completed);
* ``data_received(bytes)`` -- or, for an ``asyncio.BufferedProtocol``, ``get_buffer(n)`` then
  ``buffer_updated(nbytes)`` -- for received stream bytes, in order, never while reading is
  paused;
* ``eof_received()`` once when the peer ended its side (``write_eof``/``close``); a falsy
  return closes the transport, a true one keeps it open for writing;
* ``pause_writing()`` / ``resume_writing()`` around the write-buffer high and low marks;
* ``connection_lost(exc)`` exactly once, last: ``None`` after ``close()``/``abort()`` or an
  orderly end, a ``ConnectionResetError`` (its ``__cause__`` the aiordma error) when the
  connection failed -- also when, after ``close()``, the peer may not have everything (its host
  died or it reset the connection before its kernel took what was written).

Theory of operation
-------------------
The transport does not run a task per connection.  On TCP the link (an asyncio protocol itself)
calls :meth:`AiordmaTransport._wake` right after it fed the Core (``Nowait.set_callbacks``) -- inside the socket's read
callback, where asyncio's transport calls ``data_received`` too.  The RDMA link wakes its waiters
from inside the completion handler, where no user code may run: there the transport waits like
any reader, on the future of ``Nowait.incoming()``, and delivers from that future's callback (one
loop turn later, outside the handler).  Bytes pass from the Core's receive buffer to the protocol
with one copy (into ``bytes``, or into the ``BufferedProtocol``'s buffer).

The transport talks to the Core and to its non-blocking API (:mod:`aiordma._conn.nowait`), never
to a link.  Writing never blocks: ``write`` frames the bytes and queues them on the link.  On TCP the write
buffer and its limits are the TCP transport's; on RDMA they are the bytes queued but not yet
posted to the send queue (the NIC owns what was posted).  Writes go through the SEND slots; a
write is never turned into a rendezvous here (that needs an await).

Closing: ``close()`` sends aiordma's CLOSE after what was written, releases the link (on RDMA:
QP to error, flushes drained, memory deregistered) and then calls ``connection_lost(None)``;
``abort()`` drops what was not sent and calls it at once (the link is released in the
background by its own, owned teardown).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

import anyio

from ._conn.stats import connection_stats
from ._conn.core import Core
from ._conn.nowait import Nowait, PassedThrough
from ._proto.protocol import Half, Mode

__all__ = ["AiordmaTransport", "PassedTransport", "extra_info", "reset_error"]

log = logging.getLogger("aiordma")

_DEFAULT_HIGH = 64 << 10


def reset_error(core: Core) -> ConnectionResetError:
    """The ``ConnectionResetError`` asyncio's API raises for a broken connection (its cause: why)."""
    err = ConnectionResetError(f"the connection is broken: {core.error}")
    err.__cause__ = core.error
    return err


def extra_info(core: Core, now: Nowait, name: str, default: Any = None) -> Any:
    """``get_extra_info`` of aiordma's asyncio objects: ``"aiordma_transport"`` (``"tcp"`` or
    ``"rdma"``), ``"aiordma_fallback_reason"``, ``"aiordma_mode"``, ``"aiordma_passed_through"``
    (the data goes unframed: see ``State.PASSED_THROUGH``), ``"aiordma_stats"`` (its counters, an
    ``aiordma.ConnectionStats``); the other names from the
    TCP transport underneath (``peername``, ``sockname``, ``socket``, ``ssl_object`` ...)."""
    if name == "aiordma_transport":
        return core.transport
    if name == "aiordma_fallback_reason":
        return core.fallback_reason
    if name == "aiordma_mode":
        return "stream" if core.proto.mode is Mode.STREAM else "messages"
    if name == "aiordma_passed_through":
        return core.proto.passed_through
    if name == "aiordma_stats":
        return connection_stats(core)
    transport = now.transport
    if transport is None:
        return default
    return transport.get_extra_info(name, default)


class AiordmaTransport(asyncio.Transport):
    """An ``asyncio.Transport`` over an aiordma connection (see the module docs)."""

    def __init__(self, core: Core, protocol: asyncio.BaseProtocol, loop: asyncio.AbstractEventLoop,
                 on_lost: Callable[[AiordmaTransport], None] | None = None) -> None:  # fmt: skip
        super().__init__()
        self._core = core
        self._now = Nowait(core)
        self._proto = core.proto
        self._loop = loop
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        self._on_lost = on_lost
        self._tcp = False  # the link calls us back (TCP) instead of being waited on (RDMA): _start
        self._fast = False
        self._reading = True
        self._closing = False  # close() or abort() was called, or the connection ended
        self._lost_called = False
        self._eof_delivered = False
        self._eof_sent = False
        self._armed: asyncio.Future[None] | None = None
        self._delivering = False
        self._writes_dropped = 0
        self._protocol_paused = False
        self._high = _DEFAULT_HIGH
        self._low = _DEFAULT_HIGH // 4
        self._drainer: asyncio.Task[None] | None = None
        self._closer: asyncio.Task[None] | None = None

    # -- start --------------------------------------------------------------------------------

    def _start(self) -> None:
        """Call ``connection_made`` and start delivering (what arrived already goes first)."""
        self._protocol.connection_made(self)
        self._tcp = self._now.set_callbacks(self._wake, self._tcp_write_paused)
        self._fast = self._tcp and not self._buffered
        self._loop.call_soon(self._wake)

    # -- receiving ----------------------------------------------------------------------------

    def _wake(self) -> None:
        """The link fed the Core or ended: deliver what there is to the protocol."""
        if self._delivering or self._closing:
            return  # (after close() or abort() nothing more is delivered, as with asyncio)
        core = self._core
        if self._fast and self._reading and not core.peer_eof and core.error is None:
            # the hot path (TCP, a plain Protocol, bytes arrived): what asyncio's transport does
            rbuf = core.rbuf
            if not rbuf:
                return
            data = rbuf.take_chunk()  # (one read's bytes: its chunk, not copied again)
            self._now.consumed()
            self._delivering = True
            try:
                self._protocol.data_received(data)  # type: ignore[attr-defined]
            except Exception as exc:
                self._fatal(exc, "Fatal error: protocol.data_received() call failed")
            finally:
                self._delivering = False
            if not rbuf:
                return
        self._delivering = True
        try:
            self._deliver()
        except Exception as exc:  # the protocol's callback raised: asyncio's fatal error
            self._fatal(exc, "Fatal error: protocol callback raised")
        finally:
            self._delivering = False
        if not self._tcp and not self._closing and self._reading and self._armed is None:
            # (not while reading is paused: a waiting reader makes the RDMA link return its
            # credits, and a paused protocol wants the peer held back)
            self._arm()

    def _arm(self) -> None:
        wait = self._now.incoming()
        fut: asyncio.Future[None] = asyncio.ensure_future(wait)  # a future (a link that is done: a coroutine)
        self._armed = fut
        fut.add_done_callback(self._woken)

    def _woken(self, fut: asyncio.Future[None]) -> None:
        self._armed = None
        if not fut.cancelled() and fut.exception() is not None:  # pragma: no cover - links do not fail waits
            self._fatal(fut.exception(), "Fatal error: the link's wait failed")  # type: ignore[arg-type]
            return
        self._wake()

    def _deliver(self) -> None:
        core = self._core
        rbuf = core.rbuf
        protocol = self._protocol
        now = self._now
        if core.error is not None and not (rbuf and self._reading):
            self._fatal(reset_error(core), None)
            return
        while rbuf and self._reading and not self._closing:
            if self._buffered:
                n = len(rbuf)
                buf = protocol.get_buffer(n)  # type: ignore[attr-defined]
                with memoryview(buf) as out:
                    if out.nbytes == 0:
                        raise RuntimeError("get_buffer() returned an empty buffer")
                    with out.cast("B") as flat:
                        take = rbuf.copy_into(flat)
                now.consumed()
                protocol.buffer_updated(take)  # type: ignore[attr-defined]
            else:
                data = rbuf.take_chunk()
                now.consumed()
                protocol.data_received(data)  # type: ignore[attr-defined]
        if rbuf or self._closing or not self._reading:
            return
        if core.error is not None:  # (after the bytes that came before it)
            self._fatal(reset_error(core), None)
            return
        if core.peer_eof and not self._eof_delivered:
            self._eof_delivered = True
            keep_open = protocol.eof_received()  # type: ignore[attr-defined]
            if not keep_open or core.peer_close is not None and self._eof_sent:
                self.close()
                return
        if now.lost and not self._closing:
            # the connection ended without an error after the peer's CLOSE: release our side
            self._closing = True
            self._close_link(None, release=True)

    # -- writing ------------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if data.__class__ is not bytes and not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, not {type(data).__name__!r}")
        if self._eof_sent:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if self._closing or not self._now.writable:
            self._drop_write()
            return
        try:
            self._now.write(data)
        except Exception as exc:
            if self._tcp and isinstance(exc, (anyio.BrokenResourceError, anyio.ClosedResourceError)):
                self._drop_write()  # (the TCP transport is closing: what asyncio's does)
            else:
                self._fatal(exc, "Fatal write error on the RDMA link")
            return
        if not self._tcp and not self._protocol_paused and self._now.unsent() > self._high:
            self._pause_protocol()  # (on TCP the TCP transport pauses us itself)

    def _drop_write(self) -> None:
        # as asyncio's transport: writes to a lost connection are dropped, and said so
        self._writes_dropped += 1
        if self._writes_dropped == 5:
            log.warning("aiordma: write() on a lost connection (the data is dropped)")

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self._eof_sent or self._closing:
            return
        self._eof_sent = True
        core = self._core
        if core.error is not None or self._now.lost or self._proto.send_half is not Half.OPEN:
            return
        try:
            self._now.write_eof()
        except Exception as exc:
            self._fatal(exc, "Fatal error sending EOF")
            return
        if core.peer_eof and self._eof_delivered:
            self.close()  # both sides ended: nothing more can happen

    def get_write_buffer_size(self) -> int:
        return self._now.unsent()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        writer = self._now.tcp_writer
        if writer is not None:
            low, high = writer.get_write_buffer_limits()
            return (low, high)
        return (self._low, self._high)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is None:
            high = _DEFAULT_HIGH if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        writer = self._now.tcp_writer
        if writer is not None:
            writer.set_write_buffer_limits(high, low)
        elif not self._protocol_paused and self.get_write_buffer_size() > high:
            self._pause_protocol()

    def _tcp_write_paused(self, paused: bool) -> None:
        if paused:
            self._pause_protocol()
        else:
            self._resume_protocol()

    def _pause_protocol(self) -> None:
        if self._protocol_paused or self._lost_called:
            return
        self._protocol_paused = True
        try:
            self._protocol.pause_writing()
        except Exception as exc:
            self._loop.call_exception_handler({"message": "protocol.pause_writing() failed", "exception": exc,
                                               "transport": self, "protocol": self._protocol})  # fmt: skip
        if not self._tcp and self._drainer is None:
            self._drainer = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        """RDMA: wait until the unposted bytes are at the low mark, then resume the protocol."""
        try:
            await self._now.drain(self._low)
        except Exception:
            return  # the connection failed: the wake that follows reports it
        finally:
            self._drainer = None
        self._resume_protocol()

    def _resume_protocol(self) -> None:
        if not self._protocol_paused or self._lost_called:
            return
        self._protocol_paused = False
        try:
            self._protocol.resume_writing()
        except Exception as exc:
            self._loop.call_exception_handler({"message": "protocol.resume_writing() failed", "exception": exc,
                                               "transport": self, "protocol": self._protocol})  # fmt: skip

    # -- reading control ----------------------------------------------------------------------

    def is_reading(self) -> bool:
        return self._reading and not self._closing

    def pause_reading(self) -> None:
        """Stop calling ``data_received``.  The link keeps up to its receive high mark (1 MiB)
        buffered, then stops reading the socket (TCP) or stops returning credits (RDMA)."""
        self._reading = False

    def resume_reading(self) -> None:
        if self._reading:
            return
        self._reading = True
        if not self._lost_called:
            self._loop.call_soon(self._wake)

    # -- closing ------------------------------------------------------------------------------

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Send what was written and CLOSE, release the connection, then ``connection_lost(None)``."""
        if self._closing:
            return
        self._closing = True
        self._close_link(None)

    def abort(self) -> None:
        """Drop what was not sent; ``connection_lost(None)`` comes at once (the link's teardown runs on)."""
        first = not self._closing
        self._closing = True
        core = self._core
        if first or not core.closed:
            self._abort_link()
        self._loop.call_soon(self._call_connection_lost, None)

    def _abort_link(self) -> None:
        """Release the link delivering nothing more (the peer sees the connection fail)."""
        self._now.abort()

    def _close_link(self, exc: BaseException | None, release: bool = False) -> None:
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        if release:
            self._now.release()
        else:
            self._now.close()
        self._closer = self._loop.create_task(self._finish_close(exc))

    async def _finish_close(self, exc: BaseException | None) -> None:
        try:
            await self._now.wait_closed()
        except Exception as err:  # the peer may not have everything, or the teardown failed
            log.warning("aiordma: closing the connection failed: %r", err)
            if exc is None:  # (the protocol learns it: there is no caller to raise to)
                exc = ConnectionResetError(f"closing: {err}")
                exc.__cause__ = err
        finally:
            self._call_connection_lost(exc)

    def _fatal(self, exc: BaseException, message: str | None) -> None:
        if message is not None and not isinstance(exc, OSError):
            self._loop.call_exception_handler({"message": message, "exception": exc,
                                               "transport": self, "protocol": self._protocol})  # fmt: skip
        if self._lost_called:
            return
        if not self._closing:
            self._closing = True
            self._abort_link()
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        if self._lost_called:
            return
        self._lost_called = True
        if self._tcp:
            self._now.set_callbacks(None, None)
        if self._armed is not None:
            self._armed.cancel()
            self._armed = None
        if self._drainer is not None:
            self._drainer.cancel()
        try:
            self._protocol.connection_lost(exc)  # type: ignore[arg-type]
        finally:
            if self._on_lost is not None:
                self._on_lost(self)

    # -- the rest of asyncio.Transport ---------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return extra_info(self._core, self._now, name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)
        self._fast = self._tcp and not self._buffered

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._protocol

    def __repr__(self) -> str:
        state = "closed" if self._lost_called else "closing" if self._closing else "open"
        return f"<aiordma.asyncio.Transport {self._core.transport} {state}>"


class PassedTransport(asyncio.Transport):
    """The TCP connection's own asyncio transport, once the connection passed through (both ends
    offered it and TCP was selected: ``State.PASSED_THROUGH``): the user's protocol is called by
    asyncio's (or uvloop's) transport itself, as ``loop.create_connection`` makes it, and its
    writes are that transport's own (``write`` and ``writelines`` are its bound methods: no call
    of ours on the way).  This object adds aiordma's ``get_extra_info`` names
    (``"aiordma_passed_through"`` is True) and keeps the handover's order: ``connection_made``,
    then the data's first bytes (read along with the handshake), then the peer's end if it came
    meanwhile, and only then more from the socket.

    The stream contract is TCP's, as with asyncio's transport: ``write_eof`` sends FIN (the
    peer's ``eof_received``), ``abort`` resets (the peer's ``connection_lost`` gets a
    ``ConnectionResetError``); ``close`` stays aiordma's (see :meth:`close`)."""

    def __init__(self, core: Core, passed: PassedThrough) -> None:
        super().__init__()
        inner = passed.transport
        self._inner = inner
        self._core = core
        self._now = Nowait(core)
        self._user_paused = False
        self._closing = False
        self._passed = passed
        # the hot path: the TCP transport's own methods
        self.write = inner.write  # type: ignore[method-assign]
        self.writelines = inner.writelines  # type: ignore[method-assign]

    def _start(self, protocol: asyncio.BaseProtocol) -> None:
        """``connection_made``, then what the link held (see the class docs); raises what the
        protocol's callbacks raise (the caller aborts)."""
        passed = self._passed
        protocol.connection_made(self)
        first = passed.first
        if first:
            if isinstance(protocol, asyncio.BufferedProtocol):
                view = memoryview(first)
                while view.nbytes:
                    with memoryview(protocol.get_buffer(view.nbytes)) as out:
                        if out.nbytes == 0:
                            raise RuntimeError("get_buffer() returned an empty buffer")
                        take = min(out.nbytes, view.nbytes)
                        out.cast("B")[:take] = view[:take]
                    protocol.buffer_updated(take)
                    view = view[take:]
            else:
                protocol.data_received(first)  # type: ignore[attr-defined]
        if passed.lost:
            protocol.connection_lost(passed.error)
            return
        if passed.eof:
            if not protocol.eof_received():  # type: ignore[attr-defined]
                self.close()
            return
        if passed.reading_paused and not self._user_paused:
            self._inner.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "aiordma_passed_through":
            return True
        return extra_info(self._core, self._now, name, default)

    def is_reading(self) -> bool:
        return self._inner.is_reading()

    def pause_reading(self) -> None:
        self._user_paused = True
        self._inner.pause_reading()

    def resume_reading(self) -> None:
        self._user_paused = False
        self._inner.resume_reading()

    def is_closing(self) -> bool:
        return self._closing or self._inner.is_closing()

    def close(self) -> None:
        """Close in order, as aiordma's framed transport does (``PassedThrough.close_in_order``):
        a FIN after what was written, and ``connection_lost`` once the peer's kernel has it all --
        not when the bytes reached ours (a socket closed before would reset a slow reader's
        connection and drop what it had not taken)."""
        if self._closing:
            return
        self._closing = True
        self.write = self.writelines = self._dropped  # type: ignore[method-assign,assignment]
        protocol = self._inner.get_protocol()
        self._passed.close_in_order(protocol.connection_lost)

    def _dropped(self, data: Any) -> None:
        """A write after ``close()``: dropped, as asyncio drops it."""

    def abort(self) -> None:
        self._closing = True
        self._inner.abort()

    def can_write_eof(self) -> bool:
        return self._inner.can_write_eof()

    def write_eof(self) -> None:
        self._inner.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._inner.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._inner.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._inner.set_write_buffer_limits(high, low)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._inner.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._inner.get_protocol()

    def __repr__(self) -> str:
        state = "closing" if self.is_closing() else "open"
        return f"<aiordma.asyncio transport tcp {state}, passed through: {self._inner!r}>"
