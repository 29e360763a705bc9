"""The RDMA environment of a test: the simulated wire on any host, or the device in the guest
(test_rdma_transport, test_remote_keys).  Every environment ends checked: no device context
open, every verbs object of the wire (or of the native module) released."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from aiordma import RdmaBackend, RdmaConfig
from aiordma._rdma.config import NativeProvider
from aiordma.testing import SimFabric, SimProvider, rdma_address

from ._leaks import verbs_released


@dataclasses.dataclass
class Env:
    """``kind``: ``"sim"`` (the simulated wire) or ``"rxe"`` (the device); ``host`` to listen and
    connect on; ``fabric``: the simulated wire (None on the device)."""

    kind: str
    host: str
    fabric: SimFabric | None = None
    #: the RdmaConfig of :meth:`backend` when none is given
    config: RdmaConfig | None = None

    def backend(self, cls: Callable[..., RdmaBackend] = RdmaBackend, config: RdmaConfig | None = None,
                **kw: Any) -> RdmaBackend:  # fmt: skip
        """A backend on this environment's verbs.  A new provider object each time (as every call
        without ``rdma_backend`` gets a new default backend): devices must still be shared per loop."""
        provider = SimProvider(self.fabric) if self.fabric is not None else NativeProvider()
        return cls(config if config is not None else self.config, provider=provider, **kw)

    def live(self) -> dict[str, int]:
        if self.fabric is not None:
            return dict(self.fabric.live_objects())
        return dict(NativeProvider().live_objects())


@contextmanager
def rdma_env(on_device: bool, *, memory_windows: bool = True, config: RdmaConfig | None = None) -> Iterator[Env]:
    """A simulated wire with one device at 127.0.0.1 (``memory_windows``: whether it has them),
    or the device of this host; checked when the block ends."""
    if on_device:
        address = rdma_address()
        assert address is not None, "no RDMA device with an IPv4 RoCEv2 address"
        env = Env("rxe", address, None, config)
    else:
        fabric = SimFabric()
        fabric.add_device("sim0", "127.0.0.1", memory_windows=memory_windows)
        env = Env("sim", "127.0.0.1", fabric, config)
    yield env
    verbs_released(env.live())
