"""UCXX over TCP, client and server in two processes: 64 B round trip and 1 MiB messages' MB/s.

The figures ``benchmarks/cost.py`` compares aiordma's channels with.  It needs only ``ucxx``
(``pip install ucxx-cu12``: it runs on TCP without a GPU) and numpy, not aiordma, so that it can
run under another interpreter (``cost.py --ucxx-python``).  ``UCX_TLS=tcp`` (set here) keeps UCX
on TCP -- between two processes of one host it would otherwise use shared memory -- and the
progress mode is ``blocking`` unless ``--progress`` says otherwise (UCXX's default, ``thread``,
was slower: ~300 us per round trip).  Prints one JSON line: ``rtt_us`` (mean round trip),
``mbps`` (MB/s of ``--mib`` MiB as ``--size``-byte messages), ``progress``, ``version``.

    python benchmarks/ucxx_bench.py [--round-trips 3000] [--mib 64] [--size 1048576] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._placement import pin  # noqa: E402  (the same placement as the aiordma figures)

os.environ.setdefault("UCX_TLS", "tcp")


async def _server(progress: str, port_file: str, size: int) -> None:
    import numpy as np
    import ucxx

    ucxx.init(progress_mode=progress)
    done = asyncio.Event()

    async def handle(ep: object) -> None:
        small = np.empty(64, dtype=np.uint8)
        large = np.empty(size, dtype=np.uint8)
        op = np.empty(8, dtype=np.int64)
        while True:
            await ep.recv(op)  # type: ignore[attr-defined]
            kind, n = int(op[0]), int(op[1])
            if kind == 0:  # n round trips
                for _ in range(n):
                    await ep.recv(small)  # type: ignore[attr-defined]
                    await ep.send(small)  # type: ignore[attr-defined]
            elif kind == 1:  # n messages of ``size`` bytes, then an answer
                for _ in range(n):
                    await ep.recv(large)  # type: ignore[attr-defined]
                await ep.send(op)  # type: ignore[attr-defined]
            else:
                break
        await ep.close()  # type: ignore[attr-defined]
        done.set()

    listener = ucxx.create_listener(handle)
    Path(port_file).write_text(str(listener.port))
    await done.wait()
    listener.close()


async def _client(progress: str, port: int, args: argparse.Namespace) -> dict[str, object]:
    import numpy as np
    import ucxx

    ucxx.init(progress_mode=progress)
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    small = np.zeros(64, dtype=np.uint8)
    large = np.frombuffer(os.urandom(args.size), dtype=np.uint8).copy()
    count = max(1, (args.mib << 20) // args.size)
    op = np.zeros(8, dtype=np.int64)

    async def rtt(n: int) -> float:
        op[0], op[1] = 0, n
        await ep.send(op)
        t0 = time.perf_counter()
        for _ in range(n):
            await ep.send(small)
            await ep.recv(small)
        return (time.perf_counter() - t0) / n * 1e6

    async def bulk() -> float:
        op[0], op[1] = 1, count
        await ep.send(op)
        t0 = time.perf_counter()
        for _ in range(count):
            await ep.send(large)
        await ep.recv(op)
        return count * args.size / (time.perf_counter() - t0) / 1e6

    await rtt(max(10, args.round_trips // 10))
    await bulk()
    rtts, mbps = [], []
    for _ in range(args.rounds):
        rtts.append(await rtt(args.round_trips))
        mbps.append(await bulk())
    op[0] = 2
    await ep.send(op)
    await ep.close()
    return {"rtt_us": statistics.median(rtts), "mbps": statistics.median(mbps), "progress": progress,
            "version": ucxx.__version__}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--progress", default="blocking", choices=["blocking", "polling", "thread"])
    p.add_argument("--round-trips", type=int, default=3000)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--serve", metavar="PORT_FILE")
    args = p.parse_args()
    if args.serve:
        pin("server")
        asyncio.run(_server(args.progress, args.serve, args.size))
        return
    pin("client")
    port_file = f"/tmp/ucxx-bench-{os.getpid()}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", port_file, "--progress", args.progress,
                               "--size", str(args.size)])  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(port_file) and Path(port_file).read_text()):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the UCXX server did not start")
            time.sleep(0.05)
        port = int(Path(port_file).read_text())
        os.unlink(port_file)
        print(json.dumps(asyncio.run(_client(args.progress, port, args))))
        server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
