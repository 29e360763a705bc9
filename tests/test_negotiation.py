"""Whatever changes what a peer may send is negotiated (issue 31, item 4): two endpoints with
different configurations interoperate over the simulated wire, or refuse at the handshake with
a reason -- never fail on the first message that crosses a threshold only one of them knows.

First case found: a client with ``RdmaConfig(hot_path="checked")`` (no native path, so it cannot
READ a rendezvous) lost its connection on the first message of 8 MiB from a default server:
whether the receiver READs rendezvous came from the sender's own config.  The HELLO's RDMA
parameters now carry it (flag ``READS_RENDEZVOUS``), and a sender uses the rendezvous only
towards a peer that READs it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiordma
from aiordma import RdmaConfig
from aiordma.testing import SimFabric, simulated_backend

from ._pairs import served_pair

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def mixed_pair(fabric: SimFabric, server_cfg: RdmaConfig, client_cfg: RdmaConfig,
                     max_message_size: int = 32 << 20) -> AsyncIterator[tuple[Any, Any]]:  # fmt: skip
    listener = await aiordma.create_channel_listener(
        "127.0.0.1", 0, transport="rdma", rdma_backend=simulated_backend(server_cfg, fabric=fabric),
        max_message_size=max_message_size,
    )  # fmt: skip
    connect = partial(
        aiordma.connect_channel, "127.0.0.1", transport="rdma",
        rdma_backend=simulated_backend(client_cfg, fabric=fabric), max_message_size=max_message_size,
    )  # fmt: skip
    async with served_pair(listener, connect) as pair:
        yield pair


async def exchange(fabric: SimFabric, server_cfg: RdmaConfig, client_cfg: RdmaConfig, sizes: list[int]) -> None:
    """Both directions, each size, concurrently: every message arrives as sent."""
    msgs = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    async with mixed_pair(fabric, server_cfg, client_cfg) as (client, server):
        for a, b in ((client, server), (server, client)):
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:

                    async def produce(a: Any = a) -> None:
                        for m in msgs:
                            await a.send(m)

                    tg.start_soon(produce)
                    for m in msgs:
                        got = await b.receive()
                        assert len(got) == len(m) and got == m


@pytest.fixture
def fabric() -> Any:
    fab = SimFabric()
    fab.add_device("sim0", "127.0.0.1")
    yield fab
    fab.release()


async def test_a_checked_client_and_a_default_server_exchange_rendezvous_sized_messages(
    anyio_backend: Any, fabric: SimFabric
) -> None:
    await exchange(fabric, RdmaConfig(), RdmaConfig(hot_path="checked"), [9 << 20, 100, 16 << 20])
    await exchange(fabric, RdmaConfig(hot_path="checked"), RdmaConfig(), [9 << 20, 100, 16 << 20])


def configs() -> st.SearchStrategy[RdmaConfig]:
    return st.builds(
        RdmaConfig,
        hot_path=st.sampled_from([None, "checked"]),
        rendezvous=st.sampled_from([0, 4096, 1 << 20, 8 << 20]),
        window=st.sampled_from([2, 8, 64]),
        buffer_size=st.sampled_from([4096, 65536]),
    )


@given(server_cfg=configs(), client_cfg=configs(),
       sizes=st.lists(st.sampled_from([0, 1, 4095, 4096, 4097, 65536, 65537, (1 << 20) + 1, 9 << 20]),
                      min_size=1, max_size=5))  # fmt: skip
@settings(max_examples=int(os.environ.get("AIORDMA_HYPOTHESIS_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
async def test_any_two_configurations_interoperate(
    anyio_backend: Any, server_cfg: RdmaConfig, client_cfg: RdmaConfig, sizes: list[int]
) -> None:
    """Two configurations drawn (hot path, rendezvous threshold, window, slot size), a mixed-size
    exchange across every threshold in both directions."""
    fab = SimFabric()
    fab.add_device("sim0", "127.0.0.1")
    try:
        await exchange(fab, server_cfg, client_cfg, sizes)
    finally:
        fab.release()


def server_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "max_message_size": st.sampled_from([65536, (1 << 20) + 1, 32 << 20]),
        "keepalive": st.sampled_from([None, 5.0]),
        "max_rdma_connections": st.sampled_from([None, 0, 4]),
        "max_pinned_bytes": st.sampled_from([None, 1 << 20]),  # (1 MiB: less than one connection's rings)
    })  # fmt: skip


def client_options() -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "max_message_size": st.sampled_from([65536, (1 << 20) + 1, 32 << 20]),
        "keepalive": st.sampled_from([None, 5.0]),
        "transport": st.sampled_from([None, "rdma"]),
    })  # fmt: skip


def full_configs() -> st.SearchStrategy[RdmaConfig]:
    return st.builds(
        RdmaConfig,
        hot_path=st.sampled_from([None, "checked"]),
        rendezvous=st.sampled_from([0, 4096, 1 << 20, 8 << 20]),
        rendezvous_inflight=st.sampled_from([1 << 20, 16 << 20]),
        window=st.sampled_from([1, 8, 64]),
        control=st.sampled_from([1, 2, 4]),
        buffer_size=st.sampled_from([4096, 65536]),
        max_inline=st.sampled_from([0, 64, 256]),
        signal_every=st.sampled_from([1, 8]),
    )


SIZES = [0, 1, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 65536, 65537, (1 << 20) + 1, (1 << 20) + 2, 9 << 20]


@given(server_cfg=full_configs(), client_cfg=full_configs(), server_opts=server_options(),
       client_opts=client_options(), sizes=st.lists(st.sampled_from(SIZES), min_size=1, max_size=5))  # fmt: skip
@settings(max_examples=int(os.environ.get("AIORDMA_HYPOTHESIS_EXAMPLES", "15")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
async def test_any_two_configurations_and_options_interoperate_or_refuse_with_a_reason(
    anyio_backend: Any, server_cfg: RdmaConfig, client_cfg: RdmaConfig, server_opts: dict[str, Any],
    client_opts: dict[str, Any], sizes: list[int],
) -> None:  # fmt: skip
    """Two RdmaConfigs and two sets of connect/listener options drawn (limits on message size and
    on RDMA connections and pinned memory, keepalive, a strict client): the client connects --
    over RDMA, over TCP with the reason, or (strict) refused with ``RDMAUnavailableError`` and
    its reason -- then both directions exchange messages across every threshold (inline,
    slot, rendezvous, each side's own limit).  A message over the receiver's limit is refused
    before anything is sent (``LocalProtocolError``), and the connection goes on."""
    fab = SimFabric()
    fab.add_device("sim0", "127.0.0.1")
    try:
        listener = await aiordma.create_channel_listener(
            "127.0.0.1", 0, rdma_backend=simulated_backend(server_cfg, fabric=fab), **server_opts
        )  # fmt: skip
        connect = partial(aiordma.connect_channel, "127.0.0.1", rdma_backend=simulated_backend(client_cfg, fabric=fab),
                          **client_opts)  # fmt: skip
        refuses = server_opts["max_rdma_connections"] == 0  # (surely; a pinned-bytes limit may refuse too)
        may_refuse = refuses or server_opts["max_pinned_bytes"] is not None
        try:
            pair = served_pair(listener, connect)
            with anyio.fail_after(30):
                client, server = await pair.__aenter__()
        except aiordma.RDMAUnavailableError as exc:
            assert client_opts["transport"] == "rdma" and may_refuse, exc
            assert exc.reason, "a refusal without a reason"
            return
        try:
            transport = client.extra(aiordma.TransportAttribute.transport)
            reason = client.extra(aiordma.TransportAttribute.fallback_reason)
            assert transport == "tcp" if refuses else (transport == "rdma" or may_refuse), (transport, reason)
            assert (transport == "tcp") == bool(reason), (transport, reason)
            if transport == "tcp":
                assert "max_rdma_connections" in reason or "max_pinned_bytes" in reason, reason
            assert server.extra(aiordma.TransportAttribute.transport) == transport
            for a, b, limit in ((client, server, server_opts["max_message_size"]),
                                (server, client, client_opts["max_message_size"])):  # fmt: skip
                msgs = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
                fits = [m for m in msgs if len(m) <= limit]
                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:

                        async def produce(a: Any = a, msgs: list[bytes] = msgs, limit: int = limit) -> None:
                            for m in msgs:
                                if len(m) > limit:
                                    with pytest.raises(aiordma.LocalProtocolError):
                                        await a.send(m)
                                else:
                                    await a.send(m)

                        tg.start_soon(produce)
                        for m in fits:
                            got = await b.receive()
                            assert len(got) == len(m) and got == m
        finally:
            await pair.__aexit__(None, None, None)
    finally:
        fab.release()
