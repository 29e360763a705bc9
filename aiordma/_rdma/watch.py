"""Is the peer alive?  The RDMA link's watch over its peer: the TCP connection after the switch,
the peer's goodbye, and liveness probes.

Theory of operation
-------------------
* **The TCP connection** stays open and silent once RDMA carries the data.  A side that closed in
  order writes one thing on it -- its goodbye (a CLOSE frame), once its in-band CLOSE was
  delivered -- and then ends it.  Anything else (an end without a goodbye, other bytes) means the
  peer is gone: crashed, killed, aborted, or not speaking the protocol; the Core fails with a
  ``ConnectionResetError`` and the QP goes to ERROR.
* **The goodbye** says the peer's CLOSE is in our receive queue, perhaps not polled yet: the
  connection waits for it over RDMA (bounded by ``RdmaConfig.close_timeout``) and never fails
  for the TCP end that follows.
* **Liveness probes** (``RdmaConfig.liveness_probe`` > 0): while a task waits on the connection,
  the device's plan (:mod:`aiordma._rdma.liveness`) looks at its progress mark; after a gap in
  which no connection of its path (the same peer host through the same port) made progress, it
  posts a zero-length RDMA WRITE on one of them.  A live peer's NIC answers it whatever its application
  does (a slow reader is never mistaken for a dead one); a dead host fails it within the RC
  retry budget, which fails the connection and wakes every waiter.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

from .._conn.core import ControlLink, Core
from .._io.backends import IOBackend, Watch
from .._proto.protocol import CLOSE_FIXED, CloseCode, FrameType, frame
from .config import RdmaConfig
from .datapath import DataPath
from .device import Device

__all__ = ["PeerWatch", "WatchedLink", "GOODBYE"]

#: what a closing side writes on the TCP connection once its CLOSE was delivered in-band and the peer
#: READ all it staged (docs/protocol.md, "Closing an RDMA connection"); ends the TCP connection's silence
GOODBYE = frame(FrameType.CLOSE, CLOSE_FIXED.pack(CloseCode.NORMAL))


class WatchedLink(Protocol):
    """What :class:`PeerWatch` asks of its RDMA link."""

    core: Core
    config: RdmaConfig
    io: IOBackend

    @property
    def session(self) -> DataPath | None: ...

    @property
    def device(self) -> Device | None: ...

    @property
    def watching(self) -> bool:
        """The link carries the Core and is not closing for good (delivering still counts)."""
        ...

    @property
    def waiters(self) -> int:
        """Tasks parked on the link."""
        ...

    @property
    def path(self) -> tuple[bytes, bytes]:
        """(our GID, the peer's GID) once connected: the liveness plan probes per path."""
        ...

    def want_sends(self) -> bool: ...

    def unwant_sends(self, wanted: bool) -> None: ...

    def wake_all(self) -> None: ...

    def broke(self) -> None: ...

    def error_qp(self) -> None:
        """Stop the NIC now (the QP to ERROR): every posted work request comes back flushed."""


class PeerWatch:
    """The watch over one RDMA connection's peer (see the module docs); the device's liveness
    plan holds it while a task waits (:meth:`liveness_mark`, :meth:`probe_liveness`)."""

    def __init__(self, link: WatchedLink) -> None:
        self._link = link
        self._control: Watch | None = None  # the TCP connection, watched after the switch
        self._rx = b""  # bytes the TCP connection carried after the switch (a goodbye, or less)
        self._goodbye_timer: Watch | None = None
        self._probe_wanted = False  # the CQ is armed for every completion while our probe is out
        #: the peer said goodbye (its CLOSE is in our queue); then the TCP connection ended
        self.peer_goodbye = False
        self.peer_ended = False
        #: the TCP connection ended (or carried other bytes) without a goodbye: the peer is gone
        self.tcp_lost = False
        #: liveness probes are on (``RdmaConfig.liveness_probe``), and we are in the device's plan
        self.probing = link.config.liveness_probe > 0
        self.watched = False
        self._started = False  # the link carries the Core (it has a path and a Core)

    # -- the TCP connection ----------------------------------------------------------------

    def start(self, control: ControlLink) -> None:
        """RDMA carries the Core from now on: watch what the TCP connection still carries."""
        self._control = control.hand_over(self._link.io, self.on_control)
        self._started = True

    def on_control(self, data: bytes | None) -> None:
        """The TCP connection carried ``data`` after the switch, or ended (``None``)."""
        if self.tcp_lost:
            return
        if data is not None:
            rx = self._rx = self._rx + data
            if not self.peer_goodbye and len(rx) <= len(GOODBYE) and GOODBYE.startswith(rx):
                if len(rx) == len(GOODBYE):
                    self._on_goodbye()
                return
        elif self.peer_goodbye:
            self._close_control()  # the end that follows the goodbye
            self.peer_ended = True  # (its QP is going or gone: a CLOSE of ours still in flight finds nobody)
            self._link.wake_all()
            return
        self._on_lost()

    def _on_goodbye(self) -> None:
        """The peer closed in order: its CLOSE is in our receive queue (its completion came back to
        it), perhaps not polled yet.  Wait for it over RDMA (bounded), never fail for the TCP end."""
        link = self._link
        self.peer_goodbye = True
        self.probing = False  # (its QP is going away: a probe, a credit would only fail)
        if link.session is not None:
            link.session.quiet = True
        core = link.core
        device = link.device
        if device is not None and not device.closed:
            device.poller.poll_now()
        if core.peer_close is None and core.error is None and not core.closed:
            timeout = link.config.close_timeout
            self._goodbye_timer = link.io.call_later(timeout, partial(self._goodbye_expired, timeout))

    def _goodbye_expired(self, timeout: float) -> None:
        self._goodbye_timer = None
        core = self._link.core
        if core.peer_close is None and core.error is None and not core.closed:
            core.feed_eof(ConnectionResetError(
                f"the peer closed the connection in order, but its CLOSE did not arrive over RDMA within {timeout} s"
            ))  # fmt: skip
            self._failed()

    def _close_control(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None

    def _on_lost(self) -> None:
        """The TCP connection ended without a goodbye (or carried other bytes): the peer is gone."""
        link = self._link
        self._close_control()
        self.tcp_lost = True
        device = link.device
        if device is not None and not device.closed:
            device.poller.poll_now()  # was the peer's CLOSE already in the CQ?
        core = link.core
        if core.peer_close is None and core.error is None and not core.closed:
            core.feed_eof(ConnectionResetError("the TCP connection of the RDMA link ended"))
        self._failed()

    def _failed(self) -> None:
        """The Core failed for a reason of the TCP side: the session follows, the QP goes to ERROR."""
        link = self._link
        core = link.core
        session = link.session
        if session is not None and session.error is None and core.error is not None:
            session.fail(core.error)
        if core.error is not None:
            link.error_qp()
        link.wake_all()

    # -- liveness probes (the device's plan looks at waiting connections) ----------------------

    def watch(self) -> None:
        """A task waits on the link: join the device's plan (the caller checked ``probing`` and
        not ``watched``)."""
        link = self._link
        device = link.device
        session = link.session
        if link.watching and device is not None and session is not None:
            self.watched = True
            device.watch_liveness(self, link.config.liveness_probe, int(session.progress))

    @property
    def liveness_path(self) -> tuple[bytes, bytes]:
        """Our path (the plan probes per path: one peer host through one port)."""
        return self._link.path

    def liveness_mark(self) -> int | None:
        """The plan's look: our progress mark (bytes received and posted) while a task waits,
        else None (we leave the plan until a task waits again)."""
        link = self._link
        session = link.session
        if self._probe_wanted and (session is None or not session.probe_outstanding):
            self._probe_wanted = False  # our probe completed
            link.unwant_sends(True)
        if session is None or session.error is not None or not link.watching or not link.waiters:
            self.watched = False
            return None
        return int(session.progress)

    def probe_liveness(self) -> None:
        """The plan found us silent for a whole gap while a task waits: post a liveness probe
        (a zero-length RDMA WRITE) unless the last one is still out."""
        link = self._link
        session = link.session
        if session is None or session.error is not None or not link.watching:
            return
        if session.probe_outstanding:
            return  # the last probe has not completed: the retry budget is running
        session.post_probe()  # (with the send queue full it does not: what fills it times out by itself)
        if session.error is not None:
            link.broke()
            link.wake_all()
            return
        if not self._probe_wanted and session.probe_outstanding:
            # (a failed probe must wake the poller: its completion is not solicited)
            self._probe_wanted = link.want_sends()

    def failed(self) -> None:
        """The connection failed (its QP goes to ERROR): it leaves the plan, and its path is
        suspect -- the device probes the path's other waiting connections at once, so a dead host
        fails all of them within one retry budget."""
        device = self._link.device
        if device is not None and self._started:
            self.watched = False
            device.unwatch_liveness(self, failed=True)

    # -- teardown ------------------------------------------------------------------------------

    def stop(self) -> None:
        """The link is torn down: stop watching the TCP connection, leave the plan, disarm."""
        link = self._link
        self._close_control()
        if self._goodbye_timer is not None:
            self._goodbye_timer.close()
            self._goodbye_timer = None
        device = link.device
        if device is not None and self._started:
            self.watched = False
            device.unwatch_liveness(self)
        if self._probe_wanted:
            self._probe_wanted = False
            link.unwant_sends(True)

