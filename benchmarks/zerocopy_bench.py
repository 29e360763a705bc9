"""Zero-copy and one-sided RDMA, against aiordma over TCP and perftest, in one run (one boot).

For each size (64 KiB .. 64 MiB by default), over RDMA and over TCP on the same address:

* **messages**: a channel sends messages of that size; the receiver takes each with
  ``receive_into`` a ``RegisteredBuffer`` (on RDMA, sizes from ``RdmaConfig.rendezvous`` up go by
  rendezvous: RDMA READ straight into that buffer);
* **one-sided read / write**: ``channel.read`` / ``channel.write`` of that size against memory the
  peer exposed (registered memory on both sides: no staging);

then the 64 B one-sided read and write latency, ``ib_write_bw`` / ``ib_read_bw`` at the same sizes
(perftest, same device), the registration cost per GiB and the registration cache's hit rate.
Client and server run in two processes (``--processes 2``, the default) and/or one.  Prints
ratios; a benchmark, not a test: it passes or fails nothing.  In the Soft-RoCE guest::

    python -m tools.vm --timeout 3000 -- python benchmarks/zerocopy_bench.py --json docs/zerocopy-guest.json
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
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import anyio  # noqa: E402

import aiordma  # noqa: E402
from aiordma import RegisteredBuffer, RemoteBuffer  # noqa: E402

MIB = 1 << 20
SIZES = "64K,256K,1M,4M,16M,64M"


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if text.endswith(suffix):
            return int(text[:-1]) * mult
    return int(text)


def count_for(size: int, megabytes: int) -> int:
    return max(2, min(200, megabytes * MIB // size))


# -- the serving side ------------------------------------------------------------------------------


async def serve_one(ch: aiordma.Channel, largest: int) -> None:
    async with ch:
        while True:
            try:
                cmd = await ch.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            words = cmd.split()
            if words[0] == b"sink":
                size, count = int(words[1]), int(words[2])
                with RegisteredBuffer(size) as buf:
                    for _ in range(count):
                        await ch.receive_into(buf)
                await ch.send(b"ok")
            elif words[0] == b"expose":
                with RegisteredBuffer(largest) as buf:
                    async with ch.expose(buf, read=True, write=True) as remote:
                        await ch.send(remote.to_bytes())
                        await ch.receive()  # "done"
                await ch.send(b"ok")
            elif words[0] == b"quit":
                return


async def server_main(host: str, port_file: str, transport: str, largest: int) -> None:
    async with await aiordma.create_channel_listener(host, 0, transport=transport, max_message_size=1 << 30) as lst:
        Path(port_file).write_text(str(lst.port))
        async with anyio.create_task_group() as tg:
            await lst.serve(lambda ch: serve_one(ch, largest), tg)


# -- the measuring side ----------------------------------------------------------------------------


async def measure(ch: aiordma.Channel, sizes: list[int], megabytes: int, latency_iters: int,
                  messages_only: bool = False) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"messages": {}, "read": {}, "write": {}}
    largest = max(sizes)
    for size in sizes:
        count = count_for(size, megabytes)
        payload = RegisteredBuffer(size)
        try:
            payload[:] = os.urandom(size) if size <= 4 * MIB else os.urandom(4 * MIB) * (size // (4 * MIB))
            await ch.send(b"sink %d %d" % (size, count))
            t0 = time.perf_counter()
            for _ in range(count):
                await ch.send(payload)
            assert await ch.receive() == b"ok"
            out["messages"][size] = size * count / (time.perf_counter() - t0) / 1e6
        finally:
            payload.close()
    if messages_only:
        return out
    await ch.send(b"expose")
    remote = RemoteBuffer.from_bytes(await ch.receive())
    with RegisteredBuffer(largest) as local:
        view = memoryview(local)
        try:
            for size in sizes:
                count = count_for(size, megabytes)
                for op in ("read", "write"):
                    t0 = time.perf_counter()
                    for _ in range(count):
                        if op == "read":
                            await ch.read(remote, view[:size])
                        else:
                            await ch.write(remote, view[:size])
                    out[op][size] = size * count / (time.perf_counter() - t0) / 1e6
            for op in ("read", "write"):
                times = []
                for _ in range(latency_iters):
                    t0 = time.perf_counter()
                    if op == "read":
                        await ch.read(remote, view[:64])
                    else:
                        await ch.write(remote, view[:64])
                    times.append(time.perf_counter() - t0)
                out[f"{op}_64B_us"] = statistics.median(times) * 1e6
        finally:
            view.release()
    await ch.send(b"done")
    assert await ch.receive() == b"ok"
    return out


def registration_cost(ch: aiordma.Channel) -> float | None:
    """ms per GiB to register fresh memory on the connection's device (None over TCP)."""
    link: Any = ch._core.link
    device = getattr(link, "device", None)
    if device is None:
        return None
    size = 128 * MIB
    with RegisteredBuffer(size) as buf:
        t0 = time.perf_counter()
        buf.mr_for(device)
        seconds = time.perf_counter() - t0
    return seconds * 1000 * (1 << 30) / size


async def client_main(host: str, port: int, transport: str, args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    send_path = transport == "rdma-send"  # rendezvous off: every message through the SEND slots
    backend = None
    if send_path:
        backend = aiordma.RdmaBackend(aiordma.RdmaConfig(rendezvous=0))
    elif transport == "rdma" and args.rendezvous is not None:
        backend = aiordma.RdmaBackend(aiordma.RdmaConfig(rendezvous=args.rendezvous))
    real = "rdma" if send_path else transport
    ch = await aiordma.connect_channel(host, port, transport=real, max_message_size=1 << 30, rdma_backend=backend)
    async with ch:
        assert ch.transport == real, ch.fallback_reason
        result = await measure(ch, sizes, args.megabytes, args.latency_iters,
                               messages_only=send_path or args.messages_only)  # fmt: skip
        if transport == "rdma":
            result["registration_ms_per_gib"] = registration_cost(ch)
        await ch.send(b"quit")
    stats = aiordma.memory_stats()
    total = stats.cache_hits + stats.cache_misses
    result["cache_hit_rate"] = stats.cache_hits / total if total else None
    return result


async def one_process(host: str, transport: str, args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    real = "rdma" if transport == "rdma-send" else transport
    async with await aiordma.create_channel_listener(host, 0, transport=real, max_message_size=1 << 30) as lst:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lst.serve, lambda ch: serve_one(ch, max(sizes)), tg)
            result = await client_main(host, lst.port, transport, args, sizes)
            tg.cancel_scope.cancel()
    return result


def two_processes(host: str, transport: str, args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    port_file = f"/tmp/zerocopy-{os.getpid()}-{transport}.port"
    if os.path.exists(port_file):
        os.unlink(port_file)
    server = subprocess.Popen([sys.executable, __file__, "--serve", host, "--port-file", port_file,
                               "--transport", "rdma" if transport == "rdma-send" else transport,
                               "--largest", str(max(sizes))])  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file) or not Path(port_file).read_text():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        port = int(Path(port_file).read_text())
        return asyncio.run(client_main(host, port, transport, args, sizes))
    finally:
        server.terminate()
        server.wait(30)
        if os.path.exists(port_file):
            os.unlink(port_file)


def perftest(host: str, sizes: list[int]) -> dict[str, dict[int, float]]:
    import rdma_baseline  # (benchmarks/)

    ns = argparse.Namespace(device=os.environ.get("AIORDMA_TEST_DEVICE") or rdma_baseline._first("AIORDMA_VM_DEVICES", "rxe0"),
                            gid_index=1, server_addr=host, timeout=600.0)  # fmt: skip
    out: dict[str, dict[int, float]] = {"ib_write_bw": {}, "ib_read_bw": {}}
    port = 18600
    for tool in out:
        for size in sizes:
            iters = max(5, min(200, 64 * MIB // size))
            r = rdma_baseline.run_pair(tool, ns, size, iters, port, ("-t", "4"))
            port += 1
            if r.ok:
                out[tool][size] = r.figures.get("BW average[MB/sec]", float("nan")) * 1.048576
    return out


def fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MIB else f"{n >> 10} KiB"


def report(results: dict[str, Any], sizes: list[int], pt: dict[str, dict[int, float]]) -> None:
    nan = float("nan")
    for where, by_transport in results.items():
        print(f"== {where} (MB/s; ratios: RDMA against aiordma-TCP and against perftest, same size)")
        rdma, tcp = by_transport.get("rdma"), by_transport.get("tcp")
        send_path = by_transport.get("rdma-send")
        if send_path:
            print("  messages over RDMA, rendezvous against the SEND slots (rendezvous=0), MB/s:")
            for size in sizes:
                a = float(rdma["messages"].get(size, nan)) if rdma else nan
                b = float(send_path["messages"].get(size, nan))
                print(f"    {fmt_size(size):>8}: rendezvous {a:7.1f}  SEND slots {b:7.1f}  ratio {a / b:5.2f}")
        print(f"{'size':>8} | {'msg':>7} {'msg tcp':>7} {'x tcp':>5} {'x ibw':>5} | {'read':>7} {'rd tcp':>7} {'x tcp':>5} "
              f"{'x ibr':>5} | {'write':>7} {'wr tcp':>7} {'x tcp':>5} {'x ibw':>5} | {'ib_read':>7} {'ib_write':>8}")  # fmt: skip
        for size in sizes:
            def g(d: Any, k: str) -> float:
                return float(d[k].get(size, nan)) if d else nan

            ib_r = pt.get("ib_read_bw", {}).get(size, nan)
            ib_w = pt.get("ib_write_bw", {}).get(size, nan)
            m, mt = g(rdma, "messages"), g(tcp, "messages")
            r, rt = g(rdma, "read"), g(tcp, "read")
            w, wt = g(rdma, "write"), g(tcp, "write")
            print(f"{fmt_size(size):>8} | {m:7.1f} {mt:7.1f} {m / mt:5.2f} {m / ib_w:5.2f} | {r:7.1f} {rt:7.1f} {r / rt:5.2f} "
                  f"{r / ib_r:5.2f} | {w:7.1f} {wt:7.1f} {w / wt:5.2f} {w / ib_w:5.2f} | {ib_r:7.1f} {ib_w:8.1f}")  # fmt: skip
        for t, res in by_transport.items():
            if "read_64B_us" not in res:
                continue
            line = f"  {t}: 64 B one-sided read {res['read_64B_us']:.0f} us, write {res['write_64B_us']:.0f} us"
            if res.get("registration_ms_per_gib") is not None:
                line += f"; registration {res['registration_ms_per_gib']:.0f} ms per GiB"
            if res.get("cache_hit_rate") is not None:
                line += f"; registration cache hit rate {res['cache_hit_rate']:.3f}"
            print(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", help="an address an RDMA device serves (default: the first one found)")
    p.add_argument("--sizes", default=SIZES)
    p.add_argument("--megabytes", type=int, default=64, help="bytes moved per size and operation (default %(default)s MB)")
    p.add_argument("--latency-iters", type=int, default=100)
    p.add_argument("--processes", type=int, nargs="+", default=[2, 1])
    p.add_argument("--transports", nargs="+", default=["rdma", "tcp"],
                   help="rdma, tcp, rdma-send (messages over RDMA with rendezvous off, to place the threshold)")
    p.add_argument("--no-perftest", action="store_true")
    p.add_argument("--rendezvous", type=lambda t: parse_size(t), default=None,
                   help="RdmaConfig.rendezvous of the rdma line's sender (e.g. 4K: every size by rendezvous)")
    p.add_argument("--messages-only", action="store_true", help="messages only (no one-sided read/write)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--serve", metavar="HOST", help=argparse.SUPPRESS)
    p.add_argument("--port-file", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="rdma", help=argparse.SUPPRESS)
    p.add_argument("--largest", type=int, default=64 * MIB, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        anyio.run(server_main, args.serve, args.port_file, args.transport, args.largest)
        return 0
    from aiordma.testing import rdma_address

    host = args.host or (rdma_address() if "rdma" in args.transports else "127.0.0.1")
    if host is None:
        print("no RDMA device with an IPv4 RoCEv2 address here (run it in the guest)", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {}
    for n in args.processes:
        where = "two processes" if n == 2 else "one process"
        results[where] = {}
        for transport in args.transports:
            print(f"-- {where}, {transport} ...", file=sys.stderr, flush=True)
            if n == 2:
                results[where][transport] = two_processes(host, transport, args, sizes)
            else:
                results[where][transport] = asyncio.run(one_process(host, transport, args, sizes))
    pt = {} if args.no_perftest else perftest(host, sizes)
    report(results, sizes, pt)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "perftest": pt}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
