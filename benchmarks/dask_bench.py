"""Dask over rdma:// (aiordma) against Dask's own tcp://, measured in the same run.

    .venv/bin/python benchmarks/dask_bench.py                   # 127.0.0.1, both protocols
    .venv/bin/python benchmarks/dask_bench.py --host 198.18.0.1 # an address an RDMA device serves
    .venv/bin/python benchmarks/dask_bench.py --mib 64 --repeat 5 --tasks 300 --protocols tcp,rdma

For each protocol, a LocalCluster of one worker process (one thread), and a client in this
process:

* **scatter**: ``client.scatter(array, hash=False)`` of a ``--mib`` MiB numpy array, waited
  for, ``--repeat`` times; MB/s of the median.
* **gather**: ``client.gather(future)`` of such a scattered array back to the client.
* **task round trip**: ``client.submit(inc, i, pure=False).result()``, ``--tasks`` times one
  after the other: the median time of one (client -> scheduler -> worker -> scheduler -> client;
  Dask's batched streams wait a few ms each way, so this is mostly their intervals).
* **rpc echo**: ``client.scheduler.echo(data=i)``, as often: one request and its answer on one
  comm (no batching): the comm's own round trip, plus Dask's handler dispatch.

Over 127.0.0.1 (or any host without RDMA) rdma:// runs on aiordma's TCP fallback: the figures
are the cost of aiordma's framing against Tornado's TCP comm.  The clusters are measured
one after the other, in rounds that alternate the protocols (``--rounds``), so that drift on
the machine spreads over both; the table shows the medians over the rounds.  A benchmark: it
prints and asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import statistics
import time
from typing import Any

import numpy as np
from distributed import Client, LocalCluster

import aiordma

MiB = 1 << 20


def inc(x: int) -> int:
    return x + 1


async def measure(protocol: str, host: str, nbytes: int, repeat: int, tasks: int) -> dict[str, float]:
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype="u1")
    async with LocalCluster(
        protocol=f"{protocol}://",
        host=host,
        n_workers=1,
        threads_per_worker=1,
        processes=True,
        asynchronous=True,
        dashboard_address=None,
        worker_dashboard_address=None,
        silence_logs=logging.ERROR,
    ) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            # warm-up: connections, the first large transfer, the first task
            future = await client.scatter(data, hash=False)
            await client.gather(future)
            del future
            await client.submit(inc, 0, pure=False)
            scatter: list[float] = []
            gather: list[float] = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                future = await client.scatter(data, hash=False)
                t1 = time.perf_counter()
                got = await client.gather(future)
                t2 = time.perf_counter()
                assert got.nbytes == nbytes
                scatter.append(t1 - t0)
                gather.append(t2 - t1)
                del future, got
            rtt: list[float] = []
            for i in range(tasks):
                t0 = time.perf_counter()
                await client.submit(inc, i, pure=False)
                rtt.append(time.perf_counter() - t0)
            echo: list[float] = []
            for i in range(tasks):
                t0 = time.perf_counter()
                await client.scheduler.echo(data=i)
                echo.append(time.perf_counter() - t0)
            transports = await client.run_on_scheduler(_transports)
    return {
        "scatter_mbs": nbytes / statistics.median(scatter) / 1e6,
        "gather_mbs": nbytes / statistics.median(gather) / 1e6,
        "rtt_ms": statistics.median(rtt) * 1e3,
        "echo_ms": statistics.median(echo) * 1e3,
        "transport": transports,  # type: ignore[dict-item]
    }


def _transports(dask_scheduler: Any = None) -> str:
    from distributed.comm.core import Comm

    from aiordma._dask import RDMAComm

    seen = sorted({c.transport for c in list(Comm._instances) if isinstance(c, RDMAComm)})
    return "/".join(seen) or "-"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--mib", type=int, default=64, help="size of the scattered arrays (MiB)")
    parser.add_argument("--repeat", type=int, default=5, help="scatter/gather pairs per round")
    parser.add_argument("--tasks", type=int, default=300, help="task round trips per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each measures every protocol)")
    parser.add_argument("--protocols", default="tcp,rdma")
    parser.add_argument("--json", metavar="FILE", help="also write the medians as JSON")
    args = parser.parse_args()
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in protocols}
    for r in range(args.rounds):
        order = protocols if r % 2 == 0 else list(reversed(protocols))
        for protocol in order:
            results[protocol].append(await measure(protocol, args.host, args.mib * MiB, args.repeat, args.tasks))

    print(f"Dask comm benchmark: {args.mib} MiB arrays, {args.repeat} scatter/gather x {args.rounds} rounds, "
          f"{args.tasks} task round trips x {args.rounds} rounds, host {args.host}")
    print(f"python {platform.python_version()}, aiordma {aiordma.__version__}, "
          f"AIORDMA_TRANSPORT={os.environ.get('AIORDMA_TRANSPORT', '(unset)')}, {os.cpu_count()} CPUs")
    med: dict[str, dict[str, float]] = {}
    header = (
        f"{'protocol':<10}{'carried by':<12}{'scatter MB/s':>14}{'gather MB/s':>14}{'task rtt ms':>14}"
        f"{'rpc echo ms':>14}"
    )
    print(header)
    print("-" * len(header))
    for protocol in protocols:
        rows = results[protocol]
        keys = ("scatter_mbs", "gather_mbs", "rtt_ms", "echo_ms")
        med[protocol] = {k: statistics.median(row[k] for row in rows) for k in keys}
        carried = rows[0]["transport"] if protocol == "rdma" else "tornado tcp"
        m = med[protocol]
        print(
            f"{protocol + '://':<10}{carried:<12}{m['scatter_mbs']:>14.0f}{m['gather_mbs']:>14.0f}"
            f"{m['rtt_ms']:>14.3f}{m['echo_ms']:>14.3f}"
        )
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(med, f)
    if "tcp" in med and "rdma" in med:
        t, r = med["tcp"], med["rdma"]
        print(
            f"ratio rdma:// / tcp://: scatter {r['scatter_mbs'] / t['scatter_mbs']:.2f}x, "
            f"gather {r['gather_mbs'] / t['gather_mbs']:.2f}x (higher is better), "
            f"task round trip {r['rtt_ms'] / t['rtt_ms']:.2f}x, rpc echo {r['echo_ms'] / t['echo_ms']:.2f}x "
            "(lower is better)"
        )


if __name__ == "__main__":
    asyncio.run(main())
