"""aiordma's pytest plugin: connected pairs for property tests of your own network code.

pytest loads it by its ``pytest11`` entry point wherever aiordma is installed (as anyio's
plugin); ``-p no:aiordma.testing.plugin`` turns it off, and naming it -- ``-p
aiordma.testing.plugin``, or ``pytest_plugins = ["aiordma.testing.plugin"]`` in a top-level
``conftest.py`` -- is harmless.

It follows anyio's pytest plugin: mark your tests ``@pytest.mark.anyio`` (and parametrize
``anyio_backend`` as anyio's documentation says, for asyncio and trio both).  Fixtures:

``aiordma_kind``
    Parametrized over the kinds of pair this host can make: ``"memory"`` (the real protocol
    over an in-memory pipe, no sockets: deterministic and fast), ``"tcp"`` (a real listener on
    127.0.0.1), ``"sim"`` (the RDMA transport over the simulated RC wire, any host) and
    ``"rdma"`` (a real device; skipped, with the reason, where none is usable).  Narrow it by
    overriding the fixture in your conftest: ``@pytest.fixture(params=["memory", "sim"],
    scope="module")`` returning ``request.param`` (module-scoped, so that ``@given`` tests may
    use it: hypothesis refuses function-scoped fixtures, which its examples would share).

``aiordma_stream_pair`` / ``aiordma_channel_pair``
    ``(client, server)``: a connected :class:`aiordma.Stream` (byte stream) or
    :class:`aiordma.Channel` (messages) pair of that kind, under the test's anyio backend.
    After the test both ends are closed together (:func:`aiordma.testing.aclose_together`: a
    close waits for its reader), then checked: the test's file descriptors and tasks are back
    to what they were, and on ``"sim"`` every verbs object of the wire (QPs, CQs, MRs) was
    released (on ``"rdma"``, every queue pair of the device) -- a test that leaks one fails in
    its teardown, naming what is left.

``checked_pair(kind, messages=..., faults=..., delays=..., config=..., max_message_size=...)``
    The same pair as an async context manager, checked the same way when it ends: for property
    tests, where every hypothesis example needs a pair of its own.

Every fixture is a plain pytest fixture: nothing here changes how pytest collects or runs
tests.  The pairs' own modules are imported when a fixture is first used.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from .._api import Channel, Stream
    from .._rdma.config import RdmaConfig
    from ._faults import Fault

__all__ = ["aiordma_kind", "aiordma_stream_pair", "aiordma_channel_pair", "checked_pair", "KINDS"]

#: the kinds of pair, in the order the fixtures run them
KINDS = ("memory", "tcp", "sim", "rdma")
#: how long closed resources may take to go (uvloop closes a socket one iteration after
#: ``connection_lost``; a peer's teardown runs in its own task)
SETTLE = 2.0


def _open_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/null":
                continue  # (libuv keeps one open per loop from its first listening socket on)
        except OSError:
            continue  # (closed meanwhile, or the listing's own descriptor)
        fds.add(int(name))
    return fds


def _describe(fds: set[int]) -> str:
    out = []
    for fd in sorted(fds):
        try:
            out.append(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            out.append(f"{fd} (gone)")
    return ", ".join(out)


@pytest.fixture(params=KINDS, scope="module")
def aiordma_kind(request: pytest.FixtureRequest) -> str:
    """The kind of pair (see the module docs); ``"rdma"`` is skipped where no device is usable.
    Module-scoped, as anyio's ``anyio_backend``: a hypothesis test (``@given``) may use it."""
    kind: str = request.param
    if kind == "rdma":
        from ._pairs import rdma_address

        if rdma_address() is None:
            pytest.skip("aiordma: no RDMA device with an active IPv4 RoCEv2 port on this host")
    return kind


@asynccontextmanager
async def checked_pair(kind: str, *, messages: bool = False, faults: Sequence[Fault] = (),
                       delays: Sequence[int] = (), config: RdmaConfig | None = None,
                       max_message_size: int | None = None) -> AsyncIterator[tuple[Any, Any]]:  # fmt: skip
    """``async with checked_pair(kind, faults=schedule) as (client, server):`` -- the fixtures'
    pair (a stream pair, or a channel pair with ``messages=True``) as a context manager, checked
    the same way when it ends: for a property test, where each hypothesis example needs a pair
    of its own (a fixture would be shared by every example of the test).  ``faults`` and
    ``delays``: see :func:`aiordma.testing.stream_pair`.  ``config`` (an
    :class:`aiordma.RdmaConfig`) sets both ends' RDMA settings on ``"sim"`` and ``"rdma"`` (the
    data path, the poll mode, the sizes); ``max_message_size`` bounds a channel pair's messages."""
    import anyio

    from .._proto.protocol import DEFAULT_MAX_MESSAGE_SIZE
    from .._rdma.config import RdmaBackend
    from ._pairs import channel_pair, stream_pair
    from ._sim import SimFabric, simulated_backend

    fds = _open_fds()
    tasks = len(anyio.get_running_tasks())
    live_qps: Callable[[], int] = lambda: 0  # noqa: E731
    if kind == "rdma":  # (a device's context, PD and pools outlive a connection; its QPs do not)
        from .._rdma.verbs import live_objects

        live_qps = lambda: live_objects()["qps"]  # noqa: E731
    qps = live_qps()
    fabric: SimFabric | None = None
    backend = None
    if kind == "sim":
        fabric = SimFabric()
        fabric.add_device("sim0", "127.0.0.1")
        backend = simulated_backend(config, fabric=fabric)
    elif kind == "rdma" and config is not None:
        backend = RdmaBackend(config)
    elif config is not None:
        raise ValueError(f"an RdmaConfig applies to the sim and rdma kinds, not to {kind!r}")
    if max_message_size is not None and not messages:
        raise ValueError("max_message_size applies to channel pairs (messages=True)")
    pairing = (channel_pair(kind, rdma_backend=backend, faults=faults, delays=delays,  # type: ignore[arg-type]
                            max_message_size=max_message_size or DEFAULT_MAX_MESSAGE_SIZE)
               if messages else stream_pair(kind, rdma_backend=backend, faults=faults, delays=delays))  # type: ignore[arg-type]  # fmt: skip
    async with pairing as pair:
        try:
            yield pair
        finally:
            if fabric is not None:
                fabric.release()  # (what the test held comes now: the close must not wait on it)
    deadline = anyio.current_time() + SETTLE
    while True:
        left_fds = _open_fds() - fds
        extra_tasks = len(anyio.get_running_tasks()) - tasks
        extra_qps = live_qps() - qps
        if (not left_fds and extra_tasks <= 0 and extra_qps <= 0) or anyio.current_time() >= deadline:
            break
        await anyio.sleep(0.02)
    problems = []
    if left_fds:
        problems.append(f"file descriptors left open: {_describe(left_fds)}")
    if extra_tasks > 0:
        problems.append(f"{extra_tasks} task(s) still running")
    if extra_qps > 0:
        problems.append(f"{extra_qps} queue pair(s) of the device not destroyed")
    if fabric is not None:
        live = {name: n for name, n in fabric.live_objects().items() if n}
        if live:
            problems.append(f"verbs objects of the simulated wire not released: {live}")
    if problems:
        pytest.fail(f"aiordma: after the test ({kind} pair): " + "; ".join(problems), pytrace=False)


@pytest.fixture
async def aiordma_stream_pair(aiordma_kind: str, anyio_backend: Any) -> AsyncIterator[tuple[Stream, Stream]]:
    """A connected ``(client, server)`` byte-stream pair of ``aiordma_kind`` (see the module docs)."""
    async with checked_pair(aiordma_kind, messages=False) as pair:
        yield pair


@pytest.fixture
async def aiordma_channel_pair(aiordma_kind: str, anyio_backend: Any) -> AsyncIterator[tuple[Channel, Channel]]:
    """A connected ``(client, server)`` message-channel pair of ``aiordma_kind`` (see the module docs)."""
    async with checked_pair(aiordma_kind, messages=True) as pair:
        yield pair
