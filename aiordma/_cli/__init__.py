"""The ``aiordma`` command: ``aiordma info``, ``aiordma demo``, ``aiordma perf`` and ``aiordma top``.

``aiordma info`` tells what this host has (versions, the native verbs module,
RDMA devices with their ports and GIDs from sysfs) and which transport
``transport="auto"`` would use here, and why.  ``--json`` prints the same as
one JSON object.

``aiordma demo`` runs a byte-stream listener and a channel listener on
127.0.0.1 in this process, connects a client to each, checks that bytes and
messages come back intact (message boundaries, the empty message included),
and prints the transport, the fallback reason and a few figures: 64 B round
trip latency, byte-stream throughput and message rate.  It exits with 1 when a
check fails.

``aiordma top [PID]`` shows a live table of a process's connections, read from the stats
endpoint that process serves (``aiordma.serve_stats()``; see ``aiordma/metrics.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from .common import EXIT_FAILED, MiB, parse_positive, parse_size
from .demo import cmd_demo
from .info import _version, cmd_info
from .perf import _sizes, cmd_perf
from .top import cmd_top

__all__ = ["main", "build_parser"]


# -- entry point ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiordma",
        description="Async RDMA queue pairs with automatic TCP fallback: host information and a loopback demo.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version('aiordma') or 'unknown'}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    info = sub.add_parser(
        "info",
        help="what this host has, and which transport 'auto' would use",
        description=(
            "Print the versions, the native verbs module, the RDMA devices (ports, states, GIDs from sysfs), "
            "$AIORDMA_TRANSPORT and the transport that transport='auto' would use here, with the reason."
        ),
    )
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    info.add_argument("--measure-rendezvous", action="store_true",
                      help="first measure, on each RDMA device (or --device), from which message size the "
                           "rendezvous beats the SEND slots, and keep it for this user's connections")  # fmt: skip
    info.add_argument("--device", default=None, help="with --measure-rendezvous: only this device")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser(
        "demo",
        help="echo bytes and messages over the best transport here and measure",
        description=(
            "Start a byte-stream listener and a channel listener in this process (on an address an RDMA device "
            "serves when there is one, else 127.0.0.1), connect to each, check that bytes and messages come back "
            "intact, and print the transport, the fallback reason, latency, throughput and message rate."
        ),
    )
    demo.add_argument("--host", default=None, help="address to listen and connect on (default: see above)")
    demo.add_argument(
        "--transport",
        choices=("auto", "tcp", "rdma"),
        default=None,
        help="transport policy (default: $AIORDMA_TRANSPORT, else auto)",
    )
    demo.add_argument(
        "--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio", help="event loop (default: asyncio)"
    )
    demo.add_argument(
        "--bytes",
        type=parse_size,
        default=64 * MiB,
        metavar="N",
        help="bytes for the throughput run, e.g. 64M (default 64M)",
    )
    demo.add_argument(
        "--messages", type=parse_positive, default=20_000, metavar="N", help="64 B messages for the rate (default 20000)"
    )
    demo.add_argument(
        "--round-trips", type=parse_positive, default=2000, metavar="N", help="64 B round trips for latency (default 2000)"
    )
    demo.add_argument("--timeout", type=float, default=120.0, metavar="S", help="give up after S seconds (default 120)")
    demo.set_defaults(func=cmd_demo)

    perf = sub.add_parser(
        "perf",
        help="latency and bandwidth over message sizes, per transport and poll mode",
        description=(
            "Like ib_send_lat / ib_write_bw: 'aiordma perf server' listens (three ports, one per RDMA poll mode); "
            "'aiordma perf client HOST' measures round-trip latency (p50/p99/p99.9) and bandwidth for each size, "
            "over RDMA in each poll mode and over TCP, and prints a table with ratios to TCP.  --local runs both "
            "in this process.  --plot FILE.png draws latency and bandwidth against size; --json prints the data."
        ),
    )
    perf_sub = perf.add_subparsers(dest="role", metavar="ROLE")
    perf_sub.required = True
    server = perf_sub.add_parser("server", help="serve perf clients")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    server.add_argument("--port", type=int, default=18515, help="first of three ports (default 18515)")
    server.add_argument("--max-connections", type=parse_positive, default=None, metavar="N",
                        help="stop after serving N connections (default: run until interrupted)")  # fmt: skip
    client = perf_sub.add_parser("client", help="measure against a perf server (or --local)")
    client.add_argument("host", nargs="?", default=None, help="the server's address")
    client.add_argument("--local", action="store_true", help="run the server in this process too")
    client.add_argument("--port", type=int, default=18515, help="the server's first port (default 18515)")
    client.add_argument("--transports", default="rdma,tcp", help="comma-separated: rdma,tcp (default both)")
    client.add_argument("--poll", default=",".join(("event", "adaptive", "busy")),
                        help="RDMA poll modes, comma-separated (default event,adaptive,busy)")  # fmt: skip
    client.add_argument("--sizes", type=_sizes, default=[64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20,
                                                          4 << 20, 16 << 20],
                        help="message sizes, comma-separated (default 64,1K,16K,64K,256K,1M,4M,16M)")  # fmt: skip
    client.add_argument("--ops", default="send",
                        help="comma-separated: send (messages), read, write (one-sided, against memory the "
                             "server exposes; registered buffers on both sides) (default send)")  # fmt: skip
    client.add_argument("--iterations", type=parse_positive, default=1000, help="round trips per size (default 1000)")
    client.add_argument("--lat-bytes", type=parse_size, default=64 * MiB, metavar="N",
                        help="cap the round trips of a size at N bytes' worth (default 64M)")  # fmt: skip
    client.add_argument("--bw-bytes", type=parse_size, default=64 * MiB, metavar="N",
                        help="bytes sent per size for bandwidth (default 64M)")  # fmt: skip
    client.add_argument("--bw-messages", type=parse_positive, default=20_000, metavar="N",
                        help="... and at most N messages (default 20000)")  # fmt: skip
    client.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per run (default 300 s)")
    client.add_argument("--plot", metavar="FILE.png", default=None, help="write a plot (needs matplotlib)")
    client.add_argument("--json", action="store_true", help="print JSON instead of the table")
    client.add_argument("--no-progress", action="store_true", help="no progress bar")
    for p in (server, client):
        p.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio",
                       help="event loop (default asyncio)")  # fmt: skip
        p.set_defaults(func=cmd_perf)

    top = sub.add_parser(
        "top",
        help="a live table of a process's aiordma connections",
        description=(
            "Read the counters of a process that serves them (aiordma.serve_stats(): a unix socket in this "
            "user's stats directory) and redraw them every --interval seconds: totals and rates, devices, "
            "and one row per connection, busiest first."
        ),
    )
    top.add_argument("target", nargs="?", default=None,
                     help="a PID or a socket path (default: the only process that serves its stats)")  # fmt: skip
    top.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between snapshots (default 1)")
    top.add_argument("--rows", type=parse_positive, default=40, metavar="N", help="connections shown (default 40)")
    top.add_argument("--once", action="store_true", help="print one table (rates over --interval) and exit")
    top.set_defaults(func=cmd_top)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED
