"""CPU used by idle RDMA connections, per poll mode (issue 8: below 1% of a core in event and adaptive).

A server process and this client open ``--connections`` channels, exchange
one message on each (so every spinning mode has seen activity), then stay
idle for ``--seconds``; the script prints the CPU time both processes used
while idle (``time.process_time`` in the client, /proc in the server) as a
share of one core.  The server is another process, so the poll modes really
spin (a peer in the same thread would turn spinning off).

    .venv/bin/python benchmarks/idle_cpu.py [--transport rdma|tcp] [--poll event,adaptive,busy]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import anyio

import aiordma
from aiordma import RdmaBackend, RdmaConfig

SERVER = r"""
import sys, anyio, aiordma
from aiordma import RdmaBackend, RdmaConfig
async def main():
    backend = RdmaBackend(RdmaConfig(poll=sys.argv[3], liveness_probe=float(sys.argv[5])))
    async with await aiordma.create_channel_listener(sys.argv[1], 0, transport=sys.argv[2],
                                                     rdma_backend=backend) as lst:
        print(lst.port, flush=True)
        async def echo(ch):
            async with ch:
                async for m in ch:
                    await ch.send(m)
        with anyio.move_on_after(float(sys.argv[4])):
            await lst.serve(echo)
anyio.run(main)
"""


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(host: str, port: int, transport: str, poll: str, n: int, seconds: float, server_pid: int,
                  liveness: float) -> tuple[float, float, str]:  # fmt: skip
    backend = RdmaBackend(RdmaConfig(poll=poll, liveness_probe=liveness))
    channels = [await aiordma.connect_channel(host, port, transport=transport, rdma_backend=backend) for _ in range(n)]
    try:
        for ch in channels:
            await ch.send(b"hello")
            assert await ch.receive() == b"hello"
        got = channels[0].transport
        c0, s0, t0 = time.process_time(), _cpu_of(server_pid), time.monotonic()
        await anyio.sleep(seconds)
        c1, s1, t1 = time.process_time(), _cpu_of(server_pid), time.monotonic()
        return (c1 - c0) / (t1 - t0), (s1 - s0) / (t1 - t0), got
    finally:
        for ch in channels:
            await ch.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default=None)
    parser.add_argument("--transport", default="rdma", choices=["rdma", "tcp"])
    parser.add_argument("--poll", default="event,adaptive,busy")
    parser.add_argument("--connections", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--liveness", type=float, default=RdmaConfig.liveness_probe,
                        help="RdmaConfig.liveness_probe at both ends (0: no probes; default %(default)s s)")
    args = parser.parse_args()
    host = args.host
    if host is None:
        from aiordma.testing import rdma_address

        host = rdma_address() or "127.0.0.1"
    print(f"idle CPU, {args.connections} open idle connections for {args.seconds:.0f} s, {args.transport} on {host}, "
          f"liveness probe {args.liveness} s")
    for poll in args.poll.split(","):
        server = subprocess.Popen([sys.executable, "-c", SERVER, host, args.transport, poll, str(args.seconds + 60),
                                   str(args.liveness)],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            client, srv, got = anyio.run(_client, host, port, args.transport, poll, args.connections, args.seconds,
                                         server.pid, args.liveness)  # fmt: skip
            print(f"  {poll:9} client {client * 100:6.2f}% of a core   server {srv * 100:6.2f}%   ({got})")
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
