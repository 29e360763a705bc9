"""The floor under the RDMA/TCP round-trip targets: the same 64 B ping-pong in C, over rxe and
over TCP, in the same boot (issue 33: "a target the environment makes impossible is reported
with the measurement that shows it").

Three C programs, two processes each, alternated ``--repeats`` times:

* ``tcp_pingpong`` (``benchmarks/tcp_pingpong.c``, built here with gcc): blocking send/recv with
  TCP_NODELAY -- each answer wakes a process blocked in the kernel, as an event loop's is;
* ``ib_send_lat -e``: perftest's SEND/RECV latency waiting for each completion on the completion
  channel (the wake aiordma's ``event`` mode takes);
* ``ib_send_lat``: the same, busy-polling the CQ (``busy``).

It prints each one's median round trip and the ratios RDMA/TCP.  aiordma's own RDMA/TCP
ratios (``rdma_bench.py``) sit on top of these: both of its transports run the same Python per
round trip (``call_count.py``: 94 against 91 calls), so where the C floor itself is above 1 the
library cannot bring its ratio below it by its own work.  Run it in the Soft-RoCE guest::

    python -m tools.vm -- python benchmarks/wake_floor.py [--iters 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rdma_baseline  # (benchmarks/)

HERE = Path(__file__).resolve().parent


def tcp_round_trip(binary: Path, address: str, port: int, iters: int) -> float:
    """The median round trip (us) of ``tcp_pingpong`` between two processes."""
    server = subprocess.Popen([str(binary), "-p", str(port), "-n", str(iters)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not rdma_baseline._listening(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("tcp_pingpong: the server did not listen")
            time.sleep(0.05)
        out = subprocess.run([str(binary), "-p", str(port), "-n", str(iters), address],
                             capture_output=True, text=True, timeout=300, check=True).stdout  # fmt: skip
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return float(out.splitlines()[-1].split()[3])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=rdma_baseline._first("AIORDMA_VM_DEVICES", "rxe0"))
    parser.add_argument("--gid-index", type=int, default=1)
    parser.add_argument("--server-addr", default=rdma_baseline._first("AIORDMA_VM_ADDRESSES", "198.18.0.1"))
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    if not (rdma_baseline.SYS_IB / args.device).is_dir() or shutil.which("ib_send_lat") is None:
        print("wake_floor: run it in the Soft-RoCE guest (python -m tools.vm -- python benchmarks/wake_floor.py)",
              file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "tcp_pingpong"
        subprocess.run(["gcc", "-O2", "-o", str(binary), str(HERE / "tcp_pingpong.c")], check=True)
        rows: dict[str, list[float]] = {"TCP (C, blocking)": [], "ib_send_lat -e (event)": [], "ib_send_lat (busy)": []}
        port = rdma_baseline.BASE_PORT + 40
        for _ in range(args.repeats):
            rows["TCP (C, blocking)"].append(tcp_round_trip(binary, args.server_addr, port, args.iters))
            port += 1
            for name, extra in (("ib_send_lat -e (event)", ("-e",)), ("ib_send_lat (busy)", ())):
                result = rdma_baseline.run_pair("ib_send_lat", args, 64, args.iters, port, extra)
                port += 1
                if not result.ok:
                    print(f"{name}: FAILED {result.error}", file=sys.stderr)
                    return 1
                rows[name].append(2 * result.figures["t_typical[usec]"])  # (perftest prints half)
    print(f"64 B round trips, median of {args.repeats} runs of {args.iters} (us), two processes:")
    medians = {name: statistics.median(values) for name, values in rows.items()}
    for name, values in rows.items():
        print(f"  {name:24s} {medians[name]:9.1f}   runs: {', '.join(f'{v:.1f}' for v in values)}")
    tcp = medians["TCP (C, blocking)"]
    print(f"floor ratios: event/TCP {medians['ib_send_lat -e (event)'] / tcp:.2f}, "
          f"busy/TCP {medians['ib_send_lat (busy)'] / tcp:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
