"""Message channels against asyncio streams, client and server in two processes.

* **bulk**: the client sends ``--mib`` MiB as messages of ``--size`` bytes (1 MiB by default);
  the server takes each one (``receive()``, or ``receive_into`` one buffer of its own) and answers
  with an 8-byte count once it has them all.  asyncio streams carry the same messages behind a
  4-byte length (``write`` + ``drain``; ``readexactly``), and ``asyncio-streams-raw`` carries the
  bytes alone, read as they come (``read(1 MiB)``: no message boundaries, the upper bound).  The
  figure is MB/s from the first send to the answer.
* **rtt**: 64-byte messages echoed, ``--round-trips`` of them; the figure is the mean round trip.

Rounds alternate between the contenders (order rotated) and the median is printed with the ratio
to asyncio streams.  A benchmark: it prints, it asserts nothing.  ``--loop uvloop`` runs both
processes on uvloop.

    .venv/bin/python benchmarks/channel_bench.py [--mib 64] [--size 1048576] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import anyio  # noqa: E402

import aiordma  # noqa: E402
import aiordma.asyncio  # noqa: E402
from benchmarks._placement import pin, placement  # noqa: E402

LEN = struct.Struct("!I")
#: asyncio's StreamReader limit (its default, 64 KiB, unless --streams-limit)
_LIMIT = int(os.environ.get("CHANNEL_BENCH_STREAMS_LIMIT", str(1 << 16)))
KINDS = ("asyncio-streams", "asyncio-streams-raw", "aiordma-streams", "channel-receive", "channel-receive_into")


# -- servers (in the child process) ---------------------------------------------------------------


async def _asyncio_server(host: str, aiordma_streams: bool = False) -> tuple[Any, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readexactly(5)
                except asyncio.IncompleteReadError:
                    return
                op, n = head[0], LEN.unpack(head[1:])[0]
                if op == ord("e"):  # echo one message
                    writer.write(head + await reader.readexactly(n))
                    await writer.drain()
                elif op == ord("r"):  # raw: n bytes follow, read as they come
                    total = 0
                    while total < n:
                        total += len(await reader.read(1 << 20))
                    writer.write(struct.pack("!Q", total))
                    await writer.drain()
                else:  # bulk: n messages follow
                    total = 0
                    for _ in range(n):
                        (size,) = LEN.unpack(await reader.readexactly(4))
                        total += len(await reader.readexactly(size))
                    writer.write(struct.pack("!Q", total))
                    await writer.drain()
        finally:
            writer.close()

    if aiordma_streams:  # (aiordma.asyncio's drop-in for asyncio's streams, over TCP)
        server = await aiordma.asyncio.start_server(handle, host, 0, transport="tcp", limit=_LIMIT)
    else:
        server = await asyncio.start_server(handle, host, 0, limit=_LIMIT)
    return server, server.sockets[0].getsockname()[1]


async def _channel_server(host: str, into: bool) -> tuple[Any, int]:
    listener = await aiordma.create_channel_listener(host, 0, transport="tcp", max_message_size=64 << 20)

    async def handle(ch: Any) -> None:
        buf = bytearray(64 << 20)
        async with ch:
            try:
                while True:
                    head = await ch.receive()
                    op, n = head[0], LEN.unpack(head[1:5])[0]
                    if op == ord("e"):
                        await ch.send(head)
                        continue
                    total = 0
                    for _ in range(n):
                        if into:
                            total += await ch.receive_into(buf)
                        else:
                            total += len(await ch.receive())
                    await ch.send(struct.pack("!Q", total))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return

    async def serve() -> None:
        await listener.serve(handle)

    task = asyncio.get_running_loop().create_task(serve())
    return (listener, task), listener.port


def _serve(kind: str, host: str, port_file: str, loop: str) -> None:
    async def body() -> None:
        if kind.startswith("asyncio-streams") or kind == "aiordma-streams":
            _, port = await _asyncio_server(host, aiordma_streams=kind == "aiordma-streams")
        else:
            _, port = await _channel_server(host, into=kind == "channel-receive_into")
        Path(port_file).write_text(str(port))
        await asyncio.Event().wait()

    _run(loop, body())


def _run(loop: str, coro: Any) -> Any:
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


# -- clients ----------------------------------------------------------------------------------------


class _Streams:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bool) -> None:
        self.reader, self.writer, self.raw = reader, writer, raw

    async def bulk(self, count: int, payload: bytes) -> float:
        w = self.writer
        t0 = time.perf_counter()
        if self.raw:
            w.write(b"r" + LEN.pack(count * len(payload)))
            for _ in range(count):
                w.write(payload)
                await w.drain()
            (total,) = struct.unpack("!Q", await self.reader.readexactly(8))
            assert total == count * len(payload), total
            return time.perf_counter() - t0
        w.write(b"b" + LEN.pack(count))
        head = LEN.pack(len(payload))
        for _ in range(count):
            w.writelines((head, payload))
            await w.drain()
        (total,) = struct.unpack("!Q", await self.reader.readexactly(8))
        assert total == count * len(payload), total
        return time.perf_counter() - t0

    async def rtt(self, n: int) -> float:
        msg = b"e" + LEN.pack(59) + b"x" * 59
        w, r = self.writer, self.reader
        t0 = time.perf_counter()
        for _ in range(n):
            w.write(msg)
            await w.drain()
            await r.readexactly(64)
        return time.perf_counter() - t0

    async def close(self) -> None:
        self.writer.close()


class _Channel:
    def __init__(self, ch: Any) -> None:
        self.ch = ch

    async def bulk(self, count: int, payload: bytes) -> float:
        ch = self.ch
        t0 = time.perf_counter()
        await ch.send(b"b" + LEN.pack(count))
        for _ in range(count):
            await ch.send(payload)
        (total,) = struct.unpack("!Q", await ch.receive())
        assert total == count * len(payload), total
        return time.perf_counter() - t0

    async def rtt(self, n: int) -> float:
        msg = b"e" + LEN.pack(59) + b"x" * 59
        ch = self.ch
        t0 = time.perf_counter()
        for _ in range(n):
            await ch.send(msg)
            await ch.receive()
        return time.perf_counter() - t0

    async def close(self) -> None:
        await self.ch.aclose()


async def _connect(kind: str, host: str, port: int) -> Any:
    if kind == "aiordma-streams":
        r, w = await aiordma.asyncio.open_connection(host, port, transport="tcp", limit=_LIMIT)
        return _Streams(r, w, raw=False)
    if kind.startswith("asyncio-streams"):
        return _Streams(*await asyncio.open_connection(host, port, limit=_LIMIT), raw=kind == "asyncio-streams-raw")
    return _Channel(await aiordma.connect_channel(host, port, transport="tcp", max_message_size=64 << 20))


async def measure(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    procs: list[subprocess.Popen[bytes]] = []
    clients: dict[str, Any] = {}
    out: dict[str, dict[str, list[float]]] = {k: {"bulk": [], "rtt": []} for k in args.kinds}
    try:
        for kind in args.kinds:
            port_file = f"/tmp/channel-bench-{os.getpid()}-{kind}"
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve", kind, "--host", args.host,
                                           "--loop", args.loop, "--port-file", port_file]))  # fmt: skip
            deadline = time.monotonic() + 120
            while not (os.path.exists(port_file) and Path(port_file).read_text()):
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {kind} server did not start")
                await asyncio.sleep(0.05)
            port = int(Path(port_file).read_text())
            os.unlink(port_file)
            clients[kind] = await _connect(kind, args.host, port)
        payload = os.urandom(args.size)
        count = max(1, (args.mib << 20) // args.size)
        for kind in args.kinds:  # warm-up
            await clients[kind].bulk(max(1, count // 8), payload)
            await clients[kind].rtt(args.round_trips // 10)
        kinds = list(args.kinds)
        for r in range(args.rounds):
            order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
            for kind in order:
                secs = await clients[kind].bulk(count, payload)
                out[kind]["bulk"].append(count * args.size / secs / 1e6)
                secs = await clients[kind].rtt(args.round_trips)
                out[kind]["rtt"].append(secs / args.round_trips * 1e6)
    finally:
        for c in clients.values():
            await c.close()
        for p in procs:
            p.terminate()
            p.wait(10)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--size", type=int, default=1 << 20)
    p.add_argument("--round-trips", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--streams-limit", type=int, default=1 << 16, help="asyncio's StreamReader limit (default 64 KiB, its own)")
    p.add_argument("--json", metavar="FILE", help="also write the medians as JSON")
    p.add_argument("--serve")
    p.add_argument("--port-file")
    args = p.parse_args()
    if args.serve:
        pin("server")
        _serve(args.serve, args.host, args.port_file, args.loop)
        return
    pin("client")
    args.kinds = args.kinds.split(",")
    os.environ["CHANNEL_BENCH_STREAMS_LIMIT"] = str(args.streams_limit)  # (the server processes read it)
    res = _run(args.loop, measure(args))
    if args.json:
        import json

        med = {k: {"mbps": statistics.median(f["bulk"]), "rtt_us": statistics.median(f["rtt"])} for k, f in res.items()}
        Path(args.json).write_text(json.dumps(med))
    base = res.get("asyncio-streams")
    print(f"two processes, {args.loop}; asyncio streams' limit {args.streams_limit}; {args.mib} MiB as {args.size}-byte messages; {args.round_trips} x 64 B round trips; "
          f"median of {args.rounds}; pinned: {placement()}")  # fmt: skip
    print(f"{'variant':24} {'MB/s':>8} {'x streams':>10} {'RTT us':>8} {'x streams':>10}")
    for kind, fig in res.items():
        mb, rt = statistics.median(fig["bulk"]), statistics.median(fig["rtt"])
        rb = f"{mb / statistics.median(base['bulk']):.2f}" if base else "-"
        rr = f"{rt / statistics.median(base['rtt']):.2f}" if base else "-"
        print(f"{kind:24} {mb:8.0f} {rb:>10} {rt:8.1f} {rr:>10}")


if __name__ == "__main__":
    main()
