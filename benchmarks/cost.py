"""Issue 33's targets on this host, from one run: every ratio against what it replaces.

It runs the benchmarks that measure each pair -- in two processes, alternating rounds -- and
prints one table, measured against target::

    .venv/bin/python benchmarks/cost.py [--quick] [--ucxx-python PATH] [--json FILE]

* ``channel_bench.py`` (asyncio, then uvloop): channels' 1 MiB messages and 64 B round trip, and
  ``aiordma.asyncio`` streams' round trip, against asyncio streams;
* ``protocol_bench.py --processes 2``: an asyncio Protocol's echo over aiordma's Transport
  against asyncio's own (asyncio and uvloop);
* ``dask_bench.py``: ``rdma://`` on the TCP fallback against Dask's ``tcp://``;
* ``ucxx_bench.py`` (UCXX over TCP, blocking progress), run by ``--ucxx-python`` (an interpreter
  with ``ucxx``: ``pip install aiordma[bench]``, or a venv of its own), against channels.  Where
  UCXX does not import, its rows say why and are skipped.

The guest's rows (RDMA against TCP per poll mode, pyverbs, perftest, connect, idle CPU) come from
``benchmarks/rdma_bench.py`` and ``benchmarks/idle_cpu.py`` in the Soft-RoCE guest.  A benchmark:
it prints; it passes or fails nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _run(args: list[str], python: str = sys.executable, timeout: float = 1800) -> dict[str, Any]:
    """Run a benchmark script with ``--json`` and return what it wrote."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        proc = subprocess.run([python, *args, "--json", out], timeout=timeout, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {proc.stderr[-2000:]}")
        sys.stdout.write(proc.stdout)
        data: dict[str, Any] = json.loads(Path(out).read_text())
        return data
    finally:
        os.unlink(out)


def _ucxx(python: str, quick: bool) -> dict[str, Any] | str:
    """UCXX's figures, or why there are none."""
    check = subprocess.run([python, "-c", "import ucxx"], capture_output=True, text=True)
    if check.returncode != 0:
        last = (check.stderr.strip().splitlines() or ["?"])[-1]
        return f"UCXX does not import under {python} ({last}); pip install 'aiordma[bench]' or pass --ucxx-python"
    env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
    extra = ["--rounds", "3", "--round-trips", "1000", "--mib", "32"] if quick else []
    proc = subprocess.run([python, str(HERE / "ucxx_bench.py"), *extra], capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return f"ucxx_bench.py failed: {proc.stderr.strip()[-500:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds and smaller runs (minutes, noisier)")
    p.add_argument("--ucxx-python", default=sys.executable, help="an interpreter with ucxx (default: this one)")
    p.add_argument("--json", metavar="FILE", help="also write every figure as JSON")
    args = p.parse_args()
    rounds = ["--rounds", "3"] if args.quick else ["--rounds", "5"]
    kinds = "--kinds=asyncio-streams,aiordma-streams,channel-receive,channel-receive_into"
    figures: dict[str, Any] = {}
    for loop in ("asyncio", "uvloop"):
        figures[f"channels/{loop}"] = _run([str(HERE / "channel_bench.py"), "--loop", loop, kinds, *rounds])
    figures["protocol"] = _run([str(HERE / "protocol_bench.py"), "--processes", "2", "--loops", "asyncio", "uvloop",
                                "--iters", "1000" if args.quick else "2000", *rounds])  # fmt: skip
    figures["dask"] = _run([str(HERE / "dask_bench.py"), "--mib", "64", "--repeat", "3", "--tasks", "50",
                            "--rounds", "2" if args.quick else "3"])  # fmt: skip
    figures["ucxx"] = _ucxx(args.ucxx_python, args.quick)

    rows: list[tuple[str, str, str, str]] = []

    def row(what: str, value: float | None, target: str, ok: bool | None, note: str = "") -> None:
        shown = "-" if value is None else f"{value:.2f}"
        verdict = "skipped" if ok is None else ("met" if ok else "MISSED")
        rows.append((what, shown, target, verdict + (f" ({note})" if note else "")))

    for loop, rtt_target in (("asyncio", 1.05), ("uvloop", 1.10)):
        ch = figures[f"channels/{loop}"]
        base = ch["asyncio-streams"]
        bulk = min(ch["channel-receive"]["mbps"], ch["channel-receive_into"]["mbps"]) / base["mbps"]
        row(f"channels, 1 MiB messages MB/s / asyncio streams ({loop})", bulk, ">= 0.95", bulk >= 0.95)
        rtt = ch["channel-receive"]["rtt_us"] / base["rtt_us"]
        row(f"channels, 64 B RTT / asyncio streams ({loop})", rtt, "<= 1.15", rtt <= 1.15)
        srtt = ch["aiordma-streams"]["rtt_us"] / base["rtt_us"]
        row(f"aiordma.asyncio streams RTT / asyncio streams ({loop})", srtt, f"<= {rtt_target:.2f}", srtt <= rtt_target)
    for loop, target in (("asyncio", 1.05), ("uvloop", 1.10)):
        r = figures["protocol"][f"{loop}/2"]["ratio"]
        row(f"asyncio Protocol echo / asyncio's transport ({loop})", r, f"<= {target:.2f}", r <= target)
    d = figures["dask"]
    if "tcp" in d and "rdma" in d:
        for key, what in (("scatter_mbs", "scatter"), ("gather_mbs", "gather")):
            r = d["rdma"][key] / d["tcp"][key]
            row(f"Dask rdma:// (TCP fallback) / tcp://: 64 MiB {what} MB/s", r, ">= 0.95", r >= 0.95)
        r = d["rdma"]["echo_ms"] / d["tcp"]["echo_ms"]
        row("Dask rdma:// (TCP fallback) / tcp://: rpc time", r, "<= 1.00", r <= 1.0)
    u = figures["ucxx"]
    ch = figures["channels/asyncio"]
    if isinstance(u, dict):
        r = ch["channel-receive"]["rtt_us"] / u["rtt_us"]
        row("channels over TCP / UCXX over TCP (blocking): 64 B RTT", r, "<= 1.00", r <= 1.0)
        r = ch["channel-receive_into"]["mbps"] / u["mbps"]
        row("channels over TCP / UCXX over TCP (blocking): 1 MiB MB/s", r, ">= 1.00", r >= 1.0)
    else:
        row("channels over TCP / UCXX over TCP", None, "<= 1.0; >= 1.0", None, u)

    print()
    print("issue 33's targets on this host (two processes; ratios of medians from this run)")
    width = max(len(r[0]) for r in rows)
    for what, shown, target, verdict in rows:
        print(f"  {what:<{width}}  {shown:>6}  {target:<8}  {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figures, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
