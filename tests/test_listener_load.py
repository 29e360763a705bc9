"""A listener under load from other processes: bursts wait their turn, and slow is not hostile.

The listener runs in a process of its own, the clients in others (``tests/_listener_proc.py``):
a loop that runs both cannot accept faster than its clients speak, which hides exactly what
fails here.

* 1000 clients from 4 processes connect at the same moment to a default channel listener
  (asyncio, uvloop and trio on both sides; plain and TLS): every one is served, none refused;
  the same with ``aiordma.asyncio``'s streams at both ends (plain: they pass through, unframed).
  The connect-to-first-echo times are printed (p50/p99; docs/benchmarks.md has the figures).
* 300 sockets that never speak and 300 that start and stall (a few bytes of the magic, or a
  whole HELLO and then nothing), from another process and reopened as they are dropped: a
  client in a third process connects and echoes within 1 s, every 0.25 s, on each loop.
* A client whose loop stalls 5 s right after its TCP connect (before its HELLO) and one that
  stalls 5 s after it (before its SELECT) still connect.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import anyio
import pytest

import aiordma

from ._listener_proc import Proc

LOOPS = ["asyncio", "uvloop", "trio"]


def _serve(loop: str, tdir: str, api: str = "channel") -> tuple[Proc, int]:
    server = Proc("serve", loop, api, tdir)
    first = server.line()
    assert first.startswith("PORT "), first
    return server, int(first.split()[1])


def _drops(log: str) -> list[str]:
    return [line for line in log.splitlines() if "aiordma: dropped" in line]


@pytest.mark.slow
@pytest.mark.alone  # (its 5 s stall deadline is the listener's, not the CI host's parallel workers')
@pytest.mark.parametrize(
    "loop, tls, api",
    [(loop, tls, "channel") for loop in LOOPS for tls in (False, True)]
    # aiordma.asyncio's streams at both ends: plain, they pass through (each client checks it)
    + [(loop, tls, "asyncio-streams") for loop in ("asyncio", "uvloop") for tls in (False, True)],
    ids=lambda v: v if isinstance(v, str) else ("tls" if v else "plain"),
)
def test_a_burst_from_four_processes_is_served_whole(loop: str, tls: bool, api: str, tlsdir: str) -> None:
    tdir = tlsdir if tls else "-"
    server, port = _serve(loop, tdir, api)
    clients: list[Proc] = []
    try:
        clients = [Proc("burst", loop, api, str(port), tdir, "250") for _ in range(4)]
        for c in clients:
            assert c.line(60) == "READY"
        for c in clients:
            c.say("go")
        reports = [json.loads(c.line(120)) for c in clients]
    finally:
        for c in clients:
            c.stop()
        log = server.stop()
    failed = sum(r["failed"] for r in reports)
    times = sorted(t for r in reports for t in r["times"])
    assert failed == 0, f"{failed} of 1000 failed: {[r['errors'] for r in reports if r['errors']]}; {_drops(log)[:5]}"
    assert len(times) == 1000
    p50, p99 = statistics.median(times), times[int(len(times) * 0.99) - 1]
    print(f"\nburst {loop} {api} {'tls' if tls else 'plain'}: 1000 clients from 4 processes, connect to first echo "
          f"p50 {p50:.3f} s, p99 {p99:.3f} s, max {times[-1]:.3f} s")  # fmt: skip
    assert not _drops(log), _drops(log)[:5]


@pytest.mark.slow
@pytest.mark.parametrize("loop", LOOPS)
def test_silent_and_stalling_sockets_never_keep_a_client_out(loop: str) -> None:
    server, port = _serve(loop, "-")
    flood = prober = None
    try:
        flood = Proc("flood", "-", "channel", str(port), "300", "300")
        assert flood.line() == "READY"
        time.sleep(1.0)  # (the 600 are in: the listener holds them)
        prober = Proc("probe", loop, "channel", str(port), "-")
        assert prober.line() == "READY"
        time.sleep(float(os.environ.get("AIORDMA_FLOOD_SECONDS", "12")))
        report = prober.ask("stop")
        flooded = flood.ask("stop")
        stats = server.ask("stats")
    finally:
        for proc in (prober, flood):
            if proc is not None:
                proc.stop()
        log = server.stop()
    print(f"\nflood {loop}: {report['probes']} probes, worst {report['worst']:.3f} s; the listener dropped "
          f"{flooded['reopened']} flooding sockets")  # fmt: skip
    assert not report["errors"], report
    assert report["probes"] >= 10, report
    assert report["worst"] < 1.0, report
    assert stats["serving"], stats
    # every drop has its reason in the log
    # (the last: the flood closing its sockets at the end)
    reasons = ("silent", "first frame", "stalled", "did not complete in time", "the peer closed", "ended during")
    unexplained = [line for line in _drops(log) if not any(r in line for r in reasons)]
    assert not unexplained, unexplained[:5]
    sys.stderr.write("\n".join(_drops(log)[:3]))


async def _stalled_client(port: int, where: str) -> None:
    """A real client whose loop blocks 5 s right after its TCP connect, or after its HELLO."""
    from aiordma._handshake import negotiate

    original = negotiate.client_handshake if where == "before-hello" else negotiate._next_control

    async def slow_handshake(*args: Any, **kw: Any) -> Any:
        time.sleep(5)  # (the whole loop: nothing of this process runs meanwhile)
        return await original(*args, **kw)

    name = "client_handshake" if where == "before-hello" else "_next_control"
    calls = {"n": 0}

    async def once(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            return await slow_handshake(*args, **kw)
        return await original(*args, **kw)

    setattr(negotiate, name, once)
    try:
        with anyio.fail_after(30):
            async with await aiordma.connect_channel("127.0.0.1", port, transport="tcp") as ch:
                await ch.send(b"slow")
                assert await ch.receive() == b"slow"
    finally:
        setattr(negotiate, name, original)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before-hello", "before-select"])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_whose_loop_stalls_5_s_still_connects(loop: str, where: str) -> None:
    server, port = _serve(loop, "-")
    try:
        anyio.run(_stalled_client, port, where)
    finally:
        log = server.stop()
    assert not _drops(log), _drops(log)
