"""Where an RDMA connect's time goes: a timeline of its steps at both ends, two processes.

Each end stamps its set-up steps (``RdmaBackend.before_step``: device, open, resources, init,
memory, post, params, rtr, rts, probe) and the handshake's own (the transport probe, the HELLOs,
the SELECT) with CLOCK_MONOTONIC, which both processes share; the client merges them and prints,
per step, the median time since the step before and since the connect began.  The handshake's
stamps wrap private functions of ``aiordma._handshake.negotiate``: this is a measuring tool, not
an API user.  Run it in the Soft-RoCE guest (``python -m tools.vm -- python
benchmarks/connect_steps.py``):

    T=rdma|tcp  N=connects  HOLD=1 (keep one connection open: the device stays open)

Figures: docs/benchmarks.md, "Connect".
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import anyio

import aiordma
from aiordma._handshake import negotiate
from aiordma._rdma import link as rdma_link
from aiordma._rdma.config import RdmaBackend
from aiordma._rdma.discovery import rdma_address

EVENTS: list[tuple[float, str]] = []


def mark(what: str) -> None:
    EVENTS.append((time.monotonic(), what))


def _stamp() -> None:
    """Wrap the steps to stamp (this process only)."""

    def before_step(self: RdmaBackend, step: str) -> None:
        mark(step)

    RdmaBackend.before_step = before_step  # type: ignore[method-assign]
    probe, activate = rdma_link.RdmaLink.probe, rdma_link.RdmaLink.activate

    async def probed(self: Any) -> None:
        await probe(self)
        mark("probe done")

    def activated(self: Any, core: Any, control: Any) -> None:
        mark("activate")
        activate(self, core, control)

    rdma_link.RdmaLink.probe = probed  # type: ignore[method-assign]
    rdma_link.RdmaLink.activate = activated  # type: ignore[method-assign]
    open_endpoint, next_control, local_offer = negotiate._open_endpoint, negotiate._next_control, negotiate.local_offer

    def opened(*args: Any) -> Any:
        mark("endpoint")
        try:
            return open_endpoint(*args)
        finally:
            mark("endpoint open")

    async def got(core: Any, kind: Any) -> Any:
        event = await next_control(core, kind)
        mark("got " + kind.__name__)
        return event

    def offered(*args: Any, **kwargs: Any) -> Any:
        mark("transport probe")
        try:
            return local_offer(*args, **kwargs)
        finally:
            mark("transport probe done")

    negotiate._open_endpoint = opened  # type: ignore[assignment]
    negotiate._next_control = got
    negotiate.local_offer = offered


HOST = os.environ.get("HOST") or rdma_address() or "127.0.0.1"
TRANSPORT = os.environ.get("T", "rdma")
CONNECTS = int(os.environ.get("N", "14"))


async def echo(channel: Any) -> None:
    async with channel:
        try:
            while True:
                await channel.send(await channel.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


async def serve() -> None:
    async with await aiordma.create_channel_listener(HOST, 0, transport=TRANSPORT) as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, echo)
            print(listener.port, flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)
            tg.cancel_scope.cancel()
    print(json.dumps(EVENTS), flush=True)


async def client() -> None:
    async with await anyio.open_process([sys.executable, __file__, "--serve"], stderr=None) as server:
        assert server.stdout is not None and server.stdin is not None
        head = b""
        while b"\n" not in head:
            head += await server.stdout.receive()
        port = int(head.split()[0])
        held = None
        if os.environ.get("HOLD"):
            held = await aiordma.connect_channel(HOST, port, transport=TRANSPORT)
            await held.send(b"x")
            await held.receive()
        for _ in range(CONNECTS):
            mark("connect")
            async with await aiordma.connect_channel(HOST, port, transport=TRANSPORT) as other:
                mark("connected")
                await other.send(b"x")
                await other.receive()
                mark("round trip")
            mark("closed")
            await anyio.sleep(0.05)
        if held is not None:
            await held.aclose()
        await server.stdin.aclose()
        out = b""
        async for chunk in server.stdout:
            out += chunk
    theirs = json.loads(out.decode().strip().splitlines()[-1])
    merged = sorted([(t, "C " + w) for t, w in EVENTS] + [(t, "S " + w) for t, w in theirs])
    runs: list[list[tuple[float, str]]] = []
    for t, what in merged:
        if what == "C connect":
            runs.append([])
        if runs:
            runs[-1].append((t, what))
    steps: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)
    for run in runs[2:]:  # (the first two warm up)
        start = previous = run[0][0]
        for k, (t, what) in enumerate(run):
            steps[(k, what)].append(((t - previous) * 1e3, (t - start) * 1e3))
            previous = t
    print(f"{TRANSPORT}, {CONNECTS} connects{', one connection held' if held is not None else ''}:")
    for (k, what), times in sorted(steps.items()):
        since = statistics.median(d for d, _ in times)
        at = statistics.median(a for _, a in times)
        print(f"{k:2d} {what:26s} +{since:7.2f} ms  at {at:7.2f} ms  (n={len(times)})")


if __name__ == "__main__":
    _stamp()
    anyio.run(serve if "--serve" in sys.argv else client)
