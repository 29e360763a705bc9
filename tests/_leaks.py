"""Checks that a test released what it acquired: descriptors, pinned memory and registrations,
device contexts and verbs objects.  (A pair from ``aiordma.testing.plugin.checked_pair`` checks its
own descriptors, tasks and verbs objects: tests/_kinds.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager

import anyio

import aiordma
from aiordma._rdma.device import open_devices

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


@contextmanager
def pinned_unchanged() -> Iterator[None]:
    """Fail if the block left pinned memory, a registration or a registered buffer behind
    (``aiordma.memory_stats()`` before and after)."""
    before = aiordma.memory_stats()
    yield
    after = aiordma.memory_stats()
    assert after.pinned_bytes == before.pinned_bytes, "pinned bytes were not given back"
    assert after.registrations == before.registrations, "a registration was left"
    assert after.buffers == before.buffers, "a registered buffer was left open"


def verbs_released(live: Mapping[str, int] | None = None) -> None:
    """Fail if a device context is still open, or (``live``: a provider's or fabric's
    ``live_objects()``) a verbs object is left."""
    assert open_devices() == [], "a device context was left open (a listener or a connection)"
    if live is not None:
        assert dict(live) == dict.fromkeys(live, 0), f"verbs objects left: {dict(live)}"
