"""Counters (issue 23, item 4): ``aiordma.stats()`` and ``extra(TransportAttribute.stats)``.

The counts are checked against what the test itself sent, with the peer in another process
(a client process on the same kind of loop talks to a listener in this one: each side counts
on its own, and the two must agree with each other and with the traffic), and on the simulated
RDMA wire for what only RDMA counts (pinned ring bytes, credit stalls, one-sided operations,
rendezvous).  Counting must cost nothing per message: no function of the stats module runs
during round trips (cProfile), and ``benchmarks/call_count.py`` shows the same Python calls
per round trip as before it (91 TCP, 94 RDMA, asyncio).
"""

from __future__ import annotations

import cProfile
import json
import subprocess
import sys
import textwrap
from typing import Any

import anyio
import pytest

import aiordma
from aiordma._conn import stats as stats_module
from aiordma.testing import channel_pair, simulated_backend, stream_pair

SEED = 2312
N = 40

CLIENT = textwrap.dedent(
    """
    import json, random, sys
    import anyio
    import aiordma

    async def main(port, n, seed):
        rnd = random.Random(seed)
        sizes = [rnd.choice([0, 1, 64, 4096, 70000, 300000]) for _ in range(n)]
        ch = await aiordma.connect_channel("127.0.0.1", port, transport="tcp")
        st = await aiordma.connect("127.0.0.1", port + 1, transport="tcp")
        for size in sizes:
            data = bytes([size % 251]) * size
            await ch.send(data)
            assert await ch.receive() == data
        await st.send(b"s" * 123457)
        got = 0
        while got < 123457:
            got += len(await st.receive())
        mine = {"channel": ch.extra(aiordma.TransportAttribute.stats).__dict__,
                "stream": st.extra(aiordma.TransportAttribute.stats).__dict__}
        await ch.aclose()
        await st.aclose()
        after = aiordma.stats()
        print(json.dumps({"sizes": sizes, "mine": mine, "totals": after.totals, "open": after.open,
                          "opened": after.opened, "fallbacks": after.fallbacks}), flush=True)

    backend, uvloop, port, n, seed = sys.argv[1:]
    anyio.run(main, int(port), int(n), int(seed), backend=backend,
              backend_options={"use_uvloop": True} if uvloop == "1" else {})
    """
)


async def _listener_pair() -> tuple[Any, Any]:
    """A channel listener and a stream listener on consecutive ports."""
    for _ in range(50):
        channels = await aiordma.create_channel_listener("127.0.0.1", 0, transport="tcp")
        try:
            streams = await aiordma.create_listener("127.0.0.1", channels.port + 1, transport="tcp")
        except OSError:
            await channels.aclose()
            continue
        return channels, streams
    raise RuntimeError("no two consecutive free ports")


async def test_both_ends_count_the_same_traffic_in_two_processes(anyio_backend: Any) -> None:
    stats_module.reset()
    channels, streams = await _listener_pair()
    served: dict[str, Any] = {}
    done = anyio.Event()

    async def echo_messages(ch: Any) -> None:
        async with ch:
            try:
                while True:
                    await ch.send(await ch.receive())
            except anyio.EndOfStream:
                pass
            served["channel"] = ch.extra(aiordma.TransportAttribute.stats)
        if "stream" in served:
            done.set()

    async def echo_bytes(st: Any) -> None:
        async with st:
            try:
                while True:
                    await st.send(await st.receive())
            except anyio.EndOfStream:
                pass
            served["stream"] = st.extra(aiordma.TransportAttribute.stats)
        if "channel" in served:
            done.set()

    backend, uvloop = anyio_backend[0], "1" if anyio_backend[0] == "asyncio" and anyio_backend[1] else "0"
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, backend, uvloop, str(channels.port), str(N), str(SEED)],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    out = proc.stdout
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(channels.serve, echo_messages)
                tg.start_soon(streams.serve, echo_bytes)
                line = str(await anyio.to_thread.run_sync(out.readline))
                await done.wait()
                tg.cancel_scope.cancel()
    finally:
        await channels.aclose()
        await streams.aclose()
        proc.kill()
        proc.wait()
    report = json.loads(line)
    sizes: list[int] = report["sizes"]
    total = sum(sizes)
    client_ch, client_st = report["mine"]["channel"], report["mine"]["stream"]
    server_ch, server_st = served["channel"], served["stream"]
    # each side counts what it sent and what arrived, payload bytes only
    assert (client_ch["messages_sent"], client_ch["bytes_sent"]) == (N, total)
    assert (client_ch["messages_received"], client_ch["bytes_received"]) == (N, total)
    assert (server_ch.messages_received, server_ch.bytes_received) == (N, total)
    assert (server_ch.messages_sent, server_ch.bytes_sent) == (N, total)
    assert client_st["bytes_sent"] == client_st["bytes_received"] == 123457
    assert (server_st.bytes_received, server_st.bytes_sent) == (123457, 123457)
    assert server_st.messages_sent == server_st.messages_received == 0  # (a byte stream has none)
    assert (client_ch["transport"], client_ch["mode"], client_ch["role"]) == ("tcp", "messages", "client")
    assert (server_st.transport, server_st.mode, server_st.role) == ("tcp", "stream", "server")
    assert server_ch.peer.startswith("127.0.0.1:")
    assert client_ch["unread_bytes"] == 0 and client_ch["pinned_bytes"] == 0
    # the process's view: both connections closed, so their counts are in the totals
    assert report["open"] == {}
    assert report["opened"] == {"tcp": 2}
    assert report["fallbacks"] == {"client: transport='tcp' was requested": 2}
    assert report["totals"]["bytes_sent"] == report["totals"]["bytes_received"] == total + 123457
    assert report["totals"]["messages_sent"] == report["totals"]["messages_received"] == N
    ours = aiordma.stats()
    assert ours.open == {} and ours.opened == {"tcp": 2}
    assert ours.totals["bytes_received"] == ours.totals["bytes_sent"] == total + 123457
    assert ours.totals["messages_received"] == N


@pytest.mark.parametrize("kind", ["sim", pytest.param("rdma", marks=pytest.mark.rdma)])
async def test_rdma_counts_pinned_rings_stalls_and_one_sided_operations(anyio_backend: Any, kind: str) -> None:
    stats_module.reset()
    config = aiordma.RdmaConfig(rendezvous=256 << 10)
    backend = simulated_backend(config) if kind == "sim" else aiordma.RdmaBackend(config)
    async with channel_pair(kind, rdma_backend=backend) as (a, b):  # type: ignore[arg-type]
        assert a.extra(aiordma.TransportAttribute.transport) == "rdma"
        during = aiordma.stats(connections=True)
        assert during.open == {"rdma": 2} and len(during.connections) == 2
        mine = a.extra(aiordma.TransportAttribute.stats)
        assert mine.pinned_bytes > 0 and mine.device and mine.qp_num
        device = during.devices[mine.device]
        assert device["connections"] >= 2
        if kind == "rdma":  # (a real device: its RNR and retry counters, from sysfs)
            assert any("rnr" in name for name in device), device
        # a sender ahead of a reader that is not reading waits for its credits
        big = b"m" * (3 << 20)
        small = [b"s" * 60000] * 64

        async def send_all() -> None:
            for piece in small:
                await a.send(piece)
            await a.send(big)

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_all)
            await anyio.sleep(0.2)  # (the reader is late: the sender stalls on credits)
            for piece in small:
                assert await b.receive() == piece
            assert await b.receive() == big
        sender = a.extra(aiordma.TransportAttribute.stats)
        receiver = b.extra(aiordma.TransportAttribute.stats)
        assert sender.credit_stalls >= 1
        assert (sender.messages_sent, receiver.messages_received) == (65, 65)
        assert sender.bytes_sent == receiver.bytes_received == len(big) + 64 * 60000
        assert sender.rendezvous_sent == receiver.rendezvous_received == 1  # (the 3 MiB one)
        assert receiver.reads >= 1 and receiver.read_bytes >= len(big)  # (its rendezvous READ)
        # one-sided operations, by the peer's NIC into this side's exposed buffer
        target = bytearray(100000)
        got = bytearray(5000)
        async with a.expose(target, read=True, write=True) as remote:
            await a.send(remote.to_bytes())
            desc = aiordma.RemoteBuffer.from_bytes(await b.receive())
            n = await b.read(desc, got, offset=1000)
            await b.write(desc, b"hello", offset=10)
        after = b.extra(aiordma.TransportAttribute.stats)
        assert n == 5000
        assert after.reads == receiver.reads + 1 and after.read_bytes == receiver.read_bytes + 5000
        assert after.writes == 1 and after.written_bytes == 5
    totals = aiordma.stats().totals
    assert totals["reads"] >= 2 and totals["writes"] == 1 and totals["credit_stalls"] >= 1
    assert totals["rendezvous_sent"] == totals["rendezvous_received"] == 1
    assert aiordma.stats().open == {}


async def test_counting_runs_no_function_per_message(anyio_backend: Any) -> None:
    """Counters are additions on objects the hot path holds: no call of the stats module per
    message (``benchmarks/call_count.py`` gives the calls per round trip: unchanged)."""
    async with stream_pair("tcp") as (a, b):
        profile = cProfile.Profile()
        profile.enable()
        try:
            for _ in range(50):
                await a.send(b"x" * 64)
                await b.receive()
                await b.send(b"y" * 64)
                await a.receive()
        finally:
            profile.disable()
        called = [key for key in profile.getstats() if str(getattr(key.code, "co_filename", "")).endswith(stats_module.__file__)]
        assert not called, called
        assert a.extra(aiordma.TransportAttribute.stats).bytes_sent == 50 * 64


@pytest.mark.parametrize("n", [1, 7])
def test_fallback_reasons_are_bounded(n: int) -> None:
    stats_module.reset()

    class FakeCore:
        transport = "tcp"
        counts = stats_module.Counts()

    for i in range(stats_module.MAX_REASONS + n):
        core: Any = FakeCore()
        core.fallback_reason = f"client: reason {i}"
        stats_module.opened(core)
        stats_module._registry.live.discard(core)
    fallbacks = aiordma.stats().fallbacks
    assert len(fallbacks) == stats_module.MAX_REASONS + 1
    assert fallbacks[stats_module.OTHER] == n
    stats_module.reset()



def test_prometheus_text_carries_the_totals() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    async def traffic() -> None:
        async with channel_pair("tcp") as (a, b):
            for size in (10, 2000, 70000):
                await a.send(b"p" * size)
                await b.receive()

    stats_module.reset()
    anyio.run(traffic)
    text = aiordma.metrics.prometheus_text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip
    assert samples[("aiordma_sent_bytes_total", ())] == 72010
    assert samples[("aiordma_received_bytes_total", ())] == 72010
    assert samples[("aiordma_sent_messages_total", ())] == 3
    assert samples[("aiordma_connections_opened_total", (("transport", "tcp"),))] == 2
    assert samples[("aiordma_connections_open", (("transport", "tcp"),))] == 0
    reason = "client: transport='tcp' was requested"
    assert samples[("aiordma_fallbacks_total", (("reason", reason),))] == 2
    assert ("aiordma_pinned_bytes", ()) in samples


SERVED = textwrap.dedent(
    """
    import sys, time
    import anyio
    import aiordma
    from aiordma.testing import channel_pair

    async def main(path):
        with aiordma.serve_stats(path):
            async with channel_pair("tcp") as (a, b):
                for _ in range(20):
                    await a.send(b"q" * 5000)
                    await b.receive()
                print("READY", flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)
                time.sleep(4)  # (the event loop is blocked: the endpoint still answers)
                print("UNBLOCKED", flush=True)
                await anyio.to_thread.run_sync(sys.stdin.readline)

    anyio.run(main, sys.argv[1])
    """
)


def test_top_reads_another_process_and_the_endpoint_survives_rude_clients(tmp_path: Any) -> None:
    import os
    import socket
    import stat
    import time

    path = str(tmp_path / "stats.sock")
    proc = subprocess.Popen([sys.executable, "-c", SERVED, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "READY"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # rude clients: one that leaves at once, one that sends junk, one that says nothing
        with socket.socket(socket.AF_UNIX) as rude:
            rude.connect(path)
        with socket.socket(socket.AF_UNIX) as junk:
            junk.connect(path)
            junk.sendall(os.urandom(64))
            junk.settimeout(5)
            assert junk.recv(1)  # (junk is not a known request: it gets the JSON snapshot)
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(path)
        snap = aiordma.metrics.read_stats(path)
        silent.close()
        assert snap["open"] == {"tcp": 2} and len(snap["connections"]) == 2
        assert snap["totals"]["bytes_sent"] == 20 * 5000 and snap["totals"]["messages_received"] == 20
        assert {c["role"] for c in snap["connections"]} == {"client", "server"}
        # the loop blocked: the endpoint's thread still answers
        proc.stdin.write("block\n")
        proc.stdin.flush()
        time.sleep(0.3)
        started = time.monotonic()
        blocked = aiordma.metrics.read_stats(path)
        assert time.monotonic() - started < 3.0  # (the loop is blocked for 4 s)
        assert blocked["totals"] == snap["totals"]
        assert proc.stdout.readline().strip() == "UNBLOCKED"
        top = subprocess.run([sys.executable, "-m", "aiordma", "top", path, "--once", "--interval", "0.2"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert top.returncode == 0, top.stderr
        lines = top.stdout.splitlines()
        assert "open: 2 tcp" in lines[0]
        assert sum(1 for line in lines if line.startswith("127.0.0.1:")) == 2
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(path)  # (the endpoint's close removed its socket)
    finally:
        proc.kill()
        proc.wait()
    gone = subprocess.run([sys.executable, "-m", "aiordma", "top", path, "--once"], capture_output=True, text=True, timeout=60)
    assert gone.returncode != 0 and "aiordma top:" in gone.stderr


async def test_broken_connections_are_counted_by_cause(anyio_backend: Any) -> None:
    stats_module.reset()
    backend = simulated_backend()
    async with channel_pair("sim", rdma_backend=backend) as (a, b):
        await a.send(b"x")
        assert await b.receive() == b"x"
        backend.fabric.not_ready(b.extra(aiordma.TransportAttribute.qp_num))  # (no receive posted: RNR)
        with anyio.fail_after(10), pytest.raises(anyio.BrokenResourceError):
            await a.send(b"y")
            await a.receive()
    failures = aiordma.stats().failures
    assert failures.get("RDMAError: IBV_WC_RNR_RETRY_EXC_ERR", 0) == 1, failures
    assert 'aiordma_connection_failures_total{cause="RDMAError: IBV_WC_RNR_RETRY_EXC_ERR"} 1.0' in aiordma.metrics.prometheus_text()
