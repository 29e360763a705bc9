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


async def test_rdma_counts_pinned_rings_stalls_and_one_sided_operations(anyio_backend: Any) -> None:
    stats_module.reset()
    backend = simulated_backend(aiordma.RdmaConfig(rendezvous=256 << 10))
    async with channel_pair("sim", rdma_backend=backend) as (a, b):
        assert a.extra(aiordma.TransportAttribute.transport) == "rdma"
        during = aiordma.stats(connections=True)
        assert during.open == {"rdma": 2} and len(during.connections) == 2
        mine = a.extra(aiordma.TransportAttribute.stats)
        assert mine.pinned_bytes > 0 and mine.device and mine.qp_num
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

