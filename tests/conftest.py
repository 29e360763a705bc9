"""Shared fixtures: the three event loops, the RDMA marker, leak checks."""

from __future__ import annotations

import os
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency
    uvloop = None

SYSFS_IB = "/sys/class/infiniband"

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop")
    if uvloop is not None
    else pytest.param(("asyncio", {}), id="uvloop", marks=pytest.mark.skip(reason="uvloop is not installed")),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def rdma_device_present() -> bool:
    try:
        return bool(os.listdir(SYSFS_IB))
    except OSError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if rdma_device_present():
        return
    skip = pytest.mark.skip(
        reason="needs an RDMA device: none on this host (the README's test command runs these in the Soft-RoCE guest)"
    )
    for item in items:
        if "rdma" in item.keywords:
            item.add_marker(skip)

