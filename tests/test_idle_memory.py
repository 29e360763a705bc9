"""Memory per idle TCP connection, both ends in their own processes (issue 23, item 2).

A listener in this process serves ``N`` channels that a client process (on the same kind of
loop) opens over TCP; each
echoes one message, then all sit idle.  The Python heap each side holds per idle connection
(``tracemalloc``, the growth over the connections, measured on each side) stays within the
issue's bound, 32 KiB.  Before issue 23 every connection kept its 256 KiB receive buffer (~270
KiB each, measured); a plain socket's reads now go into one buffer per thread (every loop)
while a connection holds nothing unparsed (``Connection.share_receive_buffer``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc
from typing import Any

import anyio
import pytest

import aiordma

N = 300
BOUND = 32 << 10

CLIENTS = textwrap.dedent(
    """
    import gc, sys, tracemalloc
    import anyio
    import aiordma

    async def main(port, n):
        chans = [await aiordma.connect_channel("127.0.0.1", port, transport="tcp")]  # (warm-up)
        await chans[0].send(b"x" * 64)
        await chans[0].receive()
        print("READY", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)  # (the listener traces now)
        gc.collect()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(n):
            ch = await aiordma.connect_channel("127.0.0.1", port, transport="tcp")
            await ch.send(b"x" * 64)
            assert await ch.receive() == b"x" * 64
            chans.append(ch)
        await anyio.sleep(0.2)
        gc.collect()
        print("HEAP", (tracemalloc.get_traced_memory()[0] - base) // n, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        for ch in chans:
            await ch.aclose()

    backend, uvloop, port, n = sys.argv[1:]
    anyio.run(main, int(port), int(n), backend=backend,
              backend_options={"use_uvloop": True} if uvloop == "1" else {})
    """
)


async def test_an_idle_tcp_connection_holds_little_heap_at_either_end(anyio_backend: Any) -> None:
    import gc

    listener = await aiordma.create_channel_listener("127.0.0.1", 0, transport="tcp")
    served: list[Any] = []
    idle = anyio.Event()

    async def handle(ch: Any) -> None:
        served.append(ch)
        await ch.send(await ch.receive())
        if len(served) == N + 1:
            idle.set()
        await anyio.sleep_forever()

    backend, uvloop = anyio_backend[0], "1" if anyio_backend[0] == "asyncio" and anyio_backend[1] else "0"
    proc = subprocess.Popen([sys.executable, "-c", CLIENTS, backend, uvloop, str(listener.port), str(N)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    lines = proc.stdout

    async def line() -> str:
        return str(await anyio.to_thread.run_sync(lines.readline)).strip()

    def tell(text: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(text + "\n")
        proc.stdin.flush()

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, handle)
                assert await line() == "READY"  # (its warm-up connection is served)
                gc.collect()
                tracemalloc.start()
                try:
                    base = tracemalloc.get_traced_memory()[0]
                    tell("go")
                    await idle.wait()
                    await anyio.sleep(0.2)
                    gc.collect()
                    listener_heap = (tracemalloc.get_traced_memory()[0] - base) // N
                finally:
                    tracemalloc.stop()
                reported = await line()
                assert reported.startswith("HEAP "), reported
                client_heap = int(reported.split()[1])
                tell("bye")
                tg.cancel_scope.cancel()
    finally:
        await listener.aclose()
        proc.kill()
        proc.wait()
    print(f"heap per idle connection: listener {listener_heap} B, client {client_heap} B")
    for side, heap in (("listener", listener_heap), ("client", client_heap)):
        assert heap <= BOUND, f"the {side} holds {heap} bytes of heap per idle connection (bound {BOUND})"
