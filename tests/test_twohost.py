"""Across two hosts: host b's end of the two-guest bed, against ``aiordma.testing.peer`` on host a.

Run by the two-host stage (``python -m aiordma.testing.vm --hosts 2 -- python -m
aiordma.testing.peer -- python -m pytest -m twohost tests/test_twohost.py``): real RoCEv2 packets
between two kernels' rxe devices over a qemu wire, with the path MTU at rxe's largest (4096).
Skipped without ``AIORDMA_PEER_ADDRESS`` (set only in that bed).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiordma
from aiordma.testing.peer import CHANNEL_PORT, MAX_MESSAGE, STREAM_PORT, pattern

PEER = os.environ.get("AIORDMA_PEER_ADDRESS", "")
#: "rdma" in the bed; the host's check of this suite (test_twohost_suite_runs_on_the_host) sets tcp
TRANSPORT = os.environ.get("AIORDMA_TWOHOST_TRANSPORT", "rdma")
ON_THE_BED = TRANSPORT == "rdma"

pytestmark = pytest.mark.twohost
needs_peer = pytest.mark.skipif(not PEER, reason="needs the two-host bed (AIORDMA_PEER_ADDRESS)")


def wait_for_port(port: int, seconds: float = 300) -> None:
    """Host a boots and starts its services on its own schedule: wait until ``port`` listens."""
    import socket
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((PEER, port), timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(autouse=True, scope="module")
def peer_up() -> None:
    if PEER:
        wait_for_port(CHANNEL_PORT)
        wait_for_port(STREAM_PORT)


@pytest.fixture
def anyio_backend() -> Any:
    return "asyncio"  # (every loop runs the same code on the simulated wire; the guests are slow)


async def channel() -> aiordma.Channel:
    ch = await aiordma.connect_channel(PEER, CHANNEL_PORT, transport=TRANSPORT, max_message_size=MAX_MESSAGE)
    assert ch.transport == TRANSPORT, ch.fallback_reason
    return ch


@needs_peer
@pytest.mark.skipif(not ON_THE_BED, reason="the bed's wire only")
def test_the_wire_runs_at_rxes_largest_path_mtu() -> None:
    info = subprocess.run(["ibv_devinfo", "-d", "rxe0"], capture_output=True, text=True, timeout=60).stdout
    active = [line.split(":", 1)[1].strip() for line in info.splitlines() if "active_mtu" in line]
    assert active and active[0].startswith("4096"), info  # (rxe's sysfs has no active_mtu file)


@needs_peer
@pytest.mark.anyio
async def test_messages_of_random_sizes_arrive_byte_exact() -> None:
    sizes = [0, 1, 100, 4095, 4096, 65535, 65536, 65537, 1 << 20, 3 << 20]

    @settings(max_examples=int(os.environ.get("AIORDMA_HYPOTHESIS_EXAMPLES", "8")), deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
    @given(st.lists(st.integers(0, 300_000), min_size=1, max_size=4))
    def random_sizes(extra: list[int]) -> None:
        sizes.extend(extra)

    random_sizes()
    async with await channel() as ch:
        for n in sizes:
            payload = os.urandom(n)
            await ch.send(b"ECHO " + payload)
            assert await ch.receive() == payload, n


@needs_peer
@pytest.mark.anyio
async def test_a_large_message_goes_by_rendezvous_into_registered_memory() -> None:
    n = 12 << 20  # above the 8 MiB default: RDMA READ by the peer's NIC into its registered buffer
    payload = os.urandom(n)
    async with await channel() as ch:
        await ch.send(b"SUM %d" % n)
        await ch.send(payload)
        assert await ch.receive() == hashlib.sha256(payload).hexdigest().encode()


@needs_peer
@pytest.mark.anyio
async def test_one_sided_read_and_write_across_hosts() -> None:
    size, seed = 1 << 20, 7
    expected = bytearray(pattern(size, seed))
    async with await channel() as ch:
        await ch.send(b"EXPOSE %d %d" % (size, seed))
        remote = aiordma.RemoteBuffer.from_bytes(await ch.receive())
        with aiordma.RegisteredBuffer(size) as local:
            await ch.read(remote, into=local)
            assert bytes(local) == bytes(expected)
            for offset, n in ((0, 1), (4093, 5000), (size - 64, 64), (123_456, 300_000)):
                data = os.urandom(n)
                await ch.write(remote, data, offset=offset)
                expected[offset : offset + n] = data
            part = bytearray(5000)
            await ch.read(remote, into=part, offset=4093)
            assert part == expected[4093 : 4093 + 5000]
            with pytest.raises(aiordma.RemoteBoundsError):
                await ch.read(remote, into=bytearray(2), offset=size - 1)
        await ch.send(b"DONE")
        assert await ch.receive() == hashlib.sha256(expected).hexdigest().encode()


@needs_peer
@pytest.mark.anyio
async def test_streams_across_hosts() -> None:
    async with await aiordma.connect(PEER, STREAM_PORT, transport=TRANSPORT) as s:
        assert s.transport == TRANSPORT
        data = os.urandom(5 << 20)
        got = bytearray()
        async with anyio.create_task_group() as tg:

            async def write() -> None:
                for i in range(0, len(data), 777_777):
                    await s.send(data[i : i + 777_777])
                await s.send_eof()

            tg.start_soon(write)
            while True:
                try:
                    got += await s.receive(1 << 20)
                except anyio.EndOfStream:
                    break
        assert got == data


@needs_peer
@pytest.mark.skipif(not ON_THE_BED, reason="the bed's perf server only")
def test_aiordma_perf_across_hosts() -> None:
    """``aiordma perf client`` against host a's ``aiordma perf server`` (the two-host stage
    starts one beside the peer service): RDMA and TCP lines, each with figures; printed, so
    that the stage's log carries the cross-host numbers."""
    import json

    wait_for_port(18515)  # (the perf server's first port)
    out = subprocess.run([sys.executable, "-m", "aiordma", "perf", "client", PEER, "--sizes", "64,64K,1M",
                          "--iterations", "100", "--poll", "event", "--ops", "send,read,write", "--bw-bytes", "8M",
                          "--no-progress", "--json"], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    print(json.dumps(report["lines"], indent=None))
    rdma = [line for line in report["lines"] if line["transport"] == "rdma"]
    assert {line["op"] for line in rdma} == {"send", "read", "write"}, report["lines"]
    for line in report["lines"]:
        assert not line["note"], line
        for result in line["results"]:
            assert result["lat_p50_us"] > 0, line


@needs_peer
@pytest.mark.anyio
async def test_zz_the_peer_ends() -> None:
    async with await channel() as ch:
        await ch.send(b"QUIT")


@pytest.mark.skipif(bool(PEER), reason="(the host's check of this suite; in the bed the suite itself runs)")
def test_twohost_suite_runs_on_the_host() -> None:
    """This file against ``aiordma.testing.peer`` over TCP on 127.0.0.1: the suite and the peer
    service agree (what the bed runs over RDMA is not first tried there)."""
    env = {**os.environ, "AIORDMA_PEER_ADDRESS": "127.0.0.1", "AIORDMA_TWOHOST_TRANSPORT": "tcp"}
    peer = subprocess.Popen([sys.executable, "-m", "aiordma.testing.peer", "--host", "127.0.0.1", "--transport", "tcp",
                             "--timeout", "120"], stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert peer.stdout is not None and peer.stdout.readline().startswith("peer: serving")
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "twohost",
                              str(Path(__file__))], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "5 passed" in out.stdout, out.stdout
        assert peer.wait(30) == 0  # the last test told it to quit
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        if peer.stdout is not None:
            peer.stdout.close()
