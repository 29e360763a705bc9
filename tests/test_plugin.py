"""aiordma's pytest plugin (the ``pytest11`` entry point ``aiordma.testing.plugin``; issue 24,
item 1), as a user runs it: a test file of their own in a directory of its own, in a pytest
process of its own, with aiordma installed and nothing named on the command line.

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
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "test_user.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
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


@pytest.mark.paced
@pytest.mark.parametrize("args", [["-p", "no:aiordma.testing.plugin"], ["-p", "aiordma.testing.plugin"]],
                         ids=["turned-off", "named-too"])  # fmt: skip
def test_the_entry_point_can_be_turned_off_and_named_again(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "test_user.py").write_text(
        "import pytest\n"
        "@pytest.fixture(params=['memory'])\n"
        "def aiordma_kind(request):\n    return request.param\n"
        "@pytest.mark.anyio\n"
        "async def test_pair(aiordma_stream_pair):\n"
        "    client, server = aiordma_stream_pair\n"
        "    await client.send(b'x')\n    assert await server.receive() == b'x'\n"
    )
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, "test_user.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    text = out.stdout + out.stderr
    if args[1].startswith("no:"):
        assert "fixture 'aiordma_stream_pair' not found" in text, text
    else:
        assert out.returncode == 0 and re.search(r"\b[1-9] passed", text), text


USER_PROPERTY = '''
import anyio
import pytest
from hypothesis import given, settings
from aiordma.testing import Fault
from aiordma.testing.plugin import checked_pair
from aiordma.testing.strategies import faults

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"], scope="module")
def anyio_backend(request):
    return request.param


@pytest.fixture(params=["memory", "sim"], scope="module")
def aiordma_kind(request):
    return request.param


async def echo_once(kind, schedule):
    async with checked_pair(kind, messages=True, faults=schedule) as (client, server):
        async def serve():
            try:
                await server.send(await server.receive())
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                pass
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(serve)
                try:
                    await client.send(b"ping")
                    return await client.receive()
                except (anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                    return type(exc).__name__


@settings(max_examples=15, deadline=None)
@given(data=faults("sim", sides=["server"], max_after=2))
async def test_echo_under_faults(aiordma_kind, data):
    schedule = tuple(f for f in data if aiordma_kind == "sim" or f.kind in ("close", "abort", "dead", "reset"))
    got = await echo_once(aiordma_kind, schedule)
    assert got in (b"ping", "BrokenResourceError", "EndOfStream")
    if not schedule:
        assert got == b"ping"


async def test_a_leak_inside_the_property_is_named(aiordma_kind):
    kept = []
    async with checked_pair(aiordma_kind) as (client, server):
        kept.append(open("/dev/zero", "rb"))
'''


@pytest.mark.slow
def test_checked_pair_serves_property_tests_with_faults(tmp_path: Path) -> None:
    (tmp_path / "test_user_property.py").write_text(USER_PROPERTY)
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_user_property.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)  # fmt: skip
    text = out.stdout + out.stderr
    # the property on memory and sim under asyncio and trio; the leak fails, named, on each
    assert re.search(r"\b4 passed", text) and re.search(r"\b4 failed", text), text
    assert text.count("file descriptors left open") >= 4 and "/dev/zero" in text, text


USER_ON_A_DEVICE = '''
import pytest

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"], scope="module")
def anyio_backend(request):
    return request.param


@pytest.fixture(params=["rdma"], scope="module")
def aiordma_kind(request):
    return request.param


async def test_stream(aiordma_stream_pair):
    client, server = aiordma_stream_pair
    assert client.transport == "rdma"
    await client.send(b"x" * 100000)
    got = b""
    while len(got) < 100000:
        got += await server.receive()


async def test_channel(aiordma_channel_pair):
    client, server = aiordma_channel_pair
    await server.send(b"y" * 300000)
    assert await client.receive() == b"y" * 300000
'''


@pytest.mark.rdma
def test_the_plugin_on_a_device(tmp_path: Path) -> None:
    # (its pairs run on the device, and its check -- descriptors, tasks, the device's QPs -- holds)
    (tmp_path / "test_user_device.py").write_text(USER_ON_A_DEVICE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "aiordma.testing.plugin", "-p", "no:cacheprovider",
                          "-q", "test_user_device.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode == 0 and re.search(r"\b4 passed", text), text
