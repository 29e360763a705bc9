"""A reader that pauses, in a process of its own (issue 31: slow is not dead).

``python -m tests._slow_peer_proc LOOP API ROLE PORT TLSDIR PAUSE SIZE [GREET HOLD]``
    ROLE ``serve``: listens on 127.0.0.1 (any port), prints ``PORT n`` and takes one connection;
    ROLE ``connect``: connects to PORT.  Either way it reads nothing for PAUSE seconds, then
    reads until SIZE bytes came (or the end), closes, and prints one JSON line: ``received``,
    ``sha256`` of the bytes in order, ``error`` (empty when none), ``paused`` (seconds),
    ``closing`` (how long its close took, seconds) and ``close_error``.  A SIZE of 0 reads to the
    end.  GREET (default 0): bytes it sends first, before the pause (its peer need not read
    them); HOLD (default 0): seconds it keeps the connection open after reading, before it closes.

API is ``channel`` (messages, concatenated), ``stream`` (anyio byte stream), ``asyncio``
(``aiordma.asyncio`` reader/writer: the reader is simply not read) or ``protocol`` (an
``asyncio.Protocol`` on ``aiordma.asyncio``'s transport that calls ``pause_reading()`` for the
pause).  TLS with TLSDIR's certificates unless it is ``-``.  The connection uses the default
keepalive: the reader's side holds nothing for its peer, so its own watch has nothing to judge.
"""

from __future__ import annotations

import asyncio
import os
import hashlib
import json
import sys
import time
from typing import Any

import anyio

import aiordma

from ._listener_proc import client_context, run, server_context


async def read_all(api: str, conn: Any, pause: float, size: int) -> dict[str, Any]:
    digest = hashlib.sha256()
    received = 0
    error = ""
    started = time.monotonic()
    try:
        if api == "protocol":
            transport, proto = conn
            transport.pause_reading()
            await anyio.sleep(pause)
            transport.resume_reading()
            while (received < size or not size) and not proto.ended.is_set():
                await proto.more.wait()
                proto.more.clear()
                chunks, proto.chunks = proto.chunks, []
                for chunk in chunks:
                    digest.update(chunk)
                    received += len(chunk)
            if proto.error:
                error = proto.error
            transport.close()
        else:
            await anyio.sleep(pause)
            while received < size or not size:
                if api == "asyncio":
                    chunk = await conn[0].read(1 << 20)
                    if not chunk:
                        break
                else:
                    try:
                        chunk = await conn.receive()
                    except anyio.EndOfStream:
                        break
                digest.update(chunk)
                received += len(chunk)
    except Exception as exc:  # noqa: BLE001 - reported
        error = f"{type(exc).__name__}: {exc}"
    return {"received": received, "sha256": digest.hexdigest(), "error": error, "paused": time.monotonic() - started}


class Reader(asyncio.Protocol):
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.more = asyncio.Event()
        self.ended = asyncio.Event()
        self.error = ""

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.more.set()

    def eof_received(self) -> None:
        self.ended.set()
        self.more.set()

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended.set()
        self.more.set()


async def close(api: str, conn: Any, result: dict[str, Any]) -> None:
    """Close ``conn``; how long it took and how it failed go into ``result``."""
    started = time.monotonic()
    result["close_error"] = ""
    try:
        if api == "asyncio":
            conn[1].close()
            await conn[1].wait_closed()
        elif api != "protocol":
            await conn.aclose()
    except Exception as exc:  # noqa: BLE001 - reported
        result["close_error"] = f"{type(exc).__name__}: {exc}"
    result["closing"] = time.monotonic() - started


async def greet(api: str, conn: Any, size: int) -> None:
    if not size:
        return
    data = b"g" * size
    if api == "asyncio":
        conn[1].write(data)
        await conn[1].drain()
    elif api == "protocol":
        conn[0].write(data)
    else:
        await conn.send(data)


async def main(api: str, role: str, port: int, tlsdir: str, pause: float, size: int, hello: int, hold: float) -> None:
    if role == "connect":
        ctx = client_context(tlsdir)
        if api == "channel":
            conn: Any = await aiordma.connect_channel("127.0.0.1", port, ssl=ctx, transport="tcp")
        elif api == "stream":
            conn = await aiordma.connect("127.0.0.1", port, ssl=ctx, transport="tcp")
        elif api == "asyncio":
            import aiordma.asyncio as aio

            conn = await aio.open_connection("127.0.0.1", port, ssl=ctx, transport="tcp",
                                             pass_through=os.environ.get("AIORDMA_TEST_STREAMS_PASS_THROUGH") == "1")
        else:
            import aiordma.asyncio as aio

            conn = await aio.create_connection(Reader, "127.0.0.1", port, ssl=ctx, transport="tcp")
        await greet(api, conn, hello)
        result = await read_all(api, conn, pause, size)
        await anyio.sleep(hold)
        await close(api, conn, result)
        print(json.dumps(result), flush=True)
        return

    ctx = server_context(tlsdir)
    done = anyio.Event()

    async def handle(conn: Any) -> None:
        await greet(api, conn, hello)
        result = await read_all(api, conn, pause, size)
        await anyio.sleep(hold)
        await close(api, conn, result)
        print(json.dumps(result), flush=True)
        done.set()

    if api in ("asyncio", "protocol"):
        import aiordma.asyncio as aio

        if api == "asyncio":
            server = await aio.start_server(lambda r, w: handle((r, w)), "127.0.0.1", 0, ssl=ctx, transport="tcp",
                                            pass_through=os.environ.get("AIORDMA_TEST_STREAMS_PASS_THROUGH") == "1")
        else:
            handlers: set[asyncio.Task[None]] = set()  # (kept: the one connection's handler)

            def factory() -> Reader:
                proto = Reader()
                proto.connection_made = lambda tr: handlers.add(asyncio.ensure_future(handle((tr, proto))))  # type: ignore[method-assign]
                return proto

            server = await aio.create_server(factory, "127.0.0.1", 0, ssl=ctx, transport="tcp")
        print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
        await done.wait()
        server.close()
        return
    make = aiordma.create_channel_listener if api == "channel" else aiordma.create_listener
    async with await make("127.0.0.1", 0, ssl=ctx, transport="tcp") as lst, anyio.create_task_group() as tg:
        print(f"PORT {lst.port}", flush=True)
        tg.start_soon(lst.serve, handle)
        await done.wait()
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    loop, api, role, port, tlsdir, pause, size = sys.argv[1:8]
    hello, hold = (int(sys.argv[8]), float(sys.argv[9])) if len(sys.argv) > 9 else (0, 0.0)
    run(loop, main, api, role, int(port), tlsdir, float(pause), int(size), hello, hold)
