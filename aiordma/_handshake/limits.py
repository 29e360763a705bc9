"""What one listener may spend on its RDMA clients: RDMA connections, and the registered (pinned)
memory of their rings.  (Handshakes in progress are the admission's: :mod:`aiordma._proto.admission`.)

A TCP connection costs the server a socket and a protocol object; an RDMA connection costs a
queue pair, a completion queue share and its registered rings (``(2 * window + control) *
buffer_size`` bytes: 4.1 MiB with the defaults).  Without limits any client that reaches the
port could make the server pin memory until it runs out, so each listener keeps a
:class:`ListenerBudget`:

* ``max_pinned_bytes`` (default: half of what the process may pin, :func:`aiordma.set_pinned_limit`,
  i.e. RLIMIT_MEMLOCK where it is finite): the bytes of their rings; beyond it a client gets
  TCP (``transport="auto"``, the reason naming the limit) or is refused (``"rdma"``);
* ``max_rdma_connections`` (default: as many as fit in ``max_pinned_bytes``): RDMA connections
  alive at once, likewise.  The device's own caps (QPs, CQ entries) refuse a connection at its
  setup, which falls back to TCP with the step in the reason.

Both are checked after the client authenticated (when there is a key) and before anything RDMA
is built for it, so that clients cannot pin memory without bound.

Rendezvous staging and exposures are pinned as they are used, under the process-wide limit
(:func:`aiordma.set_pinned_limit`), not under these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._rdma.config import RdmaConfig

__all__ = ["ListenerBudget", "ring_bytes"]

#: handshakes at once (half of them for one peer address): as many as the listen backlog.  A
#: handshake costs what an open connection does (its receive buffer; RDMA resources are the
#: budget's below), so a burst from one host -- a thousand Dask workers starting, clients in
#: several processes -- runs at once instead of queueing behind a few dozen slots, and a few
#: hundred sockets that start and stall leave room for everyone else.
DEFAULT_MAX_HANDSHAKES = 1024


def ring_bytes(config: RdmaConfig) -> int:
    """The registered bytes one RDMA connection's rings take (receive ring and send ring)."""
    return (2 * config.window + config.control) * config.buffer_size


def default_pinned_bytes() -> int:
    """A listener's default ``max_pinned_bytes``: half of what this process may pin."""
    from .._conn.memory import pinned_limit

    return pinned_limit() // 2


@dataclass
class ListenerBudget:
    """The counters of one listener (see the module docs); all calls run on its event loop.
    ``None`` limits are the defaults, resolved at the first reservation."""

    max_rdma_connections: int | None = None
    max_pinned_bytes: int | None = None
    rdma_connections: int = 0
    pinned_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_rdma_connections is not None and self.max_rdma_connections < 0:
            raise ValueError("max_rdma_connections must be 0 (no RDMA) or more")
        if self.max_pinned_bytes is not None and self.max_pinned_bytes < 0:
            raise ValueError("max_pinned_bytes must be 0 or more")

    def limits(self, nbytes: int) -> tuple[int, int]:
        """``(max_rdma_connections, max_pinned_bytes)`` in force for connections of ``nbytes``."""
        cap = self.max_pinned_bytes if self.max_pinned_bytes is not None else default_pinned_bytes()
        count = self.max_rdma_connections
        if count is None:
            count = cap // nbytes if nbytes else cap
        return count, cap

    def reserve_rdma(self, nbytes: int) -> Callable[[], None] | str:
        """Reserve one RDMA connection of ``nbytes`` ring bytes: the release (idempotent), or
        the reason it does not fit."""
        limit, cap = self.limits(nbytes)
        if self.pinned_bytes + nbytes > cap:
            return (
                f"server: another RDMA connection would pin {self.pinned_bytes + nbytes} bytes, over the "
                f"listener's max_pinned_bytes={cap}"
            )
        if self.rdma_connections >= limit:
            return f"server: the listener has its max_rdma_connections={limit} RDMA connections"
        self.rdma_connections += 1
        self.pinned_bytes += nbytes
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.rdma_connections -= 1
                self.pinned_bytes -= nbytes

        return release
