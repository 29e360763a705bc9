"""A listener in a process of its own, and a canary client in another.

Tests that attack a listener must not share its process or its event loop: a loop that runs
the clients too cannot accept faster than they speak, and an exception that ends ``serve()``
may be caught by the test's own task group instead of killing the server.  So:

``python -m tests._listener_proc serve LOOP API TLSDIR``
    A default echo listener on 127.0.0.1 (API ``channel``, ``stream`` -- anyio listeners -- or
    ``asyncio``: ``aiordma.asyncio.start_server``, asyncio and uvloop only), TLS with
    ``TLSDIR/server.pem`` when TLSDIR is not ``-``.  Prints ``PORT n``, then answers on stdin:
    ``stats`` -> one JSON line (open fds, live tasks, open connections, whether ``serve`` still
    runs); ``quit`` -> exits 0.  The handler echoes; a channel message or stream chunk equal to
    ``b"raise"`` makes it raise (a handler that fails).
``python -m tests._listener_proc canary LOOP API PORT TLSDIR``
    Connects once (a channel to a ``channel`` listener, else a stream), then echoes 64 bytes
    every 20 ms until stdin says ``stop``; then prints one JSON line: echoes, the worst round
    trip, and every error (a canary must never see one).

LOOP is ``asyncio``, ``uvloop`` or ``trio``.  Both run until told, and die with their parent's
stdin (EOF ends them).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import sys
import time
from typing import Any

import anyio

import aiordma

HANDLER_RAISE = b"raise"


def run(loop: str, fn: Any, *args: Any) -> None:
    if loop == "uvloop":
        import uvloop

        anyio.run(fn, *args, backend="asyncio", backend_options={"loop_factory": uvloop.new_event_loop})
    else:
        anyio.run(fn, *args, backend=loop)


def live_tasks() -> int:
    if sniffio_name() == "trio":
        import trio

        def count(task: Any) -> int:
            return 1 + sum(count(child) for nursery in task.child_nurseries for child in nursery.child_tasks)

        return count(trio.lowlevel.current_root_task())
    import asyncio

    return len(asyncio.all_tasks())


def sniffio_name() -> str:
    import sniffio

    return sniffio.current_async_library()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def server_context(tlsdir: str) -> ssl.SSLContext | None:
    if tlsdir == "-":
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(os.path.join(tlsdir, "server.pem"))
    return ctx


def client_context(tlsdir: str) -> ssl.SSLContext | None:
    if tlsdir == "-":
        return None
    ctx = ssl.create_default_context(cafile=os.path.join(tlsdir, "ca.pem"))
    return ctx


async def readline() -> str:
    line: str = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
    return line.strip() if line else "quit"


async def serve(api: str, tlsdir: str) -> None:
    ctx = server_context(tlsdir)
    state = {"connections": 0, "serving": True, "serve_error": ""}

    async def echo_channel(ch: aiordma.Channel) -> None:
        state["connections"] += 1
        try:
            async with ch:
                async for msg in ch:
                    if msg == HANDLER_RAISE:
                        raise RuntimeError("the handler was asked to raise")
                    await ch.send(msg)
        finally:
            state["connections"] -= 1

    async def echo_stream(st: aiordma.Stream) -> None:
        state["connections"] += 1
        try:
            async with st:
                async for data in st:
                    if data == HANDLER_RAISE:
                        raise RuntimeError("the handler was asked to raise")
                    await st.send(data)
        finally:
            state["connections"] -= 1

    async def control(port: int, stop: Any) -> None:
        print(f"PORT {port}", flush=True)
        while True:
            cmd = await readline()
            if cmd == "stats":
                print(json.dumps({"fds": open_fds(), "tasks": live_tasks(), **state}), flush=True)
            elif cmd == "quit":
                await stop()
                return

    if api == "asyncio":
        import aiordma.asyncio as aio

        async def on_client(reader: Any, writer: Any) -> None:
            state["connections"] += 1
            try:
                while data := await reader.read(65536):
                    if data == HANDLER_RAISE:
                        raise RuntimeError("the handler was asked to raise")
                    writer.write(data)
                    await writer.drain()
                writer.close()
                await writer.wait_closed()
            finally:
                state["connections"] -= 1

        server = await aio.start_server(on_client, "127.0.0.1", 0, ssl=ctx, transport="tcp")

        async def stop_server() -> None:
            server.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(control, server.sockets[0].getsockname()[1], stop_server)
            try:
                await server.serve_forever()
            except anyio.get_cancelled_exc_class():
                pass  # (quit: close() cancels serve_forever)
            tg.cancel_scope.cancel()
        return

    make = aiordma.create_channel_listener if api == "channel" else aiordma.create_listener
    lst: Any = await make("127.0.0.1", 0, ssl=ctx, transport="tcp")
    handler = echo_channel if api == "channel" else echo_stream

    async with anyio.create_task_group() as tg:

        async def stop_listener() -> None:
            await lst.aclose()  # (serve returns once the connections it handed out ended)

        tg.start_soon(control, lst.port, stop_listener)
        try:
            await lst.serve(handler)
        except BaseException as exc:
            state["serving"] = False
            state["serve_error"] = repr(exc)
            print(json.dumps({"serve_raised": repr(exc)}), file=sys.stderr, flush=True)
            raise


async def canary(api: str, port: int, tlsdir: str) -> None:
    ctx = client_context(tlsdir)
    report: dict[str, Any] = {"echoes": 0, "worst": 0.0, "errors": []}
    payload = os.urandom(64)
    stop = anyio.Event()

    async def watch() -> None:
        await readline()
        stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        try:
            conn: Any
            if api == "channel":
                conn = await aiordma.connect_channel("127.0.0.1", port, ssl=ctx, transport="tcp")
            else:
                conn = await aiordma.connect("127.0.0.1", port, ssl=ctx, transport="tcp")
            print("CONNECTED", flush=True)
            async with conn:
                while not stop.is_set():
                    started = time.monotonic()
                    with anyio.fail_after(10):
                        await conn.send(payload)
                        got = b""
                        while len(got) < len(payload):
                            got += await conn.receive()
                    if got != payload:
                        raise AssertionError(f"the echo differs: {got!r}")
                    report["echoes"] += 1
                    report["worst"] = max(report["worst"], time.monotonic() - started)
                    with anyio.move_on_after(0.02):
                        await stop.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            report["errors"].append(repr(exc))
            print("CONNECTED", flush=True)  # (the test waits for this line either way)
            await stop.wait()
        print(json.dumps(report), flush=True)
        tg.cancel_scope.cancel()


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    what, loop, api = argv[0], argv[1], argv[2]
    if what == "serve":
        run(loop, serve, api, argv[3])
    elif what == "canary":
        run(loop, canary, api, int(argv[3]), argv[4])
    else:
        raise SystemExit(f"unknown command {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
