"""Connected pairs of aiordma endpoints for tests.

``memory`` pairs run the real protocol core (handshake, framing, EOF, close)
over an in-memory byte pipe: no sockets, deterministic, fast -- what property
tests of code *using* aiordma want.  ``tcp`` and ``rdma`` pairs go through a
real listener on 127.0.0.1 (``rdma`` demands RDMA: strict policy).
"""

from __future__ import annotations

import errno
import os

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from anyio.abc import AsyncResource, ByteStream
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._api import Channel, Stream, connect, connect_channel, core_of, create_channel_listener, create_listener
from .._conn.core import Core
from .._tcp.links import StreamLink
from .._handshake.negotiate import client_handshake, server_handshake
from .._io.backends import send_points
from .._proto.protocol import DEFAULT_MAX_MESSAGE_SIZE, Connection, Mode, Role
from .._rdma.config import RdmaBackend
from .._rdma.discovery import rdma_address
from ._faults import Fault, FaultyChannel, FaultyStream, _Injector
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


class MemoryByteStream(ByteStream):
    """One end of an in-memory byte pipe with bounded buffering (backpressure).

    ``delays``: each chunk this end receives is handed over only after that many turns of the
    event loop (the sizes used in turn, cycled) -- a slower wire, measured in scheduling steps,
    not seconds, so that it replays.  :meth:`reset` ends the pipe as a TCP reset does."""

    #: a ``send`` delivers its item whole or, cancelled, not at all
    atomic_sends = True

    def __init__(self, send: MemoryObjectSendStream[bytes], receive: MemoryObjectReceiveStream[bytes],
                 delays: Sequence[int] = ()) -> None:  # fmt: skip
        if any(turns < 0 for turns in delays):
            raise ValueError("a delay is 0 or more turns of the event loop")
        self._send = send
        self._receive = receive
        self._pending = b""
        self._delays = tuple(delays)
        self._chunks = 0
        self.peer: MemoryByteStream | None = None
        self._reset = False  # (the peer reset the connection)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if not self._pending:
            try:
                self._pending = await self._receive.receive()
            except anyio.EndOfStream:  # the peer's side closed
                if self._reset:
                    raise anyio.BrokenResourceError("the connection was reset by the peer") from _reset_error()
                raise
            if self._delays:
                turns = self._delays[self._chunks % len(self._delays)]
                self._chunks += 1
                for _ in range(turns):
                    await anyio.lowlevel.checkpoint()
        data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
        return data

    async def send(self, item: bytes) -> None:
        # as a socket's send (trio's): a cancel point, the write at once when there is room, and
        # a schedule point after it that a cancellation does not interrupt
        before, after = send_points()
        await before()
        try:
            try:
                self._send.send_nowait(bytes(item))
            except anyio.WouldBlock:
                await self._send.send(bytes(item))  # (waits for room: cancelled, nothing was sent)
            else:
                await after()
        except anyio.BrokenResourceError:
            if self._reset:
                raise anyio.BrokenResourceError("the connection was reset by the peer") from _reset_error()
            raise anyio.BrokenResourceError("the peer closed its end of the memory pipe") from None

    async def send_eof(self) -> None:
        await self._send.aclose()

    def reset(self) -> None:
        """End the pipe both ways at once as an RST does: the peer reads what it had already
        been sent, then ``BrokenResourceError``; what it sends from now on is refused."""
        if self.peer is not None:
            self.peer._reset = True
        self._send.close()
        self._receive.close()

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return {}


def _reset_error() -> ConnectionResetError:
    return ConnectionResetError(errno.ECONNRESET, os.strerror(errno.ECONNRESET))


def memory_byte_stream_pair(max_buffered_chunks: int = 16, *,
                            delays: Sequence[int] = ()) -> tuple[MemoryByteStream, MemoryByteStream]:  # fmt: skip
    """Two connected in-memory byte streams (``delays``: see :class:`MemoryByteStream`, both ways)."""
    a_send, b_receive = anyio.create_memory_object_stream[bytes](max_buffered_chunks)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](max_buffered_chunks)
    a, b = MemoryByteStream(a_send, a_receive, delays), MemoryByteStream(b_send, b_receive, delays)
    a.peer, b.peer = b, a
    return a, b


async def _memory_cores(mode: Mode, max_message_size: int,
                        delays: Sequence[int] = ()) -> tuple[Core, Core, MemoryByteStream, MemoryByteStream]:  # fmt: skip
    a, b = memory_byte_stream_pair(delays=delays)
    now = anyio.current_time()
    client = StreamLink(a, Connection(Role.CLIENT, mode, now=now, max_message_size=max_message_size)).core
    server = StreamLink(b, Connection(Role.SERVER, mode, now=now, max_message_size=max_message_size)).core
    async with anyio.create_task_group() as tg:
        tg.start_soon(client_handshake, client, "tcp")
        tg.start_soon(server_handshake, server, "tcp")
    return client, server, a, b


def _host_for(kind: str) -> str:
    if kind != "rdma":  # "sim": the simulated device sits at 127.0.0.1
        return "127.0.0.1"
    address = rdma_address()
    if address is None:
        raise RuntimeError("no RDMA device with an IPv4 RoCEv2 address on this host")
    return address


async def _connected(mode: Mode, kind: str, max_message_size: int, backend: RdmaBackend | None) -> tuple[Core, Core]:
    """The cores of a client and the server's end, connected through a real listener (closed
    before this returns)."""
    send, receive = anyio.create_memory_object_stream[Any](1)
    host = _host_for(kind)
    transport = "rdma" if kind == "sim" else kind
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
    return core_of(client), core_of(server)


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
async def _pair(kind: PairKind, mode: Mode, max_message_size: int, backend: RdmaBackend | None,
                faults: Sequence[Fault], delays: Sequence[int]) -> AsyncIterator[tuple[Any, Any]]:  # fmt: skip
    if kind not in ("memory", "tcp", "sim", "rdma"):
        raise ValueError(f"no pair kind {kind!r} (have: memory, tcp, sim, rdma)")
    if delays and kind != "memory":
        raise ValueError("delays apply to memory pairs (a real or simulated wire has its own timing)")
    if kind == "sim" and backend is None:
        backend = simulated_backend()
    fabric = getattr(backend, "fabric", None) if kind == "sim" else None
    injector = _Injector(kind, faults, fabric) if faults else None  # (checks the schedule first)
    if kind == "memory":
        client, server, client_pipe, server_pipe = await _memory_cores(mode, max_message_size, delays)
        if injector is not None:
            injector.pipes = {"client": client_pipe, "server": server_pipe}
    else:
        client, server = await _connected(mode, kind, max_message_size, backend)
    plain: Any = Stream if mode is Mode.STREAM else Channel
    if injector is None:
        a, b = plain(client), plain(server)
        try:
            yield a, b
        finally:
            await aclose_together(a, b)
        return
    faulty: Any = FaultyStream if mode is Mode.STREAM else FaultyChannel
    a, b = faulty(client, injector, "client"), faulty(server, injector, "server")
    injector.ends = {"client": a, "server": b}
    try:
        if not injector.needs_tasks:
            yield a, b
            return
        try:
            async with anyio.create_task_group() as tg:  # (the holds' releases run in it)
                injector.task_group = tg
                try:
                    yield a, b
                finally:
                    injector.release()
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # (what the test raised: as it raised it)
            if len(group.exceptions) != 1:
                raise
            inner = group.exceptions[0]
            raise inner from inner.__cause__
    finally:
        injector.release()
        await aclose_together(a, b)


@asynccontextmanager
async def stream_pair(
    kind: PairKind = "memory",
    *,
    rdma_backend: RdmaBackend | None = None,
    faults: Sequence[Fault] = (),
    delays: Sequence[int] = (),
) -> AsyncIterator[tuple[Stream, Stream]]:
    """``async with stream_pair("tcp") as (client, server):`` -- connected byte streams, closed on exit.

    ``"sim"``: the RDMA transport over the simulated wire (any host; ``rdma_backend``
    may give a :func:`simulated_backend` with another config or fabric).

    ``faults``: a schedule of :class:`~aiordma.testing.Fault` (drawn by
    :func:`aiordma.testing.strategies.faults`); each side's calls are its steps, and a fault
    fires when its side starts the step after ``after`` (see :mod:`aiordma.testing._faults`).
    ``delays`` (``"memory"`` only): turns of the event loop before each chunk is delivered,
    cycled (:func:`aiordma.testing.strategies.delays`).  Both replay: the same schedule fires
    at the same point of the same conversation."""
    async with _pair(kind, Mode.STREAM, DEFAULT_MAX_MESSAGE_SIZE, rdma_backend, faults, delays) as pair:
        yield pair


@asynccontextmanager
async def channel_pair(
    kind: PairKind = "memory",
    *,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    rdma_backend: RdmaBackend | None = None,
    faults: Sequence[Fault] = (),
    delays: Sequence[int] = (),
) -> AsyncIterator[tuple[Channel, Channel]]:
    """``async with channel_pair("tcp") as (client, server):`` -- connected message channels
    (``faults``, ``delays``: as for :func:`stream_pair`)."""
    async with _pair(kind, Mode.MESSAGES, max_message_size, rdma_backend, faults, delays) as pair:
        yield pair
