"""Slow is not dead (issue 31, item 1): a reader that pauses loses nothing; its sender waits.

The reader runs in a process of its own (``tests/_slow_peer_proc.py``), as the listener or as
the client; the sender is this test, with a keepalive of 1 s -- a user timeout of one second --
and the reader pauses three times that while the sender has 32 MiB for it.  Before the window
watch, Linux ended such a connection after the user timeout although the reader's kernel answered
every window probe: the sender got ``ETIMEDOUT`` and the reader a reset (3.6 MB of 64 MiB had
arrived).  Every front end on its own loop (the asyncio ones on asyncio and uvloop), plain TCP
and TLS; the full matrix is ``slow``.  One more ``slow`` test pauses for a minute with the
default keepalive, as the issue asks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anyio
import pytest

import aiordma
from aiordma._tcp.links import DEFAULT_KEEPALIVE

from ._listener_proc import client_context, server_context
from ._slow_peer import CHUNK, Peer, loop_name, open_sender

pytestmark = pytest.mark.anyio


def chunks(size: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * (CHUNK // 4) for i in range(size // CHUNK)]


async def send_all(api: str, conn: Any, data: list[bytes]) -> None:
    if api in ("channel", "stream"):
        for chunk in data:
            await conn.send(chunk)
        await conn.aclose()
    else:
        writer = conn[1]
        for chunk in data:
            writer.write(chunk)
            await writer.drain()
        writer.close()
        await writer.wait_closed()


async def run_case(loop: str, api: str, role: str, tlsdir: str, tls: bool, pause: float, size: int,
                   keepalive: float) -> None:  # fmt: skip
    data = chunks(size)
    tdir = tlsdir if tls else "-"
    if role == "server":  # the reader is the listener; this side connects and sends
        peer = Peer(loop, api, "serve", 0, tdir, pause, size)
        try:
            port = int((await peer.line(30)).split()[1])
            conn = await open_sender(api, port, client_context(tdir), keepalive)
            with anyio.fail_after(pause + 60):
                await send_all(api, conn, data)
            result = json.loads(await peer.line(pause + 60))
        finally:
            peer.close()
    else:  # this side listens and sends to the reader, a client
        result = await serve_and_send(loop, api, tdir, pause, size, keepalive, data)
    expected = hashlib.sha256(b"".join(data)).hexdigest()
    assert result["error"] == "", result
    assert result["received"] == size and result["sha256"] == expected, result
    assert result["paused"] >= pause


async def serve_and_send(loop: str, api: str, tdir: str, pause: float, size: int, keepalive: float,
                         data: list[bytes]) -> dict[str, Any]:  # fmt: skip
    ctx = server_context(tdir)
    errors: list[BaseException] = []
    sent = anyio.Event()

    async def handle(conn: Any) -> None:
        try:
            await send_all(api, conn, data)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)
        sent.set()

    if api in ("asyncio", "protocol"):
        import aiordma.asyncio as aio

        server = await aio.start_server(lambda r, w: handle((r, w)), "127.0.0.1", 0, ssl=ctx, transport="tcp",
                                        keepalive=keepalive)  # fmt: skip
        port = server.sockets[0].getsockname()[1]
        try:
            result = await _client_reads(loop, api, port, tdir, pause, size, sent)
        finally:
            server.close()
    else:
        make = aiordma.create_channel_listener if api == "channel" else aiordma.create_listener
        async with await make("127.0.0.1", 0, ssl=ctx, transport="tcp", keepalive=keepalive) as lst:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lst.serve, handle)
                result = await _client_reads(loop, api, lst.port, tdir, pause, size, sent)
                tg.cancel_scope.cancel()
    assert not errors, errors
    return result


async def _client_reads(loop: str, api: str, port: int, tdir: str, pause: float, size: int,
                        sent: anyio.Event) -> dict[str, Any]:  # fmt: skip
    peer = Peer(loop, api, "connect", port, tdir, pause, size)
    try:
        result: dict[str, Any] = json.loads(await peer.line(pause + 60))
        with anyio.fail_after(30):
            await sent.wait()
        return result
    finally:
        peer.close()


def cases() -> list[Any]:
    """Every front end, plain and TLS, the reader listening or connecting; the quick suite keeps
    channels over plain TCP (the rest is ``slow``: 3 s each)."""
    out = []
    for api in ["channel", "stream", "asyncio", "protocol"]:
        for tls in (False, True):
            for role in ("server", "client"):
                ident = f"{api}-{'tls' if tls else 'tcp'}-{'reader-listens' if role == 'server' else 'reader-connects'}"
                quick = api == "channel" and not tls
                out.append(pytest.param(api, tls, role, id=ident, marks=() if quick else (pytest.mark.slow,)))
    return out


@pytest.mark.paced
@pytest.mark.parametrize(("api", "tls", "role"), cases())
async def test_a_reader_that_pauses_loses_nothing_and_its_sender_waits(
    anyio_backend: Any, api: str, tls: bool, role: str, tlsdir: str
) -> None:
    loop = loop_name(anyio_backend)
    if api in ("asyncio", "protocol") and loop == "trio":
        pytest.skip("aiordma.asyncio runs on asyncio loops")
    await run_case(loop, api, role, tlsdir, tls, pause=3.0, size=32 << 20, keepalive=1.0)


@pytest.mark.slow
async def test_a_reader_that_pauses_for_a_minute_loses_nothing(anyio_backend: Any, tlsdir: str) -> None:
    """The issue's case: 60 s, the default keepalive (5 s), 64 MiB."""
    if anyio_backend[1]:
        pytest.skip("asyncio and trio are enough for the minute")
    await run_case(loop_name(anyio_backend), "channel", "server", tlsdir, False, pause=60.0, size=64 << 20,
                   keepalive=DEFAULT_KEEPALIVE)  # fmt: skip
