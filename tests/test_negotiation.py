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
