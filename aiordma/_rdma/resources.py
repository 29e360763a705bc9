"""One RDMA connection's verbs resources: opened in order at set-up, released in reverse at teardown.

:class:`LinkResources` is the set-up and teardown half of an RDMA link (``link.py`` keeps the
data path and the close; ``watch.py`` the peer's liveness; ``remote.py`` one-sided operations).

Set-up, step by step (each step's name is what :class:`~aiordma._rdma.config.RdmaSetupError`
reports, and what a test's ``RdmaBackend.before_step`` fails):

``device``/``open``
    the device behind the TCP socket's local address, asked of this loop's open devices
``resources``
    the QP, in the device's shared PD (memory windows) or the connection's own
``init``, ``memory``, ``post``
    INIT; the receive ring registered; the session (native or checked) built, routed on the
    device's poller, and every receive slot posted -- before the HELLO goes out
``params``, ``rtr``, ``rts`` (:meth:`LinkResources.connect`)
    the peer's HELLO checked; RTR and RTS towards its QP; the send ring registered

Teardown follows the device's rules (``docs/architecture.md``): the caller stops posting and
drains, then :meth:`LinkResources.destroy_qp` (the barrier: after it the device touches nothing
of this connection) and :meth:`LinkResources.release` (rings back to the scope's cache, the
connection's own PD, the CQ reservation, the device).  Each step runs whatever the one before
said: errors are collected, never left to leak the rest.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from functools import partial

from .._conn.core import RECEIVE_HIGH_WATER
from .._errors import RDMAError, RemoteProtocolError
from .._io.backends import IOBackend
from . import qp as qp_setup
from .checked import CheckedSession
from .config import RdmaBackend, RdmaSetupError
from .constants import MTU_TO_ENUM
from .datapath import ChanView, DataPath
from .device import Device, acquire_device, open_devices
from .fastpath import NativeSession
from .constants import GidEntry
from .objects import QueuePair, Region, Scope
from .params import RdmaParams
from .poller import NativeReceiver
from .session import Ring

__all__ = ["LinkResources"]

log = logging.getLogger("aiordma")

#: runs one teardown step, keeping its error and going on
Attempt = Callable[[Callable[[], object]], None]


class LinkResources:
    """What one connection holds of the device (see the module docs)."""

    def __init__(self, backend: RdmaBackend, io: IOBackend) -> None:
        self.backend = backend
        self.config = backend.config
        self.io = io
        self.device: Device | None = None
        self.gid_entry: GidEntry | None = None
        #: where this connection's memory lives: the device (shared PD, memory windows) or its own
        #: protection domain (a device without windows): see device.py
        self.scope: Scope | None = None
        self.qp: QueuePair | None = None
        self.qp_num = 0
        self.recv_mr: Region | None = None
        self.send_mr: Region | None = None
        #: the connection's session (it decides what to post, and posts): see datapath.py
        self.session: DataPath | None = None
        #: the same session when it is the native one (its completions are processed in C)
        self.native: NativeSession | None = None
        self.chan: ChanView | None = None  # (the native session's C struct, read in a wake)
        self.cid = 0  # the poller's index of our native chan (0: none)
        self.peer: RdmaParams | None = None
        self.mtu = 0
        self.psn = 0
        #: the set-up step running (what an error reports)
        self.step = "device"
        self._cq_reserved = 0
        self._routed = False
        self._counted = False  # counted in the poller's modes (and checked connections)
        self._mode = "event"
        self._local_peer = False

    def _enter(self, step: str) -> None:
        self.step = step
        self.backend.before_step(step)

    # -- set-up ------------------------------------------------------------------------------

    def open(self, local_ip: str | None, receiver: NativeReceiver) -> None:
        """Open what one side offers in its HELLO (steps ``device`` to ``post``); completions of
        the QP go to ``receiver``.  Raises; the caller then runs the teardown."""
        cfg = self.config
        provider = self.backend.provider
        self._enter("device")
        if local_ip is None:
            raise RdmaSetupError("device", "the TCP socket has no IP address")
        names = provider.device_names()
        if not names:
            raise RdmaSetupError("device", "this host has no RDMA device")
        self._enter("open")
        # the device behind the address: asked of this loop's open devices (their GID tables
        # come from one verbs call when they open), never by walking sysfs per connect
        for name in names:
            device = acquire_device(self.io, provider, name)
            found = device.find_gid(local_ip)
            if found is not None:
                self.device, entry = device, found
                break
            device.release()
        else:
            raise RdmaSetupError("device", f"no RDMA device has the local address {local_ip}")
        self.gid_entry = entry
        self._enter("resources")
        buffers = cfg.window + cfg.control
        self.scope = scope = device.scope()  # (the shared PD with windows, else this connection's own)
        self.qp, self._cq_reserved = qp, _ = qp_setup.create_qp(device, cfg, scope.pd)
        self.qp_num = int(qp.qp_num)
        caps = qp.caps
        self._enter("init")
        qp_setup.to_init(qp, entry)
        self._enter("memory")
        self.recv_mr = recv_mr = scope.take_region(buffers * cfg.buffer_size)
        ring = Ring(recv_mr.view(), recv_mr.addr, recv_mr.lkey, cfg.buffer_size, buffers)
        poller = device.poller
        self._mode = cfg.poll_mode
        session: DataPath
        if cfg.use_native(poller.native is not None):
            self.cid, gen = poller.add_native(receiver)
            session = self.native = native = NativeSession(
                window=cfg.window, control=cfg.control, buffer_size=cfg.buffer_size, recv=ring,
                rq_depth=int(caps.max_recv_wr), qp=qp, cid=self.cid, gen=gen,
            )  # fmt: skip
            self.chan = native.c
            poller.ensure_buffer(cfg.buffer_size)
            poller.set_chan(self.cid, native.c)
        else:
            session = CheckedSession(
                window=cfg.window, control=cfg.control, buffer_size=cfg.buffer_size, recv=ring,
                rq_depth=int(caps.max_recv_wr), qp=qp,
            )  # fmt: skip
            poller.add_checked(1)
        self.session = session
        poller.add_mode(self._mode)
        if self._mode != "event":
            poller.spin_window, poller.busy_window = cfg.spin_window, cfg.busy_window
            poller.spin_budget = cfg.spin_budget
        self._counted = True
        self._enter("post")
        poller.routes[self.qp_num] = receiver
        self._routed = True
        session.post_receives()
        self.mtu = min(4096, device.active_mtu)
        self.psn = random.randrange(1 << 24)

    @property
    def params(self) -> RdmaParams:
        """What our HELLO tells the peer."""
        cfg = self.config
        entry = self.gid_entry
        if entry is None:
            raise RdmaSetupError(self.step, "the connection has no device yet")
        return self.backend.hello_params(RdmaParams(
            gid=entry.gid.packed,
            qp_num=self.qp_num,
            psn=self.psn,
            mtu=MTU_TO_ENUM.get(self.mtu, 3),
            window=cfg.window,
            control=cfg.control,
            buffer_size=cfg.buffer_size,
            rd_atom=qp_setup.rd_atom_of(self.device) if self.device is not None else 1,
            reads_rendezvous=self.native is not None,  # (the native path READs what the peer staged)
        ))  # fmt: skip

    def connect(self, peer_raw: bytes | None, peer_ip: str | None) -> None:
        """RTR and RTS towards the peer's QP (steps ``params``, ``rtr``, ``rts``); raises
        :class:`RdmaSetupError`."""
        try:
            self._connect(peer_raw, peer_ip)
        except RdmaSetupError:
            raise
        except RemoteProtocolError as exc:
            raise RdmaSetupError("params", str(exc)) from exc
        except (RDMAError, OSError, ValueError) as exc:
            raise RdmaSetupError(self.step, str(exc)) from exc

    def _connect(self, peer_raw: bytes | None, peer_ip: str | None) -> None:
        cfg = self.config
        session, qp, device, scope, entry = self.session, self.qp, self.device, self.scope, self.gid_entry
        assert session is not None and device is not None and scope is not None  # (open() succeeded)
        assert qp is not None and entry is not None
        self._enter("params")
        self.peer = peer = qp_setup.check_peer(peer_raw, peer_ip)
        self._enter("rtr")
        qp_setup.rtr(qp, entry, peer, self.mtu, qp_setup.rd_atom_of(device))
        self._enter("rts")
        qp_setup.rts(qp, self.psn, cfg, device, peer)
        slot = min(peer.buffer_size, cfg.buffer_size)
        self.send_mr = send_mr = scope.take_region(cfg.window * slot)
        ring = Ring(send_mr.view(), send_mr.addr, send_mr.lkey, slot, cfg.window)
        session.start(
            peer,
            sq_depth=int(qp.caps.max_send_wr),
            send=ring,
            max_inline=int(qp.caps.max_inline_data),
            signal_every=cfg.signal_every,
            high_water=RECEIVE_HIGH_WATER,
        )
        # the peer's QP on a device of this very loop: same thread -- spinning would only delay it
        if any(
            other.io.key == self.io.key and peer.qp_num in other.poller.routes
            and any(e.gid.packed == peer.gid for e in other.gids)
            for other in open_devices()
        ):  # fmt: skip
            self._local_peer = True
            device.poller.add_local_peer(1)

    # -- teardown -----------------------------------------------------------------------------

    def unroute(self) -> None:
        """Leave the poller's routes and counts (first: nothing is dispatched to us any more)."""
        device = self.device
        if device is None:
            return
        poller = device.poller
        if self._routed:
            poller.routes.pop(self.qp_num, None)
            self._routed = False
        if self._counted:
            self._counted = False
            poller.add_mode(self._mode, -1)
            if self.native is None:
                poller.add_checked(-1)
        if self._local_peer:
            self._local_peer = False
            poller.add_local_peer(-1)

    def destroy_qp(self, attempt: Attempt) -> bool:
        """Destroy the QP (after it, the device touches nothing of ours); returns whether it is gone."""
        qp = self.qp
        qp_gone = qp is None
        if qp is not None:
            attempt(qp.close)
            qp_gone = bool(getattr(qp, "closed", True))
            self.qp = None
        device = self.device
        if self.cid and device is not None and (qp_gone or device.closed):
            device.poller.remove_native(self.cid)  # nothing of the QP can complete any more
            self.cid = 0
        return qp_gone

    def release(self, attempt: Attempt, qp_gone: bool, *, keep_scope: bool) -> None:
        """Give the rings back and release the connection's PD (unless ``keep_scope``: exposures
        still registered in it), its CQ reservation and the device.  Only after :meth:`destroy_qp`:
        memory a QP that could not be destroyed may still touch is never reused."""
        device = self.device
        if device is None:
            return
        scope = self.scope
        for mr in (self.send_mr, self.recv_mr):
            if mr is not None:
                if qp_gone and scope is not None:
                    attempt(partial(scope.give_region, mr))
                else:  # pragma: no cover - the QP could not be destroyed: never reuse what it may touch
                    log.error("aiordma: an RDMA QP could not be destroyed; its buffers are leaked on purpose")
        self.send_mr = self.recv_mr = None
        if scope is not None and qp_gone and scope is not device and not keep_scope:
            attempt(scope.close_scope)  # (a connection's own PD: after everything in it)
            self.scope = None
        if self._cq_reserved:
            device.unreserve_cq(self._cq_reserved)
            self._cq_reserved = 0
        attempt(device.release)
        self.device = None

