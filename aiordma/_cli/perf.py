"""``aiordma perf``: the benchmark's client and server (aiordma._perf) on the command line."""

from __future__ import annotations

import argparse
import platform
import sys

import anyio

from .common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, loop_of, parse_size
from .demo import demo_host
from .info import _version

__all__ = ["cmd_perf"]

# -- perf ------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def cmd_perf(args: argparse.Namespace) -> int:
    from .. import _perf

    prog = f"aiordma perf {args.role}"
    loop = loop_of(args.backend, prog)
    if loop is None:
        return EXIT_USAGE
    if args.role == "server":

        def ready(ports: list[int]) -> None:
            print(f"aiordma perf server: listening on {args.host} ports {ports[0]}-{ports[-1]} "
                  f"(poll modes {', '.join(_perf.POLL_MODES)})", flush=True)  # fmt: skip

        try:
            anyio.run(lambda: _perf.serve(args.host, args.port, max_connections=args.max_connections,
                                          on_ready=ready), backend=loop[0], backend_options=loop[1])  # fmt: skip
        except KeyboardInterrupt:
            return EXIT_OK
        return EXIT_OK
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    polls = [m.strip() for m in args.poll.split(",") if m.strip()]
    for t in transports:
        if t not in ("rdma", "tcp"):
            print(f"{prog}: error: unknown transport {t!r} (rdma, tcp)", file=sys.stderr)
            return EXIT_USAGE
    for m in polls:
        if m not in _perf.POLL_MODES:
            print(f"{prog}: error: unknown poll mode {m!r} ({', '.join(_perf.POLL_MODES)})", file=sys.stderr)
            return EXIT_USAGE
    if not args.local and not args.host:
        print(f"{prog}: error: give the server's HOST, or --local", file=sys.stderr)
        return EXIT_USAGE
    host = args.host or demo_host()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in ("send", "read", "write"):
            print(f"{prog}: error: unknown operation {o!r} (send, read, write)", file=sys.stderr)
            return EXIT_USAGE
    total = len(ops) * len(args.sizes) * 2 * sum(len(polls) if t == "rdma" else 1 for t in transports)
    bar = _perf.Progress(total, enabled=not args.no_progress)

    async def client(ports: list[int]) -> list[_perf.PerfLine]:
        return await _perf.run_client(
            host, ports, transports=transports, polls=polls, sizes=args.sizes, iterations=args.iterations,
            bw_bytes=args.bw_bytes, latency_bytes=args.lat_bytes, bw_messages=args.bw_messages, timeout=args.timeout,
            progress=bar.update, ops=ops,
        )  # fmt: skip

    async def local() -> list[_perf.PerfLine]:
        ports: list[int] = []
        ready = anyio.Event()

        def on_ready(p: list[int]) -> None:
            ports.extend(p)
            ready.set()

        lines: list[_perf.PerfLine] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _perf.serve(host, 0, on_ready=on_ready))
            await ready.wait()
            try:
                lines = await client(ports)
            finally:
                tg.cancel_scope.cancel()
        return lines

    async def remote() -> list[_perf.PerfLine]:
        return await client([args.port + i for i in range(len(_perf.POLL_MODES))])

    try:
        lines = anyio.run(local if args.local else remote, backend=loop[0], backend_options=loop[1])
    finally:
        bar.close()
    meta = {
        "host": host, "local": bool(args.local), "backend": args.backend, "sizes": args.sizes,
        "iterations": args.iterations, "bw_bytes": args.bw_bytes, "python": platform.python_version(),
        "aiordma": _version("aiordma"),
    }  # fmt: skip
    if args.json:
        print(_perf.to_json(lines, meta))
    else:
        where = "client and server in this process" if args.local else f"server {host}:{args.port}"
        print(f"aiordma perf ({where}, {args.backend})")
        print(_perf.format_table(lines))
    if args.plot:
        try:
            _perf.write_plot(lines, args.plot, title=f"aiordma perf ({'local' if args.local else host}, {args.backend})")
        except RuntimeError as exc:
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        print(f"plot written to {args.plot}", file=sys.stderr)
    failed = [line for line in lines if line.note]
    for line in failed:
        print(f"{prog}: {line.label}: {line.note}", file=sys.stderr)
    return EXIT_FAILED if failed and len(failed) == len(lines) else EXIT_OK


