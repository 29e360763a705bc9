"""The suite's skip policy, in one place.

* A test of an RDMA device (marked ``rdma``) is skipped where ``/sys/class/infiniband`` lists no
  device: the README's test command runs it in the Soft-RoCE guest (tests/conftest.py applies it).
* On a device, a test runs under one loop (asyncio): under TCG the guest runs Python ~20x slower,
  and every loop runs the same code on the simulated wire (:func:`one_loop_on_a_device`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

SYSFS_IB = "/sys/class/infiniband"

#: why a device test is skipped under trio or uvloop
ONE_LOOP = "on a device, asyncio only: every loop runs this on the simulated wire"


def rdma_device_present() -> bool:
    try:
        return bool(os.listdir(SYSFS_IB))
    except OSError:
        return False


def one_loop_on_a_device(on_device: bool, anyio_backend: Any) -> None:
    """Skip a test on a device (``on_device``) unless it runs under plain asyncio."""
    if on_device and tuple(anyio_backend) != ("asyncio", {}):
        pytest.skip(ONE_LOOP)


def backend_of(request: pytest.FixtureRequest) -> Any:
    """The test's ``anyio_backend`` (plain asyncio for a test without one)."""
    return request.getfixturevalue("anyio_backend") if "anyio_backend" in request.fixturenames else ("asyncio", {})
