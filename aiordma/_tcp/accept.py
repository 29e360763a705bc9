"""Accepting connections: the I/O around :class:`~aiordma._proto.admission.Admission`.

Every listener of aiordma -- the anyio ones (:func:`aiordma.create_listener`, channels, Dask's)
and ``aiordma.asyncio``'s servers -- accepts through one :class:`Acceptor`, under asyncio,
uvloop and trio alike:

* it owns its listening sockets (``anyio.create_tcp_listener``, listen backlog ``backlog``) and
  accepts on them itself, one raw socket at a time and only while the admission has room; the
  kernel's backlog queues the rest;
* an accepted socket gets no protocol object until its first frame is whole: its task waits for
  its first byte (``anyio.wait_readable``, bounded by ``hello_timeout``: a socket that sends
  nothing is *silent*), then, peeking, for the rest of its first frame (the HELLO, or the first
  TLS record: ``SO_RCVLOWAT`` makes the wait wake only when that many bytes are in; bounded by
  ``handshake_timeout`` from the accept), then for a handshake slot;
* with a slot, the socket becomes a link (asyncio: ``loop.connect_accepted_socket``, TLS
  handshake included and bounded by ``handshake_timeout``; trio: an anyio socket stream, TLS
  wrapped) and the handshake runs under the protocol's deadline (``handshake_timeout``);
* the admission measures whether a running handshake moves from the kernel's ``TCP_INFO``
  (the time since the last byte either way); a ready connection that finds no slot takes the
  one of a handshake stalled for ``stall_after`` -- looked at again on a timer while one waits;
* after the handshake, the connection leaves admission and goes to the listener's handler.

Every drop is logged (logger ``aiordma``, INFO) with the client's ``host:port`` and its reason.

Cancellation: each connection's task is in the listener's task group (anyio listeners) or in
the server's task set (``aiordma.asyncio``); closing the acceptor stops accepting at once;
pending connections are closed with their tasks.  Nothing of a connection outlives its task.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream

from .._proto.admission import MAX_FIRST_FRAME, SILENT, Admission, Decision, first_frame_size
from .._conn.core import Core, Link
from .._io.backends import asyncio_loop
from .asyncio_link import AsyncioLink
from .stream_link import StreamLink, wrap_tls
from .._proto.protocol import Mode, Role

__all__ = ["Acceptor", "Spawn"]

log = logging.getLogger("aiordma")

#: how a listener runs a task: the anyio task group's ``start_soon``, or the asyncio server's
Spawn = Callable[..., object]


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _close_quietly(core: Core) -> None:
    """Close a connection the listener gives up on; its failure to close is logged, not raised."""
    try:
        await core.aclose()
    except Exception as exc:
        log.debug("aiordma: closing a dropped connection failed: %s", _reason(exc))


class _Pending:
    """One accepted connection while it is in admission."""

    __slots__ = ("sock", "address", "peer", "scope", "go", "dropped", "link", "accepted_at", "slot_at")

    def __init__(self, sock: socket.socket, address: str, peer: str) -> None:
        self.sock = sock
        self.address = address  # (the host: admission's per-address share)
        self.peer = peer  # (host:port, for the logs)
        self.scope = anyio.CancelScope()
        self.go = anyio.Event()
        self.dropped = False
        self.link: Link | None = None
        self.accepted_at = time.monotonic()
        self.slot_at: float | None = None

    def tcp_socket(self) -> Any:
        """The connection's TCP socket (the link's, once a transport owns it), or None."""
        if self.sock.fileno() != -1:
            return self.sock
        transport = self.link.transport if self.link is not None else None
        return transport.get_extra_info("socket") if transport is not None else None

    def idle(self) -> float:
        """Seconds since anything moved on the connection: a byte from the peer, a byte to it
        (the kernel's TCP_INFO), or the start of its handshake slot."""
        since = time.monotonic() - (self.slot_at if self.slot_at is not None else self.accepted_at)
        sock = self.tcp_socket()
        if sock is None:
            return since
        try:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LAST.size + _TCP_INFO_LAST_AT)
        except OSError:
            return 0.0  # (the socket is going: its task is ending it; never a reason to drop it)
        sent_ms: int
        recv_ms: int
        sent_ms, _, recv_ms = _TCP_INFO_LAST.unpack_from(info, _TCP_INFO_LAST_AT)
        return min(since, sent_ms / 1000.0, recv_ms / 1000.0)


#: struct tcp_info (linux/tcp.h): tcpi_last_data_sent, tcpi_last_ack_sent, tcpi_last_data_recv
#: (milliseconds ago), after 8 one-byte fields and 9 u32s
_TCP_INFO_LAST_AT = 8 + 9 * 4
_TCP_INFO_LAST = struct.Struct("=III")


class Acceptor:
    """Listening sockets and their admission (see the module docs)."""

    def __init__(self, listener: Any, opts: Any, mode: Mode, admission: Admission, hello_timeout: float) -> None:
        #: ready connections wait for a slot: look for stalled handshakes on a timer
        self._ready_wait = anyio.Event()
        self._listener = listener  # the anyio MultiListener that owns the sockets
        self._sockets: list[socket.socket] = [lst.extra(SocketAttribute.raw_socket) for lst in listener.listeners]
        self._opts = opts
        self._mode = mode
        self.admission = admission
        self._hello_timeout = hello_timeout
        self._room = anyio.Event()
        self._closed = False

    @classmethod
    async def create(cls, host: str | None, port: int, mode: Mode, opts: Any, *, backlog: int,
                     max_handshakes: int, per_address: int | None, hello_timeout: float) -> Acceptor:  # fmt: skip
        listener = await anyio.create_tcp_listener(local_host=host, local_port=port, backlog=backlog)
        cap = per_address if per_address is not None else max(1, max_handshakes // 2)
        # (stalled: nothing moved for half the handshake's deadline -- a client whose loop is busy
        # for seconds is slow, not hostile, and only gives way when someone needs its slot)
        admission = Admission(max_handshakes, cap, backlog, stall_after=opts.handshake_timeout / 2)
        return cls(listener, opts, mode, admission, hello_timeout)

    @property
    def sockets(self) -> list[socket.socket]:
        return list(self._sockets)

    def addresses(self) -> list[Any]:
        return [sock.getsockname() for sock in self._sockets]

    async def aclose(self) -> None:
        """Stop accepting (pending connections end with their tasks)."""
        if self._closed:
            return
        self._closed = True
        for sock in self._sockets:
            anyio.notify_closing(sock)  # (an accept loop waiting on it gets ClosedResourceError)
        await self._listener.aclose()
        self._room.set()
        self._ready_wait.set()

    def close_nowait(self) -> None:
        """:meth:`aclose` without awaiting (asyncio's ``Server.close``)."""
        if self._closed:
            return
        self._closed = True
        for sock in self._sockets:
            try:
                anyio.notify_closing(sock)
            except RuntimeError:  # (no running loop: nothing waits on it)
                pass
            sock.close()
        self._room.set()
        self._ready_wait.set()

    # -- serving ---------------------------------------------------------------------------

    async def serve(self, handle: Callable[[Core], Awaitable[None]], spawn: Spawn,
                    handshake: Callable[[Core], Awaitable[None]]) -> None:  # fmt: skip
        """Accept forever; ``handshake(core)`` for each admitted connection, then
        ``handle(core)`` when it returned (it raises what ended the handshake).  Every loop and connection runs in ``spawn``ed
        tasks; this returns when the acceptor is closed."""
        async with anyio.create_task_group() as loops:
            for sock in self._sockets:
                loops.start_soon(self._accept_loop, sock, handle, spawn, handshake)
            loops.start_soon(self._watch_stalls)

    async def _watch_stalls(self) -> None:
        """While ready connections wait for a slot, look for stalled handshakes every quarter of
        ``stall_after`` (a handshake stalls without an event to tell)."""
        admission = self.admission
        while not self._closed:
            if not admission.ready:
                self._ready_wait = anyio.Event()
                await self._ready_wait.wait()
                continue
            await anyio.sleep(admission.stall_after / 4)
            self._apply(admission.reschedule())

    async def _accept_loop(self, lsock: socket.socket, handle: Callable[[Core], Awaitable[None]], spawn: Spawn,
                           handshake: Callable[[Core], Awaitable[None]]) -> None:  # fmt: skip
        admission = self.admission
        while not self._closed:
            if not admission.may_accept():
                self._room = anyio.Event()
                await self._room.wait()
                continue
            try:
                await anyio.wait_readable(lsock)
                csock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except (anyio.ClosedResourceError, OSError) as exc:
                if self._closed:
                    return
                log.warning("aiordma: accepting a connection failed: %r", exc)
                await anyio.sleep(0.1)  # (EMFILE and the like: the kernel queues meanwhile)
                continue
            csock.setblocking(False)
            if csock.family in (socket.AF_INET, socket.AF_INET6):
                csock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            host = str(addr[0]) if isinstance(addr, tuple) else str(addr)
            port = f":{addr[1]}" if isinstance(addr, tuple) else ""
            pending = _Pending(csock, host, f"[{host}]{port}" if ":" in host and port else host + port)
            self._apply(admission.accepted(pending, pending.address, pending.idle))
            spawn(self._connection, pending, handle, handshake)

    def _apply(self, decision: Decision) -> None:
        for key, why in decision.drop:
            pending: Any = key
            pending.dropped = True
            pending.scope.cancel()
            pending.go.set()
            if why == SILENT:
                log.info("aiordma: dropped a client (%s): silent (not one byte in %.1f s), and the queue was full",
                         pending.peer, time.monotonic() - pending.accepted_at)  # fmt: skip
            else:
                log.info("aiordma: dropped a client (%s): its handshake stalled (nothing moved for %.1f s), and a "
                         "ready client needed its slot", pending.peer, pending.idle())  # fmt: skip
        now = time.monotonic()
        for key in decision.start:
            started: Any = key
            started.slot_at = now
            started.go.set()
        if self.admission.may_accept():
            self._room.set()
        if self.admission.ready:
            self._ready_wait.set()

    def _leave(self, pending: _Pending) -> None:
        self._apply(self.admission.finished(pending))

    async def _connection(self, pending: _Pending, handle: Callable[[Core], Awaitable[None]],
                          handshake: Callable[[Core], Awaitable[None]]) -> None:  # fmt: skip
        """One accepted connection's whole life, isolated: nothing it sends or does reaches the
        accept loop or another connection.  Every way it ends early is logged once, with the
        peer's address and the reason; only cancellation (the listener closing) and
        non-``Exception`` errors (``KeyboardInterrupt``) propagate."""
        core: Core | None = None
        ok = False
        try:
            with pending.scope:
                if not await self._admit(pending):
                    return
                core = await self._make_link(pending)
                await handshake(core)
                ok = True
        except Exception as exc:
            stage = "before its handshake" if core is None else "during the handshake"
            log.info("aiordma: dropped a client (%s) %s: %s", pending.peer, stage, _reason(exc))
        finally:
            self._leave(pending)
            if not ok:
                with anyio.CancelScope(shield=True):
                    if core is not None:
                        await _close_quietly(core)
                    elif pending.link is None:
                        pending.sock.close()
        if not ok or core is None:
            return
        try:
            await handle(core)
        except Exception as exc:
            log.error("aiordma: the handler of a connection from %s failed: %s", pending.peer, _reason(exc),
                      exc_info=exc)  # fmt: skip
            core.on_error(exc)  # (a stream the handler left open ends as failed, not in order)
            with anyio.CancelScope(shield=True):
                await _close_quietly(core)

    async def _admit(self, pending: _Pending) -> bool:
        """Wait for the first byte, the whole first frame, then a slot (see the module docs);
        False when the connection is to be dropped (logged here, or by :meth:`_apply`)."""
        admission = self.admission
        readable = False
        first_byte_by = min(self._hello_timeout, self._opts.handshake_timeout)  # (never past the handshake's)
        with anyio.move_on_after(first_byte_by):
            await anyio.wait_readable(pending.sock)
            readable = True
        if not readable:
            admission.dropped_silent += 1
            log.info("aiordma: dropped a client (%s): silent (not one byte in %g s)", pending.peer,
                     first_byte_by)  # fmt: skip
            return False
        if admission.state(pending) is None:
            return False  # (dropped meanwhile)
        admission.speaking(pending)
        left = self._opts.handshake_timeout - (time.monotonic() - pending.accepted_at)
        whole = False
        with anyio.move_on_after(max(0.0, left)):
            await self._whole_first_frame(pending.sock)
            whole = True
        if not whole:
            log.info("aiordma: dropped a client (%s): its first frame did not come whole within handshake_timeout "
                     "(%g s)", pending.peer, self._opts.handshake_timeout)  # fmt: skip
            return False
        self._apply(admission.spoke(pending))
        await pending.go.wait()  # (a slot: our wait, not the client's, so no deadline of its own)
        return not pending.dropped and admission.state(pending) == "handshaking"

    async def _whole_first_frame(self, sock: socket.socket) -> None:
        """Wait until the client's first frame (:func:`first_frame_size`) is in the socket,
        peeking; returns early when the peer stops sending (EOF, a reset: the handshake then
        reports it)."""
        tls = self._opts.ssl is not None
        seen = -1
        try:
            while True:
                try:
                    head = sock.recv(MAX_FIRST_FRAME, socket.MSG_PEEK)
                except BlockingIOError:
                    head = b""
                except OSError:
                    return  # (a reset: the handshake reports it)
                need = first_frame_size(head, tls)
                if len(head) >= need or len(head) == seen:
                    return  # (whole; or readable without a new byte: EOF)
                seen = len(head)
                # (wake only once the frame is in, or at EOF)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, need)
                await anyio.wait_readable(sock)
        finally:
            if seen >= 0:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
                except OSError:
                    pass

    async def _make_link(self, pending: _Pending) -> Core:
        """The socket as a link of this listener (TLS handshake included), bounded."""
        opts = self._opts
        mode = self._mode
        sock = pending.sock
        with anyio.fail_after(opts.handshake_timeout):
            loop = asyncio_loop()
            if loop is not None:
                proto = opts.protocol(Role.SERVER, mode, loop.time())
                link = AsyncioLink(proto, loop)
                pending.link = link
                # (uvloop returns its TLS protocol here, not ours: keep our own)
                await loop.connect_accepted_socket(
                    lambda: link, sock, ssl=opts.ssl,
                    ssl_handshake_timeout=opts.handshake_timeout if opts.ssl is not None else None,
                )  # fmt: skip
                return link.core
            stream: Any = await SocketStream.from_socket(sock)
            pending.link = stream  # (owns the socket now)
            try:
                if opts.ssl is not None:
                    stream = await wrap_tls(stream, server_side=True, ssl_context=opts.ssl)
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.aclose_forcefully(stream)
                raise
            slink = StreamLink(stream, opts.protocol(Role.SERVER, mode, anyio.current_time()))
            pending.link = slink
            return slink.core


