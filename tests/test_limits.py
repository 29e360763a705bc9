"""A listener's limits: handshakes in progress, RDMA connections and their pinned ring bytes.

The budget alone (hypothesis: any sequence of calls stays within its limits and returns to zero),
then real listeners over TCP and the simulated RC wire: a flood of handshakes that never finish
does not keep a well-behaved client out once the limit frees, an RDMA connection over the limit
gets TCP with the limit in its reason (or a refusal under ``transport="rdma"``), and the budget
comes back when a connection's teardown is done.
"""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aiordma
from aiordma._limits import ListenerBudget, ring_bytes
from aiordma.testing import SimFabric, SimProvider

from ._leaks import no_fd_leak

pytestmark = pytest.mark.anyio


@given(
    st.integers(1, 4),
    st.one_of(st.none(), st.integers(0, 3)),
    st.one_of(st.none(), st.integers(0, 10)),
    st.lists(st.tuples(st.sampled_from(["hs", "end", "rdma", "free"]), st.integers(1, 4)), max_size=60),
)
def test_the_budget_never_exceeds_its_limits(hs: int, conns: int | None, pinned: int | None, ops: list[tuple[str, int]]) -> None:
    b = ListenerBudget(hs, conns, pinned)
    open_hs = 0
    releases: list[Any] = []
    for op, n in ops:
        if op == "hs":
            refusal = b.begin_handshake()
            assert (refusal is None) == (open_hs < hs)
            if refusal is None:
                open_hs += 1
            else:
                assert f"max_handshakes={hs}" in refusal
        elif op == "end" and open_hs:
            b.end_handshake()
            open_hs -= 1
        elif op == "rdma":
            got = b.reserve_rdma(n)
            if isinstance(got, str):
                assert "max_rdma_connections" in got or "max_pinned_bytes" in got
            else:
                releases.append(got)
        elif op == "free" and releases:
            release = releases.pop(0)
            release()
            release()  # idempotent
        assert b.handshakes == open_hs <= hs
        assert conns is None or b.rdma_connections <= conns
        assert pinned is None or b.pinned_bytes <= pinned
        assert b.rdma_connections == len(releases)
    for release in releases:
        release()
    assert b.rdma_connections == 0 and b.pinned_bytes == 0


def test_bad_limits() -> None:
    with pytest.raises(ValueError):
        ListenerBudget(0)
    with pytest.raises(ValueError):
        ListenerBudget(1, -1)


async def test_stalled_handshakes_hold_only_their_slots(anyio_backend: Any) -> None:
    async with no_fd_leak():
        lst = await aiordma.create_channel_listener("127.0.0.1", 0, transport="tcp", max_handshakes=2,
                                                    handshake_timeout=1.0)  # fmt: skip
        async with lst, anyio.create_task_group() as tg:

            async def handler(ch: aiordma.Channel) -> None:
                async with ch:
                    await ch.send(b"welcome")

            tg.start_soon(lst.serve, handler)
            # two clients that connect and say nothing: they hold both handshake slots
            stalled = [socket.create_connection(("127.0.0.1", lst.port)) for _ in range(2)]
            try:
                await anyio.sleep(0.2)
                with anyio.fail_after(5), pytest.raises(aiordma.HandshakeError, match="max_handshakes=2"):
                    await aiordma.connect_channel("127.0.0.1", lst.port, transport="tcp")
                # their handshakes time out (1 s): the slots free, a real client gets in
                with anyio.fail_after(10):
                    while True:
                        try:
                            ch = await aiordma.connect_channel("127.0.0.1", lst.port, transport="tcp")
                        except aiordma.HandshakeError:
                            await anyio.sleep(0.1)
                            continue
                        break
                async with ch:
                    assert await ch.receive() == b"welcome"
            finally:
                for sock in stalled:
                    sock.close()
            tg.cancel_scope.cancel()


def _sim() -> tuple[SimFabric, Any]:
    fabric = SimFabric()
    fabric.add_device("sim0", "127.0.0.1")
    return fabric, lambda: aiordma.RdmaBackend(provider=SimProvider(fabric))


async def test_rdma_connections_over_the_limit_get_tcp_and_say_why(anyio_backend: Any) -> None:
    fabric, backend = _sim()
    async with no_fd_leak():
        lst = await aiordma.create_channel_listener("127.0.0.1", 0, rdma_backend=backend(), max_rdma_connections=1)
        async with lst, anyio.create_task_group() as tg:

            async def handler(ch: aiordma.Channel) -> None:
                async with ch:
                    try:
                        while True:
                            await ch.send(await ch.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass

            tg.start_soon(lst.serve, handler)
            first = await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend())
            assert first.transport == "rdma"
            second = await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend())
            assert second.transport == "tcp"
            assert "max_rdma_connections=1" in second.fallback_reason
            with pytest.raises(aiordma.RDMAUnavailableError, match="max_rdma_connections=1"):
                await aiordma.connect_channel("127.0.0.1", lst.port, transport="rdma", rdma_backend=backend())
            for ch in (first, second):
                await ch.send(b"still fine")
                assert await ch.receive() == b"still fine"
                await ch.aclose()
            # once the first one's teardown is done, RDMA is there again
            with anyio.fail_after(10):
                while True:
                    third = await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend())
                    if third.transport == "rdma":
                        break
                    await third.aclose()
                    await anyio.sleep(0.05)
            await third.aclose()
            tg.cancel_scope.cancel()
    with anyio.fail_after(10):
        while fabric.live_objects().get("qps", 0):
            await anyio.sleep(0.01)


async def test_pinned_bytes_over_the_limit_get_tcp(anyio_backend: Any) -> None:
    fabric, backend = _sim()
    one = ring_bytes(aiordma.RdmaConfig())
    async with no_fd_leak():
        lst = await aiordma.create_channel_listener("127.0.0.1", 0, rdma_backend=backend(), max_pinned_bytes=one - 1)
        async with lst, anyio.create_task_group() as tg:

            async def handler(ch: aiordma.Channel) -> None:
                await ch.aclose()

            tg.start_soon(lst.serve, handler)
            async with await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend()) as ch:
                assert ch.transport == "tcp"
                assert f"max_pinned_bytes={one - 1}" in ch.fallback_reason
            tg.cancel_scope.cancel()
