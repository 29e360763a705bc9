"""The TCP transport against broken, foreign and silent peers, TLS, and the fallback policy."""

from __future__ import annotations

import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio import BrokenResourceError, EndOfStream
from anyio.abc import SocketStream

import aiordma
from aiordma._proto.protocol import HEADER, MAGIC, CloseCode, Connection, ConnectionClosed, FrameType, Mode, frame
from aiordma._proto.states import Role

from ._leaks import no_fd_leak

pytestmark = pytest.mark.anyio


async def _collect(sock: SocketStream, conn: Connection) -> list[Any]:
    """Read from a raw socket into a sans-IO connection until it ends."""
    events: list[Any] = []
    while True:
        try:
            events += conn.receive_data(await sock.receive())
        except (EndOfStream, BrokenResourceError):
            return events


async def raw_client_handshake(sock: SocketStream, mode: Mode) -> Connection:
    """Play the client's part by hand over a plain socket."""
    conn = Connection(Role.CLIENT, mode, now=0.0)
    await sock.send(conn.send_hello())
    while conn.peer_hello is None:
        conn.receive_data(await sock.receive())
    await sock.send(conn.select("tcp", "client: raw test peer"))
    return conn


@asynccontextmanager
async def serving(
    handler: Callable[[Any], Awaitable[None]], *, channel: bool = False, **kwargs: Any
) -> AsyncIterator[int]:
    factory = aiordma.create_channel_listener if channel else aiordma.create_listener
    async with await factory("127.0.0.1", 0, transport="tcp", **kwargs) as listener:  # type: ignore[operator]
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            yield listener.port
            tg.cancel_scope.cancel()


async def test_peer_disconnecting_mid_message_breaks_the_receiver(anyio_backend: Any) -> None:
    outcome: list[BaseException] = []
    done = anyio.Event()

    async def handler(channel: aiordma.Channel) -> None:
        async with channel:
            try:
                await channel.receive()
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)
            done.set()

    async with no_fd_leak(), serving(handler, channel=True) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            await raw_client_handshake(sock, Mode.MESSAGES)
            await sock.send(HEADER.pack(FrameType.MESSAGE, 0, 0, 1000) + b"only ten b")
        with anyio.fail_after(5):
            await done.wait()
    assert isinstance(outcome[0], BrokenResourceError)
    assert isinstance(outcome[0].__cause__, aiordma.RemoteProtocolError)
    assert "middle of a frame" in str(outcome[0].__cause__)


async def test_malformed_frame_gets_a_close_with_the_reason(anyio_backend: Any) -> None:
    outcome: list[BaseException] = []
    done = anyio.Event()

    async def handler(stream: aiordma.Stream) -> None:
        async with stream:
            try:
                await stream.receive()
            except BaseException as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)
            done.set()

    async with no_fd_leak(), serving(handler) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            conn = await raw_client_handshake(sock, Mode.STREAM)
            await sock.send(HEADER.pack(FrameType.DATA, 0x80, 0, 3) + b"abc")
            with anyio.fail_after(5):
                events = await _collect(sock, conn)
                await done.wait()
    closes = [e for e in events if isinstance(e, ConnectionClosed)]
    assert closes and closes[0].code == CloseCode.PROTOCOL_ERROR and "flags" in closes[0].reason
    assert isinstance(outcome[0], BrokenResourceError)


async def test_oversized_frame_is_refused_before_its_payload(anyio_backend: Any) -> None:
    async def handler(channel: aiordma.Channel) -> None:
        async with channel:
            with pytest.raises(BrokenResourceError):
                await channel.receive()

    async with serving(handler, channel=True, max_message_size=1024) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            conn = await raw_client_handshake(sock, Mode.MESSAGES)
            # only the header: a server that waited for the payload would hang here
            await sock.send(HEADER.pack(FrameType.MESSAGE, 0, 0, 1 << 30))
            with anyio.fail_after(5):
                events = await _collect(sock, conn)
    assert any(isinstance(e, ConnectionClosed) and "exceeds the limit" in e.reason for e in events)


async def test_garbage_client_is_dropped_and_others_are_served(anyio_backend: Any) -> None:
    async def handler(stream: aiordma.Stream) -> None:
        async with stream:
            await stream.send(await stream.receive())

    async with no_fd_leak(), serving(handler) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            await sock.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            with anyio.fail_after(5):
                rest = b""
                try:
                    while True:
                        rest += await sock.receive()
                except (EndOfStream, BrokenResourceError):
                    pass
            assert rest == b"" or rest.startswith(MAGIC) or rest.startswith(HEADER.pack(FrameType.CLOSE, 0, 0, 0)[:1])
        async with await aiordma.connect("127.0.0.1", port, transport="tcp") as stream:
            await stream.send(b"still serving")
            assert await stream.receive() == b"still serving"


@pytest.mark.paced
async def test_connecting_to_something_else_is_a_handshake_error(anyio_backend: Any) -> None:
    async def foreign(sock: SocketStream) -> None:
        async with sock:
            await sock.send(b"SSH-2.0-OpenSSH_9.2\r\n")
            await anyio.sleep(1)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, foreign)
            async with no_fd_leak():
                with pytest.raises(aiordma.HandshakeError, match="does not speak aiordma"):
                    await aiordma.connect("127.0.0.1", port, transport="tcp")
            tg.cancel_scope.cancel()


async def test_silent_server_times_out(anyio_backend: Any) -> None:
    async def silent(sock: SocketStream) -> None:
        async with sock:
            await anyio.sleep(10)

    async with no_fd_leak():
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, silent)
                with anyio.fail_after(5):
                    with pytest.raises(aiordma.HandshakeTimeoutError):
                        await aiordma.connect("127.0.0.1", port, transport="tcp", handshake_timeout=0.3)
                tg.cancel_scope.cancel()


async def test_silent_client_is_dropped_by_the_server(anyio_backend: Any) -> None:
    served = []

    async def handler(stream: aiordma.Stream) -> None:
        served.append(stream)
        await stream.aclose()

    async with serving(handler, handshake_timeout=0.3) as port:
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            with anyio.fail_after(5):
                with pytest.raises((EndOfStream, BrokenResourceError)):
                    while True:
                        await sock.receive()
    assert served == []


async def test_mode_mismatch_fails_clearly(anyio_backend: Any) -> None:
    async def handler(stream: aiordma.Stream) -> None:
        await stream.aclose()

    async with serving(handler) as port:
        with pytest.raises(aiordma.HandshakeError, match="byte-stream"):
            await aiordma.connect_channel("127.0.0.1", port, transport="tcp")


async def test_connection_refused_is_an_oserror(anyio_backend: Any) -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    with pytest.raises(OSError):
        await aiordma.connect("127.0.0.1", port, transport="tcp")


# -- transport policy on a host without RDMA ------------------------------------------


async def test_auto_falls_back_with_the_reason(anyio_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_TRANSPORT", raising=False)
    from aiordma._rdma.discovery import probe

    if probe().usable:
        pytest.skip("this host has a usable RDMA device")

    async def handler(stream: aiordma.Stream) -> None:
        async with stream:
            await stream.send(stream.extra(aiordma.TransportAttribute.fallback_reason).encode())

    async with await aiordma.create_listener("127.0.0.1", 0) as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            async with await aiordma.connect("127.0.0.1", listener.port) as stream:
                reason = stream.extra(aiordma.TransportAttribute.fallback_reason)
                assert stream.extra(aiordma.TransportAttribute.transport) == "tcp"
                assert reason.startswith("client: ") and "RDMA" in reason
                assert (await stream.receive()).decode() == reason  # the server records the same sentence
            tg.cancel_scope.cancel()


async def test_strict_rdma_raises_on_this_host(anyio_backend: Any) -> None:
    from aiordma._rdma.discovery import probe

    if probe().usable:
        pytest.skip("this host has a usable RDMA device")
    with pytest.raises(aiordma.RDMAUnavailableError, match="no RDMA device|native module") as info:
        await aiordma.connect("127.0.0.1", 9, transport="rdma")  # fails before any connection
    assert info.value.reason
    with pytest.raises(aiordma.RDMAUnavailableError):
        await aiordma.create_listener("127.0.0.1", 0, transport="rdma")


async def test_environment_variable_sets_the_default(anyio_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_TRANSPORT", "tcp")
    async with await aiordma.create_listener("127.0.0.1", 0) as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, lambda s: s.aclose())
            async with await aiordma.connect("127.0.0.1", listener.port) as stream:
                assert "transport='tcp' was requested" in stream.extra(aiordma.TransportAttribute.fallback_reason)
            tg.cancel_scope.cancel()
    monkeypatch.setenv("AIORDMA_TRANSPORT", "infiniband")
    with pytest.raises(ValueError, match="AIORDMA_TRANSPORT='infiniband'"):
        await aiordma.connect("127.0.0.1", 9)
    # an explicit argument wins
    with pytest.raises(ValueError, match="transport='x'"):
        await aiordma.connect("127.0.0.1", 9, transport="x")


async def test_strict_server_refuses_a_tcp_only_client(anyio_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend this host has RDMA on the server side only by making the server strict
    # on TLS-less RDMA while the client asks for TCP: the refusal must name the cause.
    from aiordma._handshake import negotiate as _negotiate

    real = _negotiate.local_offer

    def fake_offer(choice: Any, side: str, *, tls: bool = False, backend: object | None = None) -> Any:
        if side == "server":
            return _negotiate.LocalOffer(True, "")
        return real(choice, side, tls=tls, backend=backend)

    monkeypatch.setattr(_negotiate, "local_offer", fake_offer)
    monkeypatch.setattr("aiordma._handshake.settings.local_offer", fake_offer)
    async with await aiordma.create_listener("127.0.0.1", 0, transport="rdma") as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, lambda s: s.aclose())
            with pytest.raises(aiordma.RDMAUnavailableError, match="server requires RDMA; client: transport='tcp'"):
                await aiordma.connect("127.0.0.1", listener.port, transport="tcp")
            tg.cancel_scope.cancel()


# -- TLS ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


async def test_tls_round_trip(anyio_backend: Any, tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_ctx, client_ctx = tls_contexts

    async def handler(channel: aiordma.Channel) -> None:
        async with channel:
            async for message in channel:
                await channel.send(message[::-1])

    async with no_fd_leak():
        async with await aiordma.create_channel_listener("127.0.0.1", 0, ssl=server_ctx) as listener:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, handler)
                async with await aiordma.connect_channel(
                    "127.0.0.1", listener.port, ssl=client_ctx, server_hostname="localhost"
                ) as channel:
                    for message in (b"secret", b"", bytes(100_000)):
                        await channel.send(message)
                        assert await channel.receive() == message[::-1]
                    assert channel.extra(aiordma.TransportAttribute.transport) == "tcp"
                    assert "TLS" in channel.extra(aiordma.TransportAttribute.fallback_reason)
                tg.cancel_scope.cancel()


async def test_tls_with_strict_rdma_is_refused(anyio_backend: Any) -> None:
    with pytest.raises(aiordma.RDMAUnavailableError, match="TLS"):
        await aiordma.connect("127.0.0.1", 9, transport="rdma", ssl=True)


def test_raw_frames_helper_is_consistent() -> None:
    assert frame(FrameType.EOF) == struct.pack("!BBHI", FrameType.EOF, 0, 0, 0)
