"""Accepting connections: the I/O around :class:`~aiordma._proto.admission.Admission`.

Every listener of aiordma -- the anyio ones (:func:`aiordma.create_listener`, channels, Dask's)
and ``aiordma.asyncio``'s servers -- accepts through one :class:`Acceptor`, under asyncio,
uvloop and trio alike:

* it owns its listening sockets (``anyio.create_tcp_listener``, listen backlog ``backlog``) and
  accepts on them itself, one raw socket at a time and only while the admission has room; the
  kernel's backlog queues the rest;
* an accepted socket gets no protocol object until it spoke: its task waits for its first byte
  (``anyio.wait_readable``, bounded by ``hello_timeout``), then for a handshake slot;
* with a slot, the socket becomes a link (asyncio: ``loop.connect_accepted_socket``, TLS
  handshake included and bounded by ``handshake_timeout``; trio: an anyio socket stream, TLS
  wrapped) and the handshake runs; until its HELLO came (``hello_timeout`` after the start), the
  admission may drop it for a client that did speak;
* after the handshake, the connection leaves admission and goes to the listener's handler.

Cancellation: each connection's task is in the listener's task group (anyio listeners) or in
the server's task set (``aiordma.asyncio``); closing the acceptor stops accepting at once;
pending connections are closed with their tasks.  Nothing of a connection outlives its task.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.tls import TLSStream

from .._proto.admission import Admission, Decision
from .._conn.core import Core, Link
from .links import AsyncioLink, StreamLink
from .._proto.protocol import Mode, Role

__all__ = ["Acceptor", "Spawn"]

log = logging.getLogger("aiordma")

#: how a listener runs a task: the anyio task group's ``start_soon``, or the asyncio server's
Spawn = Callable[..., object]


def _running_on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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

    __slots__ = ("sock", "address", "peer", "scope", "go", "dropped", "link")

    def __init__(self, sock: socket.socket, address: str, peer: str) -> None:
        self.sock = sock
        self.address = address  # (the host: admission's per-address share)
        self.peer = peer  # (host:port, for the logs)
        self.scope = anyio.CancelScope()
        self.go = anyio.Event()
        self.dropped = False
        self.link: Link | None = None


class Acceptor:
    """Listening sockets and their admission (see the module docs)."""

    def __init__(self, listener: Any, opts: Any, mode: Mode, admission: Admission, hello_timeout: float) -> None:
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
        return cls(listener, opts, mode, Admission(max_handshakes, cap, backlog), hello_timeout)

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

    # -- serving ---------------------------------------------------------------------------

    async def serve(self, handle: Callable[[Core], Awaitable[None]], spawn: Spawn,
                    handshake: Callable[[Core], Awaitable[None]]) -> None:  # fmt: skip
        """Accept forever; ``handshake(core)`` for each admitted connection, then
        ``handle(core)`` when it returned (it raises what ended the handshake).  Every loop and connection runs in ``spawn``ed
        tasks; this returns when the acceptor is closed."""
        async with anyio.create_task_group() as loops:
            for sock in self._sockets:
                loops.start_soon(self._accept_loop, sock, handle, spawn, handshake)

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
            self._apply(admission.accepted(pending, pending.address))
            spawn(self._connection, pending, handle, handshake)

    def _apply(self, decision: Decision) -> None:
        for key in decision.drop:
            pending: Any = key
            pending.dropped = True
            pending.scope.cancel()
            pending.go.set()
        for key in decision.start:
            started: Any = key
            started.go.set()
        if self.admission.may_accept():
            self._room.set()

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
                with anyio.move_on_after(self._hello_timeout):
                    await anyio.wait_readable(pending.sock)
                    self._apply(self.admission.spoke(pending))
                if self.admission.state(pending) is not None and not pending.go.is_set():
                    if self.admission.state(pending) == "waiting":  # (silent for hello_timeout)
                        self.admission.dropped_silent += 1
                        log.info("aiordma: dropped a client (%s): it sent nothing within hello_timeout (%g s)",
                                 pending.peer, self._hello_timeout)  # fmt: skip
                        return
                    await pending.go.wait()
                if pending.dropped or self.admission.state(pending) != "handshaking":
                    return
                core = await self._make_link(pending)
                proto = core.proto
                # (the protocol's own deadline: a HELLO late by hello_timeout fails the handshake,
                # and the client gets a CLOSE that says so)
                proto.expect_hello_within(self._hello_timeout, anyio.current_time())
                self.admission.started(pending, lambda: proto.peer_hello is not None)
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
            if pending.dropped:
                log.info("aiordma: dropped a silent client (%s) for one that spoke", pending.peer)
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

    async def _make_link(self, pending: _Pending) -> Core:
        """The socket as a link of this listener (TLS handshake included), bounded."""
        opts = self._opts
        mode = self._mode
        sock = pending.sock
        with anyio.fail_after(opts.handshake_timeout):
            if _running_on_asyncio():
                loop = asyncio.get_running_loop()
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
                    stream = await TLSStream.wrap(stream, server_side=True, ssl_context=opts.ssl,
                                                  standard_compatible=False)  # fmt: skip
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await anyio.aclose_forcefully(stream)
                raise
            slink = StreamLink(stream, opts.protocol(Role.SERVER, mode, anyio.current_time()))
            pending.link = slink
            return slink.core


