"""aiordma.asyncio: the reader/writer and server behave like asyncio's streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

import aiordma
from aiordma.asyncio import StreamReader, StreamWriter

from ._asyncio_net import anyio_backend  # noqa: F401  (asyncio and uvloop)
from ._leaks import no_fd_leak


pytestmark = pytest.mark.anyio

Handler = Callable[[StreamReader, StreamWriter], Awaitable[None]]

#: whether both ends offer to pass through (set per test by ``streams``)
_PASS_THROUGH = [True]


@pytest.fixture(autouse=True, params=[True, False], ids=["passed", "framed"])
def streams(request: pytest.FixtureRequest) -> Any:
    """Every test runs with the streams passed through (the default: unframed after the
    handshake) and framed (``pass_through=False``)."""
    _PASS_THROUGH[0] = request.param
    yield request.param
    _PASS_THROUGH[0] = True


@asynccontextmanager
async def server_and_client(handler: Handler, **kwargs: Any) -> AsyncIterator[tuple[StreamReader, StreamWriter]]:
    """A server running ``handler`` and a client connected to it (``kwargs``: the client's;
    ``pass_through`` the server's too)."""
    pass_through = kwargs.setdefault("pass_through", _PASS_THROUGH[0])
    async with no_fd_leak():
        server = await aiordma.asyncio.start_server(handler, "127.0.0.1", 0, transport="tcp", pass_through=pass_through)
        async with server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await aiordma.asyncio.open_connection("127.0.0.1", port, transport="tcp", **kwargs)
            assert writer.get_extra_info("aiordma_passed_through") is pass_through
            try:
                yield reader, writer
            finally:
                writer.close()
                await writer.wait_closed()


async def echo(reader: StreamReader, writer: StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_echo_and_extra_info(anyio_backend: Any) -> None:
    async with server_and_client(echo) as (reader, writer):
        writer.write(b"hello ")
        writer.writelines([b"wor", b"ld"])
        await writer.drain()
        assert await reader.readexactly(11) == b"hello world"
        assert writer.get_extra_info("aiordma_transport") == "tcp"
        assert "transport='tcp' was requested" in writer.get_extra_info("aiordma_fallback_reason")
        assert writer.get_extra_info("peername")[0] == "127.0.0.1"
        assert writer.get_extra_info("no such thing", 42) == 42
        assert writer.can_write_eof() and not writer.is_closing()
    assert writer.is_closing()


async def test_read_variants(anyio_backend: Any) -> None:
    async def talker(reader: StreamReader, writer: StreamWriter) -> None:
        writer.write(b"line one\nline two\r\nEND|tail")
        await writer.drain()
        writer.write_eof()
        await reader.read()  # until the client closes
        writer.close()

    async with server_and_client(talker) as (reader, writer):
        assert await reader.readline() == b"line one\n"
        assert await reader.readuntil(b"\r\n") == b"line two\r\n"
        assert await reader.readuntil(b"|") == b"END|"
        assert await reader.read(2) == b"ta"
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readexactly(10)
        assert info.value.partial == b"il" and info.value.expected == 10
        assert await reader.read() == b""
        assert reader.at_eof()
        assert await reader.readline() == b""


async def test_read_all_until_eof_and_async_iteration(anyio_backend: Any) -> None:
    async def lines(reader: StreamReader, writer: StreamWriter) -> None:
        for i in range(100):
            writer.write(f"line {i}\n".encode())
        writer.write_eof()
        await writer.drain()
        await reader.read()
        writer.close()

    async with server_and_client(lines) as (reader, writer):
        got = [line async for line in reader]
        assert got == [f"line {i}\n".encode() for i in range(100)]


async def test_incomplete_readuntil_at_eof(anyio_backend: Any) -> None:
    async def partial(reader: StreamReader, writer: StreamWriter) -> None:
        writer.write(b"no separator")
        writer.write_eof()
        await reader.read()
        writer.close()

    async with server_and_client(partial) as (reader, writer):
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await reader.readuntil(b"\n")
        assert info.value.partial == b"no separator" and info.value.expected is None


async def test_limit_overrun(anyio_backend: Any) -> None:
    async def long_line(reader: StreamReader, writer: StreamWriter) -> None:
        writer.write(b"x" * 200 + b"\nshort\n" + b"y" * 300)
        await writer.drain()
        await reader.read()
        writer.close()

    async with server_and_client(long_line, limit=100) as (reader, writer):
        await anyio.sleep(0.05)
        with pytest.raises(asyncio.LimitOverrunError) as info:
            await reader.readuntil(b"\n")
        assert info.value.consumed == 200  # the separator was found past the limit; data stays
        assert len(await reader.readexactly(201)) == 201
        assert await reader.readline() == b"short\n"
        with pytest.raises(ValueError):
            await reader.readline()  # 300 bytes without newline, over the limit


async def test_half_close_from_the_client(anyio_backend: Any) -> None:
    async def upper(reader: StreamReader, writer: StreamWriter) -> None:
        data = await reader.read()  # to EOF
        writer.write(data.upper())
        await writer.drain()
        writer.close()

    async with server_and_client(upper) as (reader, writer):
        writer.write(b"shout")
        writer.write_eof()
        with pytest.raises(RuntimeError):
            writer.write(b"more")
        assert await reader.read() == b"SHOUT"


async def test_peer_breaking_the_protocol_is_a_connection_reset(anyio_backend: Any) -> None:
    async def vandal(reader: StreamReader, writer: StreamWriter) -> None:
        transport = writer.transport
        assert transport is not None
        transport.write(b"\x7f\x00\x00\x00\x00\x00\x00\x00")  # an unknown frame type, bypassing the framing
        await reader.read()
        writer.close()

    async with server_and_client(vandal, pass_through=False) as (reader, writer):  # (garbage in the framing)
        with pytest.raises(ConnectionResetError) as info:
            await reader.read(10)
        assert isinstance(info.value.__cause__, aiordma.RemoteProtocolError)
        with pytest.raises(ConnectionResetError):
            writer.write(b"x")
            await writer.drain()


async def test_peer_close_gives_eof_then_drain_fails(anyio_backend: Any) -> None:
    """Framed: the peer's CLOSE says it reads no more, so the next drain fails at once.  (A
    stream that passed through has TCP's semantics, as asyncio's own: the write goes to the
    kernel and only the peer's reset, later, fails a drain.)"""

    async def closer(reader: StreamReader, writer: StreamWriter) -> None:
        writer.write(b"bye")
        writer.close()
        await writer.wait_closed()

    async with server_and_client(closer, pass_through=False) as (reader, writer):
        assert await reader.read() == b"bye"
        writer.write(b"ignored, as asyncio does after a lost connection")
        with pytest.raises(ConnectionResetError):
            await writer.drain()


async def test_drain_applies_backpressure(anyio_backend: Any) -> None:
    release = asyncio.Event()

    async def slow(reader: StreamReader, writer: StreamWriter) -> None:
        await release.wait()
        total = 0
        while data := await reader.read(1 << 20):
            total += len(data)
        writer.write(str(total).encode())
        await writer.drain()
        writer.close()

    async with server_and_client(slow) as (reader, writer):
        payload = bytes(1 << 20)

        async def flood() -> int:
            for i in range(64):
                writer.write(payload)
                await writer.drain()
            return 64

        task = asyncio.ensure_future(flood())
        await asyncio.sleep(0.3)
        assert not task.done(), "64 MiB were drained although the server does not read"
        release.set()
        assert await asyncio.wait_for(task, 20) == 64
        writer.write_eof()
        assert int(await reader.read()) == 64 << 20


async def test_server_api(anyio_backend: Any) -> None:
    seen: list[str] = []

    async def handler(reader: StreamReader, writer: StreamWriter) -> None:
        seen.append((await reader.readline()).decode())
        writer.close()

    async with no_fd_leak():
        server = await aiordma.asyncio.start_server(handler, "127.0.0.1", 0, transport="tcp", start_serving=False)
        assert not server.is_serving()
        await server.start_serving()
        assert server.is_serving() and server.get_loop() is asyncio.get_running_loop()
        port = server.addresses[0][1]
        serve_task = asyncio.ensure_future(server.serve_forever())
        for i in range(5):
            reader, writer = await aiordma.asyncio.open_connection("127.0.0.1", port, transport="tcp")
            writer.write(f"client {i}\n".encode())
            await writer.drain()
            assert await reader.read() == b""
            writer.close()
            await writer.wait_closed()
        serve_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serve_task
        assert not server.is_serving()
        await server.wait_closed()
    assert sorted(seen) == [f"client {i}\n" for i in range(5)]


async def test_handler_exception_is_reported_and_connection_closed(anyio_backend: Any) -> None:
    loop = asyncio.get_running_loop()
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reports.append(context))

    async def broken(reader: StreamReader, writer: StreamWriter) -> None:
        raise RuntimeError("handler bug")

    try:
        async with server_and_client(broken) as (reader, writer):
            assert await reader.read() == b""  # the server closed the connection
        assert any(isinstance(r.get("exception"), RuntimeError) for r in reports)
    finally:
        loop.set_exception_handler(None)


async def test_strict_rdma_and_bad_arguments(anyio_backend: Any) -> None:
    from aiordma._rdma.discovery import probe

    if not probe().usable:
        with pytest.raises(aiordma.RDMAUnavailableError):
            await aiordma.asyncio.open_connection("127.0.0.1", 9, transport="rdma")
        with pytest.raises(aiordma.RDMAUnavailableError):
            await aiordma.asyncio.start_server(echo, "127.0.0.1", 0, transport="rdma")
    with pytest.raises(ValueError):
        await aiordma.asyncio.open_connection("127.0.0.1", 9, transport="carrier-pigeon")
