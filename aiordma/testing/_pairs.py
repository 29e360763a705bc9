"""Connected pairs of aiordma endpoints for tests.

``memory`` pairs run the real protocol core (handshake, framing, EOF, close)
over an in-memory byte pipe: no sockets, deterministic, fast -- what property
tests of code *using* aiordma want.  ``tcp`` and ``rdma`` pairs go through a
real listener on 127.0.0.1 (``rdma`` demands RDMA: strict policy).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeVar

import anyio
from anyio.abc import AsyncResource, ByteStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._api import Channel, Stream, connect, connect_channel, create_channel_listener, create_listener
from .._conn.core import Core
from .._tcp.links import StreamLink
from .._handshake.negotiate import client_handshake, server_handshake
from .._proto.protocol import DEFAULT_MAX_MESSAGE_SIZE, Connection, Mode, Role
from .._rdma.config import RdmaBackend
from ._sim import simulated_backend

__all__ = [
    "MemoryByteStream",
    "memory_byte_stream_pair",
    "stream_pair",
    "channel_pair",
    "rdma_address",
    "aclose_together",
]

PairKind = Literal["memory", "tcp", "rdma", "sim"]
E = TypeVar("E", Stream, Channel)


class MemoryByteStream(ByteStream):
    """One end of an in-memory byte pipe with bounded buffering (backpressure)."""

    #: a ``send`` delivers its item whole or, cancelled, not at all
    atomic_sends = True

    def __init__(self, send: MemoryObjectSendStream[bytes], receive: MemoryObjectReceiveStream[bytes]) -> None:
        self._send = send
        self._receive = receive
        self._pending = b""

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self._pending:
            self._pending = await self._receive.receive()  # EndOfStream when the peer's side closed
        data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return data

    async def send(self, item: bytes) -> None:
        try:
            await self._send.send(bytes(item))
        except anyio.BrokenResourceError:
            raise anyio.BrokenResourceError("the peer closed its end of the memory pipe") from None

    async def send_eof(self) -> None:
        await self._send.aclose()

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return {}


def memory_byte_stream_pair(max_buffered_chunks: int = 16) -> tuple[MemoryByteStream, MemoryByteStream]:
    """Two connected in-memory byte streams."""
    a_send, b_receive = anyio.create_memory_object_stream[bytes](max_buffered_chunks)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](max_buffered_chunks)
    return MemoryByteStream(a_send, a_receive), MemoryByteStream(b_send, b_receive)


async def _memory_cores(mode: Mode, max_message_size: int) -> tuple[Core, Core]:
    a, b = memory_byte_stream_pair()
    now = anyio.current_time()
    client = StreamLink(a, Connection(Role.CLIENT, mode, now=now, max_message_size=max_message_size)).core
    server = StreamLink(b, Connection(Role.SERVER, mode, now=now, max_message_size=max_message_size)).core
    async with anyio.create_task_group() as tg:
        tg.start_soon(client_handshake, client, "tcp")
        tg.start_soon(server_handshake, server, "tcp")
    return client, server


def rdma_address() -> str | None:
    """A local IPv4 address that an RDMA device serves (RoCEv2 GID), or None."""
    from .._rdma.discovery import list_devices

    for device in list_devices(query_verbs=False):
        for port in device.ports:
            if port.state != "ACTIVE":
                continue
            for entry in port.gids:
                if entry.gid_type == "RoCEv2" and entry.gid.ipv4_mapped is not None:
                    return str(entry.gid.ipv4_mapped)
    return None


def _host_for(kind: str) -> str:
    if kind != "rdma":  # "sim": the simulated device sits at 127.0.0.1
        return "127.0.0.1"
    address = rdma_address()
    if address is None:
        raise RuntimeError("no RDMA device with an IPv4 RoCEv2 address on this host")
    return address


@asynccontextmanager
async def _tcp_pair(
    mode: Mode, kind: str, max_message_size: int, wrap: Callable[[Core], E], backend: RdmaBackend | None = None
) -> AsyncIterator[tuple[E, E]]:
    send, receive = anyio.create_memory_object_stream[Any](1)
    host = _host_for(kind)
    transport = "rdma" if kind == "sim" else kind
    if kind == "sim" and backend is None:
        backend = simulated_backend()
    listener: Any
    if mode is Mode.STREAM:
        listener = await create_listener(host, 0, transport=transport, rdma_backend=backend)
    else:
        listener = await create_channel_listener(
            host, 0, transport=transport, max_message_size=max_message_size, rdma_backend=backend
        )
    async with listener, send, receive:

        async def handler(endpoint: Any) -> None:
            await send.send(endpoint)

        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            if mode is Mode.STREAM:
                client: Any = await connect(host, listener.port, transport=transport, rdma_backend=backend)
            else:
                client = await connect_channel(
                    host, listener.port, transport=transport, max_message_size=max_message_size, rdma_backend=backend
                )
            server = await receive.receive()
            tg.cancel_scope.cancel()
    try:
        yield client, server
    finally:
        await aclose_together(client, server)


async def aclose_together(*endpoints: AsyncResource) -> None:
    """Close every endpoint at once, each in its own task, as independent peers do; shielded.

    Both ends of a pair held by one task must not be closed one after the other: a close waits
    until the peer has everything it was sent (a socket's linger), so closing the sender first
    while its reader, closed next, has not read waits as long as that reader stays alive --
    for ever, here.  Raises the first error a close raised (after every close finished)."""
    errors: list[BaseException] = []

    async def close(endpoint: AsyncResource) -> None:
        try:
            await endpoint.aclose()
        except Exception as exc:  # noqa: BLE001 -- reported after the others closed
            errors.append(exc)

    with anyio.CancelScope(shield=True):
        async with anyio.create_task_group() as tg:
            for endpoint in endpoints:
                tg.start_soon(close, endpoint)
    if errors:
        raise errors[0]


@asynccontextmanager
async def _pair(
    kind: PairKind, mode: Mode, max_message_size: int, wrap: Callable[[Core], E], backend: RdmaBackend | None = None
) -> AsyncIterator[tuple[E, E]]:
    if kind != "memory":
        async with _tcp_pair(mode, kind, max_message_size, wrap, backend) as pair:
            yield pair
        return
    client, server = await _memory_cores(mode, max_message_size)
    a, b = wrap(client), wrap(server)
    try:
        yield a, b
    finally:
        await aclose_together(a, b)


@asynccontextmanager
async def stream_pair(
    kind: PairKind = "memory", *, rdma_backend: RdmaBackend | None = None
) -> AsyncIterator[tuple[Stream, Stream]]:
    """``async with stream_pair("tcp") as (client, server):`` -- connected byte streams, closed on exit.

    ``"sim"``: the RDMA transport over the simulated wire (any host; ``rdma_backend``
    may give a :func:`simulated_backend` with another config or fabric)."""
    async with _pair(kind, Mode.STREAM, DEFAULT_MAX_MESSAGE_SIZE, Stream, rdma_backend) as pair:
        yield pair


@asynccontextmanager
async def channel_pair(
    kind: PairKind = "memory",
    *,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    rdma_backend: RdmaBackend | None = None,
) -> AsyncIterator[tuple[Channel, Channel]]:
    """``async with channel_pair("tcp") as (client, server):`` -- connected message channels."""
    async with _pair(kind, Mode.MESSAGES, max_message_size, Channel, rdma_backend) as pair:
        yield pair
