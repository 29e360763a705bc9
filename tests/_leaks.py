"""Checks that a test released what it acquired."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


def open_fds() -> set[int]:
    """Open descriptors, less /dev/null: libuv (uvloop) keeps one open per
    loop from its first listening socket on, as a reserve for EMFILE."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/null":
                continue
        except OSError:
            continue  # closed meanwhile (or the listing's own descriptor)
        fds.add(int(name))
    return fds


def _describe(fds: set[int]) -> list[str]:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} (gone)")
    return out


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
