"""Python-level calls per 64 B round trip: the RDMA link over the simulated wire vs the TCP link.

A noise-free figure (it does not depend on the machine or the boot): cProfile
counts every call of a Python function (a coroutine resumption counts as a
call) during N round trips of a 64-byte message on a channel, both ends in
one event loop, and the script prints the count per round trip.  The
simulated wire's own frames (``aiordma/testing/_sim*.py``), and the calls
they make, are left out, and so is this script's own coroutine (the application):
on a real device those are C (the verbs), like the kernel's socket code on
TCP.  Builtin and C-method calls are printed apart.

    .venv/bin/python benchmarks/call_count.py [--loop asyncio|uvloop|trio] [--n 2000] [--top 15]

Targets: issue 7, RDMA <= 60 for both ends together and never more than the TCP link; issue 8,
<= 40 with inline sends.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
from collections import Counter
from typing import Any

import anyio

from aiordma.testing import channel_pair

#: the simulated wire's modules (aiordma/testing/_sim*.py): the device, in C on real hardware
SIM_PREFIX = "/aiordma/testing/_sim"
SELF_FILE = "call_count.py"


async def _round_trips(kind: str, n: int, profile: cProfile.Profile) -> None:
    async with channel_pair(kind) as (a, b):  # type: ignore[arg-type]
        msg = b"x" * 64
        for _ in range(200):  # warm up: caches, first allocations
            await a.send(msg)
            await b.receive()
            await b.send(msg)
            await a.receive()
        profile.enable()
        for _ in range(n):
            await a.send(msg)
            await b.receive()
            await b.send(msg)
            await a.receive()
        profile.disable()


def count(kind: str, loop: str, n: int) -> tuple[float, float, Counter[str]]:
    profile = cProfile.Profile()
    backend: Any = ("asyncio", {}) if loop != "trio" else ("trio", {})
    options: dict[str, Any] = {}
    if loop == "uvloop":
        import uvloop

        options["loop_factory"] = uvloop.new_event_loop
    anyio.run(_round_trips, kind, n, profile, backend=backend[0], backend_options=options)
    stats = pstats.Stats(profile)
    python = builtin = 0
    where: Counter[str] = Counter()
    table = stats.stats  # type: ignore[attr-defined]
    # calls made by the simulated wire (enum lookups, ipaddress, ...) are its cost, not ours -- and
    # so are the calls those make: a function counts as the wire's when every call of it came
    # from the wire or from another function of the wire's (a fixed point over the caller graph)
    wire = {key for key in table if SIM_PREFIX in key[0]}
    changed = True
    while changed:
        changed = False
        for key, (_p, _t, _tt, _ct, callers) in table.items():
            if key not in wire and callers and all(caller in wire for caller in callers):
                wire.add(key)
                changed = True
    for (filename, _line, name), (_primitive, _total, _tt, _ct, callers) in table.items():
        if (filename, _line, name) in wire or filename.endswith(SELF_FILE):
            continue  # (this script's own coroutine is the application, not aiordma)
        primitive = sum(c[1] for caller, c in callers.items() if caller not in wire)
        if filename == "~":
            builtin += primitive
            continue
        python += primitive
        where[f"{filename.rsplit('/', 1)[-1]}:{name}"] += primitive
    return python / n, builtin / n, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop", "trio"])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--top", type=int, default=0, help="also list the N most called functions")
    args = parser.parse_args()
    results = {}
    for kind, label in (("tcp", "TCP link"), ("sim", "RDMA link (simulated wire)")):
        py, bi, where = count(kind, args.loop, args.n)
        results[kind] = py
        print(f"{label:28} {py:6.1f} Python-level calls per round trip, {bi:6.1f} builtin/C calls  ({args.loop})")
        if args.top:
            for name, calls in where.most_common(args.top):
                print(f"    {calls / args.n:6.2f}  {name}")
    print(f"RDMA / TCP: {results['sim'] / results['tcp']:.2f}  (targets: RDMA <= 40 with inline sends, and <= TCP)")


if __name__ == "__main__":
    main()
