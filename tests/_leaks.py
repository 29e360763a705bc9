"""Checks that a test released what it acquired."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

# (one definition of "open descriptors": the pytest plugin's, which users' tests get too)
from aiordma.testing.plugin import _describe
from aiordma.testing.plugin import _open_fds as open_fds


@asynccontextmanager
async def no_fd_leak(settle: float = 2.0) -> AsyncIterator[None]:
    """Fail if file descriptors opened inside the block are still open after it.

    Some loops (uvloop) close sockets one iteration after ``connection_lost``;
    the check waits up to ``settle`` seconds for that.
    """
    before = open_fds()
    yield
    with anyio.move_on_after(settle):
        while open_fds() - before:
            await anyio.sleep(0.01)
    leaked = open_fds() - before
    assert not leaked, f"file descriptors left open: {_describe(leaked)}"
