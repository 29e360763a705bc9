"""The RDMA transport: on the host over the simulated RC wire (``sim``), and on a real
device (``rxe``: Soft-RoCE in the guest, or an RNIC; marked ``rdma``).

The conformance suite runs over both too (tests/test_conformance.py, kinds
``sim`` and ``rdma``); this file covers what is RDMA's own: fallback from every
setup step, strict mode, teardown and resource release, a dead peer, a full
duplex transfer with a late reader, mismatched configurations, hostile
completions, the GID binding.  Every test checks that no verbs object, fd or
device is left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import sys
import time
from array import array
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
from anyio import BrokenResourceError, ClosedResourceError

import aiordma
from aiordma import RdmaBackend, RdmaConfig, TransportAttribute
from aiordma._rdma import RdmaSetupError
from aiordma._rdma.device import open_devices
from aiordma._rdma.liveness import ProbePlan
from aiordma._rdma.params import RdmaParams

from ._leaks import no_fd_leak
from ._rdma_env import Env, rdma_env
from ._pairs import served_pair
from ._kinds import read_exactly
from ._skips import one_loop_on_a_device

pytestmark = pytest.mark.anyio

STEPS = ["device", "open", "resources", "init", "memory", "post", "params", "rtr", "rts", "probe"]


@pytest.fixture(
    params=[
        pytest.param("sim", id="sim"),
        pytest.param("sim-checked", id="sim-checked"),  # the checked (Python) data path
        pytest.param("rxe", id="rxe", marks=pytest.mark.rdma),
    ]
)
def env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    if request.param == "sim-checked":
        monkeypatch.setenv("AIORDMA_HOT_PATH", "checked")
    with rdma_env(request.param == "rxe") as e:
        yield e


class FailingBackend(RdmaBackend):
    """Makes one setup step fail, as a real failure of that step would."""

    def __init__(self, config: RdmaConfig | None = None, *, provider: Any = None, step: str = "") -> None:
        super().__init__(config, provider=provider)
        self.step = step

    def before_step(self, step: str) -> None:
        if step == self.step:
            raise RdmaSetupError(step, f"injected failure of {step}")


class HangingProbeBackend(RdmaBackend):
    async def probe_delay(self) -> None:
        await anyio.sleep(3600)


class WrongGidBackend(RdmaBackend):
    """Announces a GID that is not the address of its TCP end (aims the peer's QP elsewhere)."""

    def hello_params(self, params: RdmaParams) -> RdmaParams:
        return dataclasses.replace(params, gid=ipaddress.IPv6Address("::ffff:198.19.254.254").packed)


@asynccontextmanager
async def echo_channel(
    env: Env, server_transport: str = "auto", server_backend: RdmaBackend | None = None
) -> AsyncIterator[int]:
    async def handler(channel: aiordma.Channel) -> None:
        async with channel:
            async for message in channel:
                await channel.send(message)

    async with await aiordma.create_channel_listener(
        env.host, 0, transport=server_transport, rdma_backend=server_backend or env.backend()
    ) as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            yield listener.port
            tg.cancel_scope.cancel()


async def round_trip(channel: aiordma.Channel) -> None:
    for message in (b"", b"ping", os.urandom(200_000)):
        await channel.send(message)
        assert await channel.receive() == message


async def test_auto_uses_rdma_and_reports_it(anyio_backend: Any, env: Env) -> None:
    async with no_fd_leak(), echo_channel(env) as port:
        async with await aiordma.connect_channel(env.host, port, rdma_backend=env.backend()) as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.transport) == "rdma"
            assert channel.extra(TransportAttribute.fallback_reason) == ""
            assert channel.extra(TransportAttribute.device)
            assert channel.extra(TransportAttribute.qp_num) > 0
            assert env.live()["qps"] == 2
            assert env.live()["contexts"] == 1  # one device context per loop, shared by both ends


async def test_peer_without_rdma_interoperates(anyio_backend: Any, env: Env) -> None:
    async with no_fd_leak(), echo_channel(env, server_transport="tcp") as port:
        async with await aiordma.connect_channel(env.host, port, rdma_backend=env.backend()) as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.transport) == "tcp"
            assert channel.extra(TransportAttribute.fallback_reason) == "server: transport='tcp' was requested"
    async with no_fd_leak(), echo_channel(env) as port:
        async with await aiordma.connect_channel(env.host, port, transport="tcp", rdma_backend=env.backend()) as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.fallback_reason) == "client: transport='tcp' was requested"


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("step", STEPS)
async def test_each_failing_setup_step_falls_back_to_tcp(anyio_backend: Any, env: Env, side: str, step: str) -> None:
    if side == "server" and step == "probe":
        pytest.skip("only the client probes the path")
    one_loop_on_a_device(env.kind == "rxe", anyio_backend)
    failing = env.backend(FailingBackend, step=step)
    async with no_fd_leak(), echo_channel(env, server_backend=failing if side == "server" else None) as port:
        async with await aiordma.connect_channel(
            env.host, port, rdma_backend=failing if side == "client" else env.backend()
        ) as channel:
            await round_trip(channel)  # no data lost
            assert channel.extra(TransportAttribute.transport) == "tcp"
            reason = channel.extra(TransportAttribute.fallback_reason)
            assert reason == f"{side}: RDMA setup failed at {step}: injected failure of {step}"


async def test_failing_step_with_strict_rdma_raises(anyio_backend: Any, env: Env) -> None:
    async with echo_channel(env, server_backend=env.backend(FailingBackend, step="rtr")) as port:
        with pytest.raises(aiordma.RDMAUnavailableError, match="server: RDMA setup failed at rtr"):
            await aiordma.connect_channel(env.host, port, transport="rdma", rdma_backend=env.backend())


async def test_setup_timeout_falls_back(anyio_backend: Any, env: Env) -> None:
    backend = env.backend(HangingProbeBackend, RdmaConfig(setup_timeout=0.5))
    async with no_fd_leak(), echo_channel(env) as port:
        with anyio.fail_after(20):
            async with await aiordma.connect_channel(env.host, port, rdma_backend=backend) as channel:
                await round_trip(channel)
                reason = channel.extra(TransportAttribute.fallback_reason)
                assert channel.extra(TransportAttribute.transport) == "tcp"
                assert reason.startswith("client: RDMA setup failed at probe: no answer") and "0.5 s" in reason


async def test_a_gid_that_is_not_the_tcp_peer_is_refused(anyio_backend: Any, env: Env) -> None:
    """The peer's GID must be its TCP address: a client cannot aim our QP at a third host."""
    async with no_fd_leak(), echo_channel(env) as port:
        async with await aiordma.connect_channel(env.host, port, rdma_backend=env.backend(WrongGidBackend)) as channel:
            await round_trip(channel)
            reason = channel.extra(TransportAttribute.fallback_reason)
            assert channel.extra(TransportAttribute.transport) == "tcp"
            assert reason.startswith("server: RDMA setup failed at params: the peer's GID ::ffff:198.19.254.254 is not its TCP address"), reason


async def test_strict_client_and_tcp_server(anyio_backend: Any, env: Env) -> None:
    async with echo_channel(env, server_transport="tcp") as port:
        with pytest.raises(aiordma.RDMAUnavailableError, match="server: transport='tcp' was requested"):
            await aiordma.connect_channel(env.host, port, transport="rdma", rdma_backend=env.backend())


@pytest.mark.rdma
async def test_loopback_address_has_no_device(anyio_backend: Any) -> None:
    async with await aiordma.create_channel_listener("127.0.0.1", 0) as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, lambda c: c.aclose())
            async with await aiordma.connect_channel("127.0.0.1", listener.port) as channel:
                assert channel.extra(TransportAttribute.fallback_reason) == (
                    "client: RDMA setup failed at device: no RDMA device has the local address 127.0.0.1"
                )
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_many_cycles_leave_nothing_behind(anyio_backend: Any, env: Env) -> None:
    """Hundreds of connect/transfer/close cycles (under asyncio: the loop does not matter here, the time does).

    The listener keeps its device open (each connection then finds the device and its cached
    rings ready): what is open after the first cycle stays exactly what is open after the last
    one, and everything is gone once the listener closes (the ``env`` fixture checks)."""
    cycles = int(os.environ.get("AIORDMA_TEST_CYCLES", "300" if env.kind == "rxe" else "200"))
    async with no_fd_leak():
        async with echo_channel(env) as port:
            assert env.live() == dict.fromkeys(env.live(), 0)
            steady: dict[str, int] = {}
            for i in range(cycles):
                with anyio.fail_after(60):  # a cycle that hangs is a bug, reported where it hangs
                    async with await aiordma.connect_channel(
                        env.host, port, transport="rdma", rdma_backend=env.backend()
                    ) as channel:
                        payload = i.to_bytes(4, "big") * 16
                        await channel.send(payload)
                        assert await channel.receive() == payload
                with anyio.fail_after(10):
                    while env.live()["qps"]:  # the server side closes after our CLOSE
                        await anyio.sleep(0.01)
                if i == 0:
                    steady = env.live()
                    assert steady["contexts"] == 1 and steady["qps"] == 0
            assert env.live() == steady
        assert env.live() == dict.fromkeys(steady, 0)


@pytest.mark.paced
async def test_cancelled_transfer_releases_everything(anyio_backend: Any, env: Env) -> None:
    async def sink(stream: aiordma.Stream) -> None:
        async with stream:
            await anyio.sleep(3600)  # never reads: the client's send blocks on credits

    async with no_fd_leak():
        async with await aiordma.create_listener(env.host, 0, transport="rdma", rdma_backend=env.backend()) as listener:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, sink)
                stream = await aiordma.connect(env.host, listener.port, transport="rdma", rdma_backend=env.backend())
                with anyio.move_on_after(1) as scope:
                    await stream.send(bytes(64 << 20))
                assert scope.cancelled_caught, "64 MiB went into a peer that does not read"
                # the close waits for the staged bytes while the peer is alive (a socket's linger);
                # the caller bounds it by cancelling it: an abort, which still releases everything
                with anyio.move_on_after(1) as closing:
                    await stream.aclose()
                assert closing.cancelled_caught, "the close returned while the live peer had not taken everything"
                tg.cancel_scope.cancel()


PEER = """
import sys, anyio, aiordma
async def main():
    async with await aiordma.create_listener(sys.argv[1], 0, transport="rdma") as listener:
        print(listener.port, flush=True)
        async def handler(stream):
            await stream.send(b"ready")
            await anyio.sleep(3600)
        await listener.serve(handler)
anyio.run(main)
"""


async def test_killed_peer_breaks_the_stream(anyio_backend: Any, env: Env) -> None:
    """A peer process that dies (SIGKILL, no CLOSE) is reported, never waited for."""
    if env.kind == "sim":
        pytest.skip("the simulated wire lives in one process (see test_killed_qp_breaks_the_stream)")
    host = env.host
    async with await anyio.open_process([sys.executable, "-c", PEER, host]) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            with anyio.fail_after(120):  # a new Python process starts slowly in a loaded guest
                port = int((await process.stdout.receive()).decode().split()[0])
                async with no_fd_leak():
                    async with await aiordma.connect(host, port, transport="rdma") as stream:
                        assert await stream.receive() == b"ready"
                        process.kill()
                        with pytest.raises(BrokenResourceError):
                            await stream.receive()
                        with pytest.raises(BrokenResourceError):
                            await stream.send(b"anyone?")
        except BaseException:
            process.kill()
            with anyio.move_on_after(5):
                print("peer stderr:", (await process.stderr.receive()).decode(errors="replace"))
            raise


async def test_asyncio_streams_over_rdma(anyio_backend: Any, env: Env) -> None:
    if anyio_backend[0] != "asyncio":
        pytest.skip("aiordma.asyncio runs on asyncio (and uvloop) only")

    async def handler(reader: aiordma.asyncio.StreamReader, writer: aiordma.asyncio.StreamWriter) -> None:
        assert writer.get_extra_info("aiordma_transport") == "rdma"
        while line := await reader.readline():
            writer.write(line.upper())
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    with anyio.fail_after(60):
        async with no_fd_leak():
            server = await aiordma.asyncio.start_server(
                handler, env.host, 0, transport="rdma", limit=8 << 20, rdma_backend=env.backend()
            )
            async with server:
                port = server.addresses[0][1]
                reader, writer = await aiordma.asyncio.open_connection(
                    env.host, port, transport="rdma", rdma_backend=env.backend()
                )
                assert writer.get_extra_info("aiordma_transport") == "rdma"
                assert writer.get_extra_info("aiordma_fallback_reason") == ""
                big = b"y" * (3 << 20) + b"\n"
                writer.write(b"hello\n")
                writer.writelines([b"wor", b"ld\n"])
                writer.write(big)  # more than the credits allow at once: drain must wait
                await writer.drain()
                assert await reader.readline() == b"HELLO\n"
                assert await reader.readexactly(6) == b"WORLD\n"
                assert await reader.readexactly(len(big)) == big.upper()
                writer.write(b"last line, then EOF\n")
                writer.write_eof()
                assert await reader.readline() == b"LAST LINE, THEN EOF\n"
                assert await reader.read() == b""
                writer.close()
                await writer.wait_closed()


async def test_tiny_window_exercises_credits_both_ways(anyio_backend: Any, env: Env) -> None:
    """Two data buffers of 4 KiB and one control buffer per side: frames span many SENDs,
    credits run out all the time and come back in credit messages; nothing is lost."""
    tiny = env.backend(config=RdmaConfig(window=2, control=1, buffer_size=4096))
    sizes = [0, 1, 4095, 4096, 4097, 50_000, 3, 200_000, 7]
    async with no_fd_leak():
        async with await aiordma.create_channel_listener(env.host, 0, transport="rdma", rdma_backend=tiny) as listener:

            async def handler(channel: aiordma.Channel) -> None:
                async with channel:
                    async with anyio.create_task_group() as tg:

                        async def talk_back() -> None:  # the server sends while it receives
                            for size in reversed(sizes):
                                await channel.send(bytes([size % 251]) * size)

                        tg.start_soon(talk_back)
                        got = [await channel.receive() for _ in sizes]
                        assert got == [bytes([size % 251]) * size for size in sizes]
                    await channel.send(b"all good")  # after talk_back: its messages come first

            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, handler)
                with anyio.fail_after(60):
                    async with await aiordma.connect_channel(
                        env.host, listener.port, transport="rdma", rdma_backend=tiny
                    ) as channel:
                        for size in sizes:
                            await channel.send(bytes([size % 251]) * size)
                        back = [await channel.receive() for _ in sizes]
                        assert back == [bytes([size % 251]) * size for size in reversed(sizes)]
                        assert await channel.receive() == b"all good"
                tg.cancel_scope.cancel()


# -- the defects of the first RDMA transport, each with its test --------------------------------


@asynccontextmanager
async def stream_pair_on(
    env: Env, client_config: RdmaConfig | None = None, server_config: RdmaConfig | None = None
) -> AsyncIterator[tuple[aiordma.Stream, aiordma.Stream]]:
    listener = await aiordma.create_listener(
        env.host, 0, transport="rdma", rdma_backend=env.backend(config=server_config)
    )  # fmt: skip
    connect = partial(aiordma.connect, env.host, transport="rdma", rdma_backend=env.backend(config=client_config))
    async with served_pair(listener, connect) as pair:
        yield pair


@pytest.mark.guest_loops("trio")
async def test_full_duplex_with_a_late_reader_finishes(anyio_backend: Any, env: Env) -> None:
    """B1: both sides send 8 MiB before reading, the client's reader starts 0.2 s late.
    The first transport spun in the credit wait and froze the loop; now senders wait."""
    size = 8 << 20
    a_data, b_data = os.urandom(size), os.urandom(size)
    got: dict[str, bytes] = {}
    async with no_fd_leak(), stream_pair_on(env) as (a, b):

        async def late_reader() -> None:
            await anyio.sleep(0.2)
            got["a"] = await read_exactly(a, size)

        async def reader() -> None:
            got["b"] = await read_exactly(b, size)

        with anyio.fail_after(60 if env.kind == "sim" else 300):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.send, a_data)
                tg.start_soon(b.send, b_data)
                tg.start_soon(late_reader)
                tg.start_soon(reader)
    assert got["a"] == b_data and got["b"] == a_data


@pytest.mark.slow
async def test_a_reader_that_pauses_past_the_keepalive_loses_nothing(anyio_backend: Any, env: Env) -> None:
    """Slow is not dead (issue 31): the reader sleeps 8 s -- past the TCP link's keepalive (5 s)
    and several of the liveness plan's probes -- while the sender waits for credits with 8 MiB;
    then it reads everything.  The NIC answers the probes, so nothing ends."""
    size = 8 << 20
    data = os.urandom(size)
    got = b""
    async with no_fd_leak(), stream_pair_on(env) as (a, b):

        async def paused_reader() -> None:
            nonlocal got
            await anyio.sleep(8)
            got = await read_exactly(b, size)

        with anyio.fail_after(60 if env.kind == "sim" else 300):
            async with anyio.create_task_group() as tg:
                tg.start_soon(paused_reader)
                await a.send(data)
    assert got == data


async def test_a_timeout_fires_while_a_send_waits_for_a_peer_that_never_reads(anyio_backend: Any, env: Env) -> None:
    async with no_fd_leak(), stream_pair_on(env) as (a, _b):
        started = time.monotonic()
        with anyio.move_on_after(0.5) as scope:
            await a.send(bytes(32 << 20))
        assert scope.cancelled_caught
        assert time.monotonic() - started < 5  # the loop kept running: the deadline could fire


@pytest.mark.paced
@pytest.mark.parametrize(
    ("client", "server"),
    [
        (None, RdmaConfig(window=256, buffer_size=4096)),
        (RdmaConfig(window=256, buffer_size=4096), None),
        (RdmaConfig(window=1, control=1, buffer_size=256), RdmaConfig(window=64, control=4, buffer_size=1 << 20)),
    ],
    ids=["big-window-server", "big-window-client", "tiny-vs-huge"],
)
async def test_peers_with_other_configs(
    anyio_backend: Any, env: Env, client: RdmaConfig | None, server: RdmaConfig | None
) -> None:
    """B2: the send queue is sized by what was granted and bounded by the session, whatever the peer posts."""
    # (tiny-vs-huge moves 256-byte SENDs one credit at a time: 1 MiB is 4096 round trips each way,
    # over a minute on rxe in the guest, where Python runs ~20x slower)
    tiny = client is not None and client.window == 1
    data = os.urandom((1 << 20) if tiny and env.kind == "rxe" else 3 << 20)
    async with no_fd_leak(), stream_pair_on(env, client, server) as (a, b):
        with anyio.fail_after(120 if env.kind != "rxe" else 300):
            async with anyio.create_task_group() as tg:
                tg.start_soon(a.send, data)
                tg.start_soon(b.send, data[::-1])
                assert await read_exactly(b, len(data)) == data
                assert await read_exactly(a, len(data)) == data[::-1]


def _link(stream: aiordma.Stream) -> Any:
    return stream._core.link


@pytest.mark.paced
async def test_a_peer_that_over_returns_credits_fails_only_itself(anyio_backend: Any, env: Env) -> None:
    """B3: the victim's connection breaks with a typed cause, aclose() raises nothing, nothing leaks."""
    async with no_fd_leak(), stream_pair_on(env) as (a, b):
        session = _link(a).session
        # a broken peer: returns credits it does not owe
        credits = session.c if getattr(session, "native", False) else session.credits
        credits.to_return = 5
        credits.peer_available = 0
        await a.send(b"hostile")
        with anyio.fail_after(10):
            with pytest.raises(BrokenResourceError) as ei:
                while True:
                    await b.receive()
        assert isinstance(ei.value.__cause__, aiordma.RemoteProtocolError)
        assert "more credits" in str(ei.value.__cause__)
        await b.aclose()  # must not raise


async def test_close_is_quick_when_the_close_went_out_after_credits_came_back(anyio_backend: Any, env: Env) -> None:
    """B4: closing right after a send that ran out of credits must not wait the close timeout."""
    config = RdmaConfig(window=2, buffer_size=4096, close_timeout=5.0)
    async with no_fd_leak(), stream_pair_on(env, config, config) as (a, b):
        async with anyio.create_task_group() as tg:

            async def drain_peer() -> None:
                await anyio.sleep(0.2)
                assert await read_exactly(b, 100_000) == bytes(100_000)

            tg.start_soon(drain_peer)
            with anyio.fail_after(30):
                await a.send(bytes(100_000))
            started = time.monotonic()
            await a.aclose()
            assert time.monotonic() - started < 2.5, "aclose waited for a completion never asked for"


@pytest.mark.parametrize("fault", ["write_with_imm", "credit_with_payload"])
async def test_hostile_completions_break_only_the_offending_connection(anyio_backend: Any, env: Env, fault: str) -> None:
    """B6: an RDMA WRITE with immediate, or a credit-only SEND with a payload, is refused;
    another connection on the same device goes on."""
    from aiordma._rdma.constants import Opcode, SendWR

    async with no_fd_leak(), stream_pair_on(env) as (a, b), stream_pair_on(env) as (c, d):
        link = _link(a)
        if fault == "write_with_imm":
            wr = SendWR(Opcode.RDMA_WRITE_WITH_IMM, wr_id=(1 << 63) | 7, imm_data=0)
        else:
            mr = link.res.send_mr
            wr = SendWR(Opcode.SEND_WITH_IMM, wr_id=(1 << 63) | 7, addr=mr.addr, length=16, lkey=mr.lkey,
                        imm_data=1 << 31 | 1)  # fmt: skip
        link.qp.post_send(wr)
        with anyio.fail_after(10):
            with pytest.raises(BrokenResourceError) as ei:
                while True:
                    await b.receive()
        assert isinstance(ei.value.__cause__, aiordma.RemoteProtocolError), ei.value.__cause__
        await c.send(b"still here")
        assert await d.receive() == b"still here"


async def test_asyncio_api_raises_asyncio_errors_over_rdma(anyio_backend: Any, env: Env) -> None:
    """B5: StreamWriter.drain() raises ConnectionResetError, not anyio's errors, when the RDMA link broke."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("aiordma.asyncio runs on asyncio (and uvloop) only")
    if env.fabric is None:
        pytest.skip("needs the simulated wire's fault knobs")
    served = anyio.Event()

    async def handler(reader: aiordma.asyncio.StreamReader, writer: aiordma.asyncio.StreamWriter) -> None:
        served.set()
        with pytest.raises(ConnectionResetError):
            await reader.read()  # our QP is "dead": the client's TCP close ends us without a CLOSE
        writer.close()

    async with no_fd_leak():
        server = await aiordma.asyncio.start_server(handler, env.host, 0, transport="rdma", rdma_backend=env.backend())
        async with server:
            reader, writer = await aiordma.asyncio.open_connection(
                env.host, server.addresses[0][1], transport="rdma", rdma_backend=env.backend()
            )
            await served.wait()
            env.fabric.kill_qp(writer._core.link.res.peer.qp_num)  # the server's QP vanishes as a dead host would
            with anyio.fail_after(10):
                with pytest.raises(ConnectionResetError):
                    for _ in range(100):
                        writer.write(bytes(1 << 20))  # never raises
                        await writer.drain()
            writer.close()
            await writer.wait_closed()


async def test_a_fatal_async_event_breaks_only_its_connection(anyio_backend: Any, env: Env) -> None:
    if env.fabric is None:
        pytest.skip("needs the simulated wire's fault knobs")
    async with no_fd_leak(), stream_pair_on(env) as (a, b), stream_pair_on(env) as (c, d):
        link = _link(b)
        env.fabric.post_async_event(link.res.gid_entry.device, 1, qp_num=link.qp_num)  # IBV_EVENT_QP_FATAL
        with anyio.fail_after(10):
            with pytest.raises(BrokenResourceError):
                await b.receive()
        await c.send(b"unaffected")
        assert await d.receive() == b"unaffected"


async def test_killed_qp_breaks_the_stream(anyio_backend: Any, env: Env) -> None:
    """The peer's QP vanishes (a dead host): our operations fail, never hang."""
    if env.fabric is None:
        pytest.skip("needs the simulated wire's fault knobs")
    async with no_fd_leak(), stream_pair_on(env) as (a, b):
        env.fabric.kill_qp(_link(b).qp_num)
        with anyio.fail_after(10):
            with pytest.raises(BrokenResourceError):
                for _ in range(100):
                    await a.send(bytes(1 << 16))


async def _recorded(op: Callable[[], Any], outcome: list[BaseException | None], done: anyio.Event) -> None:
    """Run ``op``; its outcome (None, or what it raised) goes to ``outcome``, then ``done`` is set."""
    try:
        await op()
        outcome.append(None)
    except Exception as exc:  # (what the test looks at)
        outcome.append(exc)
    finally:
        done.set()


async def _kill_the_peer_and_expect_the_probe(env: Env, qp_num: int, done: anyio.Event,
                                              outcome: list[BaseException | None], probe: float,
                                              who: str) -> None:  # fmt: skip
    """The peer's QP ``qp_num`` vanishes (its host died); a task of ours waits, and ``done`` is
    set when it ended with ``outcome``.  Probing, it must fail within 1 s naming the probe (at
    most 2 x ``probe``, then the failure: no retry budget here); not probing, it waits on."""
    assert env.fabric is not None
    env.fabric.kill_qp(qp_num)
    t0 = time.monotonic()
    with anyio.move_on_after(1.5):
        await done.wait()
    took = time.monotonic() - t0
    if probe:
        assert done.is_set(), f"{who} waited on a dead peer"
        assert isinstance(outcome[0], BrokenResourceError), outcome
        assert "probe" in str(outcome[0]) and "RETRY_EXC_ERR" in str(outcome[0]), outcome[0]
        assert took < 1.0, took
    else:
        assert not done.is_set(), outcome  # only a probe could tell


@pytest.mark.paced
@pytest.mark.parametrize("probe", [0.25, 0.0], ids=["probing", "not-probing"])
async def test_a_sender_waiting_for_credits_learns_that_the_peer_host_died(anyio_backend: Any, env: Env,
                                                                           probe: float) -> None:  # fmt: skip
    """The reader stopped reading, so the sender waits for credits with everything it posted
    acknowledged -- nothing of its own is at the NIC to time out -- and then the peer's host
    dies (its QP vanishes; the TCP link here stays up, as it does for seconds after a real
    crash).  The sender probes the path after ``liveness_probe`` seconds (a zero-length RDMA
    WRITE), the probe fails, and the send raises ``BrokenResourceError`` naming the probe.
    Without probing it waits on (for a keepalive that, on this live TCP link, never fires)."""
    if env.fabric is None:
        pytest.skip("needs the simulated wire's fault knobs (across hosts: tests/test_twohost.py)")
    cfg = RdmaConfig(window=4, liveness_probe=probe)
    async with no_fd_leak(), stream_pair_on(env, client_config=cfg) as (a, b):
        link = _link(a)
        outcome: list[BaseException | None] = []
        done = anyio.Event()

        async def send() -> None:
            await a.send(bytes(4 << 20))  # more than the reader takes in: it blocks on credits

        async with anyio.create_task_group() as tg:
            tg.start_soon(_recorded, send, outcome, done)
            with anyio.fail_after(10):
                while True:  # blocked: nothing posted for a while, all of it completed
                    mark = link.session.posted_bytes
                    await anyio.sleep(0.05)
                    session = link.session
                    outstanding = session.c.sq_used if getattr(session, "native", False) else session.sq_used
                    if session.posted_bytes == mark and outstanding == 0:
                        break
            assert not done.is_set()
            await _kill_the_peer_and_expect_the_probe(env, _link(b).qp_num, done, outcome, probe, "the sender")
            tg.cancel_scope.cancel()


@pytest.mark.paced
@pytest.mark.parametrize("probe", [0.25, 0.0], ids=["probing", "not-probing"])
async def test_a_receiver_learns_that_the_peer_host_died_mid_transfer(anyio_backend: Any, env: Env,
                                                                     probe: float) -> None:  # fmt: skip
    """The peer streams to us and its host dies: the reader waits for bytes that never come,
    with nothing of its own at the NIC.  The device's liveness plan sees a waiting reader whose
    connection made no progress for ``liveness_probe`` seconds and probes the path; the probe
    fails and ``receive`` raises ``BrokenResourceError`` naming it -- within 1 s, not after the
    keepalive.  Without probing the reader waits on (the TCP link here stays up)."""
    if env.fabric is None:
        pytest.skip("needs the simulated wire's fault knobs (across hosts: tests/test_twohost.py)")
    cfg = RdmaConfig(liveness_probe=probe)
    async with no_fd_leak(), stream_pair_on(env, server_config=cfg) as (a, b):
        outcome: list[BaseException | None] = []
        done = anyio.Event()
        flowing = anyio.Event()

        async def stream_to_b() -> None:
            with anyio.move_on_after(10):
                try:
                    while True:
                        await a.send(os.urandom(1000))
                        await anyio.sleep(0.005)
                except (BrokenResourceError, ClosedResourceError):
                    pass  # (its host is "dead": its QP is gone)

        async def read() -> None:
            got = 0
            while True:
                got += len(await b.receive())
                if got > 20_000:
                    flowing.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream_to_b)
            tg.start_soon(_recorded, read, outcome, done)
            with anyio.fail_after(10):
                await flowing.wait()
            await _kill_the_peer_and_expect_the_probe(env, _link(a).qp_num, done, outcome, probe, "the reader")
            tg.cancel_scope.cancel()


@pytest.mark.paced
async def test_an_idle_reader_probes_its_live_peer_rarely(anyio_backend: Any, env: Env) -> None:
    """A reader waits on an idle connection whose peer is alive: the plan probes after 0.05 s,
    then 0.1, 0.2, 0.4 s later (each answered), so a second of waiting costs four probes, not
    twenty; the connection is unharmed, and it leaves the device's plan once nobody waits."""
    cfg = RdmaConfig(liveness_probe=0.05)
    async with no_fd_leak(), stream_pair_on(env, server_config=cfg) as (a, b):
        link = _link(b)
        probes: list[float] = []
        watch = link.watch
        real = watch.probe_liveness

        def counted() -> None:
            probes.append(time.monotonic())
            real()

        watch.probe_liveness = counted
        async with anyio.create_task_group() as tg:

            async def read() -> None:
                assert await b.receive() == b"late"

            tg.start_soon(read)
            await anyio.sleep(1.0)
            assert watch in link.device.liveness  # (a task waits)
            await a.send(b"late")
        assert 2 <= len(probes) <= 5, probes
        gaps = [t1 - t0 for t0, t1 in zip(probes, probes[1:])]
        assert len(gaps) < 2 or gaps[-1] >= 1.5 * gaps[0], gaps  # (it backs off: 0.1, 0.2, 0.4 s)
        with anyio.fail_after(5):
            while link.session.probe_outstanding:
                await anyio.sleep(0.01)
        assert link.session.probe_status == 0  # (answered)
        await a.send(b"again")
        assert await b.receive() == b"again"
        with anyio.fail_after(5):
            while watch in link.device.liveness:  # nobody waits: the next look drops it
                await anyio.sleep(0.05)


@pytest.mark.paced
async def test_idle_readers_to_one_peer_host_share_its_probes(anyio_backend: Any, env: Env,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Four readers wait on four idle connections to one peer host: the device probes the path
    (our GID, the peer's), not each connection -- a second of waiting costs about as many probes
    as one connection's (0.05, 0.1, 0.2, 0.4 s), and they take turns.  Then (on the simulated
    wire) the peer host dies -- every QP of its side vanishes -- and every reader fails within a
    second, naming the probe: the first failure makes the path suspect and the others are
    probed at once, in one look (on this wire a failure is instant; a NIC takes its retry
    budget for each, so one after another would take that many budgets)."""
    cfg = RdmaConfig(liveness_probe=0.05)
    looks: list[int] = []  # how many connections each look of the plan probed
    real_tick = ProbePlan.tick

    def tick(self: ProbePlan[Any], now: float, look: Any) -> list[Any]:
        probed = real_tick(self, now, look)
        if probed:
            looks.append(len(probed))
        return probed

    monkeypatch.setattr(ProbePlan, "tick", tick)
    async with no_fd_leak(), AsyncExitStack() as stack:
        pairs = [await stack.enter_async_context(stream_pair_on(env, server_config=cfg)) for _ in range(4)]
        probes: list[int] = []
        for i, (_a, b) in enumerate(pairs):
            watch = _link(b).watch
            real = watch.probe_liveness

            def counted(i: int = i, real: Callable[[], None] = real) -> None:
                probes.append(i)
                real()

            watch.probe_liveness = counted
        outcome: list[BaseException | None] = []
        done = [anyio.Event() for _ in pairs]

        async with anyio.create_task_group() as tg:
            for (_a, b), ended in zip(pairs, done):
                tg.start_soon(_recorded, b.receive, outcome, ended)
            await anyio.sleep(1.0)
            assert all(_link(b).watch in _link(b).device.liveness for _a, b in pairs)  # (all wait)
            assert 2 <= len(probes) <= 6, probes  # one connection alone makes 2-5
            assert len(set(probes)) == len(probes), probes  # (in turn)
            if env.fabric is None:
                for a, _b in pairs:
                    await a.send(b"late")
            else:
                for a, _b in pairs:  # the peer host dies: all of its QPs vanish
                    env.fabric.kill_qp(_link(a).qp_num)
            before = len(looks)
            t0 = time.monotonic()
            with anyio.fail_after(5):
                for ended in done:
                    await ended.wait()
            took = time.monotonic() - t0
        if env.fabric is None:
            assert outcome == [None] * 4
        else:
            assert took < 1.5, took
            assert len(outcome) == 4 and all(isinstance(exc, BrokenResourceError) for exc in outcome), outcome
            assert any("probe" in str(exc) for exc in outcome), outcome
            assert looks[before:][:2] == [1, 3], looks  # one probe fails: the three others at once


async def test_many_connections_share_one_device(anyio_backend: Any, env: Env) -> None:
    async with no_fd_leak():
        async with anyio.create_task_group() as tg:
            results: list[bool] = []

            async def one(i: int) -> None:
                async with stream_pair_on(env) as (a, b):
                    payload = os.urandom(1000 + i * 997)
                    await a.send(payload)
                    results.append(await read_exactly(b, len(payload)) == payload)

            with anyio.fail_after(60):
                for i in range(12):
                    tg.start_soon(one, i)
        assert results == [True] * 12
        assert env.live()["contexts"] == 0


async def test_closing_while_another_task_waits_to_receive(anyio_backend: Any, env: Env) -> None:
    """B7: a task parked in receive() is woken by aclose() with ClosedResourceError."""
    async with no_fd_leak(), stream_pair_on(env) as (a, _b):
        errors: list[BaseException] = []

        async def parked() -> None:
            try:
                await a.receive()
            except BaseException as exc:
                errors.append(exc)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(parked)
                await anyio.sleep(0.05)
                await a.aclose()
        assert len(errors) == 1 and isinstance(errors[0], ClosedResourceError)


async def test_a_busy_receiver_yields_to_other_tasks(anyio_backend: Any, env: Env) -> None:
    """B12: with data always buffered, receive() still checkpoints: another task gets to run."""
    async with no_fd_leak(), stream_pair_on(env) as (a, b):
        await a.send(bytes(200_000))
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.sleep(0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            for _ in range(50):
                await b.receive(1)
            tg.cancel_scope.cancel()
        assert ticks >= 25


async def test_typed_memoryviews_are_framed_by_bytes(anyio_backend: Any, env: Env) -> None:
    """B13 over RDMA (the conformance suite has it for every transport)."""
    values = array("I", range(1 << 18))  # 1 MiB of 4-byte items
    async with no_fd_leak(), stream_pair_on(env) as (a, b):
        await a.send(memoryview(values))
        assert await read_exactly(b, len(values) * 4) == values.tobytes()


async def test_a_refused_post_is_fatal_and_releases_everything(anyio_backend: Any, env: Env) -> None:
    """A post that fails (here: ENOMEM with no precise count) leaves the QP in an unknown state:
    the connection breaks with the verbs error as its cause, teardown still releases everything."""
    import errno

    from aiordma._errors import PostError

    async with no_fd_leak(), stream_pair_on(env) as (a, _b):
        link = _link(a)
        qp = link.qp
        if link.native is not None:
            if env.kind == "rxe":
                pytest.skip("a device refuses no post on demand; the native path's refusal is tested on "
                            "the simulated wire")  # fmt: skip
            qp._post_send = lambda *args, **kw: errno.ENOMEM  # the simulated QP refuses what C recorded
            with pytest.raises(BrokenResourceError) as ei:
                await a.send(b"x" * 100)
            assert isinstance(ei.value.__cause__, aiordma.RDMAError) and ei.value.__cause__.errno == errno.ENOMEM
            with pytest.raises(BrokenResourceError):
                await a.send(b"again")
            return

        def refuse(*args: Any) -> None:
            raise PostError(errno.ENOMEM, "ibv_post_send", 0, 1)

        qp.post_send_imm = refuse
        qp.post_send_batch = refuse
        with pytest.raises(BrokenResourceError) as ei:
            await a.send(b"x" * 100)
        assert isinstance(ei.value.__cause__, PostError)
        with pytest.raises(BrokenResourceError):
            await a.send(b"again")


async def test_a_peer_cannot_write_into_our_buffers(anyio_backend: Any, env: Env) -> None:
    """Least privilege: our rings are local-only, so a peer that knows (or guesses) an address
    and rkey gets a remote access error; nothing of ours is touched and our other
    connection on the same device goes on."""
    from aiordma._rdma.constants import Opcode, SendWR

    async with no_fd_leak(), stream_pair_on(env) as (a, b), stream_pair_on(env) as (c, d):
        victim = _link(b)
        target = victim.res.recv_mr
        before = bytes(target.view()[:64])
        attacker = _link(a)
        src = attacker.res.send_mr
        src.view()[:64] = b"\xee" * 64
        attacker.qp.post_send(SendWR(Opcode.RDMA_WRITE, wr_id=(1 << 63) | 9, addr=src.addr, length=64, lkey=src.lkey,
                                     remote_addr=target.addr, rkey=target.rkey))  # fmt: skip
        with anyio.fail_after(10):
            with pytest.raises(BrokenResourceError) as ei:
                while True:
                    await a.receive()
        assert "REM_ACCESS_ERR" in str(ei.value.__cause__), ei.value.__cause__
        assert bytes(target.view()[:64]) == before
        await c.send(b"other connection")
        assert await d.receive() == b"other connection"


async def test_connections_with_separate_backends_share_the_device(anyio_backend: Any, env: Env) -> None:
    """The device is opened once per loop, whatever backend object each call was given."""
    async with no_fd_leak():
        async with await aiordma.create_channel_listener(env.host, 0, transport="rdma", rdma_backend=env.backend()) as lst:
            async with anyio.create_task_group() as tg:
                tg.start_soon(lst.serve, lambda ch: ch.aclose())
                for _ in range(3):
                    ch = await aiordma.connect_channel(env.host, lst.port, transport="rdma", rdma_backend=env.backend())
                    await ch.aclose()
                    assert len(open_devices()) == 1
                    assert env.live()["contexts"] == 1
                tg.cancel_scope.cancel()


@pytest.mark.parametrize("step", [1000, 100])
async def test_asyncio_writes_without_drain_all_arrive_when_the_send_ring_is_small(
    anyio_backend: Any, env: Env, step: int
) -> None:
    """asyncio's write() without drain() over a small send queue and a 2-slot send ring, with many
    credits: the backlog is moved by our own send completions while no task waits for them, and
    every byte arrives.  With 100-byte writes the first ones go out inline and fill the send
    queue (8 entries) long before the peer owes a credit (32 of 64): only a send completion can
    move the rest, and it must wake the loop although nobody awaits it.  On the simulated wire the
    server gets a second device (another CQ and poller, as on another host): on one shared CQ the
    server's own wake-ups would poll the client's send completions and hide a lost wake-up."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("the asyncio API")
    import aiordma.asyncio as aio

    small = RdmaConfig(window=2, buffer_size=4096)
    big = RdmaConfig(window=64, buffer_size=4096)
    got = bytearray()
    done = asyncio.Event()
    total = (2 << 20) if step >= 1000 else (256 << 10)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while len(got) < total:
            chunk = await reader.read(1 << 16)
            if not chunk:
                break
            got.extend(chunk)
        done.set()
        writer.close()

    server_host = env.host
    if env.fabric is not None:
        env.fabric.add_device("sim1", "127.0.0.2")
        server_host = "127.0.0.2"
    server = await aio.start_server(handle, server_host, 0, transport="rdma", rdma_backend=env.backend(config=big))
    async with server:
        port = server.sockets[0].getsockname()[1]
        reader, writer = await aio.open_connection(server_host, port, transport="rdma",
                                                   rdma_backend=env.backend(config=small))  # fmt: skip
        if env.fabric is not None:
            assert len(open_devices()) == 2
        data = os.urandom(total)
        try:
            for i in range(0, total, step):
                writer.write(data[i : i + step])  # no drain
            with anyio.fail_after(20 if env.kind != "rxe" else 300):
                await done.wait()
            assert bytes(got) == data
        finally:  # (also when it failed: the server waits for its handler, the handler for EOF)
            writer.close()
            await writer.wait_closed()


@pytest.mark.paced
@pytest.mark.parametrize("fault", ["sends_beyond_credits", "oversized_send", "garbage_payload", "read_guessed_rkey"])
async def test_a_hostile_peer_breaks_only_its_own_connection(anyio_backend: Any, env: Env, fault: str) -> None:
    """Issue 11's hostile peer, written against the verbs layer (raw work requests on its QP,
    bypassing its session): SENDs beyond the credits it was given, a SEND larger than our
    buffers, a SEND of bytes that are no aiordma frames, an RDMA READ of our rings with their
    rkey.  The victim's connection fails with a typed error (or the attacker's does, for the
    READ), our other connection on the same device goes on, and nothing leaks."""
    from aiordma._rdma.constants import Access

    one_loop_on_a_device(env.kind == "rxe", anyio_backend)
    async with no_fd_leak(), stream_pair_on(env) as (a, b), stream_pair_on(env) as (c, d):
        attacker, victim = _link(a), _link(b)
        cfg = victim.config
        # the attacker's own memory for its raw work requests (its session's send ring may still
        # hold posted SENDs: writing there would corrupt those instead)
        src = attacker.device.pd.reg_mr(2 * cfg.buffer_size, Access.LOCAL_WRITE)
        try:
            await _hostile(fault, a, b, c, d, attacker, victim, cfg, src)
        finally:
            await a.aclose()  # (the attacker's QP is gone after this: nothing can still read src)
            src.close()


async def _hostile(fault: str, a: Any, b: Any, c: Any, d: Any, attacker: Any, victim: Any, cfg: RdmaConfig,
                   src: Any) -> None:  # fmt: skip
    from aiordma._proto.protocol import FrameType, frame
    from aiordma._rdma.constants import Opcode, SendWR
    from aiordma._rdma.credits import SendKind, pack_imm

    broken = b
    if fault == "read_guessed_rkey":
        target = victim.res.recv_mr
        attacker.qp.post_send(SendWR(Opcode.RDMA_READ, wr_id=(1 << 63) | 11, addr=src.addr, length=64,
                                     lkey=src.lkey, remote_addr=target.addr, rkey=target.rkey))  # fmt: skip
        broken = a  # the READ fails on the attacker's side (a remote access error), nothing read
    else:
        if fault == "oversized_send":
            payloads = [b"\0" * (cfg.buffer_size + 1)]
        elif fault == "garbage_payload":
            payloads = [b"\xff" * 64]
        else:
            # the victim does not read: past its receive high mark it withholds the credits
            # its reposts would return; then a flood of more DATA SENDs than its whole window
            async def fill() -> None:
                with anyio.move_on_after(30):
                    try:
                        await a.send(b"f" * (3 << 20))
                    except (BrokenResourceError, ClosedResourceError):
                        pass  # (the attacker's own connection breaks too: its raw WRs complete)

            filler = await _start_soon(fill)
            with anyio.fail_after(20):
                while not _withheld(victim):
                    await anyio.sleep(0.01)
            payloads = [frame(FrameType.DATA, b"x")] * (cfg.window + cfg.control + 2)
        for i, payload in enumerate(payloads):
            src.view()[: len(payload)] = payload
            attacker.qp.post_send(SendWR(Opcode.SEND_WITH_IMM, wr_id=(1 << 63) | (20 + i), addr=src.addr,
                                         length=len(payload), lkey=src.lkey,
                                         imm_data=pack_imm(SendKind.DATA, 0, 0)))  # fmt: skip
    with anyio.fail_after(20):
        with pytest.raises(BrokenResourceError) as ei:
            while True:
                await broken.receive()
    cause = ei.value.__cause__
    if fault == "sends_beyond_credits":
        filler.cancel()
    if fault == "read_guessed_rkey":
        # (the simulated wire and most NICs NAK it as an access error; rxe NAKs a READ with a
        # bad rkey as an invalid request: both are the responder's refusal)
        assert any(s in str(cause) for s in ("REM_ACCESS_ERR", "REM_INV_REQ_ERR")), cause
    elif fault == "sends_beyond_credits":
        # the SENDs it still had credits for join the byte stream (in the middle of a DATA
        # frame: the framing check fails), the rest are refused by the credit check; which of
        # the two fires first depends on when the completions are polled
        assert isinstance(cause, aiordma.RemoteProtocolError), cause
        assert "without a credit" in str(cause) or "frame" in str(cause), cause
    elif fault == "garbage_payload":
        assert isinstance(cause, aiordma.ProtocolError), cause
    else:
        assert isinstance(cause, (aiordma.RemoteProtocolError, aiordma.RDMAError)), cause
    # the other connection on the same device is untouched
    await c.send(b"other connection")
    assert await d.receive() == b"other connection"
    await d.send(b"and back")
    assert await c.receive() == b"and back"


def _withheld(link: Any) -> bool:
    session = link.session
    return bool(session.c.withheld if getattr(session, "native", False) else session.withheld)


async def _start_soon(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a task of the running loop; returns something with ``cancel()``."""
    import sniffio

    if sniffio.current_async_library() == "trio":
        import trio

        scope = trio.CancelScope()

        async def run() -> None:
            with scope:
                await fn()

        trio.lowlevel.spawn_system_task(run)
        return scope
    return asyncio.ensure_future(fn())
