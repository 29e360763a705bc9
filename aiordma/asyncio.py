"""The asyncio front end: ``open_connection`` and ``start_server`` like asyncio's.

The reader and writer have the methods of ``asyncio.StreamReader`` and
``asyncio.StreamWriter`` and raise what those raise:
``asyncio.IncompleteReadError`` (EOF before ``readexactly``/``readuntil`` were
satisfied), ``asyncio.LimitOverrunError`` (``readuntil`` past ``limit``),
``ConnectionResetError`` (the connection failed or the peer broke the
protocol; ``__cause__`` tells how).  As with asyncio, ``write`` never raises for
a lost connection: ``drain`` does.

``create_connection`` and ``create_server`` are asyncio's Transport/Protocol API: the
transport is an ``asyncio.Transport`` (see :mod:`aiordma._transport` for how it calls the
protocol), so a program written against ``loop.create_connection`` runs over aiordma unchanged.

These run under asyncio (and uvloop) only; under trio use :func:`aiordma.connect`.
Extra info: ``writer.get_extra_info("aiordma_transport")`` is ``"tcp"`` or
``"rdma"``, ``"aiordma_fallback_reason"`` says why TCP; the usual names
(``peername``, ``sockname``, ``socket``, ``ssl_object``...) come from the TCP transport.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

import anyio

from ._proto.admission import DEFAULT_BACKLOG, DEFAULT_HELLO_TIMEOUT
from ._tcp.accept import Acceptor
from ._handshake.negotiate import Options, accept_handshake, open_client as _open
from ._handshake.settings import ClientSettings, ListenerSettings, listen
from ._conn.core import Core
from ._conn.nowait import Nowait
from ._handshake.limits import DEFAULT_MAX_HANDSHAKES
from ._tcp.links import DEFAULT_KEEPALIVE
from ._rdma.config import RdmaBackend
from ._transport import AiordmaTransport as Transport
from ._transport import PassedTransport
from ._transport import extra_info
from ._transport import reset_error as _reset
from ._rdma.device import DeviceHold
from ._proto.protocol import DEFAULT_HANDSHAKE_TIMEOUT, Half, Mode

__all__ = [
    "StreamReader",
    "StreamWriter",
    "Server",
    "Transport",
    "open_connection",
    "start_server",
    "create_connection",
    "create_server",
]

_DEFAULT_LIMIT = 2**16
_EOF = Half.EOF


class StreamReader:
    """Reads a byte stream; the interface of ``asyncio.StreamReader``.

    Bytes that arrived before an error or EOF are always returned first.
    """

    def __init__(self, core: Core, limit: int = _DEFAULT_LIMIT) -> None:
        if limit <= 0:
            raise ValueError("Limit cannot be <= 0")
        self._core = core
        nowait = Nowait(core)
        # the hot path: await the link's future directly (no frame of ours)
        self._incoming = nowait.incoming
        self._consumed = nowait.consumed
        self._limit = limit

    def exception(self) -> BaseException | None:
        return self._core.error

    def at_eof(self) -> bool:
        core = self._core
        return not core.rbuf and (core.peer_eof or core.closed or core.error is not None)

    def _more(self) -> bool:
        """Whether more bytes may come (then wait on ``_incoming()``); raises
        ConnectionResetError on failure."""
        core = self._core
        if core.peer_eof or core.closed:
            return False
        if core.error is not None:
            raise _reset(core)
        return True

    async def _wait(self) -> bool:
        """Wait for more bytes; False when none will come, ConnectionResetError on failure."""
        if not self._more():
            return False
        await self._incoming()
        return True

    def _take(self, n: int) -> bytes:
        data = self._core.rbuf.take(n)  # (a chunk taken whole is not copied again)
        self._consumed()
        return data

    # read() and readexactly() are the hot path: they inline _wait() and
    # _take() (no coroutine frame but their own, no call per read)

    async def read(self, n: int = -1) -> bytes:
        if n == 0:
            return b""
        core = self._core
        rbuf = core.rbuf
        if n < 0:
            while await self._wait():
                pass
            return self._take(len(rbuf))
        while not rbuf.nbytes:  # (the attribute: no call of StreamBuffer's per read)
            if core.peer_eof or core.closed:
                return b""
            if core.error is not None:
                raise _reset(core)
            await self._incoming()
        data = rbuf.take(n, some=True)  # (at most n: a full chunk alone, not copied again)
        self._consumed()
        return data

    async def readexactly(self, n: int) -> bytes:
        if n < 0:
            raise ValueError("readexactly size can not be less than zero")
        core = self._core
        rbuf = core.rbuf
        while (have := rbuf.nbytes) < n:
            if core.peer_eof or core.closed:
                raise asyncio.IncompleteReadError(self._take(have), n)
            if core.error is not None:
                raise _reset(core)
            await self._incoming()
        data = rbuf.take(n)
        self._consumed()
        return data

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        seplen = len(separator)
        if seplen == 0:
            raise ValueError("Separator should be at least one-byte string")
        rbuf = self._core.rbuf
        offset = 0
        while True:
            buflen = len(rbuf)
            if buflen - offset >= seplen:
                isep = rbuf.find(separator, offset)
                if isep != -1:
                    break
                offset = buflen + 1 - seplen
                if offset > self._limit:
                    raise asyncio.LimitOverrunError("Separator is not found, and chunk exceed the limit", offset)
            if not await self._wait():
                partial = self._take(len(rbuf))
                raise asyncio.IncompleteReadError(partial, None)
        if isep > self._limit:
            raise asyncio.LimitOverrunError("Separator is found, but chunk is longer than limit", isep)
        return self._take(isep + seplen)

    async def readline(self) -> bytes:
        try:
            return await self.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            return exc.partial
        except asyncio.LimitOverrunError as exc:
            rbuf = self._core.rbuf
            if rbuf.startswith(b"\n", exc.consumed):
                rbuf.drop(exc.consumed + 1)
            else:
                rbuf.clear()
            self._consumed()
            raise ValueError(exc.args[0]) from exc

    def __aiter__(self) -> StreamReader:
        return self

    async def __anext__(self) -> bytes:
        line = await self.readline()
        if line == b"":
            raise StopAsyncIteration
        return line


class StreamWriter:
    """Writes a byte stream; the interface of ``asyncio.StreamWriter``."""

    def __init__(self, core: Core, reader: StreamReader) -> None:
        self._core = core
        self._now = now = Nowait(core)
        self._flags = now.flags
        self._reader = reader
        self._proto = core.proto

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._proto.send_half is _EOF:
            raise RuntimeError("Cannot call write() after write_eof()")
        core = self._core  # (Nowait.writable, inline: the hot path)
        if core.closed or core.error is not None or core.peer_close is not None or self._flags.lost:
            return  # as with asyncio: drain() reports the lost connection
        try:
            self._now.write(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # as with asyncio: write() never raises for a lost connection, drain() does

    def writelines(self, data: Iterable[bytes | bytearray | memoryview]) -> None:
        for chunk in data:
            self.write(chunk)

    async def drain(self) -> None:
        core = self._core
        if core.error is not None:
            raise _reset(core)
        flags = self._flags
        if flags.lost or core.peer_close is not None:
            raise ConnectionResetError("Connection lost")
        if not flags.paused_writing:
            return  # the common case: no coroutine to await
        now = self._now
        try:
            await now.drain()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            # the one boundary where the Core's (anyio) errors become asyncio's
            if core.error is not None:
                raise _reset(core) from exc
            raise ConnectionResetError("Connection lost") from exc
        if now.lost:
            if core.error is not None:
                raise _reset(core)
            raise ConnectionResetError("Connection lost")

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if self._core.closed or self._now.lost or self._proto.send_half is not Half.OPEN:
            return
        try:
            self._now.write_eof()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return  # drain() reports it

    def close(self) -> None:
        if not self._core.closed:
            self._now.close()

    def is_closing(self) -> bool:
        return self._core.closed or self._now.lost

    async def wait_closed(self) -> None:
        """Wait until the connection is closed: after a ``close()`` with bytes for the peer, until
        the peer has them all (however long a live peer takes to read); ``ConnectionResetError``
        (its cause: why) when it may not have them all -- its host died, it reset the connection."""
        try:
            await self._now.wait_closed()
        except anyio.BrokenResourceError as exc:
            raise ConnectionResetError(str(exc)) from exc

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """The TCP transport underneath (writing to it directly breaks the framing, or, passed
        through, the order of what this writer queued)."""
        return self._now.transport

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return extra_info(self._core, self._now, name, default)

    def __repr__(self) -> str:
        return f"<aiordma.asyncio.StreamWriter transport={self._core.transport}>"


def _pair(core: Core, limit: int) -> tuple[StreamReader, StreamWriter]:
    """The reader and writer of an open connection (passed through -- see
    :func:`open_connection` -- the link carries it on unframed, under the same two)."""
    if core.proto.passed_through:
        Nowait(core).unframe()
    reader = StreamReader(core, limit)
    return reader, StreamWriter(core, reader)


async def _open_stream(host: str, port: int, settings: ClientSettings) -> Core:
    """Connect a byte stream; a handshake the link broke is asyncio's ``ConnectionResetError``."""
    opts = settings.options()
    try:
        return await _open(host, port, Mode.STREAM, opts)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
        raise ConnectionResetError(f"the connection failed during the handshake: {exc}") from exc


async def open_connection(
    host: str,
    port: int,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | bool | None = None,
    server_hostname: str | None = None,
    limit: int = _DEFAULT_LIMIT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    pass_through: bool = True,
) -> tuple[StreamReader, StreamWriter]:
    """Connect to an aiordma byte-stream server; returns ``(reader, writer)``.

    Arguments as for :func:`aiordma.connect`; ``limit`` is the reader's
    ``readuntil``/``readline`` limit as in asyncio.  ``pass_through``: when TCP carries the data
    (no RNIC, not TLS) and the server offers it too (:func:`start_server`,
    :func:`create_server` do by default), the bytes go unframed after the handshake
    (``get_extra_info("aiordma_passed_through")``): the same reader and writer, without a frame
    header to write or parse per write -- asyncio's round trip, one copy per byte.  The peer's
    ``write_eof`` is then TCP's FIN and a reset the stream's error, as with asyncio's streams;
    closing reasons are not carried.
    """
    settings = ClientSettings.of(locals())
    return _pair(await _open_stream(host, port, settings), limit)


ClientConnectedCallback = Callable[[StreamReader, StreamWriter], Awaitable[None] | None]


class Server(asyncio.AbstractServer):
    """A listening aiordma server; used like ``asyncio.Server``.

    ``close()`` stops listening; ``wait_closed()`` then waits for the
    handlers of accepted connections to finish.  A handler's exception is
    reported through the loop's exception handler (as asyncio does) and its
    connection is closed.  Accepting and admission are those of every aiordma listener
    (:mod:`aiordma._tcp.accept`): no client is refused for a burst.
    """

    def __init__(self, acceptor: Acceptor, handle: Callable[[Core], Coroutine[Any, Any, None]], opts: Options,
                 transports: weakref.WeakSet[asyncio.Transport] | None = None) -> None:  # fmt: skip
        self._acceptor = acceptor
        self._handle = handle
        self._opts = opts
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._devices = DeviceHold()
        self._transports = transports if transports is not None else weakref.WeakSet()
        self._serving: asyncio.Task[None] | None = None
        self._closed = False
        self._forever: asyncio.Future[None] | None = None

    def _spawn(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        task = self._loop.create_task(fn(*args))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._loop.call_exception_handler({"message": "aiordma server task failed", "exception": task.exception()})

    async def _handshake(self, core: Core) -> None:
        await accept_handshake(core, self._opts, self._devices)

    @property
    def sockets(self) -> tuple[Any, ...]:
        return () if self._closed else tuple(self._acceptor.sockets)

    @property
    def addresses(self) -> list[Any]:
        return [] if self._closed else self._acceptor.addresses()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def is_serving(self) -> bool:
        return self._serving is not None and not self._closed

    async def start_serving(self) -> None:
        if self._closed:
            raise RuntimeError(f"server {self!r} is closed")
        if self._serving is None:
            self._serving = self._loop.create_task(self._acceptor.serve(self._handle, self._spawn, self._handshake))
            self._tasks.add(self._serving)
            self._serving.add_done_callback(self._done)
        await asyncio.sleep(0)

    async def serve_forever(self) -> None:
        if self._forever is not None:
            raise RuntimeError(f"server {self!r} is already being awaited on serve_forever()")
        await self.start_serving()
        self._forever = self._loop.create_future()
        try:
            await self._forever
        finally:
            self.close()
            self._forever = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._acceptor.close_nowait()
        self._devices.release()
        if self._forever is not None and not self._forever.done():
            self._forever.cancel()

    async def wait_closed(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def close_clients(self) -> None:
        """Close the transports of accepted connections (``create_server``; as in Python 3.13)."""
        for transport in list(self._transports):
            transport.close()

    def abort_clients(self) -> None:
        for transport in list(self._transports):
            transport.abort()

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def start_server(
    client_connected_cb: ClientConnectedCallback,
    host: str | None = None,
    port: int | None = None,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | None = None,
    limit: int = _DEFAULT_LIMIT,
    backlog: int = DEFAULT_BACKLOG,
    start_serving: bool = True,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
    max_handshakes_per_address: int | None = None,
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT,
    max_rdma_connections: int | None = None,
    max_pinned_bytes: int | None = None,
    pass_through: bool = True,
) -> Server:
    """Start an aiordma byte-stream server; ``client_connected_cb(reader, writer)``
    runs (in a task) for each client once its handshake completed (``pass_through``: see
    :func:`open_connection`)."""
    settings = ListenerSettings.of(locals())
    loop = asyncio.get_running_loop()

    async def serve_one(core: Core) -> None:
        reader, writer = _pair(core, limit)
        try:
            result = client_connected_cb(reader, writer)
            if result is not None:
                await result
        except Exception as exc:
            transport = writer.transport
            peer = transport.get_extra_info("peername") if transport is not None else None
            loop.call_exception_handler(
                {"message": "Unhandled exception in client_connected_cb", "exception": exc,
                 "transport": transport, "peer": peer}  # fmt: skip
            )
            writer.close()

    return await _listen(settings, host, port, serve_one, start_serving=start_serving)


async def _listen(
    settings: ListenerSettings,
    host: str | None,
    port: int | None,
    serve_one: Callable[[Core], Coroutine[Any, Any, None]],
    *,
    start_serving: bool,
    transports: weakref.WeakSet[asyncio.Transport] | None = None,
) -> Server:
    """A listening :class:`Server` whose admitted connections each get a task: the handshake,
    then ``serve_one(core)`` (the front end's part); a task's failure goes to the loop's
    exception handler."""
    acceptor, opts = await listen(host, port or 0, Mode.STREAM, settings)
    server = Server(acceptor, serve_one, opts, transports)
    if start_serving:
        await server.start_serving()
    return server


ProtocolFactory = Callable[[], asyncio.BaseProtocol]


async def create_connection(
    protocol_factory: ProtocolFactory,
    host: str,
    port: int,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | bool | None = None,
    server_hostname: str | None = None,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    pass_through: bool = True,
) -> tuple[asyncio.Transport, asyncio.BaseProtocol]:
    """``loop.create_connection`` over aiordma: connect (TCP handshake, then RDMA if both sides
    can, see :func:`aiordma.connect`), call ``protocol_factory()`` and its ``connection_made``,
    and return ``(transport, protocol)``.  The peer is an aiordma byte-stream server
    (:func:`create_server`, :func:`start_server` or :func:`aiordma.create_listener`).

    ``pass_through``: when the data goes over TCP (no RDMA, not TLS) and the server offers it too
    (:func:`create_server` does), the TCP connection is handed to the protocol after the
    handshake: asyncio's own transport calls it, with nothing of aiordma's in between
    (``get_extra_info("aiordma_passed_through")``).  Otherwise the transport is aiordma's
    :class:`Transport` (framed).

    Raises ``ConnectionRefusedError``/``OSError`` as asyncio does when TCP cannot connect,
    ``ConnectionResetError`` when the handshake failed, :class:`aiordma.RDMAUnavailableError`
    for ``transport="rdma"`` without a usable device."""
    settings = ClientSettings.of(locals())
    core = await _open_stream(host, port, settings)
    protocol = protocol_factory()
    tr = _transport_for(core, protocol, asyncio.get_running_loop())
    return tr, protocol


def _passed_transport(core: Core, protocol: asyncio.BaseProtocol) -> PassedTransport | None:
    """When the connection passed through: the TCP transport, handed to ``protocol`` and started
    (aborted if the protocol's first callbacks raise); else None."""
    passed = Nowait(core).pass_through(protocol)
    if passed is None:
        return None
    transport = PassedTransport(core, passed)
    try:
        transport._start(protocol)
    except BaseException:
        transport.abort()
        raise
    return transport


def _transport_for(core: Core, protocol: asyncio.BaseProtocol, loop: asyncio.AbstractEventLoop,
                   on_lost: Callable[[Transport], None] | None = None) -> asyncio.Transport:  # fmt: skip
    """The transport of an open connection, started (``connection_made`` called): the TCP
    connection's own if it passed through, else aiordma's."""
    passed = _passed_transport(core, protocol)
    if passed is not None:
        return passed
    tr = Transport(core, protocol, loop, on_lost=on_lost)
    try:
        tr._start()
    except BaseException:
        tr.abort()
        raise
    return tr


async def create_server(
    protocol_factory: ProtocolFactory,
    host: str | None = None,
    port: int | None = None,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | None = None,
    backlog: int = DEFAULT_BACKLOG,
    start_serving: bool = True,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
    max_handshakes_per_address: int | None = None,
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT,
    max_rdma_connections: int | None = None,
    max_pinned_bytes: int | None = None,
    pass_through: bool = True,
) -> Server:
    """``loop.create_server`` over aiordma: for each client, once its aiordma handshake completed,
    ``protocol_factory()`` gets a transport (``connection_made``): the TCP connection's own when
    it passed through (see :func:`create_connection`), else aiordma's :class:`Transport`.  Returns a
    :class:`Server` (an ``asyncio.AbstractServer``: ``async with``, ``serve_forever``, ``close``,
    ``wait_closed``, ``sockets``; ``close_clients``/``abort_clients`` close the transports).
    A client whose handshake fails never reaches the factory."""
    settings = ListenerSettings.of(locals())
    loop = asyncio.get_running_loop()
    # (weak: a transport that passed through is asyncio's, and ends without telling us)
    transports: weakref.WeakSet[asyncio.Transport] = weakref.WeakSet()

    async def handshake(core: Core) -> None:
        try:
            protocol = protocol_factory()
        except Exception as exc:
            loop.call_exception_handler({"message": "the protocol factory failed", "exception": exc})
            await core.aclose()
            return
        try:
            tr = _transport_for(core, protocol, loop, on_lost=transports.discard)
        except Exception as exc:
            loop.call_exception_handler({"message": "connection_made() failed", "exception": exc})
            return
        transports.add(tr)

    return await _listen(settings, host, port, handshake, start_serving=start_serving, transports=transports)
