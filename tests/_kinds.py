"""The kinds of connection the suite runs its tests on, and the pairs they open.

``memory`` (the protocol over an in-memory pipe), ``tcp``, ``sim`` (the RDMA transport over the
simulated RC wire, on any host) and its variants (the checked data path, the spinning poll modes),
``rdma`` and its variants on a real device (the Soft-RoCE guest), and ``twohost`` (the far end on
host a of the two-guest bed).  The pairs are aiordma.testing's -- what users get -- and every one is
checked for leaked file descriptors once closed (test_conformance, test_onesided,
test_rdma_transport)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from anyio import EndOfStream

import aiordma
from aiordma import RdmaConfig
from tools.remote_end import remote_pair
from aiordma.testing.plugin import checked_pair

from ._leaks import no_fd_leak


KINDS = [
    pytest.param("memory", id="memory"),
    pytest.param("tcp", id="tcp"),
    pytest.param("sim", id="sim"),  # the RDMA transport over the simulated RC wire (native path, event mode)
    # the checked (Python) data path and the spinning poll modes, on the same wire
    pytest.param("sim-checked", id="sim-checked"),
    pytest.param("sim-adaptive", id="sim-adaptive"),
    pytest.param("sim-busy", id="sim-busy"),
    pytest.param("rdma", id="rdma", marks=pytest.mark.rdma),
    pytest.param("rdma-checked", id="rdma-checked", marks=pytest.mark.rdma),
    pytest.param("rdma-adaptive", id="rdma-adaptive", marks=pytest.mark.rdma),
    pytest.param("rdma-busy", id="rdma-busy", marks=pytest.mark.rdma),
]


#: this suite's kinds also run across two hosts: the far end on host a of the two-guest bed
#: (tests/test_twohost.py; other files that take KINDS have no far end there)
SUITE_KINDS = [*KINDS, pytest.param("twohost", id="twohost", marks=pytest.mark.twohost)]


#: the two-host kind: host a's address, and the transport (rdma in the bed; the host's own check
#: of this kind, test_twohost.test_twohost_suite_runs_on_the_host, sets tcp)
PEER = os.environ.get("AIORDMA_PEER_ADDRESS", "")


TWOHOST_TRANSPORT = os.environ.get("AIORDMA_TWOHOST_TRANSPORT", "rdma")


#: variant -> (pair kind, RdmaConfig fields)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    f"{base}-{name}": (base, config)
    for base in ("sim", "rdma")
    for name, config in (("checked", {"hot_path": "checked"}), ("adaptive", {"poll": "adaptive"}),
                         ("busy", {"poll": "busy"}))  # fmt: skip
}


def pair_args(kind: str, extra: dict[str, Any] | None = None) -> tuple[str, RdmaConfig | None]:
    """The pair kind and RDMA config of a test kind (a variant names a config; ``extra``: more
    RdmaConfig fields, for the RDMA kinds)."""
    if kind == "twohost":
        return TWOHOST_TRANSPORT, None
    if kind not in VARIANTS:
        if not extra or kind not in ("sim", "rdma"):
            return kind, None
        base, fields = kind, {}
    else:
        base, fields = VARIANTS[kind]
    return base, RdmaConfig(**{**fields, **(extra or {})})

SMALL_LIMIT = 64 * 1024


@asynccontextmanager
async def streams(kind: str, config: dict[str, Any] | None = None) -> AsyncIterator[tuple[aiordma.Stream, aiordma.Stream]]:
    """A stream pair of the kind: the pytest plugin's (``checked_pair``), checked as it checks
    users' pairs when it ends (descriptors, tasks, verbs objects)."""
    if kind == "twohost":
        async with no_fd_leak(), remote_pair(PEER, "stream", transport=TWOHOST_TRANSPORT) as remote:
            yield remote  # type: ignore[misc]
        return
    base, rdma_config = pair_args(kind, config)
    async with checked_pair(base, config=rdma_config) as pair:
        yield pair


@asynccontextmanager
async def channels(kind: str, limit: int = SMALL_LIMIT,
                   config: dict[str, Any] | None = None) -> AsyncIterator[tuple[aiordma.Channel, aiordma.Channel]]:  # fmt: skip
    """A channel pair of the kind (as :func:`streams`), taking messages up to ``limit``."""
    if kind == "twohost":
        async with no_fd_leak(), remote_pair(PEER, "channel", transport=TWOHOST_TRANSPORT, limit=limit,
                                             config=config) as remote:  # fmt: skip
            yield remote  # type: ignore[misc]
        return
    base, rdma_config = pair_args(kind, config)
    async with checked_pair(base, messages=True, config=rdma_config, max_message_size=limit) as pair:
        yield pair


async def read_exactly(stream: aiordma.Stream, n: int) -> bytes:
    parts = []
    while n:
        chunk = await stream.receive(min(n, 1 << 20))
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


async def read_to_eof(stream: aiordma.Stream) -> bytes:
    parts = []
    while True:
        try:
            parts.append(await stream.receive())
        except EndOfStream:
            return b"".join(parts)
