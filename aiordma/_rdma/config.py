"""RDMA configuration, the injectable backend and the setup error (no native code here)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .constants import GidEntry
from .discovery import Probe
from .params import RdmaParams
from .poller import POLL_MODES

if TYPE_CHECKING:  # pragma: no cover
    from . import objects
    from .device import VerbsProvider

__all__ = ["RdmaConfig", "RdmaBackend", "RdmaSetupError", "NativeProvider"]


@dataclass(frozen=True)
class RdmaConfig:
    """Sizes and timeouts of the RDMA transport (per connection)."""

    #: receive buffers for data SENDs (the peer's data credits)
    window: int = 32
    #: receive buffers for credit-only SENDs
    control: int = 2
    #: size of each receive (and send) buffer
    buffer_size: int = 64 << 10
    #: how long the path probe and the QP bring-up may take
    setup_timeout: float = 5.0
    #: QP ACK timeout exponent (4.096 us * 2**n) and retries: a dead peer is
    #: reported after about (retry_cnt + 1) * timeout.  Not 7: rxe (Soft-RoCE) retries
    #: forever with 7 (as the spec has it for rnr_retry only), and a silent peer would never
    #: fail a work request (found across two hosts, tests/test_twohost.py)
    qp_timeout: int = 14
    retry_cnt: int = 6
    rnr_retry: int = 6
    #: how long the teardown waits for flushes, a peer's goodbye for its in-band CLOSE, and our
    #: goodbye for the TCP connection to take it.  Not a bound on closing: a close waits for a
    #: slow reader as long as the peer is alive (docs/protocol.md, "Closing an RDMA connection")
    close_timeout: float = 2.0
    #: ask for a send completion at least every this many SENDs (the others
    #: are unsignaled; a completion retires every send posted before it)
    signal_every: int = 8
    #: the data path: ``"native"`` (C: one call per send and one per wake) or
    #: ``"checked"`` (the Python session, the reference; slower).  None: the
    #: environment variable ``AIORDMA_HOT_PATH``, else native where the native module is built
    hot_path: str | None = None
    #: how completions are waited for: ``"event"`` (sleep on the completion
    #: channel fd), ``"adaptive"`` (spin briefly after activity, then sleep) or
    #: ``"busy"`` (spin while traffic flows); see ``aiordma/_rdma/poller.py``.
    #: None: the environment variable ``AIORDMA_POLL``, else ``"event"``
    poll: str | None = None
    #: adaptive: keep polling this long after the last completion (seconds)
    spin_window: float = 100e-6
    #: busy: keep polling this long after the last completion (seconds)
    busy_window: float = 1.0
    #: adaptive and busy: the longest one spin in C may take before the loop runs again (seconds)
    spin_budget: float = 50e-6
    #: send messages up to this many bytes inline (copied into the work request: no send slot,
    #: no DMA read); the QP may grant less, and what it granted is what is used
    max_inline: int = 256
    #: messages of at least this many bytes go by rendezvous on the native path: the sender
    #: stages them in a registered region the peer may READ (or lends them where they lie, in
    #: registered memory), the receiver READs them straight into its buffer (``receive_into``:
    #: zero copy into registered memory) -- no 64 KiB SENDs.  0: never.  None (the default): the
    #: threshold measured on the connection's device (``aiordma info --measure-rendezvous``,
    #: :mod:`aiordma._rdma.thresholds`), else 8 MiB -- Soft-RoCE's crossover (docs/benchmarks.md,
    #: "Where the rendezvous pays"); an RNIC, where copies and not the wire are the cost, crosses
    #: far lower.  ``aiordma info`` shows each device's.
    rendezvous: int | None = None
    #: rendezvous bytes a connection may have staged for its peer at once (a send waits beyond;
    #: one message larger than this still goes, alone); a byte stream is staged in pieces of
    #: half of it.  This is the sender's "socket buffer" for large writes.
    rendezvous_inflight: int = 16 << 20
    #: a connection on which a task waits (a reader for bytes, a sender for credits) and that
    #: made no progress for one to two such gaps probes the path: a zero-length RDMA WRITE (no
    #: rkey, no receive on the peer).  A live peer's NIC ACKs it; a dead host's lets it fail
    #: within the retry budget, and the waiting tasks get ``BrokenResourceError`` within about a
    #: second instead of at the TCP keepalive.  The gap doubles after each probe the peer
    #: answered (at most 8 s) and starts over on progress.  The device looks at each waiting
    #: connection once per gap and probes per path -- one peer host through one port -- not per
    #: connection (:mod:`aiordma._rdma.liveness`).  0: never.
    liveness_probe: float = 0.05

    def __post_init__(self) -> None:
        if not 1 <= self.window <= 4096:
            raise ValueError("window must be between 1 and 4096")
        if not 1 <= self.control <= 127:
            raise ValueError("control must be between 1 and 127")
        if not 256 <= self.buffer_size <= 16 << 20:
            raise ValueError("buffer_size must be between 256 bytes and 16 MiB")
        if self.signal_every < 1:
            raise ValueError("signal_every must be at least 1")
        if self.hot_path not in (None, "native", "checked"):
            raise ValueError(f"hot_path must be 'native' or 'checked', not {self.hot_path!r}")
        if self.poll not in (None, *POLL_MODES):
            raise ValueError(f"poll must be one of {', '.join(POLL_MODES)}, not {self.poll!r}")
        if not 0 <= self.max_inline <= 1024:
            raise ValueError("max_inline must be between 0 and 1024 bytes")
        if self.rendezvous is not None and (self.rendezvous < 0 or 0 < self.rendezvous < 4096):
            raise ValueError("rendezvous must be None (measured), 0 (off) or at least 4096 bytes")
        if self.rendezvous_inflight < 1:
            raise ValueError("rendezvous_inflight must be positive")
        for name in ("spin_window", "busy_window", "spin_budget", "liveness_probe"):
            if not 0 <= getattr(self, name) <= 10.0:
                raise ValueError(f"{name} must be between 0 and 10 seconds")

    @property
    def poll_mode(self) -> str:
        """The poll mode in force: ``poll``, else ``AIORDMA_POLL``, else ``"event"``."""
        mode = self.poll or os.environ.get("AIORDMA_POLL", "").strip().lower() or "event"
        if mode not in POLL_MODES:
            raise ValueError(f"AIORDMA_POLL must be one of {', '.join(POLL_MODES)}, not {mode!r}")
        return mode

    def use_native(self, available: bool) -> bool:
        """Whether connections run the native data path (``hot_path``, else ``AIORDMA_HOT_PATH``)."""
        path = self.hot_path or os.environ.get("AIORDMA_HOT_PATH", "").strip().lower() or None
        if path not in (None, "native", "checked"):
            raise ValueError(f"AIORDMA_HOT_PATH must be 'native' or 'checked', not {path!r}")
        if path == "native" and not available:
            raise RdmaSetupError("resources", "hot_path='native' needs the native module, which is not built here")
        return available and path != "checked"


class RdmaSetupError(Exception):
    """A step of the RDMA setup failed; ``step`` names it, the message says why."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"RDMA setup failed at {step}: {detail}")
        self.step = step
        self.detail = detail


class NativeProvider:
    """The verbs of this host: the native module, sysfs discovery."""

    name = "native"
    key: object = "native"  # every NativeProvider reaches the same devices

    def open_context(self, name: str) -> objects.Context:
        from .verbs import Context  # the native module loads here, when RDMA is first needed

        return Context(name)

    def WCArray(self, n: int) -> objects.WorkCompletions:  # noqa: N802 - mirrors the class name
        from .verbs import WCArray

        return WCArray(n)

    def device_names(self) -> list[str]:
        from .discovery import device_names

        return device_names()

    def gid_for_ip(self, ip: str) -> GidEntry | None:
        from .discovery import gid_for_ip

        return gid_for_ip(ip)

    def probe(self) -> Probe:
        """Whether this host offers RDMA.  While a device is open in this process (a listener
        holds one, another connection uses one), verbs demonstrably work here: the answer comes
        from that, without the sysfs walk and the verbs device list every connect would
        otherwise make on each side (~2.3 ms of an RDMA connect's ~40 in the Soft-RoCE guest).
        ``devices`` then names the open ones; the connection's ``open`` step lists the host's."""
        from .device import open_devices

        names = sorted({device.name for device in open_devices() if device.provider.key == self.key and not device.closed})
        if names:
            return Probe(True, "", True, "RDMA devices open in this process: " + ", ".join(names), names)
        from .discovery import probe

        return probe()

    def live_objects(self) -> dict[str, int]:
        from .verbs import live_objects

        return live_objects()

    def native(self) -> tuple[Any, Any] | None:
        from .fastpath import native_lib

        return native_lib()


class RdmaBackend:
    """Opens RDMA connections.  Injectable (``rdma_backend=``): tests subclass it
    to make a chosen setup step fail, or give it another verbs provider (the
    simulated wire of :mod:`aiordma.testing`); :meth:`probe` decides whether
    RDMA is offered at all."""

    def __init__(self, config: RdmaConfig | None = None, *, provider: VerbsProvider | None = None) -> None:
        self.config = config or RdmaConfig()
        self.provider: VerbsProvider = provider if provider is not None else NativeProvider()

    def probe(self) -> Probe:
        return self.provider.probe()

    def before_step(self, step: str) -> None:
        """Called before each setup step (``device``, ``open``, ``resources``,
        ``init``, ``memory``, ``post``, ``params``, ``rtr``, ``rts``, ``probe``)."""

    async def probe_delay(self) -> None:
        """Called while the path probe is outstanding (tests make it hang)."""

    def hello_params(self, params: RdmaParams) -> RdmaParams:
        """What our HELLO announces (tests announce a wrong GID)."""
        return params

