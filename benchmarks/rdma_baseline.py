"""Baseline RDMA figures from perftest, for comparison with aiordma's own numbers.

Runs ``ib_send_lat``, ``ib_write_bw`` and ``ib_read_bw`` between a server and a
client process on the same device (rxe loopback in the Soft-RoCE guest) and
prints a table of the figures parsed from their output, then the raw result
lines.  Meant to run inside the guest::

    python -m tools.vm -- python benchmarks/rdma_baseline.py

Under qemu TCG the absolute figures say little; compare only figures taken in
the same run (or at least on the same machine and in the same kind of guest).

Exit status: 0 when all three ran and parsed, 1 when one failed, 2 when
there is no such device (not in the guest).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SYS_IB = Path("/sys/class/infiniband")
#: The only addresses this may talk to: the guest's own (and loopback).
ALLOWED_NETWORKS = (ipaddress.ip_network("198.18.0.0/15"), ipaddress.ip_network("127.0.0.0/8"))
BASE_PORT = 18515


@dataclasses.dataclass
class Result:
    tool: str
    size: int
    iterations: int
    ok: bool
    figures: dict[str, float]
    raw: list[str]
    error: str = ""
    seconds: float = 0.0


def _first(env_name: str, default: str) -> str:
    values = [v for v in os.environ.get(env_name, "").split(",") if v]
    return values[0] if values else default


def _listening(port: int) -> bool:
    """True when something listens on TCP *port* (IPv4 or IPv6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


_HEADER_TOKEN = re.compile(r"\d+(?:\.\d+)?%\s+\S+|BW\s+\S+|\S+")


def parse_perftest(output: str) -> tuple[dict[str, float], list[str]]:
    """Figures of the result table in perftest output (header ``#bytes ...``
    followed by one line of numbers), and those raw lines."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("#bytes") and i + 1 < len(lines):
            header = _HEADER_TOKEN.findall(line.strip())
            values = lines[i + 1].split()
            if len(values) != len(header):
                continue
            try:
                figures = {name: float(value) for name, value in zip(header, values)}
            except ValueError:
                continue
            return figures, [line.rstrip(), lines[i + 1].rstrip()]
    return {}, []


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        return ""
    return out or ""


def run_pair(tool: str, args: argparse.Namespace, size: int, iterations: int, port: int,
             extra: tuple[str, ...] = ()) -> Result:
    common = [tool, "-d", args.device, "-i", "1", "-x", str(args.gid_index), "-s", str(size),
              "-n", str(iterations), "-F", "-p", str(port), *extra]
    t0 = time.monotonic()
    server = subprocess.Popen(common, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                out = _stop(server)
                return Result(tool, size, iterations, False, {}, out.splitlines()[-5:],
                              "server did not start listening")
            time.sleep(0.05)
        try:
            client = subprocess.run([*common, args.server_addr], stdin=subprocess.DEVNULL,
                                    capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            _stop(server)
            return Result(tool, size, iterations, False, {}, [], f"client timed out after {args.timeout:.0f} s")
        try:
            server_out, _ = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server_out = _stop(server)
            return Result(tool, size, iterations, False, {}, [], "server did not exit after the client")
    finally:
        if server.poll() is None:
            _stop(server)
    seconds = time.monotonic() - t0
    figures, raw = parse_perftest(client.stdout)
    if not figures:  # some tools report on the server side only
        figures, raw = parse_perftest(server_out)
    ok = client.returncode == 0 and server.returncode == 0 and bool(figures)
    error = "" if ok else (
        f"client exit {client.returncode}, server exit {server.returncode}: "
        + " | ".join((client.stdout + client.stderr).strip().splitlines()[-3:])
    )
    return Result(tool, size, iterations, ok, figures, raw, error, seconds)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if value < 1 else f"{value:.2f}"


def print_table(results: list[Result], device: str) -> None:
    print(f"\nperftest baseline on {device} (RC, server and client on the same device)")
    lat = [r for r in results if r.tool.endswith("_lat")]
    bw = [r for r in results if r.tool.endswith("_bw")]
    if lat:
        print(f"{'test':<14}{'bytes':>8}{'iters':>8}{'typical us':>12}{'avg us':>10}{'min us':>10}{'max us':>10}{'p99 us':>10}")
        for r in lat:
            f = r.figures
            print(f"{r.tool:<14}{r.size:>8}{r.iterations:>8}{_fmt(f.get('t_typical[usec]')):>12}"
                  f"{_fmt(f.get('t_avg[usec]')):>10}{_fmt(f.get('t_min[usec]')):>10}"
                  f"{_fmt(f.get('t_max[usec]')):>10}{_fmt(f.get('99% percentile[usec]')):>10}"
                  + ("" if r.ok else f"  FAILED: {r.error}"))
    if bw:
        print(f"{'test':<14}{'bytes':>8}{'iters':>8}{'avg MB/s':>12}{'peak MB/s':>10}{'Mmsg/s':>10}")
        for r in bw:
            f = r.figures
            print(f"{r.tool:<14}{r.size:>8}{r.iterations:>8}{_fmt(f.get('BW average[MB/sec]')):>12}"
                  f"{_fmt(f.get('BW peak[MB/sec]')):>10}{_fmt(f.get('MsgRate[Mpps]')):>10}"
                  + ("" if r.ok else f"  FAILED: {r.error}"))
    print("\nraw result lines:")
    for r in results:
        print(f"[{r.tool} -s {r.size} -n {r.iterations}] ({r.seconds:.1f} s)")
        for line in r.raw or [f"(none) {r.error}"]:
            print("   " + line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=os.environ.get("AIORDMA_TEST_DEVICE") or _first("AIORDMA_VM_DEVICES", "rxe0"))
    p.add_argument("--gid-index", type=int, default=1, help="GID index (rxe: 1 = ::ffff:<IPv4>, RoCEv2)")
    p.add_argument("--server-addr", default=_first("AIORDMA_VM_ADDRESSES", "198.18.0.1"),
                   help="address of the server for perftest's TCP handshake (default: the guest's rxe0 address)")
    p.add_argument("--lat-size", type=int, default=64)
    p.add_argument("--bw-size", type=int, default=65536)
    p.add_argument("--lat-iters", type=int, default=1000)
    p.add_argument("--bw-iters", type=int, default=500)
    p.add_argument("--timeout", type=float, default=120.0, help="per perftest process (default %(default).0f s)")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)

    if not (SYS_IB / args.device).is_dir():
        present = sorted(d.name for d in SYS_IB.iterdir()) if SYS_IB.is_dir() else []
        print(
            f"rdma_baseline: no RDMA device {args.device!r} here (devices: {', '.join(present) or 'none'}).\n"
            "Run it in the Soft-RoCE guest:\n"
            "  python -m tools.vm -- python benchmarks/rdma_baseline.py",
            file=sys.stderr,
        )
        return 2
    addr = ipaddress.ip_address(args.server_addr)
    if not any(addr in net for net in ALLOWED_NETWORKS):
        print(f"rdma_baseline: refusing {addr}: only 198.18.0.0/15 (the guest) or loopback", file=sys.stderr)
        return 2
    missing = [t for t in ("ib_send_lat", "ib_write_bw", "ib_read_bw") if shutil.which(t) is None]
    if missing:
        print(f"rdma_baseline: missing {', '.join(missing)} (apt-get install perftest)", file=sys.stderr)
        return 2

    plan = [
        ("ib_send_lat", args.lat_size, args.lat_iters),
        ("ib_write_bw", args.bw_size, args.bw_iters),
        ("ib_read_bw", args.bw_size, args.bw_iters),
    ]
    results = [run_pair(tool, args, size, iters, BASE_PORT + 10 + i) for i, (tool, size, iters) in enumerate(plan)]
    print_table(results, args.device)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=1))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
