"""aiordma's pytest plugin (``-p aiordma.testing.plugin``; issue 24, item 1), as a user runs it:
a test file of their own in a directory of its own, in a pytest process of its own.

Its pair fixtures give connected pairs of every kind this host can make under each anyio
backend the user's ``anyio_backend`` names, skip ``rdma`` with the reason where no device is
usable, and fail a test that leaks a file descriptor in its teardown, naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aiordma.testing import rdma_address

ROOT = Path(__file__).resolve().parent.parent

USER_TESTS = '''
import socket

import pytest

pytestmark = pytest.mark.anyio
LEAK = []


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def test_echo(aiordma_stream_pair):
    a, b = aiordma_stream_pair
    await a.send(b"hello")
    assert await b.receive() == b"hello"


async def test_messages(aiordma_channel_pair):
    a, b = aiordma_channel_pair
    await b.send(b"x" * 100000)
    assert await a.receive() == b"x" * 100000


async def test_unread_bytes_at_the_end(aiordma_stream_pair):
    a, b = aiordma_stream_pair
    await a.send(b"y" * (1 << 20))  # (never read: closing the pair together must not wait for ever)


async def test_a_leak_is_reported(aiordma_stream_pair):
    LEAK.append(socket.socket())
'''


@pytest.mark.slow
def test_the_plugin_gives_pairs_of_every_kind_and_finds_leaks(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "aiordma.testing.plugin", "-p", "no:cacheprovider", "-q", "-rs",
         "test_user.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    text = out.stdout + out.stderr
    rdma = rdma_address() is not None
    kinds = 4 if rdma else 3
    # memory, tcp, sim (and rdma with a device) under asyncio and trio; the leak fails its teardown
    assert re.search(rf"\b{4 * 2 * kinds} passed", text), text  # (the leak's call passes; its teardown errs)
    assert re.search(rf"\b{2 * kinds} errors?\b", text), text
    if not rdma:
        assert re.search(r"\b8 skipped", text), text
        assert "no RDMA device with an active IPv4 RoCEv2 port" in text, text
    for kind in ("memory", "tcp", "sim"):
        assert f"after the test ({kind} pair): file descriptors left open" in text, text
