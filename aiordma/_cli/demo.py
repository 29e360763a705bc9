"""``aiordma demo``: a byte-stream and a channel listener on one host in this process, a client to
each, checks that bytes and messages come back intact, and a few figures."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio import EndOfStream
from anyio.abc import TaskGroup

from .._api import Channel, Stream, connect, connect_channel, create_channel_listener, create_listener
from .._attributes import TransportAttribute
from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, MiB, human_bytes, loop_of

__all__ = ["cmd_demo", "run_demo", "format_demo", "demo_host", "DemoResult", "DemoFailure"]

# -- demo ----------------------------------------------------------------------


class DemoFailure(Exception):
    """A check of the demo failed."""


@dataclass
class DemoResult:
    transport: str
    fallback_reason: str
    checks: list[str]
    rtt_median_us: float
    rtt_p99_us: float
    throughput_mb_s: float
    stream_bytes: int
    message_rate: float
    messages: int


def _pattern(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible pseudo-random bytes (a lost, doubled or moved block shows)."""
    return random.Random(seed).randbytes(n)


def _percentile(sorted_values: Sequence[float], fraction: float) -> float:
    index = min(len(sorted_values) - 1, max(0, int(round(fraction * (len(sorted_values) - 1)))))
    return sorted_values[index]


Connect = Callable[[], Awaitable[Stream]]

# The byte-stream server understands one mode byte at the start of a connection.
MODE_ECHO = b"E"  # echo every byte back, half-close at EOF
MODE_DRAIN = b"D"  # read to EOF, then answer with the byte count (8 bytes)


async def _receive_exactly(stream: Stream, n: int) -> bytes:
    parts = []
    left = n
    while left:
        chunk = await stream.receive(left)
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


async def _stream_server(stream: Stream) -> None:
    """Echo (``MODE_ECHO``) or count (``MODE_DRAIN``) what one client sends."""
    async with stream:
        try:
            mode = await stream.receive(1)
            if mode == MODE_ECHO:
                while True:
                    try:
                        data = await stream.receive(MiB)
                    except EndOfStream:
                        break
                    await stream.send(data)
                await stream.send_eof()
            elif mode == MODE_DRAIN:
                total = 0
                while True:
                    try:
                        total += len(await stream.receive(MiB))
                    except EndOfStream:
                        break
                await stream.send(total.to_bytes(8, "big"))
                await stream.send_eof()
            # anything else: close
        except (EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the client went away; the client side reports what matters


async def _channel_server(channel: Channel) -> None:
    """Echo every message back."""
    async with channel:
        try:
            async for message in channel:
                await channel.send(message)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


async def _check_stream_echo(connect: Connect, checks: list[str]) -> None:
    stream = await connect()
    async with stream:
        await stream.send(MODE_ECHO)
        sizes = [1, 63, 64, 4096, 65536, 100_000, MiB, 3 * MiB + 5]
        payloads = [_pattern(n, seed) for seed, n in enumerate(sizes)]
        expected = b"".join(payloads)
        received = bytearray()

        async def send_all() -> None:
            for payload in payloads:
                await stream.send(payload)
            await stream.send_eof()

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_all)
            while True:
                try:
                    received += await stream.receive(MiB)
                except EndOfStream:
                    break
        if bytes(received) != expected:
            shorter = min(len(received), len(expected))
            first = next((i for i, (a, b) in enumerate(zip(received, expected)) if a != b), shorter)
            raise DemoFailure(
                f"byte stream echo differs: sent {len(expected)} bytes, got {len(received)} back, "
                f"first difference at byte {first}"
            )
    checks.append(f"byte stream: {len(expected)} bytes in {len(sizes)} writes echoed back intact, EOF seen")


async def _check_messages(channel: Channel, checks: list[str]) -> None:
    sizes = [0, 1, 7, 64, 0, 4096, 65536, MiB, 17, 0]
    messages = [_pattern(n, seed) for seed, n in enumerate(sizes)]
    got: list[bytes] = []

    async def send_all() -> None:
        for message in messages:
            await channel.send(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send_all)
        for _ in messages:
            got.append(await channel.receive())
    if [len(m) for m in got] != sizes:
        raise DemoFailure(f"message boundaries were not kept: sent sizes {sizes}, received {[len(m) for m in got]}")
    if got != messages:
        bad = next(i for i, (a, b) in enumerate(zip(got, messages)) if a != b)
        raise DemoFailure(f"message {bad} ({sizes[bad]} bytes) came back changed")
    empties = sizes.count(0)
    checks.append(
        f"messages: {len(sizes)} messages (sizes 0..{max(sizes)}, {empties} empty) echoed with boundaries kept"
    )


async def _measure_rtt(connect: Connect, round_trips: int) -> tuple[float, float]:
    stream = await connect()
    async with stream:
        await stream.send(MODE_ECHO)
        payload = _pattern(64, 99)
        for _ in range(min(200, round_trips)):  # warm up
            await stream.send(payload)
            await _receive_exactly(stream, 64)
        times = []
        clock = time.perf_counter_ns
        for _ in range(round_trips):
            t0 = clock()
            await stream.send(payload)
            answer = await _receive_exactly(stream, 64)
            times.append(clock() - t0)
            if answer != payload:
                raise DemoFailure("a 64 B round trip came back changed")
        await stream.send_eof()
        try:
            extra = await stream.receive()
        except EndOfStream:
            pass
        else:
            raise DemoFailure(f"the echo server sent {len(extra)} bytes more than it received")
    times.sort()
    return statistics.median(times) / 1000.0, _percentile(times, 0.99) / 1000.0


async def _measure_throughput(connect: Connect, total: int) -> float:
    stream = await connect()
    async with stream:
        await stream.send(MODE_DRAIN)
        block = _pattern(MiB, 5)
        start = time.perf_counter()
        left = total
        while left:
            n = min(left, MiB)
            await stream.send(block if n == MiB else block[:n])
            left -= n
        await stream.send_eof()
        answer = await _receive_exactly(stream, 8)
        elapsed = time.perf_counter() - start
        try:
            await stream.receive()
        except EndOfStream:
            pass
        else:
            raise DemoFailure("the draining server sent more than its count")
    count = int.from_bytes(answer, "big")
    if count != total:
        raise DemoFailure(f"the server received {count} bytes of the {total} sent")
    return total / elapsed / 1e6


async def _measure_message_rate(channel: Channel, count: int) -> float:
    message = _pattern(64, 3)

    async def send_all() -> None:
        for _ in range(count):
            await channel.send(message)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(send_all)
        for _ in range(count):
            if await channel.receive() != message:
                raise DemoFailure("a 64 B message came back changed")
    return count / (time.perf_counter() - start)


def demo_host() -> str:
    """Where the demo listens: an address an RDMA device serves when this host
    can do RDMA (RDMA needs the device behind the address), else loopback."""
    from .._rdma.discovery import probe, rdma_address

    if probe().usable:
        address = rdma_address()
        if address is not None:
            return address
    return "127.0.0.1"


async def run_demo(
    transport: str | None, total_bytes: int, messages: int, round_trips: int, host: str = "127.0.0.1"
) -> DemoResult:
    checks: list[str] = []
    async with (
        await create_listener(host, 0, transport=transport) as stream_listener,
        await create_channel_listener(host, 0, transport=transport) as channel_listener,
        anyio.create_task_group() as servers,
    ):
        tg: TaskGroup = servers
        tg.start_soon(stream_listener.serve, _stream_server, tg)
        tg.start_soon(channel_listener.serve, _channel_server, tg)

        async def connect_stream() -> Stream:
            return await connect(host, stream_listener.port, transport=transport)

        async with await connect_stream() as first:
            kind = first.extra(TransportAttribute.transport)
            reason = first.extra(TransportAttribute.fallback_reason)
            await first.send(b"?")  # not a mode: the server closes
        await _check_stream_echo(connect_stream, checks)
        async with await connect_channel(host, channel_listener.port, transport=transport) as channel:
            if channel.extra(TransportAttribute.transport) != kind:
                raise DemoFailure("the channel and the byte stream run on different transports")
            await _check_messages(channel, checks)
            rtt_median, rtt_p99 = await _measure_rtt(connect_stream, round_trips)
            throughput = await _measure_throughput(connect_stream, total_bytes)
            rate = await _measure_message_rate(channel, messages)
            await channel.send_eof()
            try:
                extra = await channel.receive()
            except EndOfStream:
                pass
            else:
                raise DemoFailure(f"the channel server sent an extra message of {len(extra)} bytes")
        checks.append(f"throughput run: the server counted all {total_bytes} bytes")
        tg.cancel_scope.cancel()
    return DemoResult(kind, reason, checks, rtt_median, rtt_p99, throughput, total_bytes, rate, messages)


def format_demo(result: DemoResult, backend: str, policy: str, host: str = "127.0.0.1") -> str:
    lines = [f"aiordma demo: backend {backend}, transport policy {policy}, {host}, client and server in one process"]
    lines.append(f"transport: {result.transport}")
    lines.append(f"fallback reason: {result.fallback_reason or '(none: the data runs on RDMA)'}")
    for check in result.checks:
        lines.append(f"ok  {check}")
    rows = [
        ("64 B round trip, median", f"{result.rtt_median_us:.1f} \u00b5s"),
        ("64 B round trip, p99", f"{result.rtt_p99_us:.1f} \u00b5s"),
        (f"byte stream, {human_bytes(result.stream_bytes)} in 1 MiB writes", f"{result.throughput_mb_s:.0f} MB/s"),
        (f"messages, {result.messages} x 64 B echoed", f"{result.message_rate:,.0f} msgs/s"),
    ]
    width = max(len(name) for name, _ in rows)
    lines.append("")
    lines.append(f"{'measure'.ljust(width)}  value")
    lines.append(f"{'-' * width}  {'-' * 14}")
    lines.extend(f"{name.ljust(width)}  {value}" for name, value in rows)
    return "\n".join(lines)


def _leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def cmd_demo(args: argparse.Namespace) -> int:
    from .._errors import AiordmaError, RDMAUnavailableError
    from .._handshake.negotiate import resolve_transport

    try:
        policy = resolve_transport(args.transport)
    except ValueError as exc:
        print(f"aiordma demo: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    loop = loop_of(args.backend, "aiordma demo")
    if loop is None:
        return EXIT_USAGE
    backend, options = loop

    host = args.host or demo_host()

    async def bounded() -> DemoResult:
        with anyio.fail_after(args.timeout):
            return await run_demo(policy, args.bytes, args.messages, args.round_trips, host)

    try:
        result = anyio.run(bounded, backend=backend, backend_options=options)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as raised:
        leaf = _leaf(raised)
        if isinstance(leaf, ModuleNotFoundError):
            print(f"aiordma demo: error: backend {args.backend!r} is not available: {leaf}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(leaf, RDMAUnavailableError):
            print(f"aiordma demo: error: transport {policy!r} is not available here: {leaf}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(leaf, DemoFailure):
            print(f"aiordma demo: FAILED: {leaf}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(leaf, TimeoutError):
            print(f"aiordma demo: FAILED: did not finish within {args.timeout} s", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(leaf, (AiordmaError, anyio.BrokenResourceError, anyio.ClosedResourceError, EndOfStream, OSError)):
            print(f"aiordma demo: FAILED: {type(leaf).__name__}: {leaf}", file=sys.stderr)
            return EXIT_FAILED
        traceback.print_exception(raised)
        print(f"aiordma demo: FAILED: unexpected {type(leaf).__name__}: {leaf}", file=sys.stderr)
        return EXIT_FAILED
    print(format_demo(result, args.backend, policy, host))
    return EXIT_OK


