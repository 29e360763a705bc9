"""aiordma over TCP against the plain stacks it sits on: round trip and throughput.

    .venv/bin/python benchmarks/tcp_bench.py                 # every variant, 5 repeats
    .venv/bin/python benchmarks/tcp_bench.py --repeat 7 --round-trips 10000 --mib 512
    .venv/bin/python benchmarks/tcp_bench.py --variants asyncio-streams,aiordma-asyncio
    .venv/bin/python benchmarks/tcp_bench.py --profile aiordma-asyncio --profile-what rtt

What is measured, for each variant:

* **round trip**: the client writes 64 bytes, the server echoes them, the client
  reads all 64 back; repeated ``--round-trips`` times on one connection after a
  warm-up; the figure is the mean time of one round trip in that run.
* **throughput**: the client sends ``--mib`` MiB in 1 MiB writes (waiting for
  the stream's backpressure as its API wants: ``drain()``, ``send()``,
  ``send_all()``); the server reads and discards, and answers with an 8-byte
  count once it has everything; the figure is bytes / (first write to the
  answer).  A smaller warm-up transfer goes first on the same connection.

Client and server run in the same process and the same event loop (one
thread), over 127.0.0.1, so every figure includes both ends' CPU time.  Each
measurement is repeated ``--repeat`` times; the variants are interleaved
(round robin, order rotated every repeat) so that drift from other work on the
machine spreads over all of them; the table shows medians (and min-max).

``--profile VARIANT`` instead runs the server in a child process and the
client under cProfile, and prints where the client's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import importlib.metadata
import io
import multiprocessing
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio

import aiordma
import aiordma.asyncio

T = TypeVar("T")

HOST = "127.0.0.1"
MiB = 1 << 20
CHUNK = MiB
ECHO_READ = 65536
DRAIN_READ = 256 << 10
MODE_ECHO = b"E"
MODE_DRAIN = b"D"
MESSAGE = bytes(range(64))


# -- variants --------------------------------------------------------------------


class Variant:
    key = ""
    label = ""
    group = ""  # "asyncio", "uvloop", "trio"

    def run(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        raise NotImplementedError

    def server(self) -> Any:  # async context manager yielding the port
        raise NotImplementedError

    async def rtt(self, port: int, n: int, warmup: int) -> tuple[float, float]:
        raise NotImplementedError

    async def throughput(self, port: int, total: int, warmup: int) -> tuple[float, float]:
        raise NotImplementedError


def _run_asyncio(loop_factory: Callable[[], asyncio.AbstractEventLoop] | None, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(fn())


class AsyncioStreams(Variant):
    """asyncio's open_connection/start_server, or aiordma.asyncio's (same API)."""

    def __init__(self, key: str, label: str, module: Any, uvloop: bool) -> None:
        self.key = key
        self.label = label
        self.group = "uvloop" if uvloop else "asyncio"
        self._module = module
        self._uvloop = uvloop
        self._kwargs: dict[str, Any] = {"transport": "tcp"} if module is aiordma.asyncio else {}

    def run(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        factory = None
        if self._uvloop:
            import uvloop

            factory = uvloop.new_event_loop
        return _run_asyncio(factory, fn)

    @staticmethod
    async def _handle(reader: Any, writer: Any) -> None:
        try:
            mode = await reader.readexactly(1)
            if mode == MODE_ECHO:
                while True:
                    data = await reader.read(ECHO_READ)
                    if not data:
                        break
                    writer.write(data)
                    await writer.drain()
            elif mode == MODE_DRAIN:
                while True:
                    want = int.from_bytes(await reader.readexactly(8), "big")
                    if not want:
                        break
                    left = want
                    while left:
                        data = await reader.read(min(DRAIN_READ, left))
                        if not data:
                            raise ConnectionResetError("EOF in a transfer")
                        left -= len(data)
                    writer.write(want.to_bytes(8, "big"))
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except ConnectionError:
                pass

    @asynccontextmanager
    async def server(self) -> AsyncIterator[int]:
        handlers: set[asyncio.Task[Any]] = set()

        async def handle(reader: Any, writer: Any) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            try:
                await self._handle(reader, writer)
            finally:
                handlers.discard(task)

        server = await self._module.start_server(handle, HOST, 0, **self._kwargs)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()
            await server.wait_closed()
            if handlers:  # asyncio's (3.11) wait_closed does not wait for them
                await asyncio.wait(set(handlers), timeout=10)

    async def _connect(self, port: int, mode: bytes) -> tuple[Any, Any]:
        reader, writer = await self._module.open_connection(HOST, port, **self._kwargs)
        writer.write(mode)
        return reader, writer

    @staticmethod
    async def _close(writer: Any) -> None:
        writer.close()
        await writer.wait_closed()

    async def rtt(self, port: int, n: int, warmup: int) -> tuple[float, float]:
        reader, writer = await self._connect(port, MODE_ECHO)
        write, drain, readexactly = writer.write, writer.drain, reader.readexactly
        for _ in range(warmup):
            write(MESSAGE)
            await drain()
            await readexactly(64)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            write(MESSAGE)
            await drain()
            await readexactly(64)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        await self._close(writer)
        return elapsed / n, cpu / n

    async def throughput(self, port: int, total: int, warmup: int) -> tuple[float, float]:
        reader, writer = await self._connect(port, MODE_DRAIN)
        block = os.urandom(CHUNK)
        elapsed = 0.0
        cpu = 0.0
        for amount in (warmup, total):
            start, cpu = time.perf_counter(), time.process_time()
            writer.write(amount.to_bytes(8, "big"))
            left = amount
            while left:
                writer.write(block if left >= CHUNK else block[:left])
                await writer.drain()
                left -= min(left, CHUNK)
            got = int.from_bytes(await reader.readexactly(8), "big")
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            assert got == amount, (got, amount)
        writer.write(bytes(8))
        await self._close(writer)
        return total / elapsed, total / cpu


async def _receive_exactly_anyio(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += await stream.receive(n - len(data))
    return data


class AnyioAPI(Variant):
    """aiordma's anyio API (connect / create_listener), or anyio's own TCP streams."""

    def __init__(self, key: str, label: str, backend: str, uvloop: bool = False, plain_anyio: bool = False) -> None:
        self.key = key
        self.label = label
        self.group = "trio" if backend == "trio" else ("uvloop" if uvloop else "asyncio")
        self._backend = backend
        self._uvloop = uvloop
        self._plain = plain_anyio

    def run(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        options: dict[str, Any] = {}
        if self._uvloop:
            import uvloop

            options["loop_factory"] = uvloop.new_event_loop
        return anyio.run(fn, backend=self._backend, backend_options=options)

    @staticmethod
    async def _handle(stream: Any) -> None:
        async with stream:
            try:
                mode = await _receive_exactly_anyio(stream, 1)
                if mode == MODE_ECHO:
                    while True:
                        await stream.send(await stream.receive(ECHO_READ))
                elif mode == MODE_DRAIN:
                    while True:
                        want = int.from_bytes(await _receive_exactly_anyio(stream, 8), "big")
                        if not want:
                            break
                        left = want
                        while left:
                            left -= len(await stream.receive(min(DRAIN_READ, left)))
                        await stream.send(want.to_bytes(8, "big"))
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    @asynccontextmanager
    async def server(self) -> AsyncIterator[int]:
        listener: Any
        if self._plain:
            listener = await anyio.create_tcp_listener(local_host=HOST, local_port=0)
            port = listener.extra(anyio.abc.SocketAttribute.local_port)
        else:
            listener = await aiordma.create_listener(HOST, 0, transport="tcp")
            port = listener.port
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._handle, tg)
            try:
                yield port
            finally:
                tg.cancel_scope.cancel()

    async def _connect(self, port: int, mode: bytes) -> Any:
        if self._plain:
            stream: Any = await anyio.connect_tcp(HOST, port)
        else:
            stream = await aiordma.connect(HOST, port, transport="tcp")
        await stream.send(mode)
        return stream

    async def rtt(self, port: int, n: int, warmup: int) -> tuple[float, float]:
        stream = await self._connect(port, MODE_ECHO)
        send, receive = stream.send, stream.receive
        async with stream:
            for _ in range(warmup):
                await send(MESSAGE)
                got = await receive(64)
                while len(got) < 64:
                    got += await receive(64 - len(got))
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                await send(MESSAGE)
                got = await receive(64)
                while len(got) < 64:
                    got += await receive(64 - len(got))
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        return elapsed / n, cpu / n

    async def throughput(self, port: int, total: int, warmup: int) -> tuple[float, float]:
        stream = await self._connect(port, MODE_DRAIN)
        block = os.urandom(CHUNK)
        elapsed = 0.0
        async with stream:
            cpu = 0.0
            for amount in (warmup, total):
                start, cpu = time.perf_counter(), time.process_time()
                await stream.send(amount.to_bytes(8, "big"))
                left = amount
                while left:
                    await stream.send(block if left >= CHUNK else block[:left])
                    left -= min(left, CHUNK)
                got = int.from_bytes(await _receive_exactly_anyio(stream, 8), "big")
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                assert got == amount, (got, amount)
            await stream.send(bytes(8))
        return total / elapsed, total / cpu


class TrioSockets(Variant):
    """trio.open_tcp_stream / trio.serve_listeners: trio's SocketStream."""

    key = "trio-sockets"
    label = "trio SocketStream"
    group = "trio"

    def run(self, fn: Callable[[], Coroutine[Any, Any, T]]) -> T:
        import trio

        return trio.run(fn)

    @staticmethod
    async def _receive_exactly(stream: Any, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await stream.receive_some(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    async def _handle(self, stream: Any) -> None:
        import trio

        async with stream:
            try:
                mode = await self._receive_exactly(stream, 1)
                if mode == MODE_ECHO:
                    while True:
                        data = await stream.receive_some(ECHO_READ)
                        if not data:
                            break
                        await stream.send_all(data)
                elif mode == MODE_DRAIN:
                    while True:
                        want = int.from_bytes(await self._receive_exactly(stream, 8), "big")
                        if not want:
                            break
                        left = want
                        while left:
                            data = await stream.receive_some(min(DRAIN_READ, left))
                            if not data:
                                raise EOFError
                            left -= len(data)
                        await stream.send_all(want.to_bytes(8, "big"))
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    @asynccontextmanager
    async def server(self) -> AsyncIterator[int]:
        import trio

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, self._handle, 0, host=HOST))
            try:
                yield listeners[0].socket.getsockname()[1]
            finally:
                nursery.cancel_scope.cancel()

    async def _connect(self, port: int, mode: bytes) -> Any:
        import trio

        stream = await trio.open_tcp_stream(HOST, port)
        await stream.send_all(mode)
        return stream

    async def rtt(self, port: int, n: int, warmup: int) -> tuple[float, float]:
        stream = await self._connect(port, MODE_ECHO)
        send_all, receive_some = stream.send_all, stream.receive_some
        async with stream:
            for _ in range(warmup):
                await send_all(MESSAGE)
                got = await receive_some(64)
                while len(got) < 64:
                    got += await receive_some(64 - len(got))
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(n):
                await send_all(MESSAGE)
                got = await receive_some(64)
                while len(got) < 64:
                    got += await receive_some(64 - len(got))
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        return elapsed / n, cpu / n

    async def throughput(self, port: int, total: int, warmup: int) -> tuple[float, float]:
        stream = await self._connect(port, MODE_DRAIN)
        block = os.urandom(CHUNK)
        elapsed = 0.0
        async with stream:
            cpu = 0.0
            for amount in (warmup, total):
                start, cpu = time.perf_counter(), time.process_time()
                await stream.send_all(amount.to_bytes(8, "big"))
                left = amount
                while left:
                    await stream.send_all(block if left >= CHUNK else block[:left])
                    left -= min(left, CHUNK)
                got = int.from_bytes(await self._receive_exactly(stream, 8), "big")
                elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
                assert got == amount, (got, amount)
            await stream.send_all(bytes(8))
        return total / elapsed, total / cpu


def all_variants() -> list[Variant]:
    return [
        AsyncioStreams("asyncio-streams", "(a) asyncio streams, asyncio loop", asyncio, uvloop=False),
        AsyncioStreams("aiordma-asyncio", "(b) aiordma.asyncio, asyncio loop", aiordma.asyncio, uvloop=False),
        AsyncioStreams("uvloop-streams", "(c) asyncio streams, uvloop", asyncio, uvloop=True),
        AsyncioStreams("aiordma-asyncio-uvloop", "(d) aiordma.asyncio, uvloop", aiordma.asyncio, uvloop=True),
        TrioSockets(),
        AnyioAPI("aiordma-trio", "(f) aiordma (anyio API), trio", "trio"),
        AnyioAPI("aiordma-anyio-asyncio", "(g) aiordma (anyio API), asyncio loop", "asyncio"),
        AnyioAPI("anyio-asyncio", "(x) anyio TCP streams, asyncio loop", "asyncio", plain_anyio=True),
    ]


def _label(v: Variant) -> str:
    return v.label if not isinstance(v, TrioSockets) else "(e) trio SocketStream"


# -- running ---------------------------------------------------------------------


@dataclass
class Figures:
    rtt: list[float] = field(default_factory=list)  # wall seconds per round trip
    rtt_cpu: list[float] = field(default_factory=list)  # process CPU seconds per round trip
    tput: list[float] = field(default_factory=list)  # bytes per wall second
    tput_cpu: list[float] = field(default_factory=list)  # bytes per process CPU second

    def series(self, name: str) -> list[float]:
        return list(getattr(self, name))


def measure_once(v: Variant, round_trips: int, warmup_rt: int, total: int, warmup_bytes: int, into: Figures) -> None:
    async def body() -> tuple[tuple[float, float], tuple[float, float]]:
        async with v.server() as port:
            rtt = await v.rtt(port, round_trips, warmup_rt)
            tput = await v.throughput(port, total, warmup_bytes)
        return rtt, tput

    (rtt, rtt_cpu), (tput, tput_cpu) = v.run(body)
    into.rtt.append(rtt)
    into.rtt_cpu.append(rtt_cpu)
    into.tput.append(tput)
    into.tput_cpu.append(tput_cpu)


def machine_lines() -> list[str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count() or 0

    def ver(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return [
        f"CPU: {cpu}; {os.cpu_count()} logical cores ({affinity} usable by this process)",
        f"kernel: {platform.release()}; load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"Python {platform.python_version()} ({platform.python_implementation()}); "
        f"aiordma {aiordma.__version__}, anyio {ver('anyio')}, trio {ver('trio')}, uvloop {ver('uvloop')}",
    ]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_results(variants: list[Variant], figures: dict[str, Figures]) -> None:
    print()
    print("medians over the runs (min-max); wall = elapsed time, CPU = this process's CPU time (user + system)")
    head = ("variant", "RTT wall µs", "RTT CPU µs", "MB/s wall", "MB per CPU s")
    print(f"{head[0]:<40} {head[1]:>21} {head[2]:>21} {head[3]:>17} {head[4]:>17}")
    print("-" * 120)
    for v in variants:
        f = figures[v.key]
        rtt = [x * 1e6 for x in f.rtt]
        rtt_cpu = [x * 1e6 for x in f.rtt_cpu]
        mbs = [x / 1e6 for x in f.tput]
        mbs_cpu = [x / 1e6 for x in f.tput_cpu]
        cells = [
            f"{_median(rtt):6.1f} ({min(rtt):.1f}-{max(rtt):.1f})",
            f"{_median(rtt_cpu):6.1f} ({min(rtt_cpu):.1f}-{max(rtt_cpu):.1f})",
            f"{_median(mbs):5.0f} ({min(mbs):.0f}-{max(mbs):.0f})",
            f"{_median(mbs_cpu):5.0f} ({min(mbs_cpu):.0f}-{max(mbs_cpu):.0f})",
        ]
        print(f"{_label(v):<40} {cells[0]:>21} {cells[1]:>21} {cells[2]:>17} {cells[3]:>17}")

    def ratio(num: str, den: str, series: str) -> float | None:
        if num not in figures or den not in figures:
            return None
        return _median(figures[num].series(series)) / _median(figures[den].series(series))

    print()
    print("ratios of medians, wall (CPU) [target, judged on wall]:")
    checks: list[tuple[str, str, str, str, str | None, float | None]] = [
        ("aiordma.asyncio RTT / asyncio streams RTT", "aiordma-asyncio", "asyncio-streams", "rtt", "<=", 1.05),
        ("aiordma.asyncio MB/s / asyncio streams MB/s", "aiordma-asyncio", "asyncio-streams", "tput", ">=", 0.95),
        ("aiordma.asyncio RTT / streams RTT, uvloop", "aiordma-asyncio-uvloop", "uvloop-streams", "rtt", "<=", 1.10),
        ("aiordma.asyncio MB/s / streams MB/s, uvloop", "aiordma-asyncio-uvloop", "uvloop-streams", "tput", None, None),
        ("aiordma-trio RTT / trio sockets RTT", "aiordma-trio", "trio-sockets", "rtt", None, None),
        ("aiordma-trio MB/s / trio sockets MB/s", "aiordma-trio", "trio-sockets", "tput", None, None),
        ("aiordma anyio API RTT / anyio TCP RTT, asyncio", "aiordma-anyio-asyncio", "anyio-asyncio", "rtt", None, None),
        ("aiordma anyio API MB/s / anyio TCP MB/s, asyncio", "aiordma-anyio-asyncio", "anyio-asyncio", "tput", None, None),
        ("aiordma anyio API RTT / asyncio streams RTT", "aiordma-anyio-asyncio", "asyncio-streams", "rtt", None, None),
    ]
    for text, num, den, what, op, target in checks:
        wall = ratio(num, den, what)
        cpu = ratio(num, den, what + "_cpu")
        if wall is None or cpu is None:
            continue
        verdict = ""
        if op is not None and target is not None:
            met = wall <= target if op == "<=" else wall >= target
            verdict = f"[{op} {target:.2f}: {'met' if met else 'MISSED'}]"
        print(f"  {text:<50} {wall:6.3f} ({cpu:5.3f})  {verdict}")


# -- profiling (server in a child process) ---------------------------------------


def _serve_child(key: str, port_queue: Any) -> None:
    v = next(v for v in all_variants() if v.key == key)

    async def body() -> None:
        async with v.server() as port:
            port_queue.put(port)
            await anyio.sleep(3600) if not isinstance(v, AsyncioStreams) else await asyncio.sleep(3600)

    v.run(body)


def profile(key: str, what: str, round_trips: int, total: int, top: int) -> None:
    v = next((v for v in all_variants() if v.key == key), None)
    if v is None:
        raise SystemExit(f"unknown variant {key!r}")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_serve_child, args=(key, queue), daemon=True)
    child.start()
    try:
        port = queue.get(timeout=30)
        prof = cProfile.Profile(time.process_time)  # CPU time: robust to other load on the machine

        async def body() -> tuple[float, float]:
            if what == "rtt":
                await v.rtt(port, 200, 50)
                prof.enable()
                r = await v.rtt(port, round_trips, 0)
                prof.disable()
                return r
            await v.throughput(port, 16 * MiB, 0)
            prof.enable()
            r = await v.throughput(port, total, 0)
            prof.disable()
            return r

        wall, cpu = v.run(body)
        if what == "rtt":
            print(f"{_label(v)}: {wall * 1e6:.1f} µs per round trip, {cpu * 1e6:.1f} µs CPU (profiled; server in a child)")
        else:
            print(f"{_label(v)}: {wall / 1e6:.0f} MB/s, {cpu / 1e6:.0f} MB per CPU second (profiled; server in a child)")
        for order in ("tottime", "cumulative"):
            out = io.StringIO()
            stats = pstats.Stats(prof, stream=out)
            stats.strip_dirs().sort_stats(order).print_stats(top)
            print(out.getvalue())
    finally:
        child.terminate()
        child.join(10)


# -- main ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=5, help="repeats of every measurement (default 5)")
    parser.add_argument("--round-trips", type=int, default=5000, help="64 B round trips per run (default 5000)")
    parser.add_argument("--warmup", type=int, default=500, help="untimed round trips first (default 500)")
    parser.add_argument("--mib", type=int, default=256, help="MiB per throughput run (default 256)")
    parser.add_argument("--warmup-mib", type=int, default=16, help="untimed MiB first (default 16)")
    parser.add_argument("--variants", default="", help="comma-separated keys (default: all); --list shows them")
    parser.add_argument("--list", action="store_true", help="list the variants and exit")
    parser.add_argument("--profile", metavar="VARIANT", help="profile this variant's client (server in a child process)")
    parser.add_argument("--profile-what", choices=("rtt", "throughput"), default="rtt")
    parser.add_argument("--top", type=int, default=30, help="rows of the profile (default 30)")
    args = parser.parse_args(argv)

    variants = all_variants()
    if args.list:
        for v in variants:
            print(f"{v.key:<24} {_label(v)}")
        return 0
    if args.profile:
        profile(args.profile, args.profile_what, args.round_trips, args.mib * MiB, args.top)
        return 0
    if args.variants:
        wanted = [k.strip() for k in args.variants.split(",") if k.strip()]
        unknown = set(wanted) - {v.key for v in variants}
        if unknown:
            parser.error(f"unknown variants: {', '.join(sorted(unknown))} (see --list)")
        variants = [v for v in variants if v.key in wanted]

    print("aiordma TCP benchmark: client and server in one process and one event loop, over 127.0.0.1")
    for line in machine_lines():
        print(line)
    print(
        f"per run: {args.round_trips} round trips of 64 B (after {args.warmup} untimed), "
        f"{args.mib} MiB in 1 MiB writes (after {args.warmup_mib} MiB untimed); {args.repeat} runs each, interleaved"
    )
    figures = {v.key: Figures() for v in variants}
    start = time.perf_counter()
    for rep in range(args.repeat):
        shift = rep % len(variants)
        for v in variants[shift:] + variants[:shift]:
            f = figures[v.key]
            measure_once(v, args.round_trips, args.warmup, args.mib * MiB, args.warmup_mib * MiB, f)
            print(
                f"  run {rep + 1}/{args.repeat} {v.key:<24} RTT {f.rtt[-1] * 1e6:6.1f} µs ({f.rtt_cpu[-1] * 1e6:5.1f} CPU)"
                f"  {f.tput[-1] / 1e6:5.0f} MB/s ({f.tput_cpu[-1] / 1e6:5.0f} per CPU s)",
                flush=True,
            )
    print(f"total time {time.perf_counter() - start:.0f} s")
    print_results(variants, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
