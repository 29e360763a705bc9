"""RDMA vs TCP through aiordma, and the native limit, in one run (inside the Soft-RoCE guest).

Run it through the VM runner (it refuses to run without an RDMA device)::

    python -m tools.vm -- python benchmarks/rdma_bench.py

It measures on the guest's rxe address, with client and server in one process
(one event loop) and in two processes (``--processes 2``: the server runs in a
child process with the same loop):

* 64-byte message round trip (median over ``--round-trips``),
* streaming throughput (``--megabytes`` sent in 1 MiB writes, echoed as a count),
* connect time (median of ``--connects`` connect + one round trip + close; the
  server side keeps its device open while it listens),

for aiordma over RDMA and over TCP, under asyncio and trio, then runs
``benchmarks/rdma_baseline.py`` (perftest's ib_send_lat / ib_write_bw) for
the native limit of the same device in the same boot, and prints ratios.
Everything in the guest runs about 10x slower than on the host (TCG): compare
figures within one run only.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

import aiordma
from aiordma.testing import rdma_address


async def echo(channel: aiordma.Channel) -> None:
    async with channel:
        async for message in channel:
            await channel.send(message)


async def sink(stream: aiordma.Stream) -> None:
    async with stream:
        total = 0
        try:
            while True:
                total += len(await stream.receive(1 << 20))
        except anyio.EndOfStream:
            await stream.send(str(total).encode())


async def serve(host: str, transport: str) -> None:
    """The server of the two-process mode: prints its two ports, serves until stdin closes."""
    async with await aiordma.create_channel_listener(host, 0, transport=transport) as channels, await (
        aiordma.create_listener(host, 0, transport=transport)
    ) as streams:
        async with anyio.create_task_group() as tg:
            tg.start_soon(channels.serve, echo)
            tg.start_soon(streams.serve, sink)
            print(channels.port, streams.port, flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)
            tg.cancel_scope.cancel()


async def client(
    host: str, transport: str, ports: tuple[int, int], round_trips: int, megabytes: int, connects: int
) -> dict[str, float]:
    channel_port, stream_port = ports
    result: dict[str, float] = {}
    async with await aiordma.connect_channel(host, channel_port, transport=transport) as channel:
        assert channel.extra(aiordma.TransportAttribute.transport) == transport
        payload = b"x" * 64
        for _ in range(20):  # warm up
            await channel.send(payload)
            await channel.receive()
        samples = []
        for _ in range(round_trips):
            t0 = time.perf_counter()
            await channel.send(payload)
            await channel.receive()
            samples.append(time.perf_counter() - t0)
        result["rtt_us"] = statistics.median(samples) * 1e6
        result["rtt_p99_us"] = sorted(samples)[int(len(samples) * 0.99) - 1] * 1e6
        # connect time, while this connection stays open (the device is open in this process)
        times = []
        for _ in range(connects):
            t0 = time.perf_counter()
            async with await aiordma.connect_channel(host, channel_port, transport=transport) as other:
                times.append(time.perf_counter() - t0)
                await other.send(payload)
                await other.receive()
        result["connect_ms"] = statistics.median(times) * 1e3
    async with await aiordma.connect(host, stream_port, transport=transport) as stream:
        block = bytes(1 << 20)
        t0 = time.perf_counter()
        for _ in range(megabytes):
            await stream.send(block)
        await stream.send_eof()
        total = int(await stream.receive())
        elapsed = time.perf_counter() - t0
        assert total == megabytes << 20
        result["mb_s"] = total / elapsed / 1e6
    return result


async def measure_two_processes(
    host: str, transport: str, round_trips: int, megabytes: int, connects: int, backend: str
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--serve", transport, "--loop", backend]
    async with await anyio.open_process(cmd) as process:
        assert process.stdout is not None and process.stdin is not None
        head = b""
        while b"\n" not in head:  # (a pipe may hand the line over in pieces)
            head += await process.stdout.receive()
        line = head.decode().split()
        try:
            return await client(host, transport, (int(line[0]), int(line[1])), round_trips, megabytes, connects)
        finally:
            await process.stdin.aclose()
            with anyio.move_on_after(30):
                await process.wait()


async def measure(host: str, transport: str, round_trips: int, megabytes: int, connects: int = 20) -> dict[str, float]:
    async with await aiordma.create_channel_listener(host, 0, transport=transport) as channels, await (
        aiordma.create_listener(host, 0, transport=transport)
    ) as streams:
        async with anyio.create_task_group() as tg:
            tg.start_soon(channels.serve, echo)
            tg.start_soon(streams.serve, sink)
            result = await client(host, transport, (channels.port, streams.port), round_trips, megabytes, connects)
            tg.cancel_scope.cancel()
    return result


def run(backend: str, fn: Callable[..., Any], *args: Any) -> Any:
    return anyio.run(fn, *args, backend=backend)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--connects", type=int, default=20)
    parser.add_argument("--processes", type=int, choices=[1, 2], nargs="*", default=[1, 2])
    parser.add_argument("--loops", nargs="*", default=["asyncio", "trio"])
    parser.add_argument("--no-baseline", action="store_true", help="skip perftest")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the child of --processes 2
    parser.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    args = parser.parse_args()
    host = rdma_address()
    if host is None:
        print("rdma_bench: no RDMA device with an IPv4 RoCEv2 address: run it in the guest", file=sys.stderr)
        return 2
    if args.serve:
        anyio.run(serve, host, args.serve, backend=args.loop)
        return 0
    print(f"aiordma {aiordma.__version__} on {host}; {args.round_trips} round trips of 64 B, "
          f"{args.megabytes} MiB stream, {args.connects} connects")  # fmt: skip
    rows: dict[tuple[str, int, str], dict[str, float]] = {}
    for backend in args.loops:
        for procs in args.processes:
            for transport in ("rdma", "tcp"):
                if procs == 1:
                    r = run(backend, measure, host, transport, args.round_trips, args.megabytes, args.connects)
                else:
                    r = run(backend, measure_two_processes, host, transport, args.round_trips, args.megabytes,
                            args.connects, backend)  # fmt: skip
                rows[(backend, procs, transport)] = r
                print(f"  {backend} {procs}p {transport}: {r}", flush=True)
    print(f"{'loop':8} {'procs':>5} {'transport':9} {'RTT median us':>14} {'RTT p99 us':>11} {'MB/s':>9} {'connect ms':>11}")
    for (backend, procs, transport), r in rows.items():
        print(f"{backend:8} {procs:5} {transport:9} {r['rtt_us']:14.1f} {r['rtt_p99_us']:11.1f} {r['mb_s']:9.1f} "
              f"{r['connect_ms']:11.2f}")  # fmt: skip
    for backend in args.loops:
        for procs in args.processes:
            rdma, tcp = rows[(backend, procs, "rdma")], rows[(backend, procs, "tcp")]
            print(
                f"{backend} {procs} process(es): RDMA/TCP RTT {rdma['rtt_us'] / tcp['rtt_us']:.2f}, "
                f"throughput {rdma['mb_s'] / tcp['mb_s']:.2f}, connect {rdma['connect_ms'] / tcp['connect_ms']:.2f}"
            )
    if not args.no_baseline:
        print("native limit (perftest on the same device, same boot):", flush=True)
        baseline = Path(__file__).with_name("rdma_baseline.py")
        subprocess.run([sys.executable, str(baseline)], check=False, timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
