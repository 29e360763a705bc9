"""A listener that no client can take down: the listener in a process of its own, attackers and
a canary client in others (``tests/_listener_proc.py``).

Each attack opens a raw socket (TLS-wrapped against a TLS listener) and sends bytes a client
may send: frames out of order, a HELLO and a CLOSE in one segment (what a client whose connect
was cancelled writes), unknown transports, bad flags, oversized lengths, cuts at any byte, RSTs
and half-closes; well-behaved clients whose connect is cancelled; handlers that raise.
Meanwhile a canary client in a third process echoes every 20 ms.  After each run: the canary
saw no error and no echo slower than :data:`CANARY_BOUND`; a new client connects and echoes;
the listener's process is alive, still serving, and holds the fds and tasks it held before.

The explicit cases run on asyncio, uvloop and trio, over every listener API, plain and TLS;
the frame fuzzer (hypothesis) draws attacks on each loop (``AIORDMA_FUZZ_EXAMPLES`` for a
long run).  Every crash the fuzzer finds stays below as an explicit case.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import ssl
import struct
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma._proto.protocol import (
    CAP_RDMA, HEADER, MAGIC, CloseCode, Connection, FrameType, Mode, Role, frame,
)  # fmt: skip

from ._listener_proc import Proc, open_client

#: the worst echo round trip the canary may see while the listener is attacked (seconds); the
#: canary's loop and the listener's share 2 cores with the attackers and the fuzzer
CANARY_BOUND = 1.0
FUZZ_EXAMPLES = int(os.environ.get("AIORDMA_FUZZ_EXAMPLES", "60"))


# -- the processes ---------------------------------------------------------------------------


@dataclass
class Target:
    loop: str
    api: str
    tlsdir: str
    port: int
    server: Proc
    client_ctx: ssl.SSLContext | None

    @property
    def mode(self) -> Mode:
        return Mode.MESSAGES if self.api in ("channel", "dask") else Mode.STREAM


def _combos() -> list[Any]:
    out = []
    for loop in ("asyncio", "uvloop", "trio"):
        for api in ("channel", "stream", "asyncio"):
            if api == "asyncio" and loop == "trio":
                continue
            for tls in (False, True):
                out.append(pytest.param((loop, api, tls), id=f"{loop}-{api}-{'tls' if tls else 'plain'}"))
    # the drop-in listeners (asyncio only; rdma:// does not encrypt, grpc's TLS is aiordma's)
    for loop in ("asyncio", "uvloop"):
        for api, module in (("dask", "distributed"), ("grpc", "grpclib")):
            marks = [] if importlib.util.find_spec(module) else [pytest.mark.skip(reason=f"{module} is not installed")]
            out.append(pytest.param((loop, api, False), id=f"{loop}-{api}-plain", marks=marks))
    return out


@pytest.fixture(params=_combos())
def target(request: pytest.FixtureRequest, tlsdir: str) -> Iterator[Target]:
    loop, api, tls = request.param
    tdir = tlsdir if tls else "-"
    server = Proc("serve", loop, api, tdir)
    try:
        first = server.line()
        assert first.startswith("PORT "), first
        ctx = None
        if tls:
            ctx = ssl.create_default_context(cafile=os.path.join(tlsdir, "ca.pem"))
        yield Target(loop, api, tdir, int(first.split()[1]), server, ctx)
    finally:
        log = server.stop()
        # (what the listener logged, for a failing test's report)
        sys.stderr.write(log[-3000:])


@pytest.fixture
def canary(target: Target) -> Iterator[Proc]:
    proc = Proc("canary", target.loop, target.api, str(target.port), target.tlsdir)
    try:
        assert proc.line() == "CONNECTED"
        yield proc
    finally:
        proc.stop()


# -- attacks on raw sockets ----------------------------------------------------------------------


def client_proto(mode: Mode) -> Connection:
    return Connection(Role.CLIENT, mode, now=0.0)


def hello(mode: Mode, rdma_params: bytes | None = None) -> bytes:
    return client_proto(mode).send_hello(
        capabilities=CAP_RDMA if rdma_params is not None else 0, rdma_params=rdma_params,
        no_rdma_reason="" if rdma_params is not None else "attacker",
    )  # fmt: skip


def raw_frame(ftype: int, payload: bytes = b"", flags: int = 0, length: int | None = None) -> bytes:
    return HEADER.pack(ftype, flags, 0, len(payload) if length is None else length) + payload


def close_frame(reason: str = "bye") -> bytes:
    return frame(FrameType.CLOSE, struct.pack("!H", CloseCode.NORMAL) + reason.encode())


def select_frame(code: int, reason: bytes = b"") -> bytes:
    return frame(FrameType.SELECT, bytes([code]) + reason)


@dataclass(frozen=True)
class Attack:
    """What one raw client does: its segments (each sent at once, ``gap`` s apart), then
    ``end``: ``close``, ``rst`` (SO_LINGER 0), ``half`` (shutdown its sending half, then read
    until the server ends) or ``read`` (read until the server ends, at most ``read_for``)."""

    segments: tuple[bytes, ...]
    end: str = "read"
    gap: float = 0.0
    read_for: float = 0.5


def run_attack(t: Target, attack: Attack) -> None:
    raw = socket.create_connection(("127.0.0.1", t.port), timeout=5)
    sock: socket.socket = raw
    try:
        if t.client_ctx is not None:
            sock = t.client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
        for i, seg in enumerate(attack.segments):
            if i and attack.gap:
                time.sleep(attack.gap)
            if seg:
                sock.sendall(seg)
        if attack.end == "rst":
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif attack.end in ("half", "read"):
            if attack.end == "half":
                if t.client_ctx is None:
                    sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + attack.read_for
            sock.settimeout(0.1)
            while time.monotonic() < deadline:
                try:
                    if not sock.recv(65536):
                        break
                except TimeoutError:
                    continue
    except (OSError, ssl.SSLError):
        pass  # (the listener may end an attacker's connection at any point: that is its right)
    finally:
        sock.close()
        raw.close()


def cancelled_connects(t: Target, delays: list[float]) -> None:
    """Well-behaved clients whose connect is cancelled after each delay (in this process)."""

    async def one(delay: float) -> None:
        with anyio.move_on_after(delay):
            ch = await open_client(t.api, t.port, t.client_ctx)
            await ch.aclose()

    async def main() -> None:
        for delay in delays:
            await one(delay)

    anyio.run(main)


def handler_raises(t: Target) -> None:
    """A real client whose message makes the server's handler raise."""

    async def main() -> None:
        with anyio.fail_after(10):
            conn: Any = await open_client(t.api, t.port, t.client_ctx)
            async with conn:
                await conn.send(b"raise")
                try:
                    while await conn.receive():
                        pass
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    pass

    anyio.run(main)


def one_echo(t: Target) -> None:
    async def main() -> None:
        with anyio.fail_after(10):
            conn: Any = await open_client(t.api, t.port, t.client_ctx)
            async with conn:
                await conn.send(b"ping")
                assert await conn.receive() == b"ping"

    anyio.run(main)


def explicit_attacks(mode: Mode) -> dict[str, Attack]:
    h = hello(mode)
    other = hello(Mode.STREAM if mode is Mode.MESSAGES else Mode.MESSAGES)
    msg = raw_frame(FrameType.MESSAGE, b"x" * 10)
    return {
        # the review's and the cases
        "hello+close in one segment": Attack((h + close_frame(),)),
        "hello+close, then rst": Attack((h + close_frame(),), end="rst"),
        "hello+select of an unknown transport": Attack((h + select_frame(0x7F),)),
        "hello+message before select": Attack((h + msg,)),
        "hello with bad flags": Attack((MAGIC + raw_frame(FrameType.HELLO, h[len(MAGIC) + HEADER.size :], flags=0xFF),)),
        "hello+select rdma not offered": Attack((h + select_frame(1),)),
        "hello with garbage rdma parameters": Attack((hello(mode, os.urandom(64)),)),
        "hello of the other mode": Attack((other,)),
        "two hellos": Attack((h + h[len(MAGIC) :],)),
        "hello+eof": Attack((h + raw_frame(FrameType.EOF),)),
        "hello+auth": Attack((h + raw_frame(FrameType.AUTH, b"\x02" + bytes(64)),)),
        "hello+memory": Attack((h + raw_frame(FrameType.MEMORY, b"\x01" * 20),)),
        "hello+oversized data": Attack((h + raw_frame(FrameType.DATA, length=0xFFFFFFFF),)),
        "hello then half-close": Attack((h,), end="half"),
        "hello then rst": Attack((h,), end="rst"),
        "magic then rst": Attack((MAGIC,), end="rst"),
        "hello cut in two": Attack((h[:11], h[11:] + close_frame()), gap=0.05),
        "an oversized hello": Attack((MAGIC + raw_frame(FrameType.HELLO, length=0x7FFFFFFF),)),
        "http": Attack((b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",)),
        "close before hello": Attack((MAGIC + close_frame(),)),
    }


def settled(server: Proc, connections: int = 1) -> dict[str, Any]:
    """The listener's stats once the canaries' handlers run (a client may say CONNECTED a
    moment before its handler starts)."""
    deadline = time.monotonic() + 10
    while (stats := server.ask("stats"))["connections"] != connections:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def check_unharmed(t: Target, canary: Proc, baseline: dict[str, Any], connections: int = 0) -> None:
    """After the attacks: a new client echoes; the canary saw nothing wrong; the listener's
    process is alive, serving, and back to its fds and tasks (dropped connections may take a
    moment to close)."""
    one_echo(t)
    report = canary.ask("stop")
    assert not report["errors"], report
    assert report["echoes"] > 0, report
    assert report["worst"] < CANARY_BOUND, report
    canary.stop()
    deadline = time.monotonic() + 15
    while True:
        stats = t.server.ask("stats")
        assert stats["serving"], stats
        if (stats["connections"] == connections and stats["fds"] <= baseline["fds"] - 1
                and stats["tasks"] <= baseline["tasks"]):  # fmt: skip
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"the listener holds more than before: {stats} (before, with the canary: {baseline})")
        time.sleep(0.2)
    assert t.server.p.poll() is None


@pytest.mark.paced
def test_no_client_takes_the_listener_down(target: Target, canary: Proc) -> None:
    """The review's cases and their kin, each from its own socket, while a canary echoes."""
    baseline = settled(target.server)
    for name, attack in explicit_attacks(target.mode).items():
        for _ in range(2):
            run_attack(target, attack)
    cancelled_connects(target, [0.0, 0.001, 0.003, 0.01, 0.03])
    handler_raises(target)
    handler_raises(target)
    check_unharmed(target, canary, baseline)
    log = target.server.stop()
    assert "serve_raised" not in log, log
    assert "dropped a client (127.0.0.1:" in log, log
    if target.api == "asyncio":  # (asyncio's convention: the loop's exception handler)
        assert "Unhandled exception in client_connected_cb" in log and "peer: ('127.0.0.1', " in log, log
    elif target.api == "dask":
        assert "rdma://: the handler of a comm from rdma://127.0.0.1:" in log, log
    elif target.api == "grpc":  # (grpclib answers a failed handler with a status, and logs it)
        assert "Application error" in log, log
    else:
        assert "the handler of a connection from 127.0.0.1:" in log, log


# -- the frame fuzzer -------------------------------------------------------------------------------

_TYPES = [int(t) for t in FrameType] + [0x00, 0x7F, 0xFF]


@st.composite
def attacks(draw: st.DrawFn, mode: Mode) -> Attack:
    frames: list[bytes] = []
    if draw(st.booleans()):
        rdma = draw(st.one_of(st.none(), st.binary(min_size=0, max_size=60)))  # (an RDMA offer)
        frames.append(hello(draw(st.sampled_from([mode, mode, mode, Mode.STREAM, Mode.MESSAGES])), rdma))
    else:
        frames.append(MAGIC[: draw(st.integers(0, len(MAGIC)))])
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.sampled_from(["frame", "select", "close", "garbage"]))
        if kind == "frame":
            payload = draw(st.binary(max_size=64))
            length = draw(st.one_of(st.none(), st.sampled_from([0, 1, 4096, 1 << 20, 0xFFFFFFFF])))
            flags = draw(st.sampled_from([0, 0, 1, 0x80, 0xFF]))
            frames.append(raw_frame(draw(st.sampled_from(_TYPES)), payload, flags, length))
        elif kind == "select":
            frames.append(select_frame(draw(st.integers(0, 255)), draw(st.binary(max_size=8))))
        elif kind == "close":
            frames.append(close_frame(draw(st.text(max_size=8))))
        else:
            frames.append(draw(st.binary(min_size=1, max_size=32)))
    data = b"".join(frames)
    if data and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # a cut at any byte
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    segments = tuple(data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]))
    return Attack(segments, end=draw(st.sampled_from(["close", "rst", "half", "read"])),
                  gap=draw(st.sampled_from([0.0, 0.0, 0.02])), read_for=0.2)  # fmt: skip


@pytest.fixture(params=[(loop, flavor) for loop in ("asyncio", "uvloop", "trio") for flavor in ("plain", "tls", "sim")],
                ids=lambda p: "-".join(p))  # fmt: skip
def fuzz_target(request: pytest.FixtureRequest, tlsdir: str) -> Iterator[Target]:
    loop, flavor = request.param
    tdir = tlsdir if flavor == "tls" else "-"
    server = Proc("serve", loop, "sim" if flavor == "sim" else "channel", tdir)
    try:
        first = server.line()
        ctx = ssl.create_default_context(cafile=os.path.join(tlsdir, "ca.pem")) if flavor == "tls" else None
        yield Target(loop, "channel", tdir, int(first.split()[1]), server, ctx)
    finally:
        sys.stderr.write(server.stop()[-3000:])


@pytest.mark.paced
def test_fuzzed_frames_never_take_the_listener_down(fuzz_target: Target) -> None:
    """Hypothesis draws what a raw client sends (every frame type, bad flags and lengths, cuts
    at any byte, merged or split segments, RST and half-close at each point; HELLOs offering
    RDMA with drawn parameters), against a plain, a TLS and an RDMA (simulated wire) listener."""
    canary = Proc("canary", fuzz_target.loop, "channel", str(fuzz_target.port), fuzz_target.tlsdir)
    sim = fuzz_target.server.p.args[-2] == "sim"  # type: ignore[index]
    try:
        assert canary.line() == "CONNECTED"
        baseline = settled(fuzz_target.server, 2 if sim else 1)

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(attacks(Mode.MESSAGES))
        def fuzz(attack: Attack) -> None:
            run_attack(fuzz_target, attack)
            assert fuzz_target.server.p.poll() is None

        fuzz()
        if sim:
            stats = fuzz_target.server.ask("stats")
            assert not stats["inner"]["errors"] and stats["inner"]["worst"] < CANARY_BOUND, stats
        check_unharmed(fuzz_target, canary, baseline, connections=1 if sim else 0)
    finally:
        canary.stop()


# -- the simulated RDMA wire: hostile RDMA parameters ---------------------------------------------


def rdma_attacks() -> dict[str, Attack]:
    """HELLOs that offer RDMA with parameters a hostile client makes up: garbage, and
    well-formed ones naming the listener's device and QP numbers that other connections hold
    (the inner canary's among them), followed by SELECT rdma (or tcp), bytes, a close or an RST."""
    from aiordma._rdma.constants import gid_bytes
    from aiordma._rdma.params import RdmaParams

    gid = gid_bytes("127.0.0.1")
    out: dict[str, Attack] = {
        "garbage rdma parameters": Attack((hello(Mode.MESSAGES, os.urandom(41)),)),
        "short rdma parameters": Attack((hello(Mode.MESSAGES, os.urandom(7)),)),
        "garbage rdma parameters then select rdma": Attack((hello(Mode.MESSAGES, os.urandom(41)) + select_frame(1),)),
    }
    for qp in range(1, 25):
        params = RdmaParams(gid, qp, 0x1234, 3, 64, 8, 65536, 4).encode()
        ends = ["read", "rst", "close"]
        out[f"select rdma naming QP {qp}"] = Attack(
            (hello(Mode.MESSAGES, params), select_frame(1), raw_frame(FrameType.MESSAGE, b"over tcp?")),
            end=ends[qp % 3], gap=0.05,
        )  # fmt: skip
        out[f"select tcp naming QP {qp}"] = Attack((hello(Mode.MESSAGES, params), select_frame(0)), end=ends[qp % 3],
                                                   gap=0.05)  # fmt: skip
    return out


@pytest.mark.paced
@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
def test_hostile_rdma_parameters_never_take_the_listener_down(loop: str) -> None:
    """A listener offering RDMA over the simulated wire (in its own process, with an RDMA
    canary beside it, and a TCP canary in another process): hostile RDMA HELLOs end their own
    connections only."""
    server = Proc("serve", loop, "sim", "-")
    canary = None
    try:
        first = server.line()
        t = Target(loop, "channel", "-", int(first.split()[1]), server, None)
        canary = Proc("canary", loop, "channel", str(t.port), "-")
        assert canary.line() == "CONNECTED"
        deadline = time.monotonic() + 10
        while (stats := server.ask("stats"))["connections"] != 2 or not stats["inner"]["echoes"]:
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats["inner"]["transport"] == "rdma", stats
        baseline = stats
        for attack in rdma_attacks().values():
            run_attack(t, attack)
        # after the attacks: both canaries unharmed, the listener back to its fds and tasks
        inner_before = baseline["inner"]["echoes"]
        time.sleep(0.5)
        stats = server.ask("stats")
        assert not stats["inner"]["errors"], stats
        assert stats["inner"]["echoes"] > inner_before, stats
        assert stats["inner"]["worst"] < CANARY_BOUND, stats
        check_unharmed(t, canary, {**baseline, "connections": 2}, connections=1)
    finally:
        if canary is not None:
            canary.stop()
        log = server.stop()
        sys.stderr.write(log[-3000:])
    assert "serve_raised" not in log, log[-3000:]
