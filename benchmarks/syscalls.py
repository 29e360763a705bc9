"""System calls per 64 B round trip, both ends together: aiordma over TCP and over RDMA in each
poll mode (issue 33, item 3) -- a noise-free figure, unlike a time.

For each line the script runs a client and an echo server (its child process, the same event
loop) under ``strace -f -c`` twice, with ``--few`` and with ``--many`` round trips of a 64-byte
channel message, and prints the difference divided by the difference in round trips, per system
call: what one more round trip costs, set-up and teardown cancelled out.  (Spinning poll modes
make calls that depend on timing -- ``busy`` barely any, ``adaptive`` a few per idle gap -- so
their lines are figures of this run, not constants.)  Needs ``strace``; over RDMA an RDMA device
(run it in the guest)::

    python -m tools.vm -- python benchmarks/syscalls.py [--lines tcp,event,adaptive,busy]

A benchmark: it prints and passes or fails nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

LINES = ("tcp", "event", "adaptive", "busy")


def _serve(line: str) -> None:
    import anyio

    import aiordma
    from aiordma.testing import rdma_address

    async def main() -> None:
        transport = "tcp" if line == "tcp" else "rdma"
        host = "127.0.0.1" if line == "tcp" else rdma_address()
        backend = None if line == "tcp" else aiordma.RdmaBackend(aiordma.RdmaConfig(poll=line))
        listener = await aiordma.create_channel_listener(host, 0, transport=transport, rdma_backend=backend)

        async def echo(channel: aiordma.Channel) -> None:
            async with channel:
                async for message in channel:
                    await channel.send(message)
                listener_scope.cancel()  # one client: then the server ends

        async with listener:
            print(f"{host} {listener.port}", flush=True)
            with anyio.CancelScope() as listener_scope:
                await listener.serve(echo)

    anyio.run(main)


def _client(line: str, host: str, port: int, n: int) -> None:
    import anyio

    import aiordma

    async def main() -> None:
        transport = "tcp" if line == "tcp" else "rdma"
        backend = None if line == "tcp" else aiordma.RdmaBackend(aiordma.RdmaConfig(poll=line))
        async with await aiordma.connect_channel(host, port, transport=transport, rdma_backend=backend) as ch:
            assert ch.transport == transport, ch.fallback_reason
            payload = b"x" * 64
            for _ in range(n):
                await ch.send(payload)
                await ch.receive()

    anyio.run(main)


def _pair(line: str, n: int) -> None:
    """The traced process: the server as a child, then the client here."""
    server = subprocess.Popen([sys.executable, __file__, "--serve", line], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    host, port = server.stdout.readline().split()
    try:
        _client(line, host, int(port), n)
    finally:
        server.wait(timeout=120)


def _counts(line: str, n: int) -> Counter[str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "strace.txt"
        subprocess.run(["strace", "-f", "-c", "-q", "-o", str(out), sys.executable, __file__, "--pair", line, "--n", str(n)],
                       check=True, timeout=1800)  # fmt: skip
        counts: Counter[str] = Counter()
        for row in out.read_text().splitlines():
            # % time  seconds  usecs/call  calls  [errors]  syscall
            m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", row)
            if m and m.group(2) != "total":
                counts[m.group(2)] += int(m.group(1))
        return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", default=",".join(LINES), help="tcp and/or RDMA poll modes (default: all)")
    parser.add_argument("--few", type=int, default=100)
    parser.add_argument("--many", type=int, default=600)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--pair", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve)
        return 0
    if args.pair:
        _pair(args.pair, args.n)
        return 0
    if shutil.which("strace") is None:
        print("needs strace", file=sys.stderr)
        return 2
    extra = args.many - args.few
    print(f"system calls per 64 B round trip, both ends ({args.many} - {args.few} round trips, strace -f -c)")
    for line in args.lines.split(","):
        few, many = _counts(line, args.few), _counts(line, args.many)
        per = {name: (many[name] - few[name]) / extra for name in many | few}
        shown = {k: v for k, v in sorted(per.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.05}
        total = sum(per.values())
        detail = ", ".join(f"{k} {v:.2f}" for k, v in shown.items())
        print(f"  {line:9s} {total:6.2f}  ({detail})", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
