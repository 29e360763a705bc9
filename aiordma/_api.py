"""The anyio front end: byte streams, message channels and their listeners.

These functions and classes work under asyncio, asyncio on uvloop and trio.
Under asyncio the TCP link is an ``asyncio.BufferedProtocol``; under trio it is
trio's socket through anyio.

Cancellation: cancelling ``receive`` loses nothing (bytes or messages that
arrived stay buffered for the next call).  Cancelling ``send`` may leave the
data partly written, as with any anyio stream; the connection is then in an
unknown state and should be closed.  ``aclose`` always releases the
connection, also when cancelled.
"""

from __future__ import annotations

import logging
import ssl as _ssl
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar

import anyio
from anyio import BusyResourceError
from anyio.abc import ByteStream, Listener, ObjectStream, SocketAttribute, TaskGroup

from ._conn import remote as _remote
from ._attributes import TransportAttribute
from ._conn.core import Core
from ._conn.memory import RegisteredMemory
from ._conn.stats import connection_stats
from ._proto.onesided import RemoteBuffer
from ._tcp.accept import Acceptor
from ._proto.admission import DEFAULT_BACKLOG, DEFAULT_HELLO_TIMEOUT
from ._handshake.limits import DEFAULT_MAX_HANDSHAKES
from ._tcp.links import DEFAULT_KEEPALIVE
from ._handshake.negotiate import Options, accept_handshake, open_client
from ._handshake.settings import ClientSettings, ListenerSettings, listen
from ._proto.protocol import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_MESSAGE_SIZE, Mode
from ._rdma.config import RdmaBackend
from ._rdma.device import DeviceHold

__all__ = [
    "Stream",
    "Channel",
    "StreamListener",
    "ChannelListener",
    "connect",
    "connect_channel",
    "create_listener",
    "create_channel_listener",
]

log = logging.getLogger("aiordma")

T = TypeVar("T")


class _Guard:
    """Raises ``BusyResourceError`` when two tasks do the same thing at once."""

    __slots__ = ("_action", "_busy")

    def __init__(self, action: str) -> None:
        self._action = action
        self._busy = False

    def __enter__(self) -> None:
        if self._busy:
            raise BusyResourceError(self._action)
        self._busy = True

    def __exit__(self, *exc: object) -> None:
        self._busy = False


def _registered_view(item: Any) -> Any:
    """``send`` also takes registered memory (a RegisteredBuffer, a register() handle).

    Over RDMA (the native path) a send from registered memory of at least the rendezvous
    threshold is zero copy: the peer READs the caller's pages, which are the NIC's until ``send`` returns (at the
    peer's RNDV_DONE).  Cancelled before that, the memory is the caller's again when ``send``
    raises and the connection fails (what was announced can no longer be READ): see
    docs/architecture.md, "Rendezvous", step 5."""
    if isinstance(item, RegisteredMemory):
        return item.view
    raise TypeError(f"send() takes bytes, not {type(item).__name__}")


def core_of(endpoint: _Endpoint) -> Core:
    """The Core under a stream or channel (for aiordma.testing, which wraps endpoints)."""
    return endpoint._core


class _Endpoint:
    """What streams and channels share: the Core and the typed attributes."""

    def __init__(self, core: Core) -> None:
        self._core = core

    @property
    def transport(self) -> str:
        """``"tcp"`` or ``"rdma"``."""
        return self._core.transport

    @property
    def fallback_reason(self) -> str:
        """Why this connection runs on TCP (``""`` on RDMA)."""
        return self._core.fallback_reason

    def _attributes(self) -> Mapping[Any, Callable[[], Any]]:
        core = self._core
        proto = core.proto
        peer = proto.peer_hello
        attrs: dict[Any, Callable[[], Any]] = dict(core.link.extra_attributes)
        attrs.update(
            {
                TransportAttribute.transport: lambda: core.transport,
                TransportAttribute.fallback_reason: lambda: core.fallback_reason,
                TransportAttribute.mode: lambda: "stream" if proto.mode is Mode.STREAM else "messages",
                TransportAttribute.max_message_size: lambda: proto.max_message_size,
                TransportAttribute.stats: lambda: connection_stats(core),
            }
        )
        if peer is not None:
            attrs[TransportAttribute.peer_max_message_size] = lambda: peer.max_message_size
        return attrs

    async def send_eof(self) -> None:
        """Half-close: no more sends; receiving goes on."""
        await self._core.send_eof()

    # -- one-sided remote memory (see aiordma._proto.onesided and aiordma._conn.remote) ----------------------

    def expose(
        self, buffer: Any, *, read: bool = True, write: bool = False, revoke_timeout: float = _remote.REVOKE_TIMEOUT
    ) -> AbstractAsyncContextManager[RemoteBuffer]:
        """``async with conn.expose(buf, read=True, write=True) as remote:`` -- let the peer READ
        and/or WRITE ``buf`` on this connection until the block exits; ``remote.to_bytes()`` is
        the descriptor to send it.

        Over RDMA the peer's NIC reaches ``buf`` directly (a registration made for this exposure
        alone); over TCP this side's aiordma serves the peer's requests.  Leaving the block
        revokes the descriptor: the peer confirms that its operations on it are done (within
        ``revoke_timeout``), then the registration goes.  ``buf`` must stay alive and unchanged
        in size meanwhile (a :class:`RegisteredBuffer` cannot be closed while exposed)."""
        return _remote.expose(self._core, buffer, read=read, write=write, revoke_timeout=revoke_timeout)

    async def read(self, remote: RemoteBuffer, into: Any, *, offset: int = 0, length: int | None = None) -> int:
        """Copy ``length`` bytes (default: ``len(into)``) at ``offset`` of the peer's exposed
        memory into ``into`` (RDMA READ; zero-copy when ``into`` is registered memory); returns
        the count.  Checked before anything is posted: a descriptor of another connection, a
        revoked one, an access not granted or a range outside raise a :class:`RemoteMemoryError`
        and touch nothing.  Cancellation: see :mod:`aiordma._conn.remote`."""
        return await _remote.read(self._core, remote, into, offset, length)

    async def write(self, remote: RemoteBuffer, data: Any, *, offset: int = 0, notify: bool = False) -> None:
        """Write ``data`` at ``offset`` of the peer's exposed memory (RDMA WRITE); returns once it
        landed.  ``notify=True`` also tells the exposer (its ``written()`` returns the range)."""
        await _remote.write(self._core, remote, data, offset, notify)

    async def written(self, remote: RemoteBuffer) -> tuple[int, int]:
        """The exposer's side: wait for the next write into ``remote`` that landed and was
        announced (every write over TCP; ``notify=True`` ones over RDMA): ``(offset, length)``."""
        return await _remote.written(self._core, remote)

    async def aclose(self) -> None:
        """Send CLOSE (bounded) and release the connection; idempotent, also when cancelled."""
        await self._core.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self._attributes()


class Stream(_Endpoint, ByteStream):
    """A byte stream over one aiordma connection (``anyio.abc.ByteStream``).

    * ``receive`` returns at least one byte, raises ``EndOfStream`` after the
      peer's ``send_eof``/``aclose`` once everything sent before it was read,
      ``BrokenResourceError`` when the connection failed, ``ClosedResourceError``
      after our own ``aclose``, and ``BusyResourceError`` if another task is
      already receiving.
    * ``send`` writes all of ``item`` before returning (backpressure: it waits
      while the peer does not read); concurrent sends are serialized, each one
      whole.  After ``send_eof`` it raises ``ClosedResourceError``.
    """

    def __init__(self, core: Core) -> None:
        super().__init__(core)
        self._receive_guard = _Guard("another task is already receiving from this stream")

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        with self._receive_guard:
            return await self._core.receive_bytes(max_bytes)

    async def receive_into(self, buffer: Any) -> int:
        """Receive at least one and at most ``len(buffer)`` bytes into ``buffer`` (any writable
        buffer, a :class:`RegisteredBuffer` included); returns the count.  Raises like ``receive``."""
        view = _remote._byte_view(buffer, writable=True)
        if not view.nbytes:
            raise ValueError("receive_into needs a buffer of at least one byte")
        with self._receive_guard:
            return await self._core.receive_bytes_into(view)

    async def send(self, item: bytes) -> None:
        if not isinstance(item, (bytes, bytearray, memoryview)):
            item = _registered_view(item)
        if not item:
            await self._core.checkpoint()
            self._core.check_send()
            return
        await self._core.send_data(item)



class Channel(_Endpoint, ObjectStream[bytes]):
    """A message channel (``anyio.abc.ObjectStream[bytes]``): every ``send``
    arrives as one ``receive``, empty messages included, in order.

    Messages larger than the peer's ``max_message_size`` are refused by ``send``
    with :class:`~aiordma.LocalProtocolError` before anything is sent (the
    channel stays usable).  Several tasks may send and receive at once; each
    message goes whole to exactly one receiver.  ``async for message in
    channel`` ends at the peer's EOF or close.
    """

    # These two hand out the Core's coroutine (one frame fewer per message on the hot path);
    # awaiting it is what anyio's ``async def`` contract asks for.

    def receive(self) -> Coroutine[Any, Any, bytes]:
        return self._core.receive_message()

    async def receive_into(self, buffer: Any) -> int:
        """Place the next message in ``buffer`` (any writable buffer, a :class:`RegisteredBuffer`
        included) and return its length.  A message larger than ``buffer`` raises
        :class:`~aiordma.BufferTooSmallError` (``.needed`` says how large) and stays queued:
        nothing is lost, the next call gets it.  Raises like ``receive`` otherwise."""
        return await self._core.receive_message_into(_remote._byte_view(buffer, writable=True))

    def send(self, item: bytes) -> Coroutine[Any, Any, None]:
        if not isinstance(item, (bytes, bytearray, memoryview)):
            item = _registered_view(item)
        return self._core.send_data(item)



async def connect(
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
) -> Stream:
    """Connect to an aiordma byte-stream listener; returns a :class:`Stream`.

    ``transport`` is ``"auto"`` (RDMA when both sides can, else TCP with the
    reason in ``fallback_reason``), ``"rdma"`` (strict: raise
    :class:`~aiordma.RDMAUnavailableError` instead of falling back) or
    ``"tcp"``; ``None`` reads ``$AIORDMA_TRANSPORT``.  ``ssl`` wraps the TCP
    connection in TLS (``True`` for a default client context); TLS connections
    always carry their data on TCP.  Raises ``OSError`` when the TCP connection
    fails and :class:`~aiordma.HandshakeError` when the peer is no aiordma
    byte-stream listener or does not answer within ``handshake_timeout``.
    ``rdma_backend`` (an :class:`aiordma.RdmaBackend`) sets the RDMA sizes and
    timeouts (``RdmaBackend(RdmaConfig(...))``); tests inject failing ones.
    """
    settings = ClientSettings.of(locals())
    return Stream(await open_client(host, port, Mode.STREAM, settings.options()))


async def connect_channel(
    host: str,
    port: int,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | bool | None = None,
    server_hostname: str | None = None,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
) -> Channel:
    """Connect to an aiordma channel listener; returns a :class:`Channel`.

    ``max_message_size`` bounds the messages this side accepts (the peer's own
    limit bounds what we may send).  Other arguments as for :func:`connect`.
    """
    settings = ClientSettings.of(locals())
    return Channel(await open_client(host, port, Mode.MESSAGES, settings.options()))


# -- listeners -------------------------------------------------------------------
#
# Accepting and admission (who gets a handshake, when) are aiordma._tcp.accept's and
# aiordma._proto.admission's: the same for these listeners and for aiordma.asyncio's servers.


E = TypeVar("E", Stream, Channel)


class _BaseListener(Generic[E]):
    _wrap: Callable[[Core], E]

    def __init__(self, acceptor: Acceptor, opts: Options) -> None:
        self._acceptor = acceptor
        self._opts = opts
        self._closed = False
        self._devices = DeviceHold()

    @property
    def addresses(self) -> list[Any]:
        """The bound socket addresses (``(host, port, ...)`` tuples)."""
        return self._acceptor.addresses()

    @property
    def port(self) -> int:
        """The bound TCP port (useful after binding port 0)."""
        return int(self.addresses[0][1])

    async def serve(self, handler: Callable[[E], Any], task_group: TaskGroup | None = None) -> None:
        """Accept connections forever, calling ``handler`` in a task for each one.

        The handshake runs in that task first.  As with anyio's listeners, the
        handler owns the stream (close it, e.g. ``async with stream:``).

        One connection never ends ``serve`` nor touches another connection:
        whatever ends a connection -- a client that fails its handshake (bad
        bytes, a timeout, a reset, TLS), or a handler that raises -- is logged
        once (logger ``aiordma``, with the client's address and the reason)
        and ends that connection alone (a stream its handler left open is
        closed).  ``serve`` returns when the listener is closed (once the
        connections it handed out ended), and is cancelled with its task
        group; what is not an ``Exception`` (``KeyboardInterrupt``,
        ``SystemExit``) still propagates.
        """
        if self._closed:
            raise anyio.ClosedResourceError

        async def handle(core: Core) -> None:
            await handler(self._wrap(core))

        async def handshake(core: Core) -> None:
            await accept_handshake(core, self._opts, self._devices)

        if task_group is None:
            async with anyio.create_task_group() as tg:
                await self._acceptor.serve(handle, tg.start_soon, handshake)
        else:
            await self._acceptor.serve(handle, task_group.start_soon, handshake)

    async def aclose(self) -> None:
        """Stop listening (connections already handed out stay open)."""
        if not self._closed:
            self._closed = True
            await self._acceptor.aclose()
            self._devices.release()

    def _listener_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        addresses = self.addresses
        return {
            SocketAttribute.local_address: lambda: addresses[0],
            SocketAttribute.local_port: lambda: addresses[0][1],
            TransportAttribute.transport: lambda: self._opts.transport,
        }


class StreamListener(_BaseListener[Stream], Listener[Stream]):
    """Accepts aiordma byte streams (``anyio.abc.Listener[Stream]``)."""

    _wrap = Stream

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self._listener_attributes()


class ChannelListener(_BaseListener[Channel], Listener[Channel]):
    """Accepts aiordma message channels (``anyio.abc.Listener[Channel]``)."""

    _wrap = Channel

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self._listener_attributes()


async def create_listener(
    host: str | None,
    port: int,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | None = None,
    backlog: int = DEFAULT_BACKLOG,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
    max_handshakes_per_address: int | None = None,
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT,
    max_rdma_connections: int | None = None,
    max_pinned_bytes: int | None = None,
) -> StreamListener:
    """Listen for aiordma byte streams on ``host``/``port`` (port 0: any free port).

    With ``transport="rdma"`` it raises :class:`~aiordma.RDMAUnavailableError`
    at once when this host cannot do RDMA, and refuses clients that cannot.

    Admission (no client is refused for a burst): at most ``max_handshakes`` handshakes run at
    once (``max_handshakes_per_address`` for one peer address, default half of it); the others
    wait -- up to ``backlog`` accepted, then in the kernel's listen backlog of that size.  A
    connection that sends not one byte within ``hello_timeout`` seconds (10) is dropped as
    silent, and so is the oldest silent one when the queue is full; one that started has
    ``handshake_timeout`` in all, and gives its slot to a ready client only once nothing moved
    on it for half of that (stalled: slow is not hostile).  Each drop is logged with its reason
    (logger ``aiordma``).  ``max_rdma_connections`` and
    ``max_pinned_bytes`` bound what RDMA clients may pin (defaults: half of the process's pinned
    limit, RLIMIT_MEMLOCK); beyond them a client gets TCP, with the limit in the reason.
    """
    settings = ListenerSettings.of(locals())
    return StreamListener(*await listen(host, port, Mode.STREAM, settings))


async def create_channel_listener(
    host: str | None,
    port: int,
    *,
    transport: str | None = None,
    ssl: _ssl.SSLContext | None = None,
    backlog: int = DEFAULT_BACKLOG,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    rdma_backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES,
    max_handshakes_per_address: int | None = None,
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT,
    max_rdma_connections: int | None = None,
    max_pinned_bytes: int | None = None,
) -> ChannelListener:
    """Listen for aiordma message channels; see :func:`create_listener`."""
    settings = ListenerSettings.of(locals())
    return ChannelListener(*await listen(host, port, Mode.MESSAGES, settings))
