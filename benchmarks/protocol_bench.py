"""asyncio Protocol echo round trip: aiordma's Transport against asyncio's own, in one run.

An ``asyncio.Protocol`` client sends 64 bytes and waits for the echo from an ``asyncio.Protocol``
server, ``--iters`` times.  The same protocols run on ``loop.create_connection`` /
``loop.create_server`` (asyncio's TCP transport) and on ``aiordma.asyncio.create_connection`` /
``create_server`` (aiordma over TCP, or ``--transport rdma`` in the Soft-RoCE guest), client and
server in one process and in two, under asyncio and uvloop.  Rounds alternate between the
contenders; the median of ``--rounds`` is printed with the ratio.  A benchmark: it prints, it
asserts nothing.

    python benchmarks/protocol_bench.py                 # host: aiordma-TCP against asyncio TCP
    python -m tools.vm -- python benchmarks/protocol_bench.py --transport rdma --iters 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import aiordma.asyncio as aa  # noqa: E402
from benchmarks._placement import pin, placement  # noqa: E402

PAYLOAD = b"x" * 64


class Echo(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class Client(asyncio.Protocol):
    def __init__(self) -> None:
        self.waiter: asyncio.Future[None] | None = None
        self.got = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got += len(data)
        if self.got >= len(PAYLOAD) and self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def rtt(proto: Client, iters: int) -> float:
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    for _ in range(iters):
        proto.got = 0
        proto.waiter = loop.create_future()
        proto.transport.write(PAYLOAD)
        await proto.waiter
    return (time.perf_counter() - t0) / iters * 1e6


async def serve(kind: str, host: str, transport: str) -> Any:
    if kind == "asyncio":
        return await asyncio.get_running_loop().create_server(Echo, host, 0)
    return await aa.create_server(Echo, host, 0, transport=transport)


async def connect(kind: str, host: str, port: int, transport: str) -> Any:
    if kind == "asyncio":
        return await asyncio.get_running_loop().create_connection(Client, host, port)
    return await aa.create_connection(Client, host, port, transport=transport)


async def server_process(kind: str, host: str, transport: str, port_file: str) -> None:
    server = await serve(kind, host, transport)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


def run_loop(loop_name: str, main: Any) -> Any:
    if loop_name == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


async def measure(kinds: list[str], host: str, transport: str, processes: int, args: argparse.Namespace) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {k: [] for k in kinds}
    conns: dict[str, tuple[Any, Any]] = {}
    cleanup: list[Any] = []
    for kind in kinds:
        if processes == 1:
            server = await serve(kind, host, transport)
            cleanup.append(server)
            port = server.sockets[0].getsockname()[1]
        else:
            port_file = f"/tmp/protocol-bench-{os.getpid()}-{kind}"
            proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--host", host,
                                     "--transport", transport, "--loop", args.loop, "--port-file", port_file])  # fmt: skip
            cleanup.append(proc)
            deadline = time.monotonic() + 120
            while not (os.path.exists(port_file) and Path(port_file).read_text()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                await asyncio.sleep(0.05)
            port = int(Path(port_file).read_text())
            os.unlink(port_file)
        conns[kind] = await connect(kind, host, port, transport)
    try:
        for kind in kinds:
            await rtt(conns[kind][1], max(10, args.iters // 10))  # warm up
        for _ in range(args.rounds):
            for kind in kinds:
                results[kind].append(await rtt(conns[kind][1], args.iters))
    finally:
        for tr, _ in conns.values():
            tr.close()
        await asyncio.sleep(0.1)
        for item in cleanup:
            if isinstance(item, subprocess.Popen):
                item.terminate()
                item.wait(10)
            else:
                item.close()
                await item.wait_closed()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", default="tcp", choices=["tcp", "rdma", "auto"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"])
    p.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--loop", default="asyncio", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="FILE", help="also write the medians (us) and ratios as JSON")
    args = p.parse_args()
    host = args.host
    if args.transport == "rdma" and host == "127.0.0.1":
        from aiordma.testing import rdma_address

        host = rdma_address() or host
    if args.serve:
        pin("server")
        run_loop(args.loop, server_process(args.serve, host, args.transport, args.port_file))
        return
    pin("client")
    print(f"64 B echo round trip, asyncio Protocols, median of {args.rounds} x {args.iters} (us); "
          f"aiordma over {args.transport}; two processes pinned: {placement()}")  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for loop_name in args.loops:
        for processes in args.processes:
            args.loop = loop_name
            res = run_loop(loop_name, measure(["asyncio", "aiordma"], host, args.transport, processes, args))
            a, b = statistics.median(res["asyncio"]), statistics.median(res["aiordma"])
            where = "one process" if processes == 1 else "two processes"
            print(f"  {loop_name:8} {where:14} asyncio TCP {a:7.1f}  aiordma {b:7.1f}  ratio {b / a:5.2f}")
            out[f"{loop_name}/{processes}"] = {"asyncio_us": a, "aiordma_us": b, "ratio": b / a}
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
