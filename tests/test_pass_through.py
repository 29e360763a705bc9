"""A byte stream on TCP passes through after the handshake when both ends offer it (issue 33, item 2).

Both HELLOs carry ``CAP_PASS_THROUGH`` and the client SELECTs TCP on a byte stream: from the
byte after the SELECT on, the data flows unframed, and the front ends hand the TCP connection
to the user's protocol (asyncio's transport calls it, as ``loop.create_connection`` would).
These tests hold the sans-IO part: when it happens, that it never happens otherwise, and that the
first data bytes read along with the SELECT are kept for the user, not parsed.
"""

from __future__ import annotations

import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma import LocalProtocolError
from aiordma._proto.framing import CAP_PASS_THROUGH, CAP_RDMA, FrameType, Hello, encode_hello, frame
from aiordma._proto.protocol import MAGIC, Connection, EndOfStream, HelloReceived, Mode, TransportSelected
from aiordma._proto.states import Role, State


def handshake(mode: Mode, client_caps: int, server_caps: int, after_select: bytes = b"",
              transport: str = "tcp") -> tuple[Connection, Connection, bytes]:  # fmt: skip
    """Run the handshake; returns both ends and what the server kept unparsed after the SELECT."""
    c = Connection(Role.CLIENT, mode, now=0.0)
    s = Connection(Role.SERVER, mode, now=0.0)
    params = b"p" * 8
    s.receive_data(c.send_hello(capabilities=client_caps, rdma_params=params if client_caps & CAP_RDMA else None))
    events = c.receive_data(s.send_hello(capabilities=server_caps, rdma_params=params if server_caps & CAP_RDMA else None))
    assert isinstance(events[0], HelloReceived)
    events = s.receive_data(c.select(transport) + after_select)  # type: ignore[arg-type]
    assert events == [TransportSelected(transport, "")]  # type: ignore[arg-type]
    return c, s, s.take_passed() if s.passed_through else b""


@given(after=st.binary(max_size=200))
@settings(max_examples=50, deadline=None)
def test_both_offer_it_on_a_byte_stream_over_tcp_and_the_bytes_after_the_select_are_the_datas(after: bytes) -> None:
    """Whatever follows the SELECT in the same read -- even bytes that look like frames -- is
    the data's start, handed over as it is."""
    c, s, kept = handshake(Mode.STREAM, CAP_PASS_THROUGH, CAP_PASS_THROUGH, after)
    assert c.passed_through and s.passed_through
    assert c.state is s.state is State.PASSED_THROUGH
    assert kept == after
    assert c.take_passed() == b""


def test_data_read_after_passing_through_is_kept_unparsed_until_taken() -> None:
    _, s, _ = handshake(Mode.STREAM, CAP_PASS_THROUGH, CAP_PASS_THROUGH)
    framed_looking = MAGIC + frame(FrameType.CLOSE, b"\x00\x01bye")
    assert s.receive_data(framed_looking) == []
    view = s.get_buffer(-1)
    view[:3] = b"abc"
    del view
    assert s.buffer_updated(3) == []
    assert s.receive_eof() == [EndOfStream()]  # (a FIN: the data's end, once)
    assert s.receive_eof() == []
    assert s.take_passed() == framed_looking + b"abc"
    assert s.take_passed() == b""


def test_nothing_is_framed_once_passed_through() -> None:
    """Data goes as it is (any byte view, counted in bytes); the EOF is the owner's FIN (no frame),
    once, and no data after it; no CLOSE frame goes into the user's data."""
    c, s, _ = handshake(Mode.STREAM, CAP_PASS_THROUGH, CAP_PASS_THROUGH)
    for conn in (c, s):
        assert conn.send_data(b"x") == [b"x"]
        assert conn.send_data(b"") == []
        (chunk,) = conn.send_data(memoryview(array.array("i", [1, 2])))
        assert bytes(chunk) == array.array("i", [1, 2]).tobytes()
        assert conn.send_eof() == b""
        with pytest.raises(LocalProtocolError):
            conn.send_eof()
        with pytest.raises(LocalProtocolError):
            conn.send_data(b"x")
        assert conn.close() == b""
        assert conn.passed_through


@pytest.mark.parametrize(
    "mode, client_caps, server_caps, transport",
    [
        (Mode.STREAM, CAP_PASS_THROUGH, 0, "tcp"),  # the server does not offer it
        (Mode.STREAM, 0, CAP_PASS_THROUGH, "tcp"),  # the client does not
        (Mode.MESSAGES, CAP_PASS_THROUGH, CAP_PASS_THROUGH, "tcp"),  # messages need their frames
        (Mode.STREAM, CAP_PASS_THROUGH | CAP_RDMA, CAP_PASS_THROUGH | CAP_RDMA, "rdma"),  # RDMA
    ],
    ids=["server-does-not-offer", "client-does-not-offer", "messages", "rdma-selected"],
)
def test_otherwise_the_connection_stays_framed(mode: Mode, client_caps: int, server_caps: int, transport: str) -> None:
    c, s, _ = handshake(mode, client_caps, server_caps, transport=transport)
    assert not c.passed_through and not s.passed_through
    assert c.state is s.state is State.OPEN
    with pytest.raises(LocalProtocolError):
        s.take_passed()


def test_a_peer_that_knows_no_such_capability_ignores_the_bit() -> None:
    """An older peer masks capabilities it does not know (so offering it is always safe); an
    unknown bit from a newer one is ignored here the same way."""
    hello = Hello(mode=Mode.STREAM, capabilities=CAP_PASS_THROUGH | (1 << 7))
    payload = encode_hello(hello)
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    (event,) = s.receive_data(MAGIC + frame(FrameType.HELLO, payload))
    assert isinstance(event, HelloReceived)
    assert event.hello.capabilities == CAP_PASS_THROUGH


# -- the asyncio front ends: the handover, as users and raw peers meet it -------------------------

import asyncio  # noqa: E402
import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from typing import Any  # noqa: E402

import anyio  # noqa: E402

import aiordma  # noqa: E402
import aiordma.asyncio as aa  # noqa: E402
from aiordma._transport import AiordmaTransport, PassedTransport  # noqa: E402

from ._asyncio_net import anyio_backend  # noqa: E402,F401  (asyncio and uvloop)


class Recorder(asyncio.Protocol):
    """Records what asyncio's transport (or aiordma's) calls it with, in order."""

    def __init__(self, greet: bytes = b"", echo: bool = False) -> None:
        self.calls: list[Any] = []
        self.data = bytearray()
        self.greet, self.echo = greet, echo
        self.changed = asyncio.Event()
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.calls.append("made")
        if self.greet:
            transport.write(self.greet)  # (at once: the first thing this side sends)

    def data_received(self, data: bytes) -> None:
        self.calls.append("data")
        self.data += data
        if self.echo:
            self.transport.write(data)
        self.changed.set()

    def eof_received(self) -> bool:
        self.calls.append("eof")
        self.changed.set()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append("lost")
        if not self.lost.done():
            self.lost.set_result(exc)
        self.changed.set()

    async def until(self, pred: Any, timeout: float = 10) -> None:
        with anyio.fail_after(timeout):
            while not pred():
                self.changed.clear()
                await self.changed.wait()



@pytest.mark.anyio
async def test_both_ends_of_the_protocol_api_pass_through_and_greet_each_other_at_once(anyio_backend: Any) -> None:
    """Each side writes in ``connection_made`` -- the server's greeting may reach the client's
    socket before the client handed over: it is delivered first, once, in order."""
    servers: list[Recorder] = []

    def make() -> Recorder:
        servers.append(Recorder(greet=b"hello from the server", echo=True))
        return servers[-1]

    server = await aa.create_server(make, "127.0.0.1", 0, transport="tcp")
    async with server:
        port = server.sockets[0].getsockname()[1]
        tr, client = await aa.create_connection(lambda: Recorder(greet=b"hello from the client"), "127.0.0.1", port,
                                                transport="tcp")  # fmt: skip
        assert isinstance(client, Recorder)
        assert isinstance(tr, PassedTransport) and tr.get_extra_info("aiordma_passed_through")
        await client.until(lambda: bytes(client.data) == b"hello from the server" + b"hello from the client")
        assert isinstance(servers[0].transport, PassedTransport)
        assert bytes(servers[0].data) == b"hello from the client"
        tr.write_eof()
        await client.until(lambda: "lost" in client.calls)
        assert client.calls[0] == "made" and client.calls[-2:] == ["eof", "lost"]
        assert await client.lost is None
        await servers[0].until(lambda: "lost" in servers[0].calls)
        assert servers[0].calls[0] == "made" and servers[0].calls[-2:] == ["eof", "lost"]


@pytest.mark.anyio
@pytest.mark.parametrize("eof", [False, True], ids=["more-later", "eof-at-once"])
async def test_data_sent_along_with_the_select_reaches_the_protocol_first_and_whole(anyio_backend: Any,
                                                                                    eof: bool) -> None:  # fmt: skip
    """A raw client writes its SELECT and its first data in one write (and maybe its FIN): the
    server's protocol gets ``connection_made``, then exactly those bytes, then the rest -- none
    is parsed as a frame, none is lost, none comes twice."""
    servers: list[Recorder] = []

    def make() -> Recorder:
        servers.append(Recorder())
        return servers[-1]

    first = MAGIC + frame(FrameType.CLOSE, b"\x00\x00not a close: data") + bytes(range(256)) * 40
    server = await aa.create_server(make, "127.0.0.1", 0, transport="tcp")
    async with server:
        port = server.sockets[0].getsockname()[1]
        c = Connection(Role.CLIENT, Mode.STREAM, now=0.0)
        sock = socket.create_connection(("127.0.0.1", port))
        try:

            def raw_client() -> None:  # (blocking: in a thread, as another process would be)
                sock.sendall(c.send_hello(capabilities=CAP_PASS_THROUGH))
                sock.settimeout(10)
                events: list[Any] = []
                while not events:
                    events = c.receive_data(sock.recv(65536))
                assert isinstance(events[0], HelloReceived) and events[0].hello.can_pass_through
                sock.sendall(c.select("tcp") + first)  # type: ignore[arg-type]
                assert c.passed_through
                if eof:
                    sock.shutdown(socket.SHUT_WR)

            await anyio.to_thread.run_sync(raw_client)
            if not eof:
                await anyio.sleep(0.05)
                sock.sendall(b"and later")
            while not servers:
                await anyio.sleep(0.005)
            rec = servers[0]
            want = first if eof else first + b"and later"
            await rec.until(lambda: len(rec.data) >= len(want) and (not eof or "eof" in rec.calls))
            assert bytes(rec.data) == want
            assert rec.calls[0] == "made"
            if eof:
                assert rec.calls[-2:] == ["eof", "lost"] or rec.calls[-1] == "eof"
        finally:
            sock.close()


@pytest.mark.anyio
@pytest.mark.parametrize("side", ["client", "server"])
async def test_a_side_that_does_not_offer_it_gets_aiordmas_framed_transport(anyio_backend: Any, side: str) -> None:
    """Negotiated: ``pass_through=False`` on either side, or a streams/anyio peer, keeps the
    connection framed -- and it works as before."""
    servers: list[Recorder] = []

    def make() -> Recorder:
        servers.append(Recorder(echo=True))
        return servers[-1]

    server = await aa.create_server(make, "127.0.0.1", 0, transport="tcp", pass_through=side != "server")
    async with server:
        port = server.sockets[0].getsockname()[1]
        tr, client = await aa.create_connection(Recorder, "127.0.0.1", port, transport="tcp",
                                                pass_through=side != "client")  # fmt: skip
        assert isinstance(client, Recorder)
        assert isinstance(tr, AiordmaTransport) and not tr.get_extra_info("aiordma_passed_through", False)
        tr.write(b"framed")
        await client.until(lambda: bytes(client.data) == b"framed")
        tr.close()
        await client.lost
    # an anyio client (it never offers) against a server that does
    server = await aa.create_server(make, "127.0.0.1", 0, transport="tcp")
    async with server:
        port = server.sockets[0].getsockname()[1]
        async with await aiordma.connect("127.0.0.1", port, transport="tcp") as stream:
            await stream.send(b"anyio")
            assert await stream.receive() == b"anyio"
        assert isinstance(servers[-1].transport, AiordmaTransport)


PEER = textwrap.dedent(
    """
    import asyncio, sys
    import aiordma.asyncio as aa

    class Echo(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t
            print("passed" if t.get_extra_info("aiordma_passed_through") else "framed", flush=True)
        def data_received(self, d):
            self.t.write(d)
        def eof_received(self):
            return False  # (close: after the echo of everything)

    async def main():
        server = await aa.create_server(Echo, "127.0.0.1", 0, transport="tcp")
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


@pytest.mark.anyio
async def test_a_server_in_another_process_echoes_a_megabyte_and_the_end(anyio_backend: Any) -> None:
    """Server and client in two processes, as users run them: both pass through, 1 MiB in pieces
    of any size comes back whole and in order, then the client's EOF ends it in order."""
    proc = subprocess.Popen([sys.executable, "-c", PEER], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert proc.stdout is not None
        port = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        tr, client = await aa.create_connection(Recorder, "127.0.0.1", port, transport="tcp")
        assert isinstance(client, Recorder) and tr.get_extra_info("aiordma_passed_through")
        assert (await anyio.to_thread.run_sync(proc.stdout.readline)).strip() == "passed"
        payload = os.urandom(1 << 20)
        pos = 0
        for size in [1, 7, 4096, 65536, 300_000] * 10:
            tr.write(payload[pos : pos + size])
            pos += size
        tr.write(payload[pos:])
        tr.write_eof()
        await client.until(lambda: "lost" in client.calls, timeout=30)
        assert bytes(client.data) == payload
        assert client.calls[-2:] == ["eof", "lost"] and client.lost.result() is None
    finally:
        proc.kill()
        proc.wait()


STREAM_PEER = textwrap.dedent(
    """
    import asyncio, hashlib, socket, struct, sys
    import aiordma.asyncio as aa

    async def main(how, pause):
        done = asyncio.Event()

        async def handle(reader, writer):
            print("passed" if writer.get_extra_info("aiordma_passed_through") else "framed", flush=True)
            if how == "pause":  # pause, then read to the end (the kernel's buffers fill meanwhile)
                await asyncio.sleep(pause)
                data = await reader.read()
                print(len(data), hashlib.sha256(data).hexdigest(), flush=True)
                writer.close()
            elif how == "reset":
                writer.write(b"partial")
                await writer.drain()
                await reader.readexactly(2)  # (the client has the bytes)
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()  # (a reset, not an end in order)
            else:  # hold: read to the end, then keep the connection open, never closing it
                data = await reader.read()
                print(len(data), flush=True)
                await asyncio.sleep(30)
            done.set()

        keepalive = {"keepalive": 1.0} if how == "pause" else {}  # (a pause longer than its budget)
        server = await aa.start_server(handle, "127.0.0.1", 0, transport="tcp", **keepalive)
        print(server.sockets[0].getsockname()[1], flush=True)
        await done.wait()

    asyncio.run(main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.0))
    """
)


@pytest.mark.anyio
async def test_streams_pass_through_and_a_close_waits_for_a_reader_that_pauses(anyio_backend: Any) -> None:
    """Both ends of the streams API pass through (their default): aiordma's reader and writer on
    the unframed connection.  The reader (another process) pauses 3 s -- longer than the
    keepalive budget -- before it reads: the connection is not ended by the kernel's user
    timeout (the window watch still tells slow from dead), and ``close(); wait_closed()``
    returns once the reader has every byte.  (The close's own linger is test_close_delivery's
    passed-through case.)"""
    import hashlib
    import time

    pause = 3.0
    proc = subprocess.Popen([sys.executable, "-c", STREAM_PEER, "pause", str(pause)], stdout=subprocess.PIPE,
                            text=True, cwd=os.getcwd())  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        reader, writer = await aa.open_connection("127.0.0.1", port, transport="tcp", pass_through=True, keepalive=1.0)
        assert writer.get_extra_info("aiordma_passed_through")
        assert (await anyio.to_thread.run_sync(proc.stdout.readline)).strip() == "passed"
        payload = os.urandom(48 << 20)  # (far more than the two kernels take while the reader pauses)
        t0 = time.monotonic()
        writer.write(payload)
        await anyio.sleep(pause / 2)  # (bytes unacknowledged a while before the close: the watch looks)
        writer.close()
        with anyio.fail_after(60):
            await writer.wait_closed()
        took = time.monotonic() - t0
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert line.split() == [str(len(payload)), hashlib.sha256(payload).hexdigest()], line
        assert took >= pause - 0.5, took
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_a_passed_through_stream_reset_by_its_peer_is_an_error_not_an_eof(anyio_backend: Any) -> None:
    """Unframed, a reset is not the data's end: what came before it is read, then the read
    raises ``ConnectionResetError`` (as asyncio's streams do), never a short read at EOF; and
    ``drain`` raises too."""
    proc = subprocess.Popen([sys.executable, "-c", STREAM_PEER, "reset"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        reader, writer = await aa.open_connection("127.0.0.1", port, transport="tcp")
        assert writer.get_extra_info("aiordma_passed_through")
        assert (await anyio.to_thread.run_sync(proc.stdout.readline)).strip() == "passed"
        with anyio.fail_after(30):
            assert await reader.readexactly(7) == b"partial"
            writer.write(b"ok")
            with pytest.raises(ConnectionResetError):
                await reader.readexactly(10)
        assert isinstance(reader.exception(), ConnectionResetError)
        with pytest.raises(ConnectionResetError):
            await writer.drain()
        writer.close()
        with anyio.fail_after(10):
            await writer.wait_closed()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.anyio
async def test_a_passed_through_close_never_awaited_ends_once_the_peer_has_everything(anyio_backend: Any) -> None:
    """A stream's ``close()`` that nobody awaits (asyncio's own idiom allows it): the peer reads
    to the end and then holds the connection open.  The close does not wait for the peer's end:
    once the peer's kernel has every byte, the socket closes by itself (its own timers, not
    ``wait_closed``'s), and ``wait_closed`` afterwards returns at once."""
    proc = subprocess.Popen([sys.executable, "-c", STREAM_PEER, "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(await anyio.to_thread.run_sync(proc.stdout.readline))
        reader, writer = await aa.open_connection("127.0.0.1", port, transport="tcp")
        assert (await anyio.to_thread.run_sync(proc.stdout.readline)).strip() == "passed"
        sock = writer.get_extra_info("socket")
        payload = os.urandom(4 << 20)
        writer.write(payload)
        writer.close()
        assert int(await anyio.to_thread.run_sync(proc.stdout.readline)) == len(payload)
        with anyio.fail_after(10):
            while sock.fileno() >= 0:  # (closed: asyncio's TransportSocket reads -1)
                await anyio.sleep(0.05)
        with anyio.fail_after(1):
            await writer.wait_closed()
        assert proc.poll() is None  # (the peer still holds its end)
    finally:
        proc.kill()
        proc.wait()
