"""The wheel built on the host (tests/test_wheel.py: rdma-core's headers hidden, libibverbs not
linked) runs RDMA on a real device: installed on its own into a scratch directory, it loads
libibverbs.so.1 at run time and carries a channel over rxe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.rdma

WHEEL_DIR = Path(__file__).resolve().parent.parent.parent / "build" / "wheel-test"

SCRIPT = r"""
import anyio, aiordma
from aiordma.testing import rdma_address
assert "/wheel-install/" in aiordma.__file__, aiordma.__file__
host = rdma_address()
async def main():
    async def handler(ch):
        async with ch:
            await ch.send(await ch.receive())
    listener = await aiordma.create_channel_listener(host, 0, transport="rdma")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        async with await aiordma.connect_channel(host, listener.port, transport="rdma") as ch:
            await ch.send(b"from the wheel")
            assert await ch.receive() == b"from the wheel"
            print("echo", ch.transport)
        tg.cancel_scope.cancel()
anyio.run(main)
"""


def test_the_wheel_runs_rdma(tmp_path: Path) -> None:
    wheels = sorted(WHEEL_DIR.glob("aiordma-*.whl"))
    if not wheels:
        pytest.skip(f"no wheel in {WHEEL_DIR}: the host stage's tests/test_wheel.py builds it")
    target = tmp_path / "wheel-install"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(target), str(wheels[-1])], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "echo rdma" in run.stdout, run.stdout
