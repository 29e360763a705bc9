"""RDMA vs TCP through aiordma, and the native limit, in one run (inside the Soft-RoCE guest).

Run it through the VM runner (it refuses to run without an RDMA device)::

    python -m aiordma.testing.vm -- python benchmarks/rdma_bench.py

It measures, in one process on the guest's rxe address (client and server in
the same event loop):

* 64-byte message round trip (median over ``--round-trips``) and
* streaming throughput (``--megabytes`` sent in 1 MiB writes, echoed as a count),

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


async def measure(host: str, transport: str, round_trips: int, megabytes: int) -> dict[str, float]:
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

    result: dict[str, float] = {}
    async with await aiordma.create_channel_listener(host, 0, transport=transport) as channels, await (
        aiordma.create_listener(host, 0, transport=transport)
    ) as streams:
        async with anyio.create_task_group() as tg:
            tg.start_soon(channels.serve, echo)
            tg.start_soon(streams.serve, sink)
            async with await aiordma.connect_channel(host, channels.port, transport=transport) as channel:
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
            async with await aiordma.connect(host, streams.port, transport=transport) as stream:
                block = bytes(1 << 20)
                t0 = time.perf_counter()
                for _ in range(megabytes):
                    await stream.send(block)
                await stream.send_eof()
                total = int(await stream.receive())
                elapsed = time.perf_counter() - t0
                assert total == megabytes << 20
                result["mb_s"] = total / elapsed / 1e6
            tg.cancel_scope.cancel()
    return result


def run(backend: str, fn: Callable[..., Any], *args: Any) -> Any:
    return anyio.run(fn, *args, backend=backend)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--no-baseline", action="store_true", help="skip perftest")
    args = parser.parse_args()
    host = rdma_address()
    if host is None:
        print("rdma_bench: no RDMA device with an IPv4 RoCEv2 address: run it in the guest", file=sys.stderr)
        return 2
    print(f"aiordma {aiordma.__version__} on {host}; {args.round_trips} round trips of 64 B, {args.megabytes} MiB stream")
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for backend in ("asyncio", "trio"):
        for transport in ("rdma", "tcp"):
            rows[(backend, transport)] = run(backend, measure, host, transport, args.round_trips, args.megabytes)
    print(f"{'loop':8} {'transport':9} {'RTT median us':>14} {'RTT p99 us':>11} {'MB/s':>9}")
    for (backend, transport), r in rows.items():
        print(f"{backend:8} {transport:9} {r['rtt_us']:14.1f} {r['rtt_p99_us']:11.1f} {r['mb_s']:9.1f}")
    for backend in ("asyncio", "trio"):
        rdma, tcp = rows[(backend, "rdma")], rows[(backend, "tcp")]
        print(
            f"{backend}: RDMA/TCP RTT ratio {rdma['rtt_us'] / tcp['rtt_us']:.2f}, "
            f"throughput ratio {rdma['mb_s'] / tcp['mb_s']:.2f}"
        )
    if not args.no_baseline:
        print("native limit (perftest on the same device, same boot):", flush=True)
        baseline = Path(__file__).with_name("rdma_baseline.py")
        subprocess.run([sys.executable, str(baseline)], check=False, timeout=600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
