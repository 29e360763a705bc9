"""Memory per idle TCP connection, listener and clients in two processes (issue 23, item 2).

    .venv/bin/python benchmarks/idle_memory.py [--n 5000] [--trace]

The script starts a channel listener in a child process and opens ``--n`` channels to it over
TCP from this one; each echoes 64 B once, then all sit idle.  Each side prints its own growth per
idle connection: RSS (``/proc/self/statm``) and, with ``--trace``, the Python heap
(``tracemalloc``; slower).  Then 20 new clients connect and echo one after the other while the
``--n`` sit idle: the median and the worst time.  A measurement: it prints and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import subprocess
import sys
import time
import tracemalloc

import aiordma


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def heap() -> int:
    return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0


def per_connection(side: str, n: int, rss0: int, heap0: int) -> str:
    text = f"{side}: {n} idle connections: RSS {(rss() - rss0) / n / 1024:.1f} KiB each"
    if tracemalloc.is_tracing():
        text += f", heap {(heap() - heap0) / n / 1024:.1f} KiB each"
    return text


async def serve(n: int, port_file: str) -> None:
    rss0, heap0 = rss(), heap()
    served: list[object] = []
    all_idle = asyncio.Event()
    listener = await aiordma.create_channel_listener("127.0.0.1", 0, transport="tcp")

    async def handle(ch: aiordma.Channel) -> None:
        served.append(ch)
        await ch.send(await ch.receive())
        if len(served) == n:
            all_idle.set()
        if len(served) > n:
            return  # (the timed clients: closed by their side)
        await asyncio.sleep(3600)

    task = asyncio.ensure_future(listener.serve(handle))
    with open(port_file, "w") as f:
        f.write(str(listener.port))
    await all_idle.wait()
    await asyncio.sleep(0.5)
    print(per_connection("listener", n, rss0, heap0), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # (until the clients are done)
    task.cancel()


async def clients(n: int, port: int) -> None:
    rss0, heap0 = rss(), heap()
    chans = []
    for _ in range(n):
        ch = await aiordma.connect_channel("127.0.0.1", port, transport="tcp")
        await ch.send(b"x" * 64)
        await ch.receive()
        chans.append(ch)
    await asyncio.sleep(0.5)
    print(per_connection("clients", n, rss0, heap0), flush=True)
    await asyncio.sleep(0.3)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        ch = await aiordma.connect_channel("127.0.0.1", port, transport="tcp")
        await ch.send(b"y" * 64)
        await ch.receive()
        times.append(time.perf_counter() - t0)
        await ch.aclose()
    times.sort()
    print(f"a new client with {n} idle: connect and echo {times[10] * 1e3:.1f} ms median, "
          f"{times[-1] * 1e3:.1f} ms at most (20)", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=5000)
    p.add_argument("--trace", action="store_true", help="also the Python heap (tracemalloc)")
    p.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.trace:
        tracemalloc.start()
    if args.serve:
        asyncio.run(serve(args.n, args.serve))
        return
    port_file = f"/tmp/aiordma-idle-memory.{os.getpid()}"
    argv = [sys.executable, __file__, "--n", str(args.n), "--serve", port_file] + (["--trace"] if args.trace else [])
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, text=True)
    try:
        while not (os.path.exists(port_file) and open(port_file).read()):
            time.sleep(0.05)
        asyncio.run(clients(args.n, int(open(port_file).read())))
    finally:
        assert server.stdin is not None
        server.stdin.write("\n")
        server.stdin.close()
        server.wait(timeout=30)
        os.remove(port_file)


if __name__ == "__main__":
    main()
