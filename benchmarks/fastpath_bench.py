"""The fast-path figures of issue 8, in one run (one guest boot), printed as ratios.

64-byte round trip (median) and 1 MiB bulk for:

* aiordma over RDMA in each poll mode (``event``, ``adaptive``, ``busy``), and
  aiordma over TCP -- measured by ``aiordma perf`` (message channels);
* plain asyncio streams (``asyncio.start_server`` / ``open_connection``);
* a plain pyverbs SEND/RECV ping-pong (``benchmarks/pyverbs_pingpong.py``);
* perftest's ``ib_send_lat`` (one-way latency, doubled here to a round
  trip) and ``ib_write_bw`` (``benchmarks/rdma_baseline.py``), same device;

client and server in two processes, and in one.  Then the targets of the
issue, each with the ratio that decides it.  Run it in the guest::

    python -m tools.vm --timeout 3000 -- python benchmarks/fastpath_bench.py [--plot docs/perf-guest.png]

Absolute figures move 1.5-2x between boots: only the ratios of one run mean something.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-c", "from aiordma._cli import main; raise SystemExit(main())"]
MIB = 1 << 20


def _run_json(cmd: list[str], timeout: float = 1800) -> Any:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])}... failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def aiordma_perf(host: str, two: bool, args: argparse.Namespace, plot: str | None) -> dict[str, dict[str, float]]:
    common = ["--sizes", "64,1M", "--iterations", str(args.round_trips), "--bw-bytes", f"{args.megabytes}M",
              "--bw-messages", "5000", "--json", "--no-progress"]  # fmt: skip
    if plot:
        common += ["--plot", plot]
    if two:
        server = subprocess.Popen([*CLI, "perf", "server", "--host", host, "--port", "0"], stdout=subprocess.PIPE,
                                  text=True)  # fmt: skip
        try:
            assert server.stdout is not None
            port = server.stdout.readline().split("ports ")[1].split("-")[0]
            data = _run_json([*CLI, "perf", "client", host, "--port", port, *common])
        finally:
            server.kill()
            server.wait()
    else:
        data = _run_json([*CLI, "perf", "client", "--local", *common])
    out: dict[str, dict[str, float]] = {}
    for line in data["lines"]:
        label = f"aiordma-{line['transport']}" + (f"/{line['poll']}" if line["transport"] == "rdma" else "")
        small, big = line["results"]
        out[label] = {"rtt_us": small["lat_p50_us"], "bulk_mb_s": big["bw_mb_s"], "p99_us": small["lat_p99_us"]}
    return out


def full_perf(host: str, plot: str, timeout: float = 2400) -> str:
    """``aiordma perf`` over its whole size range, two processes: the table, and the PNG at ``plot``."""
    server = subprocess.Popen([*CLI, "perf", "server", "--host", host, "--port", "0"], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        port = server.stdout.readline().split("ports ")[1].split("-")[0]
        proc = subprocess.run([*CLI, "perf", "client", host, "--port", port, "--iterations", "200", "--lat-bytes",
                               "16M", "--bw-bytes", "16M", "--plot", plot, "--no-progress"],
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
        return proc.stdout + proc.stderr
    finally:
        server.kill()
        server.wait()


# -- plain asyncio streams ---------------------------------------------------------------------

STREAM_SERVER = r"""
import asyncio, sys
async def handle(r, w):
    mode = await r.readexactly(1)
    if mode == b"E":
        while True:
            data = await r.read(64)
            if not data:
                break
            w.write(data)
            await w.drain()
    else:
        total = 0
        while True:
            data = await r.read(1 << 20)
            if not data:
                break
            total += len(data)
        w.write(str(total).encode())
        await w.drain()
    w.close()
async def main():
    server = await asyncio.start_server(handle, sys.argv[1], 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await asyncio.sleep(float(sys.argv[2]))
asyncio.run(main())
"""


async def _streams_client(host: str, port: int, round_trips: int, megabytes: int) -> dict[str, float]:
    r, w = await asyncio.open_connection(host, port)
    w.write(b"E")
    msg = b"x" * 64
    samples = []
    for _ in range(round_trips):
        t0 = time.perf_counter()
        w.write(msg)
        await w.drain()
        got = 0
        while got < 64:
            got += len(await r.read(64 - got))
        samples.append(time.perf_counter() - t0)
    w.close()
    r, w = await asyncio.open_connection(host, port)
    w.write(b"D")
    block = bytes(MIB)
    t0 = time.perf_counter()
    for _ in range(megabytes):
        w.write(block)
        await w.drain()
    w.write_eof()
    total = int(await r.read())
    elapsed = time.perf_counter() - t0
    w.close()
    assert total == megabytes * MIB
    return {"rtt_us": statistics.median(samples) * 1e6, "bulk_mb_s": total / elapsed / 1e6}


def asyncio_streams(host: str, two: bool, args: argparse.Namespace) -> dict[str, float]:
    if two:
        server = subprocess.Popen([sys.executable, "-c", STREAM_SERVER, host, "3600"], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            return asyncio.run(_streams_client(host, port, args.round_trips, args.megabytes))
        finally:
            server.kill()
            server.wait()

    async def local() -> dict[str, float]:
        # the same handler, in this loop
        namespace: dict[str, Any] = {}
        exec(STREAM_SERVER.split("async def main")[0], namespace)  # noqa: S102 - our own code above
        server = await asyncio.start_server(namespace["handle"], host, 0)
        async with server:
            return await _streams_client(host, server.sockets[0].getsockname()[1], args.round_trips, args.megabytes)

    return asyncio.run(local())


# -- pyverbs and perftest ------------------------------------------------------------------------


def pyverbs(host: str, two: bool, args: argparse.Namespace) -> dict[str, float]:
    script = str(HERE / "pyverbs_pingpong.py")
    common = ["--ip", host, "--round-trips", str(args.round_trips), "--bulk", str(min(args.megabytes, 64))]
    if not two:
        return _run_json([sys.executable, script, "--local", *common])  # type: ignore[no-any-return]
    server = subprocess.Popen([sys.executable, script, "--serve", "0", *common], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        return _run_json([sys.executable, script, host, port, *common])  # type: ignore[no-any-return]
    finally:
        server.wait(timeout=60)


def perftest(host: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "baseline.json")
        subprocess.run([sys.executable, str(HERE / "rdma_baseline.py"), "--server-addr", host, "--bw-size", str(MIB),
                        "--bw-iters", "200", "--json", path], capture_output=True, text=True, timeout=1800)  # fmt: skip
        results = json.loads(Path(path).read_text()) if os.path.exists(path) else []
    out: dict[str, float] = {}
    for r in results:
        f = r["figures"]
        if r["tool"] == "ib_send_lat" and r["ok"]:
            out["rtt_us"] = 2 * f.get("t_typical[usec]", float("nan"))  # one-way -> round trip
        if r["tool"] == "ib_write_bw" and r["ok"]:
            out["write_bw_mb_s"] = f.get("BW average[MB/sec]", float("nan")) * 1.048576  # MiB/s -> MB/s
    return out


# -- report ---------------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float:
    if not a or not b:
        return float("nan")
    return a / b


def report(rows: dict[str, dict[str, float]], where: str) -> list[str]:
    out = [f"== {where}", f"{'':24}{'64 B RTT us':>14}{'1 MiB bulk MB/s':>18}"]
    for label, r in rows.items():
        rtt = r.get("rtt_us", float("nan"))
        bulk = r.get("bulk_mb_s", r.get("write_bw_mb_s", float("nan")))
        out.append(f"{label:24}{rtt:>14.1f}{bulk:>18.1f}")
    tcp = rows.get("aiordma-tcp", {})
    pv = rows.get("pyverbs", {})
    ib = rows.get("perftest", {})
    out.append("ratios (target in brackets):")
    for mode, target in (("event", 1.0), ("adaptive", 0.5), ("busy", 0.5)):
        r = rows.get(f"aiordma-rdma/{mode}", {})
        rtt_tcp = _ratio(r.get("rtt_us"), tcp.get("rtt_us"))
        rtt_pv = _ratio(r.get("rtt_us"), pv.get("rtt_us"))
        bulk = _ratio(r.get("bulk_mb_s"), tcp.get("bulk_mb_s"))
        wbw = _ratio(r.get("bulk_mb_s"), ib.get("write_bw_mb_s"))
        out.append(f"  rdma/{mode:9} RTT vs aiordma-tcp {rtt_tcp:5.2f}x [<= {target}]  vs pyverbs {rtt_pv:5.2f}x [<= 0.3]"
                   f"  bulk vs aiordma-tcp {bulk:5.2f}x [>= 1.5]  vs ib_write_bw {wbw:5.2f}x")  # fmt: skip
    streams = rows.get("asyncio-streams", {})
    out.append(f"  aiordma-tcp vs asyncio streams: RTT {_ratio(tcp.get('rtt_us'), streams.get('rtt_us')):.2f}x [<= 1.05]"
               f"  bulk {_ratio(tcp.get('bulk_mb_s'), streams.get('bulk_mb_s')):.2f}x [>= 0.95]")  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=300)
    parser.add_argument("--megabytes", type=int, default=32)
    parser.add_argument("--processes", type=int, nargs="*", choices=[1, 2], default=[2, 1])
    parser.add_argument("--plot", default=None, help="also write aiordma perf's PNG (two processes)")
    parser.add_argument("--json", default=None, help="write every figure as JSON")
    parser.add_argument("--full-plot", default=None, help="also run aiordma perf over 64 B..16 MiB (two processes) "
                        "and write its PNG here")  # fmt: skip
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from aiordma.testing import rdma_address

    host = rdma_address()
    if host is None:
        print("fastpath_bench: no RDMA device here; run it in the guest (python -m tools.vm -- ...)",
              file=sys.stderr)  # fmt: skip
        return 2
    everything: dict[str, Any] = {}
    lines: list[str] = []
    ib = perftest(host)
    for n in args.processes:
        two = n == 2
        rows: dict[str, dict[str, float]] = {}
        rows.update(aiordma_perf(host, two, args, args.plot if two else None))
        rows["asyncio-streams"] = asyncio_streams(host, two, args)
        try:
            rows["pyverbs"] = pyverbs(host, two, args)
        except Exception as exc:  # pyverbs missing: say so, keep the rest
            print(f"fastpath_bench: pyverbs: {exc}", file=sys.stderr)
        rows["perftest"] = ib
        everything["two_processes" if two else "one_process"] = rows
        lines += report(rows, "client and server in two processes" if two else "client and server in one process")
        print("\n".join(lines[-12:]), flush=True)
    print("\n".join(lines))
    if args.full_plot:
        print("== aiordma perf, 64 B .. 16 MiB, two processes")
        print(full_perf(host, args.full_plot), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
