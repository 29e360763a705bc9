"""The parent's side of a reader in its own process (``tests/_slow_peer_proc.py``): start it, read
its lines, and open the sender it reads from (test_slow_reader, test_close_delivery)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from typing import Any

import anyio

import aiordma


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CHUNK = 1 << 20


def loop_name(anyio_backend: Any) -> str:
    name, options = anyio_backend
    return "uvloop" if options else name


class Peer:
    """The reader's process; its JSON result once it is done."""

    def __init__(self, loop: str, api: str, role: str, port: int, tlsdir: str, pause: float, size: int,
                 greet: int = 0, hold: float = 0.0) -> None:  # fmt: skip
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._slow_peer_proc", loop, api, role, str(port), tlsdir, str(pause), str(size),
             str(greet), str(hold)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
        )  # fmt: skip

    async def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout):
            line: str = await anyio.to_thread.run_sync(self.proc.stdout.readline, abandon_on_cancel=True)
        if not line:
            raise AssertionError(f"the reader's process ended: {self.stderr()}")
        return line.strip()

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.err.close()


async def open_sender(api: str, port: int, ctx: Any, keepalive: float) -> Any:
    if api == "channel":
        return await aiordma.connect_channel("127.0.0.1", port, ssl=ctx, transport="tcp", keepalive=keepalive)
    if api == "stream":
        return await aiordma.connect("127.0.0.1", port, ssl=ctx, transport="tcp", keepalive=keepalive)
    import aiordma.asyncio as aio

    return await aio.open_connection("127.0.0.1", port, ssl=ctx, transport="tcp", keepalive=keepalive,
                                     pass_through=streams_pass_through())  # fmt: skip


def streams_pass_through() -> bool:
    """Whether the asyncio streams of these tests pass through (``AIORDMA_TEST_STREAMS_PASS_THROUGH``:
    set by a test for itself and its peer process)."""
    return os.environ.get("AIORDMA_TEST_STREAMS_PASS_THROUGH") == "1"
