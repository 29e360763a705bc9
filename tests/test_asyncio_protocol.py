"""aiordma.asyncio's Transport/Protocol API calls protocols as asyncio's own TCP transport does.

Every scenario runs on asyncio's TCP transport itself (``ref``: ``loop.create_server`` /
``loop.create_connection``) and on aiordma's, over TCP (``tcp``), over the simulated RC wire
(``sim``) and on a real device (``rdma``, the guest), under asyncio and uvloop; the test compares
the callback sequences each side recorded with the reference's, so "as asyncio does" is checked
against asyncio, not against a list written here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

import aiordma
import aiordma.asyncio as aa

from ._leaks import no_fd_leak
from ._asyncio_net import KINDS, Net, anyio_backend  # noqa: F401  (asyncio and uvloop)

pytestmark = pytest.mark.anyio


class Rec(asyncio.Protocol):
    """Records its callbacks (a plain Protocol: ``data_received``; :class:`BufRec`: a BufferedProtocol)."""

    def __init__(self, *, eof: Any = None, echo: bool = False, buffer: int = 0, on_data: Any = None) -> None:
        self.events: list[Any] = []
        self.data = bytearray()
        self.eof_answer = eof
        self.echo = echo
        self.on_data = on_data
        self.transport: Any = None
        loop = asyncio.get_running_loop()
        self.got: asyncio.Event = asyncio.Event()
        self.made = loop.create_future()
        self.lost = loop.create_future()
        self._buf = bytearray(buffer) if buffer else None

    def _note(self, what: str) -> None:
        if not self.events or self.events[-1] != what:  # (chunking differs between transports)
            self.events.append(what)
        self.got.set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self._note("made")
        self.made.set_result(None)

    def _received(self, data: bytes) -> None:
        self._note("data")
        self.data += data
        self.got.set()
        if self.echo:
            self.transport.write(data)
        if self.on_data is not None:
            self.on_data(self, data)

    def eof_received(self) -> Any:
        self._note("eof")
        self.got.set()
        return self.eof_answer

    def pause_writing(self) -> None:
        self._note("pause_writing")

    def resume_writing(self) -> None:
        self._note("resume_writing")

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(("lost", None if exc is None else type(exc).__name__))
        self.got.set()
        if not self.lost.done():
            self.lost.set_result(exc)

    async def until(self, pred: Callable[[], bool], timeout: float = 20) -> None:
        with anyio.fail_after(timeout):
            while not pred():
                self.got.clear()
                await self.got.wait()


    def data_received(self, data: bytes) -> None:
        self._received(data)


PlainRec = Rec


class BufRec(Rec, asyncio.BufferedProtocol):
    """The same recorder as an ``asyncio.BufferedProtocol`` with a 7-byte buffer."""

    def get_buffer(self, sizehint: int) -> memoryview:
        assert self._buf is not None
        return memoryview(self._buf)

    def buffer_updated(self, nbytes: int) -> None:
        assert self._buf is not None
        self._received(bytes(self._buf[:nbytes]))


def protocol(buffered: bool = False, **kw: Any) -> Rec:
    return BufRec(buffer=7, **kw) if buffered else Rec(**kw)


@asynccontextmanager
async def opened(net: Net, server_kw: dict[str, Any], client_kw: dict[str, Any]) -> AsyncIterator[tuple[Rec, Rec, Any]]:
    servers: list[Rec] = []

    def make() -> Rec:
        rec = protocol(**server_kw)
        servers.append(rec)
        return rec

    async with no_fd_leak():
        server = await net.server(make)
        try:
            port = server.sockets[0].getsockname()[1]
            _, client = await net.connect(lambda: protocol(**client_kw), port)
            with anyio.fail_after(20):
                while not servers:
                    await asyncio.sleep(0.005)
                await servers[0].made
            yield client, servers[0], server
            with anyio.fail_after(20):
                await client.lost
                await servers[0].lost
        finally:
            server.close()
            await server.wait_closed()
            await asyncio.sleep(0.05)  # (the RDMA teardown after connection_lost(None) of an abort)
    if net.kind == "sim":
        with anyio.fail_after(10):
            while any(net.live().values()):
                await asyncio.sleep(0.01)


# -- the scenarios: each returns what both ends recorded ------------------------------------------


async def sc_echo_then_client_eof(net: Net, buffered: bool) -> Any:
    payload = bytes(range(256)) * 80  # (in 7-byte buffers: ~3000 deliveries and echoes)
    async with opened(net, {"echo": True, "buffered": buffered}, {"buffered": buffered}) as (client, server, _):
        for i in range(0, len(payload), 10000):
            client.transport.write(payload[i : i + 10000])
        await client.until(lambda: len(client.data) >= len(payload))
        assert client.transport.can_write_eof()
        client.transport.write_eof()  # the server's eof_received returns None: it closes
        with pytest.raises(RuntimeError):
            client.transport.write(b"after eof")
        await client.until(lambda: client.lost.done())
    assert client.data == payload and server.data == payload
    return client.events, server.events


async def sc_server_keeps_writing_after_eof(net: Net, buffered: bool) -> Any:
    def bye(rec: Rec, data: bytes) -> None:
        pass

    async with opened(net, {"eof": True, "buffered": buffered}, {"buffered": buffered}) as (
        client,
        server,
        _,
    ):
        client.transport.write(b"request")
        client.transport.write_eof()
        await server.until(lambda: "eof" in server.events)
        assert not server.transport.is_closing()
        server.transport.write(b"answer after your EOF")
        server.transport.close()
        await client.until(lambda: client.lost.done())
    assert server.data == b"request" and client.data == b"answer after your EOF"
    return client.events, server.events


async def sc_client_close(net: Net, buffered: bool) -> Any:
    async with opened(net, {"buffered": buffered}, {"buffered": buffered}) as (client, server, _):
        client.transport.writelines([b"one ", b"two ", b"three"])
        client.transport.close()
        assert client.transport.is_closing()
        client.transport.close()  # idempotent
        client.transport.write(b"dropped")  # after close: dropped, no error
    assert server.data == b"one two three"
    return client.events, server.events


async def sc_client_abort(net: Net, buffered: bool) -> Any:
    async with opened(net, {"buffered": buffered}, {"buffered": buffered}) as (client, server, _):
        client.transport.write(b"x" * 100)
        await server.until(lambda: len(server.data) == 100)
        client.transport.abort()
        with anyio.fail_after(1):
            await client.lost  # at once
    # (the server's view of an abort differs: asyncio's peer sees an orderly FIN, aiordma's a
    # connection that ended without CLOSE: only the aborting side is compared)
    return client.events, None


async def sc_data_received_raises(net: Net, buffered: bool) -> Any:
    def boom(rec: Rec, data: bytes) -> None:
        raise ValueError("the protocol failed")

    loop = asyncio.get_running_loop()
    reported: list[Any] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx.get("exception")))
    try:
        async with opened(net, {"buffered": buffered, "on_data": boom}, {"buffered": buffered}) as (
            client,
            server,
            _,
        ):
            client.transport.write(b"data")
            await server.until(lambda: server.lost.done())
            client.transport.close()
    finally:
        loop.set_exception_handler(old)
    assert isinstance(server.lost.result(), ValueError)
    assert any(isinstance(e, ValueError) for e in reported)
    return None, server.events


async def sc_pause_reading(net: Net, buffered: bool) -> Any:
    # (in 7-byte buffers a smaller amount: 512 KiB are 75,000 deliveries, minutes in the guest)
    big = b"r" * ((48 << 10) if buffered else (512 << 10))
    async with opened(net, {"buffered": buffered}, {"buffered": buffered}) as (client, server, _):
        client.transport.pause_reading()
        assert not client.transport.is_reading()
        server.transport.write(big)
        await asyncio.sleep(0.3)
        assert client.data == b""  # nothing while paused
        client.transport.resume_reading()
        await client.until(lambda: len(client.data) == len(big))
        client.transport.close()
    assert client.data == big
    return client.events, server.events


async def sc_write_backpressure(net: Net, buffered: bool) -> Any:
    piece = b"w" * (64 << 10)
    async with opened(net, {"buffered": False}, {"buffered": False}) as (client, server, _):
        server.transport.pause_reading()
        client.transport.set_write_buffer_limits(high=64 << 10)
        assert client.transport.get_write_buffer_limits() == (16 << 10, 64 << 10)
        sent = 0
        with anyio.fail_after(30):
            while True:
                client.transport.write(piece)
                sent += len(piece)
                if "pause_writing" in client.events:  # (paused inside write(), as asyncio does)
                    assert client.transport.get_write_buffer_size() > 64 << 10
                    break
                await asyncio.sleep(0)
                assert sent < (64 << 20), "never paused"
        server.transport.resume_reading()
        await client.until(lambda: "resume_writing" in client.events)
        await server.until(lambda: len(server.data) == sent)
        client.transport.close()
    return client.events, server.events


SCENARIOS = {
    "echo_then_client_eof": sc_echo_then_client_eof,
    "server_keeps_writing_after_eof": sc_server_keeps_writing_after_eof,
    "client_close": sc_client_close,
    "client_abort": sc_client_abort,
    "data_received_raises": sc_data_received_raises,
    "pause_reading": sc_pause_reading,
    "write_backpressure": sc_write_backpressure,
}

_reference: dict[tuple[str, bool, str], Any] = {}


async def reference(name: str, buffered: bool) -> Any:
    """What asyncio's own TCP transport records for the scenario (run once per loop)."""
    loop_name = type(asyncio.get_running_loop()).__module__
    key = (name, buffered, loop_name)
    if key not in _reference:
        _reference[key] = await SCENARIOS[name](Net("ref"), buffered)
    return _reference[key]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("buffered", [False, True], ids=["Protocol", "BufferedProtocol"])
@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_callbacks_as_asyncio(anyio_backend: Any, name: str, buffered: bool, kind: str) -> None:
    if name == "write_backpressure" and buffered:
        pytest.skip("the same scenario as with Protocol (the writer's side is what it tests)")
    want = await reference(name, buffered)
    got = await SCENARIOS[name](Net(kind), buffered)
    if name != "write_backpressure":
        # when backpressure sets in depends on buffer sizes, which differ (the kernel's socket
        # buffer; RDMA's credits): only the backpressure scenario compares it
        want, got = _without_backpressure(want), _without_backpressure(got)
    assert got == want


def _without_backpressure(sides: Any) -> Any:
    def strip(events: Any) -> Any:
        if events is None:
            return None
        out: list[Any] = []
        for ev in events:
            if ev in ("pause_writing", "resume_writing"):
                continue
            if not out or out[-1] != ev:
                out.append(ev)
        return out

    return tuple(strip(side) for side in sides)


@pytest.mark.parametrize("kind", KINDS)
async def test_extra_info_and_repr(anyio_backend: Any, kind: str) -> None:
    net = Net(kind)
    async with opened(net, {}, {}) as (client, server, srv):
        tr = client.transport
        assert isinstance(tr, asyncio.Transport)
        want = "tcp" if kind.startswith("tcp") else "rdma"
        assert tr.get_extra_info("aiordma_transport") == want
        assert server.transport.get_extra_info("aiordma_transport") == want
        reason = tr.get_extra_info("aiordma_fallback_reason")
        assert ("transport='tcp' was requested" in reason) if kind.startswith("tcp") else reason == ""
        assert tr.get_extra_info("aiordma_passed_through", False) is (kind == "tcp")
        assert tr.get_extra_info("peername")[1] == srv.sockets[0].getsockname()[1]
        assert tr.get_extra_info("sockname")[0] == net.host
        assert tr.get_extra_info("no such thing", 42) == 42
        assert tr.get_protocol() is client
        assert f"{want} open" in repr(tr)
        with pytest.raises(TypeError):
            tr.write("text")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            tr.set_write_buffer_limits(high=1, low=2)
        tr.close()


async def test_a_broken_peer_is_connection_lost_with_a_reset(anyio_backend: Any) -> None:
    net = Net("tcp-framed")  # (garbage in the framing: a stream that passed through has none)
    async with opened(net, {}, {}) as (client, server, _):
        # the server's side writes bytes that are no aiordma frame under the framing
        server.transport._now.tcp_writer.write(b"\xff" * 64)
        exc = await asyncio.wait_for(client.lost, 10)
        server.transport.abort()
    assert isinstance(exc, ConnectionResetError)
    assert isinstance(exc.__cause__, aiordma.ProtocolError)


async def test_a_protocol_learns_that_the_peer_host_died(anyio_backend: Any) -> None:
    """The transport keeps a wait armed while it reads, so the device's liveness plan watches
    the connection: when the peer's host dies (its QP vanishes, the TCP link stays up), the
    probe fails and ``connection_lost`` comes within a second, with the probe's error."""
    import time

    net = Net("sim")
    async with opened(net, {}, {}) as (client, server, _):
        client.transport.write(b"ping")
        await server.until(lambda: bytes(server.data) == b"ping")
        assert net.fabric is not None
        net.fabric.kill_qp(server.transport._core.link.qp_num)
        t0 = time.monotonic()
        exc = await asyncio.wait_for(asyncio.shield(client.lost), 5)
        took = time.monotonic() - t0
        server.transport.abort()
    assert took < 1.0, took
    assert isinstance(exc, ConnectionResetError), exc
    assert "probe" in str(exc.__cause__) and "RETRY_EXC_ERR" in str(exc.__cause__), exc.__cause__


async def test_refused_and_strict(anyio_backend: Any) -> None:
    sock = __import__("socket").socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with pytest.raises(OSError):
        await aa.create_connection(asyncio.Protocol, "127.0.0.1", port, transport="tcp")
    with pytest.raises(aiordma.RDMAUnavailableError):
        await aa.create_server(asyncio.Protocol, "127.0.0.1", 0, transport="rdma")


async def test_server_api(anyio_backend: Any) -> None:
    made: list[Rec] = []

    def factory() -> Rec:
        rec = PlainRec(echo=True)
        made.append(rec)
        return rec

    async with no_fd_leak():
        server = await aa.create_server(factory, "127.0.0.1", 0, transport="tcp", start_serving=False)
        assert isinstance(server, asyncio.AbstractServer)
        assert not server.is_serving()
        async with server:
            await server.start_serving()
            assert server.is_serving()
            port = server.sockets[0].getsockname()[1]
            clients = [await aa.create_connection(PlainRec, "127.0.0.1", port, transport="tcp") for _ in range(5)]
            for i, (tr, _) in enumerate(clients):
                tr.write(b"%d" % i)
            for i, (_, pr) in enumerate(clients):
                await pr.until(lambda pr=pr: len(pr.data) == 1)  # type: ignore[misc]
                assert pr.data == b"%d" % i
            server.close_clients()  # the server closes every accepted transport
            for _, pr in clients:
                await asyncio.wait_for(pr.lost, 10)
                assert pr.events[-2:] == ["eof", ("lost", None)]
            forever = asyncio.ensure_future(server.serve_forever())
            await asyncio.sleep(0.05)
            forever.cancel()
            with pytest.raises(asyncio.CancelledError):
                await forever
        assert not server.is_serving()
        assert [rec.events[-1] for rec in made] == [("lost", None)] * 5


async def test_a_failed_handshake_never_reaches_the_factory(anyio_backend: Any) -> None:
    made: list[Any] = []
    async with no_fd_leak():
        server = await aa.create_server(lambda: made.append(1) or PlainRec(), "127.0.0.1", 0, handshake_timeout=0.5)  # type: ignore[func-returns-value]
        async with server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.0\r\n\r\n")  # not aiordma
            with anyio.fail_after(5):
                await reader.read()  # the server hangs up
            writer.close()
            await writer.wait_closed()
    assert made == []
