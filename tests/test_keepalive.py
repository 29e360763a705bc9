"""A peer host that dies without a word: the survivor notices within the keepalive bound.

Two network namespaces this test creates (``aiordma-ka-*``), joined by a veth pair with
addresses of their own (10.213.x.0/30, never seen outside them); the server runs in one, the
client in the other (each a subprocess under ``ip netns exec``).  Setting the server's end of
the link down is a crashed host as the client sees it: no FIN, no RST, nothing.  Then the client,
idle or sending, must get ``BrokenResourceError`` within its ``keepalive`` (2 s here), and, with
``keepalive=None``, must not (the OS's own TCP timeouts are minutes: the control shows the
bound is aiordma's).  Needs root and ``ip netns`` (the CI machine has both); skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SERVER = r"""
import sys, anyio, aiordma
async def main():
    async with await aiordma.create_channel_listener(sys.argv[1], 9000, transport="tcp") as lst:
        async def handler(ch):
            async with ch:
                while True:
                    if sys.argv[2] == "pause":
                        await anyio.sleep(3600)  # (reads nothing: its window closes)
                    await ch.receive()
        print("listening", flush=True)
        await lst.serve(handler)
anyio.run(main)
"""

CLIENT = r"""
import sys, time, anyio, aiordma
host, mode, keepalive = sys.argv[1], sys.argv[2], None if sys.argv[3] == "none" else float(sys.argv[3])
async def main():
    ch = await aiordma.connect_channel(host, 9000, transport="tcp", keepalive=keepalive)
    await ch.send(b"hello")
    if mode == "window":
        await window_closed(ch)
        return
    if mode == "closing":
        await closing(ch)
        return
    print("connected", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)  # the test took the link down
    t0 = time.monotonic()
    try:
        with anyio.fail_after(12):
            if mode == "idle":
                await ch.receive()
            else:
                while True:
                    await ch.send(b"x" * 65536)
    except anyio.BrokenResourceError as exc:
        print(f"broken after {time.monotonic() - t0:.2f} s: {exc.__cause__!r}", flush=True)
    except TimeoutError:
        print(f"still open after {time.monotonic() - t0:.2f} s", flush=True)
async def closing(ch):
    # send until 1 MiB waits here for the server, which reads nothing; the test takes the
    # server's host away; then close: the close must not pretend the bytes were delivered
    from anyio.abc import SocketAttribute
    from aiordma._tcp.links import unacknowledged
    sock = ch.extra(SocketAttribute.raw_socket)
    while unacknowledged(sock) < 1 << 20:
        await ch.send(b"x" * 65536)
        await anyio.sleep(0.005)
    print("connected", flush=True)
    await anyio.to_thread.run_sync(sys.stdin.readline)
    t0 = time.monotonic()
    try:
        with anyio.fail_after(30):
            await ch.aclose()
        print(f"closed after {time.monotonic() - t0:.2f} s", flush=True)
    except anyio.BrokenResourceError as exc:
        print(f"broken after {time.monotonic() - t0:.2f} s: {exc!r}", flush=True)
    except TimeoutError:
        print(f"still open after {time.monotonic() - t0:.2f} s", flush=True)
async def window_closed(ch):
    # send until the server's window has been closed for 3 s (a send waited that long), then the
    # test takes the server's host away while this side still waits to send
    failed = anyio.Event()
    result = []
    async def pump():
        try:
            while True:
                await ch.send(b"x" * 65536)
        except anyio.BrokenResourceError as exc:
            result.append(exc)
        failed.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(pump)
        with anyio.move_on_after(3):
            await failed.wait()
        print("connected" if not failed.is_set() else f"failed early: {result!r}", flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        t0 = time.monotonic()
        with anyio.move_on_after(60):
            await failed.wait()
        if result:
            print(f"broken after {time.monotonic() - t0:.2f} s: {result[0].__cause__!r}", flush=True)
        else:
            print(f"still open after {time.monotonic() - t0:.2f} s", flush=True)
        tg.cancel_scope.cancel()
anyio.run(main)
"""


def _can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


pytestmark = pytest.mark.skipif(not _can_netns(), reason="needs root and ip netns")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    """(client ns, server ns, server address, the server's veth), torn down afterwards."""
    tag = f"{os.getpid() % 10000}"
    a, b = f"aiordma-ka-c{tag}", f"aiordma-ka-s{tag}"
    net = 10 + os.getpid() % 200
    for ns in (a, b):
        ip("netns", "add", ns)
    try:
        ip("link", "add", f"kac{tag}", "netns", a, "type", "veth", "peer", "name", f"kas{tag}", "netns", b)
        ip("-n", a, "addr", "add", f"10.213.{net}.1/30", "dev", f"kac{tag}")
        ip("-n", b, "addr", "add", f"10.213.{net}.2/30", "dev", f"kas{tag}")
        for ns, dev in ((a, f"kac{tag}"), (b, f"kas{tag}")):
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "link", "set", dev, "up")
        yield a, b, f"10.213.{net}.2", f"kas{tag}"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _run(ns: str, code: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AIORDMA_TRANSPORT": "tcp"}
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", code, *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def _line(proc: subprocess.Popen[str], timeout: float = 30) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            return line.strip()
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
    raise AssertionError("no output in time")


def _the_server_host_dies(two_hosts: tuple[str, str, str, str], server_mode: str, client_mode: str, keepalive: str,
                          timeout: float) -> str:  # fmt: skip
    """Start the server (``read`` or ``pause``) and the client (``idle``, ``sending`` or
    ``window``); once the client says ``connected``, take the server's link down and tell the
    client to go on; the client's last line (how its connection ended, or that it did not)."""
    client_ns, server_ns, address, server_dev = two_hosts
    server = _run(server_ns, SERVER, address, server_mode)
    client = None
    try:
        assert _line(server) == "listening"
        client = _run(client_ns, CLIENT, address, client_mode, keepalive)
        assert _line(client) == "connected"
        ip("-n", server_ns, "link", "set", server_dev, "down")  # the server's host is gone
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
        return _line(client, timeout=timeout)
    finally:
        for proc in (client, server):
            if proc is not None:
                proc.kill()
                proc.wait(10)
                for f in (proc.stdin, proc.stdout, proc.stderr):
                    if f is not None:
                        f.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["idle", "sending"])
@pytest.mark.parametrize("keepalive", ["2", "none"])
def test_a_dead_peer_host_is_noticed_within_the_keepalive(two_hosts: tuple[str, str, str, str], mode: str,
                                                          keepalive: str) -> None:  # fmt: skip
    result = _the_server_host_dies(two_hosts, "read", mode, keepalive, timeout=20)
    print(f"keepalive={keepalive} {mode}: {result}")
    if keepalive == "none":
        # the control: without aiordma's bound, the OS waits far longer than the 12 s we watch
        assert result.startswith("still open"), result
        return
    assert result.startswith("broken after"), result
    elapsed = float(result.split()[2])
    assert elapsed <= 2.0 + 1.0, result  # the bound, and a second for the scheduling of the probes


@pytest.mark.slow
def test_a_peer_host_that_dies_while_its_window_is_closed_is_noticed(two_hosts: tuple[str, str, str, str]) -> None:
    """Slow is not dead, dead is still dead: the server reads nothing, the client's sends wait
    for its window (closed for 3 s, three times the user timeout: the connection lives on), then
    the server's host goes.  The window watch finds it by the unanswered window probes: within
    about twice the time the window had been closed (the probes back off), plus the budget."""
    # ("connected": 3 s with a closed window, and the connection lives)
    result = _the_server_host_dies(two_hosts, "pause", "window", "2", timeout=70)
    print(f"window closed, then the host died: {result}")
    assert result.startswith("broken after"), result
    assert "probes unanswered" in result, result
    elapsed = float(result.split()[2])
    assert elapsed <= 2 * 3 + 1.0 + 8.0, result  # twice the closed time, the budget, and the probes' granularity


@pytest.mark.slow
def test_a_close_whose_peer_host_dies_raises(two_hosts: tuple[str, str, str, str]) -> None:
    """A close is a close: 1 MiB waits at the client for a server that reads nothing, then the
    server's host goes and the client closes.  ``aclose()`` lingers while the peer could still
    take the bytes, and raises ``BrokenResourceError`` once the window watch finds the host dead
    -- it never returns as if the bytes were delivered (before: it gave up after 5 s without
    progress and returned normally)."""
    result = _the_server_host_dies(two_hosts, "pause", "closing", "2", timeout=40)
    print(f"closing, then the host died: {result}")
    assert result.startswith("broken after"), result
    assert "before the peer had everything" in result, result
    elapsed = float(result.split()[2])
    assert elapsed <= 15.0, result
