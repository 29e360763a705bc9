"""The RDMA transport on a real device (Soft-RoCE in the guest, or an RNIC).

The conformance suite runs over RDMA too (tests/test_conformance.py, kind
``rdma``); this file covers what is RDMA's own: fallback from every setup
step, strict mode, teardown and resource release, a dead peer.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio import BrokenResourceError

import aiordma
from aiordma import RdmaBackend, RdmaConfig, TransportAttribute
from aiordma._rdma import verbs as verbs
from aiordma._rdma import RdmaEndpoint, RdmaSetupError
from aiordma.testing import rdma_address

from .._leaks import no_fd_leak

pytestmark = [pytest.mark.rdma, pytest.mark.anyio]

STEPS = ["device", "open", "resources", "init", "memory", "post", "params", "rtr", "rts", "probe"]


@pytest.fixture
def host() -> str:
    address = rdma_address()
    assert address is not None, "no RDMA device with an IPv4 RoCEv2 address"
    return address


@pytest.fixture(autouse=True)
def no_live_verbs_objects() -> Any:
    yield
    assert verbs.live_objects() == dict.fromkeys(verbs.live_objects(), 0)


class FailingBackend(RdmaBackend):
    """Makes one setup step fail, as a real failure of that step would."""

    def __init__(self, step: str, config: RdmaConfig | None = None) -> None:
        super().__init__(config)
        self.step = step

    def before_step(self, step: str) -> None:
        if step == self.step:
            raise RdmaSetupError(step, f"injected failure of {step}")


class HangingProbeBackend(RdmaBackend):
    async def probe_delay(self) -> None:
        await anyio.sleep(3600)


class UnreachableGidBackend(RdmaBackend):
    """Announces a GID that no device answers for."""

    def open(self, local_ip: str | None) -> RdmaEndpoint:
        return _UnreachableEndpoint(self, local_ip)


class _UnreachableEndpoint(RdmaEndpoint):
    @property
    def params(self) -> Any:
        real = super().params
        import dataclasses
        import ipaddress

        return dataclasses.replace(real, gid=ipaddress.IPv6Address("::ffff:198.19.254.254").packed)


@asynccontextmanager
async def echo_channel(
    host: str, server_transport: str = "auto", server_backend: RdmaBackend | None = None
) -> AsyncIterator[int]:
    async def handler(channel: aiordma.Channel) -> None:
        async with channel:
            async for message in channel:
                await channel.send(message)

    async with await aiordma.create_channel_listener(
        host, 0, transport=server_transport, rdma_backend=server_backend
    ) as listener:
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handler)
            yield listener.port
            tg.cancel_scope.cancel()


async def round_trip(channel: aiordma.Channel) -> None:
    for message in (b"", b"ping", os.urandom(200_000)):
        await channel.send(message)
        assert await channel.receive() == message


async def test_auto_uses_rdma_and_reports_it(anyio_backend: Any, host: str) -> None:
    async with no_fd_leak(), echo_channel(host) as port:
        async with await aiordma.connect_channel(host, port) as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.transport) == "rdma"
            assert channel.extra(TransportAttribute.fallback_reason) == ""
            assert channel.extra(TransportAttribute.device).startswith("rxe") or channel.extra(
                TransportAttribute.device
            )
            assert channel.extra(TransportAttribute.qp_num) > 0
            assert verbs.live_objects()["qps"] == 2


async def test_peer_without_rdma_interoperates(anyio_backend: Any, host: str) -> None:
    async with no_fd_leak(), echo_channel(host, server_transport="tcp") as port:
        async with await aiordma.connect_channel(host, port) as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.transport) == "tcp"
            assert channel.extra(TransportAttribute.fallback_reason) == "server: transport='tcp' was requested"
    async with no_fd_leak(), echo_channel(host) as port:
        async with await aiordma.connect_channel(host, port, transport="tcp") as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.fallback_reason) == "client: transport='tcp' was requested"


@pytest.mark.parametrize("side", ["client", "server"])
@pytest.mark.parametrize("step", STEPS)
async def test_each_failing_setup_step_falls_back_to_tcp(anyio_backend: Any, host: str, side: str, step: str) -> None:
    if side == "server" and step == "probe":
        pytest.skip("only the client probes the path")
    failing = FailingBackend(step)
    async with no_fd_leak(), echo_channel(host, server_backend=failing if side == "server" else None) as port:
        async with await aiordma.connect_channel(
            host, port, rdma_backend=failing if side == "client" else None
        ) as channel:
            await round_trip(channel)  # no data lost
            assert channel.extra(TransportAttribute.transport) == "tcp"
            reason = channel.extra(TransportAttribute.fallback_reason)
            assert reason == f"{side}: RDMA setup failed at {step}: injected failure of {step}"


async def test_failing_step_with_strict_rdma_raises(anyio_backend: Any, host: str) -> None:
    async with echo_channel(host, server_backend=FailingBackend("rtr")) as port:
        with pytest.raises(aiordma.RDMAUnavailableError, match="server: RDMA setup failed at rtr"):
            await aiordma.connect_channel(host, port, transport="rdma")


async def test_setup_timeout_falls_back(anyio_backend: Any, host: str) -> None:
    backend = HangingProbeBackend(RdmaConfig(setup_timeout=0.5))
    async with no_fd_leak(), echo_channel(host) as port:
        with anyio.fail_after(20):
            async with await aiordma.connect_channel(host, port, rdma_backend=backend) as channel:
                await round_trip(channel)
                reason = channel.extra(TransportAttribute.fallback_reason)
                assert channel.extra(TransportAttribute.transport) == "tcp"
                assert reason.startswith("client: RDMA setup failed at probe: no answer") and "0.5 s" in reason


async def test_unreachable_gid_falls_back(anyio_backend: Any, host: str) -> None:
    backend = UnreachableGidBackend(RdmaConfig(setup_timeout=10, qp_timeout=10, retry_cnt=1))
    async with no_fd_leak(), echo_channel(host, server_backend=backend) as port:
        with anyio.fail_after(30):
            async with await aiordma.connect_channel(host, port) as channel:
                await round_trip(channel)
                reason = channel.extra(TransportAttribute.fallback_reason)
                assert channel.extra(TransportAttribute.transport) == "tcp"
                assert reason.startswith("client: RDMA setup failed at "), reason
                assert "at rtr" in reason or "at probe" in reason


async def test_strict_client_and_tcp_server(anyio_backend: Any, host: str) -> None:
    async with echo_channel(host, server_transport="tcp") as port:
        with pytest.raises(aiordma.RDMAUnavailableError, match="server: transport='tcp' was requested"):
            await aiordma.connect_channel(host, port, transport="rdma")


async def test_loopback_address_has_no_device(anyio_backend: Any) -> None:
    async with echo_channel("127.0.0.1") as port:
        async with await aiordma.connect_channel("127.0.0.1", port) as channel:
            await round_trip(channel)
            assert channel.extra(TransportAttribute.fallback_reason) == (
                "client: RDMA setup failed at device: no RDMA device has the local address 127.0.0.1"
            )


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {}), id="asyncio")])
async def test_a_thousand_cycles_leave_nothing_behind(anyio_backend: Any, host: str) -> None:
    """One run of a thousand cycles (under asyncio: the loop does not matter here, the time does)."""
    cycles = int(os.environ.get("AIORDMA_TEST_CYCLES", "1000"))
    async with no_fd_leak(), echo_channel(host) as port:
        before = verbs.live_objects()
        for i in range(cycles):
            async with await aiordma.connect_channel(host, port, transport="rdma") as channel:
                payload = i.to_bytes(4, "big") * 16
                await channel.send(payload)
                assert await channel.receive() == payload
        await anyio.sleep(0.2)  # the server side closes after our CLOSE
        assert verbs.live_objects() == before == dict.fromkeys(before, 0)


async def test_cancelled_transfer_releases_everything(anyio_backend: Any, host: str) -> None:
    async def sink(stream: aiordma.Stream) -> None:
        async with stream:
            await anyio.sleep(3600)  # never reads: the client's send blocks on credits

    async with no_fd_leak():
        async with await aiordma.create_listener(host, 0, transport="rdma") as listener:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, sink)
                stream = await aiordma.connect(host, listener.port, transport="rdma")
                with anyio.move_on_after(1) as scope:
                    await stream.send(bytes(64 << 20))
                assert scope.cancelled_caught, "64 MiB went into a peer that does not read"
                with anyio.fail_after(10):
                    await stream.aclose()
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


async def test_killed_peer_breaks_the_stream(anyio_backend: Any, host: str) -> None:
    """A peer process that dies (SIGKILL, no CLOSE) is reported, never waited for."""
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


async def test_asyncio_streams_over_rdma(anyio_backend: Any, host: str) -> None:
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
            server = await aiordma.asyncio.start_server(handler, host, 0, transport="rdma", limit=8 << 20)
            async with server:
                port = server.addresses[0][1]
                reader, writer = await aiordma.asyncio.open_connection(host, port, transport="rdma")
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


async def test_tiny_window_exercises_credits_both_ways(anyio_backend: Any, host: str) -> None:
    """Two data buffers of 4 KiB and one control buffer per side: frames span many SENDs,
    credits run out all the time and come back in credit messages; nothing is lost."""
    tiny = RdmaBackend(RdmaConfig(window=2, control=1, buffer_size=4096))
    sizes = [0, 1, 4095, 4096, 4097, 50_000, 3, 200_000, 7]
    async with no_fd_leak():
        async with await aiordma.create_channel_listener(host, 0, transport="rdma", rdma_backend=tiny) as listener:

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
                        host, listener.port, transport="rdma", rdma_backend=tiny
                    ) as channel:
                        for size in sizes:
                            await channel.send(bytes([size % 251]) * size)
                        back = [await channel.receive() for _ in sizes]
                        assert back == [bytes([size % 251]) * size for size in reversed(sizes)]
                        assert await channel.receive() == b"all good"
                tg.cancel_scope.cancel()
