"""grpclib over aiordma (aiordma.grpc): unary and streaming calls, over TCP, over the simulated RC
wire and on a real device (``rdma``, the guest), under asyncio and uvloop; the service is the one
in examples/grpc_service.py."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("grpclib")

import aiordma.grpc  # noqa: E402
from grpclib.server import Server  # noqa: E402

from ._leaks import no_fd_leak  # noqa: E402
from ._asyncio_net import KINDS, Net, anyio_backend  # noqa: E402,F401

pytestmark = pytest.mark.anyio

_spec = importlib.util.spec_from_file_location(
    "grpc_service", Path(__file__).resolve().parent.parent / "examples" / "grpc_service.py"
)
assert _spec is not None and _spec.loader is not None
service = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(service)


async def _run(net: Net, body: Any) -> None:
    async with no_fd_leak():
        kw = net._kw()
        server = Server([service.Calculator()], codec=service.RawCodec())
        listening = await aiordma.grpc.start_server(server, net.host, 0, **kw)
        port = listening.sockets[0].getsockname()[1]
        try:
            async with aiordma.grpc.Channel(net.host, port, codec=service.RawCodec(), **net._kw()) as channel:
                await body(channel, server, listening)
        finally:
            server.close()
            with anyio.fail_after(20):
                await server.wait_closed()
            await asyncio.sleep(0.05)
    if net.kind == "sim":
        with anyio.fail_after(10):
            while any(net.live().values()):
                await asyncio.sleep(0.01)


@pytest.mark.guest_loops("uvloop")
@pytest.mark.parametrize("kind", KINDS)
async def test_unary_and_streaming_calls(anyio_backend: Any, kind: str) -> None:
    net = Net(kind)

    async def body(channel: aiordma.grpc.Channel, server: Server, listening: Any) -> None:
        stub = service.CalculatorStub(channel)
        with anyio.fail_after(60):
            assert await stub.Reverse(b"abc") == b"cba"
            assert channel.aiordma_transport == ("tcp" if kind.startswith("tcp") else "rdma")
            big = os.urandom(3 << 20)  # larger than HTTP/2's windows: flow control both ways
            assert await stub.Reverse(big) == big[::-1]
            # many calls at once on one connection (HTTP/2 streams multiplexed over it)
            words = [os.urandom(n) for n in range(1, 41)]
            answers = await asyncio.gather(*(stub.Reverse(w) for w in words))
            assert answers == [w[::-1] for w in words]
            async with stub.Running.open() as stream:
                total = 0
                for n in range(1, 21):
                    await stream.send_message(str(n).encode())
                    total += n
                    assert await stream.recv_message() == str(total).encode()
                await stream.end()
                assert await stream.recv_message() is None

    await _run(net, body)


async def test_a_call_after_the_server_went_away_fails(anyio_backend: Any) -> None:
    """As with grpclib's own server, ``close()`` stops accepting but an open connection still
    serves; once the connections are gone too (``abort_clients``), a call fails, not hangs."""
    from grpclib.exceptions import StreamTerminatedError

    net = Net("tcp")

    async def body(channel: aiordma.grpc.Channel, server: Server, listening: Any) -> None:
        stub = service.CalculatorStub(channel)
        assert await stub.Reverse(b"x") == b"x"
        server.close()
        await server.wait_closed()
        assert await stub.Reverse(b"still") == b"llits"  # (grpclib does the same)
        listening.abort_clients()
        with anyio.fail_after(20), pytest.raises((StreamTerminatedError, ConnectionError, OSError)):
            await stub.Reverse(b"again")

    await _run(net, body)


async def test_strict_rdma_without_a_device_is_refused(anyio_backend: Any) -> None:
    if Net("tcp").kind and os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has an RDMA device")
    server = Server([service.Calculator()], codec=service.RawCodec())
    with pytest.raises(aiordma.RDMAUnavailableError):
        await aiordma.grpc.start_server(server, "127.0.0.1", 0, transport="rdma")
    with pytest.raises(ValueError):
        aiordma.grpc.Channel(path="/tmp/x.sock")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_server_that_closes_right_after_answering_delivers_the_answer(anyio_backend: Any, kind: str) -> None:
    """The server writes a large answer and closes its connection at once (``transport.close()``
    under grpclib, while most of the answer is still on its way); the answer arrives whole."""
    net = Net(kind)
    answered = asyncio.Event()

    class Closing(service.Calculator):  # type: ignore[misc,name-defined]
        async def reverse(self, stream: Any) -> None:
            await super().reverse(stream)
            answered.set()

    async with no_fd_leak():
        server = Server([Closing()], codec=service.RawCodec())
        listening = await aiordma.grpc.start_server(server, net.host, 0, **net._kw())
        port = listening.sockets[0].getsockname()[1]
        try:
            async with aiordma.grpc.Channel(net.host, port, codec=service.RawCodec(), **net._kw()) as channel:
                stub = service.CalculatorStub(channel)
                big = os.urandom(5 << 20)
                with anyio.fail_after(60):
                    call = asyncio.ensure_future(stub.Reverse(big))
                    await answered.wait()
                    await asyncio.sleep(0.01)  # (grpclib writes the trailers after the handler)
                    for handler in list(server._handlers):
                        handler.close()  # each connection's transport.close(), the answer in flight
                    assert await call == big[::-1]
        finally:
            server.close()
            with anyio.fail_after(20):
                await server.wait_closed()
