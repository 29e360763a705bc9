"""The RDMA link: the thin glue between a Core, its sans-IO session, its QP and the device's poller.

Theory of operation
-------------------
An :class:`RdmaLink` exists from the moment a side decides to offer RDMA
(:meth:`RdmaLink.prepare`: QP created and in INIT, receive ring registered and
posted, routed on the device's poller) through the handshake
(:meth:`connect`: the peer's parameters, RTR/RTS; :meth:`probe`: a
zero-length RDMA WRITE proves the path) to :meth:`activate`, where it takes
the Core over from the TCP link.  The TCP connection stays open, silent, as
the liveness channel: its end (or any byte on it) means the peer is gone
(``watch.py``: the link's :class:`~aiordma._rdma.watch.PeerWatch`, which also
runs the liveness probes).  One-sided operations and rendezvous are the link's
other collaborator, :class:`~aiordma._rdma.remote.RemoteOps` (``remote.py``).

Everything is pushed: the device's poller calls :meth:`on_native` (or, on the
checked path, :meth:`on_completions`) from the event loop's fd callback; that
feeds received bytes to the Core, lets the session post (re-posts, credit
messages, backlog: ``datapath.py``) and wakes the
tasks that wait -- a receiver for data, a sender for credits or send slots.
No task polls, no loop spins: every wait is on a future (asyncio) or an Event
(trio) that only :meth:`on_completions`, a fatal event or teardown sets.

Closing is the link's third collaborator, :class:`~aiordma._rdma.closing.LinkClose`
(``closing.py``): deliver (the CLOSE frame's completion, the peer's last READs), then tear
down in the device's order (``docs/architecture.md``): stop posting, the QP to ERROR, the
flushes drained (bounded), the QP destroyed, and only then the rings and the device given
back -- each step whatever the one before said, also under cancellation.  The data path reads
the close's ``closing`` flag: from then on it takes nothing more from the user.

Errors are translated here, at one boundary: verbs and completion errors
become the Core's error (``BrokenResourceError`` on the anyio API, with the
cause), and what the session calls the peer's fault is a
``RemoteProtocolError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from anyio import BrokenResourceError, ClosedResourceError
from anyio.abc import SocketAttribute

from .._attributes import TransportAttribute
from .._conn.core import ControlLink, Core, Link
from .._conn.nowait import NowaitLink
from .._errors import RDMAError
from .._io.backends import IOBackend, current_io
from .._proto.protocol import Chunk
from .config import RdmaBackend, RdmaConfig, RdmaSetupError
from . import qp as qp_setup
from .datapath import ChanView, DataPath
from .device import Device
from .objects import QueuePair, Scope
from .fastpath import BLOCK_SQ, EVT_DATA, EVT_ONESIDED, EVT_ROOM, NativeSession
from .params import RdmaParams
from .remote import RemoteOps
from .resources import LinkResources
from .thresholds import DEFAULT_RENDEZVOUS
from .closing import LinkClose
from .watch import PeerWatch

__all__ = ["RdmaLink", "local_ip_of", "peer_ip_of"]

log = logging.getLogger("aiordma")

_EVENTS_BESIDES_ROOM = ~(EVT_DATA | EVT_ROOM)


def _address(link: Link, attribute: Any) -> str | None:
    getter = link.extra_attributes.get(attribute)
    if getter is None:
        return None
    address = getter()
    if isinstance(address, tuple) and address:
        return str(address[0])
    return None


def local_ip_of(link: Link) -> str | None:
    """The local IP address of a link's TCP socket."""
    return _address(link, SocketAttribute.local_address)


def peer_ip_of(link: Link) -> str | None:
    """The peer's IP address of a link's TCP socket."""
    return _address(link, SocketAttribute.remote_address)


class RdmaLink(Link):
    """One connection's QP, session and rings (see the module docs)."""

    core: Core

    def __init__(self, backend: RdmaBackend, io: IOBackend) -> None:
        self.backend = backend
        self.config: RdmaConfig = backend.config
        self.io = io
        #: the QP, its memory and its place on the device's poller: opened at set-up, released at teardown
        self.res = LinkResources(backend, io)
        #: the connection's session (it decides what to post, and posts: datapath.py), from ``res``
        self.session: DataPath | None = None
        #: the same session when it is the native one (its completions are processed in C: on_native)
        self.native: NativeSession | None = None
        self._chan: ChanView | None = None  # (the native session's C struct, read in a wake)
        self.control: ControlLink | None = None
        self._parking = io.parking()  # readers, senders and teardown wait here
        self._qp_errored = False
        self._active = False
        self._early: list[bytes] = []  # bytes that arrived before the switch (native path)
        self._sq_wanted = False  # armed for send completions because posting waits for room (native)
        #: called once when the teardown has released everything (a listener's budget)
        self.on_destroyed: list[Callable[[], None]] = []
        #: one-sided operations, grants and rendezvous (the Core's ``nic`` on the native path)
        self.remote = RemoteOps(self, qp_access=int(qp_setup.QP_ACCESS), rndv_limit=backend.config.rendezvous_inflight)
        #: the watch over the peer: the TCP connection after the switch, its goodbye, liveness probes
        self.watch = PeerWatch(self)
        #: the close: delivery, then teardown (``closing.py``); its ``closing`` ends the data path
        self.closer = LinkClose(self)

    # -- set-up (the resources' steps: resources.py) ----------------------------------------

    @classmethod
    def prepare(cls, backend: RdmaBackend, local_ip: str | None) -> RdmaLink:
        """Open what one side offers in its HELLO; raises :class:`RdmaSetupError` (with nothing left open)."""
        link = cls(backend, current_io())
        res = link.res
        try:
            try:
                res.open(local_ip, link)
            finally:
                link.session, link.native, link._chan = res.session, res.native, res.chan
        except BaseException as exc:
            link.closer.destroy()
            if isinstance(exc, RdmaSetupError):
                raise
            if isinstance(exc, (RDMAError, OSError, ValueError)):
                raise RdmaSetupError(res.step, str(exc)) from exc
            raise
        return link

    @property
    def params(self) -> RdmaParams:
        """What our HELLO tells the peer."""
        return self.res.params

    def connect(self, peer_raw: bytes | None, peer_ip: str | None) -> None:
        """RTR and RTS towards the peer's QP (steps ``params``, ``rtr``, ``rts``)."""
        self.res.connect(peer_raw, peer_ip)

    @property
    def device(self) -> Device | None:
        return self.res.device

    @property
    def qp(self) -> QueuePair | None:
        return self.res.qp

    @property
    def scope(self) -> Scope | None:
        return self.res.scope

    @property
    def qp_num(self) -> int:
        return self.res.qp_num

    async def probe(self) -> None:
        """Prove the path: a zero-length RDMA WRITE must be ACKed (step ``probe``)."""
        session = self.session
        assert session is not None
        self.res.step = "probe"
        self.backend.before_step("probe")
        wanted = self.want_sends()
        try:
            session.post_probe()
            with anyio.fail_after(self.config.setup_timeout):
                await self.backend.probe_delay()
                while session.probe_status is None and session.error is None:
                    await self.park()
        except TimeoutError:
            raise RdmaSetupError("probe", f"no answer from the peer's QP within {self.config.setup_timeout} s") from None
        finally:
            self.unwant_sends(wanted)
        if session.error is not None or session.probe_status:
            raise RdmaSetupError("probe", f"the path to the peer failed ({session.error})")

    def activate(self, core: Core, control: ControlLink) -> None:
        """Take the Core over from the TCP link ``control`` (which stays open for liveness)."""
        session = self.session
        assert session is not None
        self.control = control
        self.core = core
        session.activate()
        self._active = True
        core.link = self
        core.transport = "rdma"
        core.fallback_reason = ""
        res = self.res
        core.counts.pinned_bytes = sum(mr.length for mr in (res.recv_mr, res.send_mr) if mr is not None)
        # (the rendezvous only towards a peer that READs it: its HELLO says so)
        peer = self.res.peer
        threshold = self.rendezvous_threshold
        if self.native is not None and threshold and peer is not None and peer.reads_rendezvous:
            core.rndv_min = threshold
        if self.native is not None:
            core.nic = self.remote  # (one-sided operations on the NIC; rendezvous when rndv_min is set)
        self.watch.start(control)
        early, self._early = self._early, []  # (the native path: delivered in C before the switch)
        for data in early:
            core.feed(data)
        if early:
            self._parking.unpark_all()
        deferred = session.take_deferred()  # (the checked path: completions kept before the switch)
        if deferred:
            self.on_completions(deferred)

    # -- pushed by the poller ------------------------------------------------------------

    def want_sends(self) -> bool:
        """Native path: a task waits for a send completion; the CQ is armed for every completion."""
        device = self.device
        if self.native is None or device is None or device.closed:
            return False
        device.poller.want_sends(1)
        return True

    def unwant_sends(self, wanted: bool) -> None:
        if wanted and self.device is not None:
            self.device.poller.want_sends(-1)

    def on_native(self, view: memoryview | None, early: int) -> None:
        """The poller's wake processed our completions in C (native path): ``view`` is the bytes
        delivered (valid only during this call), the chan's ``events`` what else happened."""
        session, c = self.native, self._chan
        assert session is not None and c is not None  # (the poller routes native links only here)
        events = c.events
        c.events = 0
        had_error = session.error is not None
        if view is not None and not had_error:
            if self._active:
                core = self.core
                core.feed(view)
                # what C counts as unread from now on: what the Core holds (the reader may have
                # taken some since the last wake); a reader's consumed() is only needed to
                # release credits that C withheld
                c.unread = core.rbuf.nbytes + core.messages.nbytes
                self.needs_consumed = c.withheld != 0 or self.remote.fetch is not None
                if core.error is not None and session.error is None:
                    session.fail(core.error)
                elif core.closed and c.withheld:
                    self.release_withheld()  # (closed: what arrives is dropped, credits flow)
            elif early:
                self._early.append(bytes(view))
        if events & EVT_ONESIDED:
            self.remote.completed(session.take_onesided())
        if self.remote.fetch is not None:
            self.remote.fetch_step()
        if events & _EVENTS_BESIDES_ROOM or (events & EVT_ROOM and (session.queued or session.need_fence)):
            session.on_events(events)
        if c.blocked == BLOCK_SQ or self._sq_wanted:
            self._track_sq()
        if session.error is not None and not had_error:
            self.broke()
        self._parking.unpark_all()

    def _track_sq(self) -> None:
        """While posting waits for room that only a send completion makes (the native path's
        send queue or ring is full, with a backlog or a credit owed), the CQ is armed for every
        completion -- also when no task waits (asyncio's ``write()`` without ``drain()``, a credit
        SEND due).  Called after every wake and post that may change it."""
        session = self.session
        need = session is not None and session.wants_send_completions
        if need == self._sq_wanted:
            return
        self._sq_wanted = need
        if need:
            if not self.want_sends():  # (it looks once: the room may be there already)
                self._sq_wanted = False
        else:
            self.unwant_sends(True)

    def posted(self, session: DataPath) -> None:
        """After a call that posts: the CQ follows what posting waits for; a refused post fails the Core."""
        self._track_sq()
        if session.error is not None:
            self.broke()

    def release_withheld(self) -> None:
        """This side is closed and reads no more: return every credit withheld for a reader, now and
        from now on (what arrives is dropped by the Core)."""
        session = self.session
        if session is None or session.error is not None:
            return
        if session.withheld:
            session.release_withheld()
            self.posted(session)

    def stop_tracking_sends(self) -> None:
        """Teardown: disarm what :meth:`_track_sq` armed."""
        device = self.device
        if self._sq_wanted and device is not None:
            self._sq_wanted = False
            device.poller.want_sends(-1)

    def on_completions(self, entries: list[tuple[int, int, int, int, int, int]]) -> None:
        """Completions polled in Python (the checked path; on the native path, one that C could
        not route to a work request of ours)."""
        session = self.session
        assert session is not None
        had_error = session.error is not None
        if not self._active:  # set-up (the probe's completion; early SENDs are kept), or abandoned
            session.complete(entries, 0)
        else:
            core = self.core
            views = session.complete(entries, core.buffered)
            if views:
                feed = core.feed
                for view in views:
                    feed(view)
                if core.error is not None and session.error is None:
                    session.fail(core.error)
                elif core.closed and session.withheld:
                    session.release_withheld()  # (closed: what arrives is dropped, credits flow)
            if session.error is None:
                session.settle()
        if session.error is not None and not had_error:
            self.broke()
        self._parking.unpark_all()

    def on_fatal(self, exc: BaseException) -> None:
        """A fatal async event for our QP (or the whole device)."""
        session = self.session
        if session is not None and session.error is None:
            session.fail(exc)
            self.broke()
        self.wake_all()

    def broke(self) -> None:
        """The session failed: the Core learns why (once)."""
        session = self.session
        assert session is not None
        error = session.error
        core = self.core if self._active else None
        if core is not None and error is not None and core.error is None and not core.closed:
            core.on_error(error)
        self.error_qp()

    def error_qp(self) -> None:
        """The connection failed: stop the NIC now, not at ``aclose``.  Moving the QP to ERROR
        completes every outstanding work request as a flush, so a task that waits for one (a
        one-sided operation waits shielded: the NIC owns its memory until its completion) is
        released at once, instead of after the peer's NIC answers -- which a dead host or a
        silent wire never does.  The teardown later finds those flushes drained."""
        qp = self.qp
        if qp is None or self._qp_errored:
            return
        self._qp_errored = True
        try:
            qp.to_error()
        except (RDMAError, OSError) as exc:
            log.warning("aiordma: moving the failed connection's QP to ERROR: %s", exc)
        self.watch.failed()  # (its path is suspect: the device probes the path's waiting connections)

    @property
    def active(self) -> bool:
        """Carrying the Core (since :meth:`activate`)."""
        return self._active

    def wake_all(self) -> None:
        self._parking.unpark_all()

    def park(self) -> Awaitable[Any]:
        return self._parking.park()

    # -- Link -------------------------------------------------------------------------------

    def _finished(self) -> bool:
        session = self.session
        return session is None or session.error is not None or self.closer.closing or self.core.closed

    async def wait_incoming(self) -> None:
        """Wait for something to read (see ``Link``).  Never returns without yielding: a reader
        loops on it until the Core has bytes, an end or an error."""
        if self._finished():
            session = self.session
            core = self.core
            if session is not None and session.error is not None:
                self.broke()  # (the Core learns why, once: its readers end with it)
            if core.closed or core.peer_eof or core.error is not None:
                await self.io.checkpoint()
            else:
                await self.park()  # (closing: the close's end wakes every waiter)
            return
        await self.incoming()

    def incoming(self) -> Awaitable[None]:
        session = self.session
        if session is None or session.error is not None or self.closer.closing or self.core.closed:
            return self.wait_incoming()
        parking = self._parking
        wakes = parking.wakes
        fetch = self.remote.fetch
        if fetch is not None and not fetch.seq:
            # a reader waits although much is buffered: it wants more (a long line): READ it now
            self.remote.fetch_step(force=True)
        chan = self._chan
        if chan.withheld if chan is not None else session.withheld:
            # a reader waits although much is buffered (a long line, a large
            # message): it wants more, so the peer gets its credits back
            session.release_withheld()
            self.posted(session)
        watch = self.watch
        if not watch.watched and watch.probing:
            watch.watch()
        if parking.wakes != wakes:
            # what ran above (a poll, a finished READ that resumed the protocol) woke the
            # waiters -- this task among them, before it parked: it looks again instead
            return self.io.checkpoint()
        return parking.park()

    def consumed(self) -> None:
        session = self.session
        fetch = self.remote.fetch
        if fetch is not None and not fetch.seq:
            self.remote.fetch_step()  # a deferred rendezvous READ: the reader took some
        if session is None:
            return
        session.reader_took(self.core.buffered)
        self.posted(session)
        if self._chan is not None:  # (the native path: only while C withholds credits)
            self.needs_consumed = self._chan.withheld != 0 or self.remote.fetch is not None

    def check_usable(self) -> None:
        core = self.core
        session = self.session
        if core.closed or self.closer.closing or core.error is not None or session is None or session.error is not None:
            raise self._unusable()

    def _unusable(self) -> BaseException:
        """Why this connection takes no more sends (closed, or its error)."""
        core = self.core
        if core.closed or self.closer.closing:
            return ClosedResourceError()
        if core.error is not None:
            return core.broken()
        return BrokenResourceError("the RDMA connection failed")

    def _check_sendable(self) -> None:
        """``check_usable`` for a sender's wait: once the peer's CLOSE came (in-band, after its
        last data), no credit will come back and nothing more we send is read -- a sender waiting
        for credits fails at once instead of waiting forever.  (Receives and the READs that fetch
        what the peer sent before its CLOSE go on: they check ``check_usable`` only.)"""
        self.check_usable()
        peer_close = self.core.peer_close
        if peer_close is not None:
            raise BrokenResourceError(f"the peer closed the connection: {peer_close.reason or 'normal close'}")

    async def send(self, chunks: Sequence[Chunk]) -> None:
        """The session posts what credits and slots allow now (the native one in one C call);
        the rest waits here until it is posted.  A cancelled wait still sends the bytes, whole:
        what is not posted yet is copied out of the caller's buffers."""
        session = self.session
        core = self.core
        if session is None or session.error is not None or self.closer.closing or core.error is not None or core.closed:
            raise self._unusable()
        end = session.send(chunks)
        if not end:
            return  # (all of it posted: the common case)
        self.posted(session)
        if session.error is not None:
            self.check_usable()  # the post failed: raises
        if session.posted_bytes < end:
            await self._wait_posted(session, end)

    async def _wait_posted(self, session: DataPath, end: int) -> None:
        """Wait until the bytes up to ``end`` are posted; a cancelled wait still sends them, whole."""
        wanted = False
        try:
            while session.posted_bytes < end:
                self._check_sendable()
                wanted = await self._wait_to_post(session, wanted)
        except BaseException:
            session.detach(end)  # a cancelled send is still sent, whole, later: the caller's buffer is not kept
            raise
        finally:
            self.unwant_sends(wanted)

    async def _wait_to_post(self, session: DataPath, wanted: bool) -> bool:
        """One step of a sender's wait until its bytes are posted (``send``, ``drain``).  Returns
        whether the CQ is armed for every completion on its behalf (``wanted``: the caller
        disarms it once, at the end)."""
        if session.blocked_on_sends:
            if not wanted:
                # only a send completion frees the send queue or ring: be woken by ours (no wait
                # now: the pass it made may have freed room already)
                return self.want_sends()
            await self.park()
            return wanted
        # only the peer's credits release it: a wait the liveness plan watches, like a reader's
        self.core.counts.credit_stalls += 1
        watch = self.watch
        if not watch.watched and watch.probing:
            watch.watch()
        await self.park()
        return wanted

    # -- what the watch over the peer asks (aiordma._rdma.watch.WatchedLink) --------------------

    @property
    def watching(self) -> bool:
        """Carrying the Core, and not closing for good (a close that delivers is still watched)."""
        return self._active and self.qp is not None and (not self.closer.closing or self.closer.delivering)

    @property
    def waiters(self) -> int:
        return len(self._parking)

    @property
    def rendezvous_threshold(self) -> int:
        """From which size our messages go by rendezvous (0: never): ``RdmaConfig.rendezvous`` when
        set, else what was measured on our device, else the default (``thresholds.py``)."""
        configured = self.config.rendezvous
        if configured is not None:
            return configured
        device = self.device
        return device.rendezvous_threshold if device is not None else DEFAULT_RENDEZVOUS

    @property
    def path(self) -> tuple[bytes, bytes]:
        """(our GID, the peer's GID): one peer host through one port (the liveness plan's unit)."""
        entry, peer = self.res.gid_entry, self.res.peer
        assert entry is not None and peer is not None, "the link is not connected"
        return entry.gid.packed, peer.gid

    # the non-blocking API (aiordma._conn.nowait.NowaitLink: asyncio's front ends) ------------

    tcp_writer = None  # the queue is the session's, not a TCP transport's

    def send_nowait(self, chunks: Sequence[Chunk]) -> None:
        self.write_nowait(chunks)

    def unsent(self) -> int:
        session = self.session
        return 0 if session is None else int(session.enqueued - session.posted_bytes)

    def set_callbacks(
        self, on_data: Callable[[], None] | None, on_write_paused: Callable[[bool], None] | None
    ) -> bool:
        return False  # (a push of its own would cost every wake: front ends wait on incoming())

    def write_nowait(self, chunks: Sequence[Chunk]) -> None:
        """Queue and post what can be posted now; ``drain`` waits for the rest (which is copied
        out of the caller's buffers: they are the caller's again when this returns)."""
        self.check_usable()
        session = self.session
        assert session is not None
        before = session.enqueued
        end = session.send(chunks)
        if end:
            self.posted(session)
            session.detach(end, end - before)

    @property
    def paused_writing(self) -> bool:
        return self.session is not None and self.session.backlog

    @property
    def lost(self) -> bool:
        session = self.session
        return session is None or session.error is not None or self.watch.tcp_lost or self.closer.closing

    async def drain(self, low: int = 0) -> None:
        """Wait until at most ``low`` queued bytes are not posted yet."""
        session = self.session
        assert session is not None
        wanted = False
        try:
            while session.enqueued - session.posted_bytes > low:
                self._check_sendable()
                wanted = await self._wait_to_post(session, wanted)
        finally:
            self.unwant_sends(wanted)

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        transport: asyncio.BaseTransport | None = getattr(self.control, "transport", None)
        return transport

    # -- closing (the link's collaborator: closing.py) ------------------------------------------

    def close_nowait(self, final: bytes) -> None:
        """Start the close in a task (asyncio's ``close()``); ``wait_closed`` awaits it."""
        self.closer.close_nowait(final)

    async def wait_closed(self) -> None:
        await self.closer.wait_closed()

    async def aclose(self, final: bytes) -> None:
        """Close in order: deliver, then tear down (``closing.py``).  Everything queued before
        ``final`` (the CLOSE frame) reaches the peer, however long a live peer's reader pauses;
        ``BrokenResourceError`` if the connection broke first.  Idempotent; the teardown is shielded."""
        await self.closer.aclose(final)

    def abort(self) -> None:
        """Close at once, delivering nothing more (``asyncio.Transport.abort``); the peer sees the
        connection fail."""
        self.closer.abort()

    async def discard(self) -> None:
        """Release a link that was prepared but never activated (fallback, setup error)."""
        await self.closer.discard()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        attrs = dict(self.control.extra_attributes) if self.control is not None else {}
        entry = self.res.gid_entry
        device = entry.device if entry is not None else None
        qp_num = self.qp_num
        attrs[TransportAttribute.device] = lambda: device
        attrs[TransportAttribute.qp_num] = lambda: qp_num
        return attrs


if TYPE_CHECKING:  # mypy holds the link to the interface asyncio's front ends use

    def _nowait(link: RdmaLink) -> NowaitLink:
        return link
