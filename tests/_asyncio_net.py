"""What the tests of aiordma's asyncio API share: their loops (asyncio and uvloop: the
``anyio_backend`` fixture to import), and :class:`Net`, which opens servers and connections of
one kind -- asyncio's own TCP (``ref``), aiordma over TCP, over the simulated RC wire, or on a
device."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

import aiordma
import aiordma.asyncio as aa
from aiordma.testing import SimFabric, SimProvider, rdma_address

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(
            ("asyncio", {"loop_factory": uvloop.new_event_loop if uvloop else None}),
            id="uvloop",
            marks=pytest.mark.skipif(uvloop is None, reason="uvloop is not installed"),
        ),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


KINDS = [
    pytest.param("tcp", id="tcp"),  # (the Protocol API: passed through, asyncio's own transport)
    pytest.param("tcp-framed", id="tcp-framed"),  # (pass_through=False: aiordma's Transport on TCP)
    pytest.param("sim", id="sim"),
    pytest.param("rdma", id="rdma", marks=pytest.mark.rdma),
]


class Net:
    """Opens servers and connections of one kind (``ref`` is asyncio's own TCP)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.fabric: SimFabric | None = None
        self.host = "127.0.0.1"
        if kind == "sim":
            self.fabric = SimFabric()
            self.fabric.add_device("sim0", "127.0.0.1")
        elif kind == "rdma":
            address = rdma_address()
            assert address is not None, "no RDMA device with an IPv4 RoCEv2 address"
            self.host = address
        self.providers: list[SimProvider] = []

    def _kw(self) -> dict[str, Any]:
        if self.kind in ("tcp", "tcp-framed"):
            return {"transport": "tcp"}
        if self.kind == "sim":
            assert self.fabric is not None
            provider = SimProvider(self.fabric)
            self.providers.append(provider)
            return {"transport": "rdma", "rdma_backend": aiordma.RdmaBackend(provider=provider)}
        return {"transport": "rdma"}

    async def server(self, factory: Callable[[], asyncio.BaseProtocol]) -> Any:
        if self.kind == "ref":
            return await asyncio.get_running_loop().create_server(factory, self.host, 0)
        return await aa.create_server(factory, self.host, 0, **self._protocol_kw())

    async def connect(self, factory: Callable[[], asyncio.BaseProtocol], port: int) -> tuple[Any, Any]:
        if self.kind == "ref":
            return await asyncio.get_running_loop().create_connection(factory, self.host, port)
        return await aa.create_connection(factory, self.host, port, **self._protocol_kw())

    def _protocol_kw(self) -> dict[str, Any]:
        """The Protocol API's (``create_server``, ``create_connection``): it passes through on TCP
        unless told not to."""
        kw = self._kw()
        if self.kind == "tcp-framed":
            kw["pass_through"] = False
        return kw

    def live(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for provider in self.providers:
            for key, value in provider.live_objects().items():
                total[key] = total.get(key, 0) + value
        return total
