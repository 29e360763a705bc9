"""Closing right after writing delivers it, on the asyncio front ends: the reader/writer and the
Transport/Protocol API, over TCP, the simulated wire and (in the guest) a real device.  The
transport's own races are forced in tests/test_close.py; grpclib and Dask have theirs in their files."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import anyio
import pytest

import aiordma
import aiordma.asyncio as aa

from ._leaks import no_fd_leak
from ._asyncio_net import KINDS, Net, anyio_backend  # noqa: F401

pytestmark = pytest.mark.anyio

SIZE = 9 << 20  # over the RDMA rendezvous threshold: StreamWriter.write goes through the SEND slots


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("closer", ["server", "client"])
async def test_a_stream_writer_closed_right_after_writing_delivers_it(anyio_backend: Any, kind: str, closer: str) -> None:
    net = Net(kind)
    payload = os.urandom(SIZE)
    got: dict[str, bytes] = {}

    async def write_and_close(writer: aa.StreamWriter) -> None:
        writer.write(payload)
        writer.close()  # at once: what was written is still in the link's buffers
        await writer.wait_closed()

    async def read_late(reader: aa.StreamReader) -> bytes:
        await asyncio.sleep(0.2)
        return await reader.read()  # to EOF

    async def handler(reader: aa.StreamReader, writer: aa.StreamWriter) -> None:
        if closer == "server":
            await write_and_close(writer)
        else:
            got["data"] = await read_late(reader)
            writer.close()

    async with no_fd_leak():
        server = await aa.start_server(handler, net.host, 0, **net._kw())
        async with server:
            reader, writer = await aa.open_connection(net.host, server.sockets[0].getsockname()[1], **net._kw())
            with anyio.fail_after(60):
                if closer == "server":
                    got["data"] = await read_late(reader)
                    writer.close()
                else:
                    await write_and_close(writer)
                    while "data" not in got:
                        await asyncio.sleep(0.01)
            await writer.wait_closed()
    assert got["data"] == payload


class Sender(asyncio.Protocol):
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.payload)
        transport.close()  # at once


class LateReader(asyncio.Protocol):
    def __init__(self) -> None:
        self.data = bytearray()
        self.events: list[str] = []
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.ReadTransport)
        transport.pause_reading()
        asyncio.get_running_loop().call_later(0.2, transport.resume_reading)

    def data_received(self, data: bytes) -> None:
        self.data += data

    def eof_received(self) -> None:
        self.events.append("eof")

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(exc)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_protocol_transport_closed_right_after_writing_delivers_it(anyio_backend: Any, kind: str) -> None:
    net = Net(kind)
    payload = os.urandom(SIZE)
    async with no_fd_leak():
        server = await net.server(lambda: Sender(payload))
        async with server:
            _transport, protocol = await net.connect(LateReader, server.sockets[0].getsockname()[1])
            with anyio.fail_after(60):
                exc = await protocol.lost
    assert exc is None
    assert protocol.events == ["eof"]
    assert bytes(protocol.data) == payload
