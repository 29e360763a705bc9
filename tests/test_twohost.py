"""Across two hosts: host b's end of the two-guest bed, against ``tools.peer`` on host a.

Run by the two-host stage (``python -m tools.vm --hosts 2 -- python -m
tools.peer -- python -m pytest -m twohost tests/test_twohost.py``): real RoCEv2 packets
between two kernels' rxe devices over a qemu wire, with the path MTU at rxe's largest (4096).
Skipped without ``AIORDMA_PEER_ADDRESS`` (set only in that bed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiordma
from tools.peer import CHANNEL_PORT, MAX_MESSAGE, STREAM_PORT, VICTIM_PORT, pattern

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


async def channel(config: aiordma.RdmaConfig | None = None) -> aiordma.Channel:
    backend = aiordma.RdmaBackend(config) if config is not None else None
    with anyio.fail_after(120):
        ch = await aiordma.connect_channel(PEER, CHANNEL_PORT, transport=TRANSPORT, max_message_size=MAX_MESSAGE,
                                           rdma_backend=backend)  # fmt: skip
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
@pytest.mark.anyio
@pytest.mark.parametrize("eof", [0, 1], ids=["close", "eof-then-close"])
async def test_the_peer_closing_right_after_sending_delivers_everything(eof: int) -> None:
    """Host a sends 12 MiB (a rendezvous) and a small message, then closes at once; this side
    starts reading late and must get both, then EOF (tests/test_close.py forces the races)."""
    size, seed = 12 << 20, 11
    async with await channel() as ch:
        await ch.send(b"SENDCLOSE %d %d %d" % (size, seed, eof))
        await anyio.sleep(0.2)
        with anyio.fail_after(120):
            assert await ch.receive() == pattern(size, seed)
            assert await ch.receive() == b"tail"
            with pytest.raises(anyio.EndOfStream):
                await ch.receive()


@needs_peer
@pytest.mark.anyio
async def test_closing_right_after_sending_delivers_everything_to_the_peer() -> None:
    """The mirror: this side sends 12 MiB and a small message and closes at once; host a reads
    late and records what it got before its EOF."""
    tag = "late-%d" % os.getpid()
    payload = os.urandom(12 << 20)
    async with await channel() as ch:
        await ch.send(b"LATE " + tag.encode())
        await ch.send(payload)
        await ch.send(b"tail")
    import json

    ends = json.loads(await control(b"STATUS " + tag.encode()))
    digest = hashlib.sha256(payload + b"tail").hexdigest()
    assert ends == [{"error": None, "detail": f"2 {digest}", "idle": ends[0]["idle"]}], ends


#: how long a reader pauses in the slow-reader tests: a minute on the bed (issue 31), past the
#: TCP keepalive (5 s) in the host's check of this suite
PAUSE = 60.0 if ON_THE_BED else 6.0


async def host_a_reads_late() -> None:
    """Host a reading: it pauses ``PAUSE`` s before it reads while this side sends 34 MiB (1 MiB
    messages, then two rendezvous of 9 MiB) and closes.  The sends wait for credits and staging
    room, the liveness probes find host a alive (its NIC answers), the close waits for the
    reader, and host a gets every byte, then a clean EOF."""
    tag = "paused-%d" % os.getpid()
    msgs = [os.urandom(1 << 20) for _ in range(16)] + [os.urandom(9 << 20), os.urandom(9 << 20)]
    started = time.monotonic()
    async with await channel() as ch:
        await ch.send(b"LATE %s %f" % (tag.encode(), PAUSE))
        for msg in msgs:
            await ch.send(msg)
    closed = time.monotonic() - started
    ends = json.loads(await control(b"STATUS " + tag.encode()))
    digest = hashlib.sha256(b"".join(msgs)).hexdigest()
    assert ends == [{"error": None, "detail": f"{len(msgs)} {digest}", "idle": ends[0]["idle"]}], ends
    assert closed >= PAUSE - 1, f"the close returned after {closed:.1f} s, before the reader read"


async def this_host_reads_late() -> None:
    """The mirror: host a sends 1 MiB messages without end while this side reads nothing for
    ``PAUSE`` s; host a's sender waits for credits all that time and does not take this host for
    dead; then this side reads on, every message whole."""
    async with await channel() as ch:
        await ch.send(b"SOURCE %d" % (1 << 20))
        await anyio.sleep(PAUSE)
        first = await ch.receive()
        assert len(first) == 1 << 20
        for _ in range(48):
            assert await ch.receive() == first


@needs_peer
@pytest.mark.anyio
async def test_readers_on_either_host_that_pause_for_a_minute_lose_nothing() -> None:
    """Slow is not dead (issue 31), across hosts, both ways at once (one minute of the stage,
    not two): host a's reader pauses while this side sends, and this side's reader pauses while
    host a sends, each on a connection of its own."""
    with anyio.fail_after(PAUSE + 240):
        async with anyio.create_task_group() as tg:
            tg.start_soon(host_a_reads_late)
            tg.start_soon(this_host_reads_late)


@needs_peer
@pytest.mark.skipif(not ON_THE_BED, reason="raw work requests on an RDMA QP")
@pytest.mark.anyio
async def test_an_rkey_of_one_connection_is_refused_on_another_across_hosts() -> None:
    """Host a exposes memory on one connection; this host, on two other connections, copies that
    exposure's address and rkey into raw RDMA READ and WRITE work requests on their own QPs.  Host
    a's NIC refuses both (the window is bound to the first connection's QP): the attackers' own
    connections fail, and the exposed memory is unread by them and unchanged."""
    from aiordma._rdma.constants import Access, Opcode, SendWR

    size, seed = 1 << 20, 23
    before = live()
    async with await channel() as victim:
        await victim.send(b"EXPOSE %d %d" % (size, seed))
        remote = aiordma.RemoteBuffer.from_bytes(await victim.receive())
        for op in (Opcode.RDMA_READ, Opcode.RDMA_WRITE):
            ch = await channel()
            link: Any = ch._core.link
            src = link.device.pd.reg_mr(4096, Access.LOCAL_WRITE)
            try:
                src.view()[:] = b"\xee" * 4096
                link.qp.post_send(SendWR(op, wr_id=(1 << 63) | 31, addr=src.addr, length=4096, lkey=src.lkey,
                                         remote_addr=remote.addr, rkey=remote.rkey))  # fmt: skip
                with anyio.fail_after(30), pytest.raises(anyio.BrokenResourceError) as ei:
                    while True:
                        await ch.receive()
                cause = str(ei.value.__cause__)
                print(f"\nanother connection's rkey ({op.name}): {cause}")
                assert any(s in cause for s in ("REM_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_OP_ERR")), cause
                if op == Opcode.RDMA_READ:
                    assert src.read(0, 4096) == b"\xee" * 4096  # nothing of host a's came
            finally:
                with anyio.fail_after(30):
                    await ch.aclose()
                src.close()
        with aiordma.RegisteredBuffer(size) as local:  # the victim's own access still works
            await victim.read(remote, into=local)
            assert bytes(local) == pattern(size, seed)
        await victim.send(b"DONE")
        assert await victim.receive() == hashlib.sha256(pattern(size, seed)).hexdigest().encode()  # unchanged
    assert live() == before


@needs_peer
@pytest.mark.skipif(not ON_THE_BED, reason="raw work requests on an RDMA QP")
@pytest.mark.anyio
@pytest.mark.parametrize("fault", ["garbage_payload", "oversized_send", "read_guessed_rkey"])
async def test_a_hostile_peer_across_hosts_breaks_only_its_own_connection(fault: str) -> None:
    """tests/test_rdma_transport.py's hostile peer on the bed's wire, host b attacking host a's
    service: raw work requests on our QP, past our session -- a SEND of bytes that are no
    aiordma frame, a SEND larger than the peer's receive buffers, an RDMA READ at a guessed
    address and rkey.  The hostile connection fails on both ends (the peer records how), the
    peer's other connection from this host goes on, the service takes new ones, and nothing of
    ours leaks."""
    import contextlib
    import json
    import random

    from aiordma._rdma.constants import Access, Opcode, SendWR
    from aiordma._rdma.credits import SendKind, pack_imm

    before = live()
    tag = f"hostile-{fault}"
    async with await channel() as bystander:
        ch = await channel()
        link: Any = ch._core.link
        src = link.device.pd.reg_mr(2 * link.config.buffer_size, Access.LOCAL_WRITE)
        try:
            await ch.send(b"TAG " + tag.encode())
            assert await ch.receive() == b"ok"
            if fault == "read_guessed_rkey":
                guess = random.Random(11)
                link.qp.post_send(SendWR(Opcode.RDMA_READ, wr_id=(1 << 63) | 11, addr=src.addr, length=64,
                                         lkey=src.lkey, remote_addr=guess.getrandbits(48) & ~0xFFF,
                                         rkey=guess.getrandbits(32)))  # fmt: skip
            else:
                payload = b"\0" * (link.config.buffer_size + 1) if fault == "oversized_send" else b"\xff" * 64
                src.view()[: len(payload)] = payload
                link.qp.post_send(SendWR(Opcode.SEND_WITH_IMM, wr_id=(1 << 63) | 20, addr=src.addr,
                                         length=len(payload), lkey=src.lkey,
                                         imm_data=pack_imm(SendKind.DATA, 0, 0)))  # fmt: skip
            # (our raw SEND is not solicited, unlike every aiordma SEND: the peer's CQ, armed
            # for solicited completions, shows it at the connection's next wake -- this message's)
            with contextlib.suppress(anyio.BrokenResourceError):
                await ch.send(b"ECHO after the attack")
            with anyio.fail_after(30), pytest.raises(anyio.BrokenResourceError) as ei:
                while True:
                    await ch.receive()
            print(f"\nhostile {fault}: this side: {ei.value} (cause {ei.value.__cause__!r})")
        finally:
            with anyio.fail_after(30):
                await ch.aclose()  # (our QP is gone after this: nothing can still use src)
            src.close()
        await bystander.send(b"ECHO still here")  # the peer's other connection from this host
        with anyio.fail_after(60):
            assert await bystander.receive() == b"still here"
    ends = json.loads(await control(b"STATUS " + tag.encode()))
    print(f"hostile {fault}: the peer: {ends}")
    assert len(ends) == 1 and ends[0]["error"] is not None, ends  # (not a clean EOF: it failed)
    if fault != "read_guessed_rkey":  # (the READ fails on our side first; the peer sees us leave)
        assert ends[0]["error"] == "BrokenResourceError", ends
    async with await channel() as after:  # the service takes new connections
        await after.send(b"ECHO and new ones")
        with anyio.fail_after(60):
            assert await after.receive() == b"and new ones"
    assert live() == before


@needs_peer
@pytest.mark.skipif(not ON_THE_BED, reason="the bed's perf server only")
def test_aiordma_perf_across_hosts() -> None:
    """``aiordma perf client`` against host a's ``aiordma perf server`` (the two-host stage
    starts one beside the peer service): RDMA and TCP lines, each with figures; printed, so
    that the stage's log carries the cross-host numbers.  (At most 200 messages or operations
    per bandwidth step: 64 B steps of 4 MiB were 20,000 awaited one-sided operations each under
    TCG, 3 of the stage's 8 minutes; the figures themselves are the benchmarks' business.)"""
    import json

    wait_for_port(18515)  # (the perf server's first port)
    out = subprocess.run([sys.executable, "-m", "aiordma", "perf", "client", PEER, "--sizes", "64,1M",
                          "--iterations", "50", "--poll", "event", "--ops", "send,read,write", "--bw-bytes", "4M",
                          "--bw-messages", "200", "--no-progress", "--json"], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    print(json.dumps(report["lines"], indent=None))
    rdma = [line for line in report["lines"] if line["transport"] == "rdma"]
    assert {line["op"] for line in rdma} == {"send", "read", "write"}, report["lines"]
    for line in report["lines"]:
        assert not line["note"], line
        for result in line["results"]:
            assert result["lat_p50_us"] > 0, line


# --------------------------------------------------------------------------
# Faults on the wire (the bed's relay and tc netem; see docs/testing.md)
# --------------------------------------------------------------------------

CONTROL = os.environ.get("AIORDMA_WIRE_CONTROL", "")
needs_wire = pytest.mark.skipif(not (PEER and CONTROL and ON_THE_BED), reason="needs the bed's wire relay")
#: the default keepalive bound (aiordma.DEFAULT_KEEPALIVE; the kernel's timers aim a second
#: early, which covers what a TCG guest's scheduler adds)
KEEPALIVE = 5.0
#: a dead peer with our SENDs or WRITEs outstanding at the NIC, or a liveness probe (a reader
#: or a sender waiting on a connection that went silent): the RC retry budget, (6+1) x 67 ms
#: (after one to two liveness_probe gaps, 0.05-0.1 s, for the probe)
WITH_TRAFFIC = 1.0


async def wire(op: str, **args: Any) -> dict[str, Any]:
    """Ask the bed's host for a fault (in a thread: the tests' traffic goes on meanwhile)."""
    import functools

    from tools.wire import request

    return await anyio.to_thread.run_sync(functools.partial(request, op, **args))


def live() -> dict[str, int]:
    from aiordma._rdma.verbs import live_objects

    return {k: v for k, v in live_objects().items() if k in ("qps", "cqs", "mrs", "mws", "channels", "registered_bytes")}


def netem_here(spec: str) -> None:
    """``tc netem`` on this guest's wire NIC; '' puts the wire's usual qdisc back."""
    from tools._guest import wire_nic, wire_qdisc_argv

    subprocess.run(wire_qdisc_argv(wire_nic(), spec), check=True, capture_output=True, timeout=60)


async def control(msg: bytes) -> bytes:
    async with await channel() as ch:
        await ch.send(msg)
        with anyio.fail_after(120):
            return await ch.receive()


async def echo_stream(n: int, chunk: int = 256 << 10, during: Any = None) -> float:
    """``n`` random bytes through the peer's stream echo, full duplex; byte-exact or it fails.

    ``during``: an async callable started once a quarter of ``n`` is back.  The writer then
    goes on, cycling through the data, until ``during`` has returned and another quarter is
    out, so the fault falls inside the transfer however fast the wire is (a fixed ``n`` could
    be over before a fault request crossed the bed's control directory).  Returns MB/s."""
    import time

    assert n % chunk == 0 and chunk <= n and n >= 1 << 20
    data = os.urandom(n)
    ring = data + data  # the bytes expected at stream offset p: ring[p % n :]
    done = anyio.Event()
    sent = got = 0

    async def fault() -> None:
        await during()
        done.set()

    async def write(s: aiordma.Stream) -> None:
        nonlocal sent
        end = n if during is None else None  # (set once ``during`` returned)
        while end is None or sent < end:
            if end is None and done.is_set():
                end = max(sent, n) + n // 4
                continue
            await s.send(ring[sent % n : sent % n + chunk])
            sent += chunk
        await s.send_eof()

    with anyio.fail_after(300):  # (a fault that never returns fails the test, not the stage)
        async with await aiordma.connect(PEER, STREAM_PORT, transport=TRANSPORT) as s:
            t0 = time.monotonic()
            async with anyio.create_task_group() as tg:
                tg.start_soon(write, s)
                while True:
                    try:
                        block = await s.receive(1 << 20)
                    except anyio.EndOfStream:
                        break
                    assert block == ring[got % n : got % n + len(block)], f"the stream differs at {got}"
                    if during is not None and got < n // 4 <= got + len(block):
                        tg.start_soon(fault)
                    got += len(block)
            seconds = time.monotonic() - t0
    assert got == sent >= n + (n // 4 if during is not None else 0), (got, sent)
    return got / seconds / 1e6


_RATES: dict[str, float] = {}


@needs_wire
@pytest.mark.anyio
@pytest.mark.parametrize("spec", ["", "loss 1%", "loss 5%", "delay 2ms reorder 25% 50%"], ids=["clean", "loss1", "loss5", "reorder"])
async def test_loss_and_reordering_on_the_wire_deliver_byte_exact(spec: str) -> None:
    """netem on both NICs: RC's retransmissions (and TCP's, for the handshake) hide it; what
    it costs is printed against the clean wire of the same boot."""
    before = live()
    netem_here(spec)
    try:
        assert await control(b"NETEM " + spec.encode()) == b"ok"
        rate = await echo_stream(2 << 20)
        async with await channel() as ch:
            payload = os.urandom(3 << 20)
            await ch.send(b"SUM %d" % len(payload))
            await ch.send(payload)
            assert await ch.receive() == hashlib.sha256(payload).hexdigest().encode()
    finally:
        netem_here("")
        assert await control(b"NETEM") == b"ok"
    _RATES[spec] = rate
    base = _RATES.get("")
    print(f"\nnetem {spec or '(none)'}: stream echo {rate:.2f} MB/s" + (f", {rate / base:.2f}x the clean wire" if base else ""))
    assert live() == before


@needs_wire
@pytest.mark.anyio
async def test_a_short_outage_is_survived() -> None:
    """The wire drops everything for 150 ms (under the RC retry budget of ~0.5 s and far under
    TCP's): the transfer that was running finishes byte-exact, and the connection lives on."""
    before = (await wire("stats"))["dropped"]
    outage: dict[str, Any] = {}

    async def cut() -> None:
        outage.update(await wire("drop", seconds=0.15))

    rate = await echo_stream(3 << 20, during=cut)
    after = (await wire("stats"))["dropped"]
    dropped = sum(after.values()) - sum(before.values())
    assert outage.get("ok") and dropped > 0, (before, after)  # it did cut
    print(f"\nshort outage: {dropped} frames dropped in the transfer, "
          f"which went on byte-exact ({rate:.2f} MB/s including the outage)")  # fmt: skip
    assert await control(b"ECHO still here") == b"still here"


async def _fails(op: Any, name: str = "") -> float:
    """Run ``op`` until it raises, which must be ``BrokenResourceError``; when (monotonic)."""
    import time

    with anyio.fail_after(60):  # (a hang fails the test instead of the stage)
        with pytest.raises(anyio.BrokenResourceError):
            await op()
    step(f"{name} failed")
    return time.monotonic()


def step(what: str) -> None:
    """A progress line in the stage's log (where a fault test stands if it hangs)."""
    import time

    print(f"  [{time.monotonic():.2f}] {what}", flush=True)


def _within(failed: dict[str, float], t0: float, bounds: dict[str, float], what: str) -> None:
    took = {name: at - t0 for name, at in failed.items()}
    print(f"\n{what}, detected after: {', '.join(f'{k} {v:.2f} s' for k, v in took.items())}")
    assert set(took) == set(bounds), took
    for name, bound in bounds.items():
        assert took[name] <= bound, f"{name} took {took[name]:.2f} s (bound {bound} s)"


async def _writes_forever(ch: aiordma.Channel, remote: aiordma.RemoteBuffer) -> None:
    block = os.urandom(64 << 10)
    while True:
        await ch.write(remote, block)


async def _sends_forever(ch: aiordma.Channel) -> None:
    block = os.urandom(60 << 10)
    while True:
        await ch.send(block)


async def _exposed(ch: aiordma.Channel, tag: bytes) -> aiordma.RemoteBuffer:
    await ch.send(b"TAG " + tag)
    assert await ch.receive() == b"ok"
    await ch.send(b"EXPOSE %d 1" % (1 << 20))
    return aiordma.RemoteBuffer.from_bytes(await ch.receive())


async def _sink(ch: aiordma.Channel, tag: bytes) -> None:
    await ch.send(b"TAG " + tag)
    assert await ch.receive() == b"ok"
    await ch.send(b"SINK")


async def _source(ch: aiordma.Channel, tag: bytes) -> None:
    """The peer streams to ``ch`` from now on (its ``SOURCE``); the first message is in."""
    await ch.send(b"TAG " + tag)
    assert await ch.receive() == b"ok"
    await ch.send(b"SOURCE %d" % (60 << 10))
    assert len(await ch.receive()) == 60 << 10


async def _receives_forever(ch: aiordma.Channel) -> None:
    while True:
        await ch.receive()


@needs_wire
@pytest.mark.anyio
async def test_a_long_outage_breaks_both_ends_within_their_bounds() -> None:
    """The wire goes silent for good (7 s, then back for the report).  Here: the one-sided
    writer (WRITEs outstanding at the NIC), the sender of SENDs (SENDs outstanding, or a
    liveness probe while it waits for credits) and the receiver of the peer's stream (a
    liveness probe once no bytes came for a gap) fail within the retry budget, the idle
    receiver within the keepalive bound.  There: the peer's ends of all four fail with
    BrokenResourceError too (asked over a new connection once the wire is back)."""
    import time

    before = live()
    writer, sender, receiver, idle = await channel(), await channel(), await channel(), await channel()
    try:
        remote = await _exposed(writer, b"outage-writer")
        await _sink(sender, b"outage-sender")
        await _source(receiver, b"outage-receiver")
        await idle.send(b"TAG outage-idle")
        assert await idle.receive() == b"ok"
        failed: dict[str, float] = {}
        step("four channels ready; the wire goes silent")
        asked = time.monotonic()
        t0 = (await wire("drop", on=True))["sent_at"]  # (the wire went silent after this)
        step(f"silent (asked {t0 - asked:.2f} s after the request began, answered {time.monotonic() - t0:.2f} s later)")
        try:
            async with anyio.create_task_group() as tg:

                async def one(name: str, op: Any) -> None:
                    failed[name] = await _fails(op, name)

                tg.start_soon(one, "writer", lambda: _writes_forever(writer, remote))
                tg.start_soon(one, "sender", lambda: _sends_forever(sender))
                tg.start_soon(one, "receiver", lambda: _receives_forever(receiver))
                tg.start_soon(one, "idle", idle.receive)
            step(f"all four failed: {failed}")
            await anyio.sleep(max(0.0, 7.0 - (time.monotonic() - t0)))  # (the peer's keepalive runs out too)
        finally:
            await wire("drop", on=False)
            step("the wire is back")
        _within(failed, t0, {"writer": WITH_TRAFFIC, "sender": WITH_TRAFFIC, "receiver": WITH_TRAFFIC,
                             "idle": KEEPALIVE}, "long outage")  # fmt: skip
    finally:
        for ch in (writer, sender, receiver, idle):
            with anyio.fail_after(30):
                await ch.aclose()
        step("closed")
    assert live() == before
    for tag in (b"outage-writer", b"outage-sender", b"outage-receiver", b"outage-idle"):
        import json

        ends = json.loads(await control(b"STATUS " + tag))
        assert len(ends) == 1 and ends[0]["error"] == "BrokenResourceError", (tag, ends)
        print(f"the peer's {tag.decode()} ended after {ends[0]['idle']:.2f} s without a message: {ends[0]['detail']}")
        assert ends[0]["idle"] <= 7.0 + KEEPALIVE, ends


@needs_peer
@pytest.mark.anyio
async def test_the_peer_process_killed_is_noticed_within_a_second() -> None:
    """SIGKILL of the serving process on the other host: its kernel closes the TCP connection
    (and destroys the QP), so an idle receiver and a busy sender both fail within 1 s."""
    import time

    before = live()
    assert (await control(b"VICTIM")).startswith(b"ok")
    idle = await aiordma.connect_channel(PEER, VICTIM_PORT, transport=TRANSPORT, max_message_size=MAX_MESSAGE)
    sender = await aiordma.connect_channel(PEER, VICTIM_PORT, transport=TRANSPORT, max_message_size=MAX_MESSAGE)
    try:
        assert idle.transport == sender.transport == TRANSPORT
        await idle.send(b"ECHO x")
        assert await idle.receive() == b"x"
        await _sink(sender, b"victim")
        failed: dict[str, float] = {}
        async with anyio.create_task_group() as tg:

            async def one(name: str, op: Any) -> None:
                failed[name] = await _fails(op, name)

            tg.start_soon(one, "idle", idle.receive)
            tg.start_soon(one, "sender", lambda: _sends_forever(sender))
            await anyio.sleep(0.3)  # (traffic flowing)
            t0 = time.monotonic()
            assert await control(b"KILL") == b"killed"
        _within(failed, t0, {"idle": WITH_TRAFFIC, "sender": WITH_TRAFFIC}, "peer process killed")
    finally:
        await idle.aclose()
        await sender.aclose()
    assert live() == before


async def _kill_the_peer_host() -> float:
    t0: float = (await wire("kill", side="a"))["sent_at"]  # (the kill came after this)
    return t0


@needs_wire
@pytest.mark.anyio
async def test_the_peer_host_killed_is_noticed_idle_within_the_keepalive_and_busy_within_a_second() -> None:
    """qemu of host a killed (its kernel sends nothing, not even a FIN), once, under four
    channels.  Under traffic -- one-sided WRITEs outstanding at the NIC fail within the RC retry
    budget; SENDs waiting for the (slower) receiver's credits, and a reader of host a's stream, by
    the liveness probe (``RdmaConfig.liveness_probe``) -- within 1 s all three.  An idle channel
    whose liveness probe is off learns it from TCP keepalive, within ``keepalive=`` (5 s by
    default): a reader that waits probes too (within a second after a fresh wait, as the long
    outage's idle reader shows; after a long one every 8 s), and this channel is the keepalive's.
    (One kill for both: booting host a again for a second kill cost the stage ~35 s.)  Last:
    host a stays down."""
    before = live()
    idle = await channel(aiordma.RdmaConfig(liveness_probe=0))
    writer, sender, receiver = await channel(), await channel(), await channel()
    try:
        await idle.send(b"ECHO x")
        assert await idle.receive() == b"x"
        remote = await _exposed(writer, b"kill-writer")
        await _sink(sender, b"kill-sender")
        await _source(receiver, b"kill-receiver")
        failed: dict[str, float] = {}
        async with anyio.create_task_group() as tg:

            async def one(name: str, op: Any) -> None:
                failed[name] = await _fails(op, name)

            tg.start_soon(one, "idle", idle.receive)
            tg.start_soon(one, "writer", lambda: _writes_forever(writer, remote))
            tg.start_soon(one, "sender", lambda: _sends_forever(sender))
            tg.start_soon(one, "receiver", lambda: _receives_forever(receiver))
            await anyio.sleep(0.5)  # (traffic flowing)
            t0 = await _kill_the_peer_host()
        _within(failed, t0, {"writer": WITH_TRAFFIC, "sender": WITH_TRAFFIC, "receiver": WITH_TRAFFIC,
                             "idle": KEEPALIVE}, "peer host killed")  # fmt: skip
    finally:
        for ch in (idle, writer, sender, receiver):
            await ch.aclose()
    assert live() == before


@needs_peer
@pytest.mark.skipif(bool(CONTROL), reason="(in the bed the last test killed host a)")
@pytest.mark.anyio
async def test_zz_the_peer_ends() -> None:
    async with await channel() as ch:
        await ch.send(b"QUIT")


@pytest.mark.slow
@pytest.mark.skipif(bool(PEER), reason="(the host's check of this suite; in the bed the suite itself runs)")
def test_twohost_suite_runs_on_the_host() -> None:
    """This file against ``tools.peer`` over TCP on 127.0.0.1: the suite and the peer
    service agree (what the bed runs over RDMA is not first tried there)."""
    env = {**os.environ, "AIORDMA_PEER_ADDRESS": "127.0.0.1", "AIORDMA_TWOHOST_TRANSPORT": "tcp"}
    peer = subprocess.Popen([sys.executable, "-m", "tools.peer", "--host", "127.0.0.1", "--transport", "tcp",
                             "--timeout", "120"], stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert peer.stdout is not None and peer.stdout.readline().startswith("peer: serving")
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "twohost",
                              str(Path(__file__).with_name("test_conformance.py")), str(Path(__file__)), "-k",
                              "not (trio or uvloop)"], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert re.search(r"\b30 passed", out.stdout), out.stdout  # 10 here, 20 of the conformance suite
        assert peer.wait(30) == 0  # the last test told it to quit
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait(10)
        if peer.stdout is not None:
            peer.stdout.close()
