"""What one listener may spend on its clients: handshakes in progress, RDMA connections, and
the registered (pinned) memory of their rings.

A TCP connection costs the server a socket and a protocol object; an RDMA connection costs a
queue pair, a completion queue share and its registered rings (``(2 * window + control) *
buffer_size`` bytes: 4.1 MiB with the defaults).  Without limits any client that reaches the
port could make the server pin memory until it runs out, so each listener keeps a
:class:`ListenerBudget`:

* ``max_handshakes`` (default 64): handshakes in progress at once; a client beyond it is refused
  at once (CLOSE ``REFUSED``, the reason naming the limit), before anything else is built;
* ``max_rdma_connections`` (default: none): RDMA connections alive at once; beyond it a client
  gets TCP (``transport="auto"``, the reason naming the limit) or is refused (``"rdma"``);
* ``max_pinned_bytes`` (default: none): the same for the bytes of their rings.

Rendezvous staging and exposures are pinned as they are used, under the process-wide limit
(:func:`aiordma.set_pinned_limit`), not under these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ._rdma.config import RdmaConfig

__all__ = ["ListenerBudget", "ring_bytes"]

DEFAULT_MAX_HANDSHAKES = 64


def ring_bytes(config: RdmaConfig) -> int:
    """The registered bytes one RDMA connection's rings take (receive ring and send ring)."""
    return (2 * config.window + config.control) * config.buffer_size


@dataclass
class ListenerBudget:
    """The counters of one listener (see the module docs); all calls run on its event loop."""

    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    max_rdma_connections: int | None = None
    max_pinned_bytes: int | None = None
    handshakes: int = 0
    rdma_connections: int = 0
    pinned_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_handshakes < 1:
            raise ValueError("max_handshakes must be at least 1")
        if self.max_rdma_connections is not None and self.max_rdma_connections < 0:
            raise ValueError("max_rdma_connections must be 0 (no RDMA) or more")
        if self.max_pinned_bytes is not None and self.max_pinned_bytes < 0:
            raise ValueError("max_pinned_bytes must be 0 or more")

    def begin_handshake(self) -> str | None:
        """Count a handshake in; the refusal's reason if the limit is reached (then nothing is counted)."""
        if self.handshakes >= self.max_handshakes:
            return f"server: too many handshakes in progress (the listener's max_handshakes={self.max_handshakes})"
        self.handshakes += 1
        return None

    def end_handshake(self) -> None:
        self.handshakes -= 1

    def reserve_rdma(self, nbytes: int) -> Callable[[], None] | str:
        """Reserve one RDMA connection of ``nbytes`` ring bytes: the release (idempotent), or
        the reason it does not fit."""
        limit = self.max_rdma_connections
        if limit is not None and self.rdma_connections >= limit:
            return f"server: the listener has its max_rdma_connections={limit} RDMA connections"
        cap = self.max_pinned_bytes
        if cap is not None and self.pinned_bytes + nbytes > cap:
            return (
                f"server: another RDMA connection would pin {self.pinned_bytes + nbytes} bytes, over the "
                f"listener's max_pinned_bytes={cap}"
            )
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
