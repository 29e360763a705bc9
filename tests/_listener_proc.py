"""A listener in a process of its own, and a canary client in another.

Tests that attack a listener must not share its process or its event loop: a loop that runs
the clients too cannot accept faster than they speak, and an exception that ends ``serve()``
may be caught by the test's own task group instead of killing the server.  So:

``python -m tests._listener_proc serve LOOP API TLSDIR``
    A default echo listener on 127.0.0.1 (API ``channel``, ``stream`` -- anyio listeners --,
    ``asyncio``: ``aiordma.asyncio.start_server``, asyncio and uvloop only -- or ``sim``: a
    channel listener offering RDMA over the simulated wire, with an inner canary client in this
    process talking to it over that wire, reported as ``inner`` in the stats), TLS with
    ``TLSDIR/server.pem`` when TLSDIR is not ``-``.  Prints ``PORT n``, then answers on stdin:
    ``stats`` -> one JSON line (open fds, live tasks, open connections, whether ``serve`` still
    runs); ``quit`` -> exits 0.  The handler echoes; a channel message or stream chunk equal to
    ``b"raise"`` makes it raise (a handler that fails).
``python -m tests._listener_proc burst LOOP API PORT TLSDIR N``
    N clients connect at once when stdin says ``go`` (after the process printed ``READY``), each
    echoes once; then one JSON line: failures, a few errors, each success's connect-to-echo time.
``python -m tests._listener_proc probe LOOP API PORT TLSDIR``
    A new client every 0.25 s (connect, echo, close) until ``stop``; then the worst time.
``python -m tests._listener_proc flood - API PORT SILENT STALLING``
    Sockets that never speak and sockets that start and stall, reopened as they are dropped,
    until ``stop`` (plain sockets and ``selectors``: no event loop).
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
import selectors
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
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


async def open_client(api: str, port: int, ctx: ssl.SSLContext | None) -> Any:
    """A client of a listener of ``api``: a channel for ``channel``, a Dask comm for ``dask``,
    a grpclib bidirectional call for ``grpc`` (both behind :class:`_Messages`), else a byte
    stream."""
    if api == "channel":
        return await aiordma.connect_channel("127.0.0.1", port, ssl=ctx, transport="tcp")
    if api == "dask":
        from distributed.comm import connect

        return _Messages(await connect(f"rdma://127.0.0.1:{port}"))
    if api == "grpc":
        from grpclib.client import StreamStreamMethod

        from aiordma.grpc import Channel  # (not ``import aiordma.grpc``: that makes aiordma local here)

        channel = Channel("127.0.0.1", port, codec=RawCodec())
        try:
            call = StreamStreamMethod(channel, ECHO, bytes, bytes).open()
            await call.__aenter__()
            try:
                await call.send_request()  # (connects: the aiordma handshake, then HTTP/2's)
            except BaseException:
                await call.__aexit__(None, None, None)
                raise
        except BaseException:
            channel.close()
            raise
        return _Messages(call, channel)
    if api == "asyncio-streams":
        import aiordma.asyncio as aio

        reader, writer = await aio.open_connection("127.0.0.1", port, ssl=ctx, transport="tcp")
        return _AsyncioStream(reader, writer)
    return await aiordma.connect("127.0.0.1", port, ssl=ctx, transport="tcp")


class _AsyncioStream:
    """``aiordma.asyncio``'s reader and writer with a stream's ``send``/``receive``/``aclose``
    (what the canary, burst and probe clients use); ``passed``: it went unframed."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader, self.writer = reader, writer
        self.passed = bool(writer.get_extra_info("aiordma_passed_through"))

    async def send(self, item: bytes) -> None:
        self.writer.write(item)
        await self.writer.drain()

    async def receive(self) -> bytes:
        data: bytes = await self.reader.read(65536)
        if not data:
            raise anyio.EndOfStream
        return data

    async def aclose(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()

    async def __aenter__(self) -> _AsyncioStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Messages:
    """A Dask comm or a grpclib call with a channel's ``send``/``receive``/``aclose`` (what the
    canary, burst and probe clients use): the peer's end is ``EndOfStream``, a failed call
    ``BrokenResourceError``."""

    def __init__(self, conn: Any, channel: Any = None) -> None:
        self.conn = conn
        self.channel = channel  # (grpc: the channel that owns the call's connection)

    async def send(self, item: bytes) -> None:
        if self.channel is None:
            await self.conn.write(item)
        else:
            await self.conn.send_message(item)

    async def receive(self) -> bytes:
        # (each side imports only its own library: either may be installed without the other)
        if self.channel is None:
            from distributed.comm.core import CommClosedError

            try:
                return bytes(await self.conn.read())
            except CommClosedError as exc:
                raise anyio.EndOfStream from exc
        from grpclib.exceptions import GRPCError, StreamTerminatedError

        try:
            got = await self.conn.recv_message()
        except (GRPCError, StreamTerminatedError) as exc:  # (the server failed the call)
            raise anyio.BrokenResourceError(str(exc)) from exc
        if got is None:
            raise anyio.EndOfStream
        return bytes(got)

    async def aclose(self) -> None:
        if self.channel is None:
            await self.conn.close()
            return
        try:
            with anyio.move_on_after(5):
                await self.conn.end()
        except Exception:  # noqa: BLE001 - (a call the server failed has nothing to end)
            pass
        finally:
            try:
                await self.conn.__aexit__(None, None, None)
            except Exception:  # noqa: BLE001 - (its status: the test looked at what it received)
                pass
            self.channel.close()

    async def __aenter__(self) -> _Messages:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


#: the grpc listener's one method: a bidirectional stream that echoes each message
ECHO = "/aiordma.test.Echo/Echo"


class RawCodec:
    """grpclib's codec for bytes messages (as examples/grpc_service.py's)."""

    __content_subtype__ = "raw"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return bytes(data)


async def readline() -> str:
    line: str = await anyio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
    return line.strip() if line else "quit"


async def serve(api: str, tlsdir: str) -> None:
    ctx = server_context(tlsdir)
    state = {"connections": 0, "serving": True, "serve_error": ""}

    async def echo(conn: Any) -> None:
        """A channel's messages or a stream's chunks, back as they came."""
        state["connections"] += 1
        try:
            async with conn:
                async for item in conn:
                    if item == HANDLER_RAISE:
                        raise RuntimeError("the handler was asked to raise")
                    await conn.send(item)
        finally:
            state["connections"] -= 1

    async def control(port: int, stop: Any, serving: Callable[[], bool] | None = None) -> None:
        """Answers ``stats`` (``serving``: asked then, where the listener's own state tells it)
        and ``quit`` from stdin."""
        print(f"PORT {port}", flush=True)
        while True:
            cmd = await readline()
            if cmd == "stats":
                if serving is not None:
                    state["serving"] = serving()
                print(json.dumps({"fds": open_fds(), "tasks": live_tasks(), **state}), flush=True)
            elif cmd == "quit":
                await stop()
                return

    if api in ("asyncio", "asyncio-streams"):
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

    if api == "dask":
        await serve_dask(state, control)
        return
    if api == "grpc":
        await serve_grpc(state, control)
        return

    inner: dict[str, Any] = {"echoes": 0, "worst": 0.0, "errors": [], "transport": None}
    inner_stop = anyio.Event()
    if api == "sim":
        # the simulated RC wire, in this process: the listener offers RDMA; an inner canary
        # talks to it over RDMA (its QPs are what a hostile HELLO may name)
        from aiordma.testing import SimFabric, SimProvider

        fabric = SimFabric()
        fabric.add_device("sim0", "127.0.0.1")
        lst: Any = await aiordma.create_channel_listener(
            "127.0.0.1", 0, transport="auto", rdma_backend=aiordma.RdmaBackend(provider=SimProvider(fabric))
        )  # fmt: skip
        state["inner"] = inner  # type: ignore[assignment]

        async def inner_canary() -> None:
            try:
                async with await aiordma.connect_channel(
                    "127.0.0.1", lst.port, transport="rdma", rdma_backend=aiordma.RdmaBackend(provider=SimProvider(fabric))
                ) as ch:  # fmt: skip
                    inner["transport"] = ch.extra(aiordma.TransportAttribute.transport)
                    while not inner_stop.is_set():
                        started = time.monotonic()
                        with anyio.fail_after(10):
                            await ch.send(b"inner")
                            assert await ch.receive() == b"inner"
                        inner["echoes"] += 1
                        inner["worst"] = max(inner["worst"], time.monotonic() - started)
                        with anyio.move_on_after(0.02):
                            await inner_stop.wait()
            except Exception as exc:  # noqa: BLE001 - reported in the stats
                inner["errors"].append(repr(exc))
    else:
        make = aiordma.create_channel_listener if api == "channel" else aiordma.create_listener
        lst = await make("127.0.0.1", 0, ssl=ctx, transport="tcp")

    async with anyio.create_task_group() as tg:

        async def stop_listener() -> None:
            inner_stop.set()
            await lst.aclose()  # (serve returns once the connections it handed out ended)

        tg.start_soon(control, lst.port, stop_listener)
        if api == "sim":
            tg.start_soon(inner_canary)
        try:
            await lst.serve(echo)
        except BaseException as exc:
            state["serving"] = False
            state["serve_error"] = repr(exc)
            print(json.dumps({"serve_raised": repr(exc)}), file=sys.stderr, flush=True)
            raise


async def serve_dask(state: dict[str, Any], control: Any) -> None:
    """Dask's ``rdma://`` listener (``distributed.comm.listen``), plain: its comm handler echoes."""
    import asyncio

    from distributed.comm import listen
    from distributed.comm.core import CommClosedError

    async def echo(comm: Any) -> None:
        state["connections"] += 1
        try:
            while True:
                msg = await comm.read()
                if msg == HANDLER_RAISE:
                    raise RuntimeError("the handler was asked to raise")
                await comm.write(msg)
        except CommClosedError:
            pass
        finally:
            state["connections"] -= 1
            await comm.close()

    listener = listen("rdma://127.0.0.1:0", echo)
    await listener.start()
    done = asyncio.Event()

    async def stop() -> None:
        task = listener.stop()
        if task is not None:
            await task
        done.set()

    def serving() -> bool:
        # (the listener's serve task runs -- what a client's bytes must never end)
        task = listener._serve_task  # noqa: SLF001 - the harness looks, nothing else reads it
        return task is not None and not task.done()

    async with anyio.create_task_group() as tg:
        tg.start_soon(control, listener.get_host_port()[1], stop, serving)
        await done.wait()


async def serve_grpc(state: dict[str, Any], control: Any) -> None:
    """grpclib's ``Server`` on :func:`aiordma.grpc.start_server`, plain: one bidirectional
    method that echoes each message."""
    import aiordma.grpc
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    class Echo:
        async def echo(self, stream: Any) -> None:
            state["connections"] += 1
            try:
                async for message in stream:
                    if message == HANDLER_RAISE:
                        raise RuntimeError("the handler was asked to raise")
                    await stream.send_message(message)
            finally:
                state["connections"] -= 1

        def __mapping__(self) -> dict[str, Any]:
            return {ECHO: Handler(self.echo, Cardinality.STREAM_STREAM, bytes, bytes)}

    server = Server([Echo()], codec=RawCodec())  # type: ignore[arg-type]
    listening = await aiordma.grpc.start_server(server, "127.0.0.1", 0)
    done = anyio.Event()

    async def stop() -> None:
        server.close()
        await server.wait_closed()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(control, listening.sockets[0].getsockname()[1], stop, listening.is_serving)
        await done.wait()


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
            conn: Any = await open_client(api, port, ctx)
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


async def burst(api: str, port: int, tlsdir: str, count: int) -> None:
    """``count`` clients connect at once (after ``go`` on stdin), each echoes once; prints one
    JSON line: how many failed, a few of their errors, and each success's time from its
    connect to its first echo (seconds)."""
    ctx = client_context(tlsdir)
    errors: list[str] = []
    times: list[float] = []
    print("READY", flush=True)
    await readline()

    async def one() -> None:
        started = time.monotonic()
        try:
            with anyio.fail_after(60):
                conn: Any = await open_client(api, port, ctx)
                if isinstance(conn, _AsyncioStream) and ctx is None:
                    assert conn.passed, "a plain asyncio stream did not pass through"
                async with conn:
                    await conn.send(b"ping")
                    got = b""
                    while len(got) < 4:
                        got += await conn.receive()
                    assert got == b"ping", got
            times.append(time.monotonic() - started)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            errors.append(repr(exc))

    async with anyio.create_task_group() as tg:
        for _ in range(count):
            tg.start_soon(one)
    print(json.dumps({"failed": len(errors), "errors": errors[:5], "times": times}), flush=True)


async def probe(api: str, port: int, tlsdir: str) -> None:
    """A new client every 0.25 s (connect, handshake, one echo, close) until stdin says
    ``stop``; then one JSON line: probes, the worst one's time, and every error."""
    ctx = client_context(tlsdir)
    report: dict[str, Any] = {"probes": 0, "worst": 0.0, "errors": []}
    stop = anyio.Event()

    async def watch() -> None:
        await readline()
        stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        print("READY", flush=True)
        while not stop.is_set():
            started = time.monotonic()
            try:
                with anyio.fail_after(10):
                    conn: Any = await open_client(api, port, ctx)
                    async with conn:
                        await conn.send(b"ping")
                        got = b""
                        while len(got) < 4:
                            got += await conn.receive()
                report["probes"] += 1
                report["worst"] = max(report["worst"], time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                report["errors"].append(repr(exc))
            with anyio.move_on_after(0.25):
                await stop.wait()
        print(json.dumps(report), flush=True)
        tg.cancel_scope.cancel()


def flood(port: int, silent: int, stalling: int, mode: str) -> None:
    """``silent`` sockets that never send a byte and ``stalling`` ones that start and stall (half
    send a few bytes of the magic, half a whole HELLO and then nothing), each opened again as
    soon as the listener drops it, until stdin says ``stop`` (or ends); then one JSON line:
    how many the listener dropped (and so were reopened)."""
    import socket

    from aiordma._proto.protocol import Connection, Mode, Role

    hello = Connection(Role.CLIENT, Mode.MESSAGES if mode == "channel" else Mode.STREAM, now=0.0).send_hello()
    sel = selectors.DefaultSelector()
    kinds = ["silent"] * silent + ["partial"] * (stalling // 2) + ["hello"] * (stalling - stalling // 2)
    reopened = 0

    def open_one(kind: str) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        sel.register(sock, selectors.EVENT_WRITE if kind != "silent" else selectors.EVENT_READ, kind)

    for kind in kinds:
        open_one(kind)
    sel.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("READY", flush=True)
    while True:
        for key, events in sel.select(1.0):
            if key.data == "stdin":
                for k in list(sel.get_map().values()):
                    if k.data != "stdin":
                        k.fileobj.close()  # type: ignore[union-attr]
                print(json.dumps({"reopened": reopened}), flush=True)
                return
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if events & selectors.EVENT_WRITE:  # (connected: start, then stall)
                try:
                    sock.send(MAGIC_PART if key.data == "partial" else hello)
                except OSError:
                    pass
                sel.modify(sock, selectors.EVENT_READ, key.data)
                continue
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:  # the listener dropped it: open another
                sel.unregister(sock)
                sock.close()
                reopened += 1
                open_one(key.data)


MAGIC_PART = b"AIORD"


# -- driving these from a test -------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Proc:
    """A ``tests._listener_proc`` process, driven over its stdin/stdout; its stderr (the
    listener's log) goes to a temporary file, so that a chatty process never blocks on a full
    pipe."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.TemporaryFile("w+")
        self._text = ""
        self.p = subprocess.Popen(
            [sys.executable, "-m", "tests._listener_proc", *args], cwd=ROOT, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
        )  # fmt: skip

    def line(self, timeout: float = 20) -> str:
        assert self.p.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.p.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise AssertionError(f"{self.p.args} said nothing for {timeout} s; stderr: {self.stderr()[-4000:]}")
        out = self.p.stdout.readline()
        if not out:
            raise AssertionError(f"{self.p.args} ended (rc {self.p.poll()}); stderr: {self.stderr()[-4000:]}")
        return out.strip()

    def say(self, cmd: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()

    def ask(self, cmd: str) -> dict[str, Any]:
        self.say(cmd)
        got: dict[str, Any] = json.loads(self.line())
        return got

    def stderr(self) -> str:
        """Everything it wrote to stderr so far."""
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        """End it (quit, then kill); returns everything it wrote to stderr.  Idempotent."""
        if self.log.closed:
            return self._text
        if self.p.poll() is None:
            try:
                self.say("quit")
                self.p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()
        for pipe in (self.p.stdin, self.p.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        self._text = self.stderr()
        self.log.close()
        return self._text


def main(argv: list[str]) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    what, loop, api = argv[0], argv[1], argv[2]
    if what == "serve":
        run(loop, serve, api, argv[3])
    elif what == "canary":
        run(loop, canary, api, int(argv[3]), argv[4])
    elif what == "probe":
        run(loop, probe, api, int(argv[3]), argv[4])
    elif what == "flood":
        flood(int(argv[3]), int(argv[4]), int(argv[5]), api)
    elif what == "burst":
        run(loop, burst, api, int(argv[3]), argv[4], int(argv[5]))
    else:
        raise SystemExit(f"unknown command {what!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
