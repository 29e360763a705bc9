"""Run aiordma's RDMA transport over the simulated RC wire, on any host.

``simulated_backend()`` gives an :class:`aiordma.RdmaBackend` whose verbs are
a :class:`SimFabric` (see :mod:`aiordma.testing._simverbs`) instead of the
native module: connections over 127.0.0.1 (the address of the simulated
device) then run the real RDMA transport -- session, credits, per-loop
device, push poller, teardown -- over simulated queue pairs, under asyncio,
uvloop and trio::

    backend = aiordma.testing.simulated_backend()
    listener = await aiordma.create_channel_listener("127.0.0.1", 0, transport="rdma", rdma_backend=backend)
    channel = await aiordma.connect_channel("127.0.0.1", listener.port, transport="rdma", rdma_backend=backend)

The fabric's fault knobs (``backend.fabric.kill_qp(...)``, ``fail_next``,
``hold_acks``) let a test break the wire on purpose.
"""

from __future__ import annotations

from typing import Any

from .._rdma.config import RdmaBackend, RdmaConfig
from .._rdma.constants import GidEntry
from .._rdma.discovery import Probe
from .._rdma.objects import Context, WorkCompletions
from ._simverbs import SimFabric

__all__ = ["SimProvider", "simulated_backend", "SimFabric"]


class SimProvider:
    """The verbs provider interface over a :class:`SimFabric`."""

    name = "simulated"

    def __init__(self, fabric: SimFabric) -> None:
        self.fabric = fabric
        self.key: object = fabric  # providers over one fabric share its devices

    def open_context(self, name: str) -> Context:
        return self.fabric.open_context(name)

    def WCArray(self, n: int) -> WorkCompletions:  # noqa: N802 - mirrors the class name
        return self.fabric.WCArray(n)

    def device_names(self) -> list[str]:
        return self.fabric.device_names()

    def gid_for_ip(self, ip: str) -> GidEntry | None:
        return self.fabric.gid_for_ip(ip)

    def probe(self) -> Probe:
        names = self.fabric.device_names()
        if not names:
            return Probe(False, "no simulated RDMA device", True, "simulated", [])
        return Probe(True, "", True, "simulated verbs", names)

    def live_objects(self) -> dict[str, int]:
        return self.fabric.live_objects()

    def native(self) -> tuple[Any, Any] | None:
        """The native data path runs on the simulated wire too (record mode), when it is built."""
        from .._rdma.fastpath import native_lib

        return native_lib()


def simulated_backend(
    config: RdmaConfig | None = None, *, fabric: SimFabric | None = None, ip: str = "127.0.0.1"
) -> RdmaBackend:
    """An RDMA backend on a simulated fabric with one device at ``ip`` (a new fabric unless given).

    ``backend.fabric`` is the fabric (fault knobs, ``live_objects()``)."""
    if fabric is None:
        fabric = SimFabric()
        fabric.add_device("sim0", ip)
    backend = RdmaBackend(config, provider=SimProvider(fabric))
    backend.fabric = fabric  # type: ignore[attr-defined]
    return backend
