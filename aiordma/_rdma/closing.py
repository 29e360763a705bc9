"""Closing an RDMA link: deliver, then tear down.

Theory of operation
-------------------
A close first *delivers*: everything queued before the CLOSE frame goes out, and the close waits
until the CLOSE's completion came back (the peer's NIC placed it, and with it everything before
it, in the peer's receive buffers) and the peer READ every rendezvous region it still had to
take.  A slow reader is waited for however long it pauses, as long as its host is alive: the
watch over the peer (``watch.py``: liveness probes, or the TCP connection's keepalive) tells a
dead host from a slow one, never a timer on progress.  Only a delivery that completed is followed
by the goodbye on the TCP connection, which tells the peer that our CLOSE is in its queue -- so
the TCP end never overtakes the data.  A delivery that cannot complete (the peer stopped
reading, the connection failed, the close was cancelled) is an abort: no goodbye, and the peer
sees an error, never a shorter stream that looks complete.

Then the *teardown*, in the device's order (``docs/architecture.md``), each step run whatever the
one before said, also under cancellation (it is shielded): stop posting, the QP to ERROR, wait
(bounded by ``RdmaConfig.close_timeout``) until every posted receive and signaled send came back
flushed, revoke every grant, destroy the QP -- the barrier after which the NIC touches nothing --
and only then give back the memory, the rings and the device.

:class:`LinkClose` is the link's collaborator for both; it asks of the link only what
:class:`ClosingLink` names.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
from anyio import BrokenResourceError, ClosedResourceError

from .._conn.core import ControlLink, Core, Link
from .._errors import RDMAError
from .datapath import DataPath
from .device import Device
from .objects import QueuePair
from .remote import RemoteOps
from .resources import LinkResources
from .config import RdmaConfig
from .states import LinkState
from .watch import GOODBYE, PeerWatch

__all__ = ["ClosingLink", "LinkClose"]

log = logging.getLogger("aiordma")


class ClosingLink(Protocol):
    """What :class:`LinkClose` asks of its RDMA link."""

    core: Core
    config: RdmaConfig
    res: LinkResources
    remote: RemoteOps
    watch: PeerWatch
    control: ControlLink | None
    #: called once when the teardown has released everything (a listener's budget)
    on_destroyed: list[Callable[[], None]]

    @property
    def session(self) -> DataPath | None: ...

    @property
    def qp(self) -> QueuePair | None: ...

    @property
    def device(self) -> Device | None: ...

    @property
    def active(self) -> bool:
        """The link carries the Core (it took it over from the TCP link)."""
        ...

    def want_sends(self) -> bool: ...

    def unwant_sends(self, wanted: bool) -> None: ...

    def stop_tracking_sends(self) -> None:
        """Disarm what the link armed for send completions on its own (the teardown's first step)."""

    def posted(self, session: DataPath) -> None:
        """After a call that posted: the link follows what posting waits for; a refused post fails the Core."""

    def release_withheld(self) -> None:
        """Return every credit withheld for a reader (this side reads no more)."""

    def park(self) -> Awaitable[Any]: ...

    def wake_all(self) -> None: ...


class LinkClose:
    """The close of one RDMA link (see the module docs): its state, read by the link's data path
    (``closing``, ``delivering``), and its steps."""

    def __init__(self, link: ClosingLink) -> None:
        self._link = link
        #: close() or abort() was called: nothing more is taken from the user
        self.closing = False
        #: closing, and waiting until the peer has everything (the watch goes on meanwhile)
        self.delivering = False
        #: the teardown finished
        self.done = False
        self._abort = False
        self._failed: BaseException | None = None  # why closing could not deliver (aclose raises it)
        self._task: asyncio.Task[None] | None = None

    def close_nowait(self, final: bytes) -> None:
        """Start the close in a task (asyncio's ``close()``); :meth:`wait_closed` awaits it."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.aclose(final))
            self._task.add_done_callback(_log_close_failure)

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    def abort(self) -> None:
        """Close at once, delivering nothing more (``asyncio.Transport.abort``); the teardown runs
        in a task, as with :meth:`close_nowait`.  The peer sees the connection fail."""
        self._abort = True
        self.close_nowait(b"")

    async def aclose(self, final: bytes) -> None:
        """Close in order: deliver, then tear down (see the module docs).

        ``final`` is the CLOSE frame; everything queued before it goes out first.  When the
        connection breaks before the peer has everything, this raises ``BrokenResourceError``
        (after the teardown).  Idempotent; the teardown itself is shielded: a cancelled close
        is an abort, and still releases everything before it returns."""
        link = self._link
        if self.closing:
            if not self.done:
                with anyio.CancelScope(shield=True):
                    while not self.done:
                        await link.park()
            return
        self.closing = True
        wanted = link.want_sends()  # the last send's completion, then the flushes
        delivered = False
        try:
            if self._may_deliver(final):
                delivered = await self._deliver(final)
                if not delivered and self._failed is not None:
                    err = BrokenResourceError(f"the connection broke before the peer had everything: {self._failed}")
                    err.__cause__ = self._failed
                    raise err
            elif self._answers_a_close():
                delivered = True  # nothing to deliver; the goodbye tells the closer we closed in order
        finally:
            self.delivering = False
            with anyio.CancelScope(shield=True):
                try:
                    if delivered and link.control is not None:
                        await self._say_goodbye(link.control)
                    await self._teardown()
                    if link.control is not None:
                        await link.control.aclose(b"")
                finally:
                    link.unwant_sends(wanted)
                    self.done = True
                    link.wake_all()

    async def discard(self) -> None:
        """Release a link that was prepared but never activated (fallback, setup error)."""
        self.closing = True
        with anyio.CancelScope(shield=True):
            try:
                await self._teardown()
            finally:
                self.done = True

    async def _say_goodbye(self, control: Link) -> None:
        """Tell the peer, on the TCP connection, that our CLOSE is in its queue (see :meth:`aclose`)."""
        with anyio.move_on_after(self._link.config.close_timeout):
            try:
                await control.send([GOODBYE])
            except (BrokenResourceError, ClosedResourceError, OSError) as exc:
                log.debug("aiordma: the goodbye on the TCP connection did not go: %r", exc)

    def _may_deliver(self, final: bytes) -> bool:
        """Whether closing has something to deliver: a CLOSE frame, a backlog, or regions the
        peer has yet to READ -- on a healthy connection whose peer still reads."""
        link = self._link
        session = link.session
        if self._abort or session is None or session.state is not LinkState.OPEN or session.error is not None:
            return False
        if link.watch.tcp_lost or (link.active and link.core.peer_close is not None):
            return False  # the peer closed first and reads no more
        return bool(final) or session.backlog or link.remote.rndv_staged > 0

    def _answers_a_close(self) -> bool:
        """The peer closed first and we close after it, with nothing to send (a CLOSE answers no
        CLOSE): it may still wait for regions of its we will never READ, and learns from our
        goodbye that we closed in order -- not that we died."""
        link = self._link
        session = link.session
        if self._abort or session is None or session.state is not LinkState.OPEN or session.error is not None:
            return False
        return link.active and not link.watch.tcp_lost and link.core.peer_close is not None

    async def _deliver(self, final: bytes) -> bool:
        """Post the backlog and ``final``, then wait until the peer has it all (see :meth:`aclose`);
        returns whether it has.  Cancellable: a cancelled delivery is an abort."""
        link = self._link
        session = link.session
        assert session is not None
        self.delivering = True
        link.release_withheld()  # this side reads no more: the peer's sends (its RNDV_DONEs) must flow
        session.close(final)
        link.posted(session)
        watch, remote, core = link.watch, link.remote, link.core
        while True:
            # the peer closed (its CLOSE came, or its goodbye: it closed in order after ours): it reads
            # no more, and the regions it has not READ are done with
            peer_closed = core.peer_close is not None or watch.peer_goodbye
            if session.close_sent and (peer_closed or not remote.rndv_staged):
                return True  # our CLOSE is in its queue: the goodbye may tell it so
            if peer_closed and (session.error is not None or watch.tcp_lost or watch.peer_ended):
                return False  # both closed; the peer tore down first: nothing was lost that it wanted
            if session.error is not None or watch.tcp_lost:
                self._failed = session.error or core.error or ConnectionResetError("the TCP connection ended")
                log.info(
                    "aiordma: closing an RDMA connection: it broke before the peer had everything (%d rendezvous "
                    "bytes not READ, CLOSE %s): %s",
                    remote.rndv_staged, "delivered" if session.close_sent else "not delivered", self._failed,
                )  # fmt: skip
                return False
            if not watch.watched and watch.probing:
                watch.watch()  # a peer host that died is noticed within the retry budget
            await link.park()

    async def _teardown(self) -> None:
        """QP to ERROR, wait for the flushes (bounded), then destroy and release (see the module docs)."""
        link = self._link
        session, qp, device = link.session, link.qp, link.device
        if session is not None and qp is not None:
            session.begin_drain()
            try:
                qp.to_error()
            except (RDMAError, OSError) as exc:
                log.warning("aiordma: RDMA teardown: moving the QP to ERROR: %s", exc)
            if device is not None and not device.closed:
                device.poller.poll_now()
            timeout = link.config.close_timeout
            with anyio.move_on_after(timeout):
                while not session.drained:
                    await link.park()
            if not session.drained:
                log.warning(
                    "aiordma: RDMA teardown: %d receives and %d sends did not come back within %.1f s; "
                    "destroying the QP reclaims them",
                    session.rq_posted, session.signaled_out, timeout,
                )  # fmt: skip
        self.destroy()

    def destroy(self) -> None:
        """Destroy the QP (the barrier after which the device touches nothing), then release the
        rest; every step runs whatever the one before raised (the errors are logged)."""
        link = self._link
        link.watch.stop()
        errors: list[BaseException] = []

        def attempt(action: Callable[[], Any]) -> None:
            try:
                action()
            except Exception as exc:  # every later step runs regardless
                errors.append(exc)

        res = link.res
        res.unroute()
        link.stop_tracking_sends()
        # every grant dies first, here and only here: a bound type-2 window holds a reference on
        # its QP (rxe waits, 10 s per object, for those at destroy), and no rkey outlives the QP
        link.remote.revoke_all(attempt)
        qp_gone = res.destroy_qp(attempt)
        session = link.session
        if session is not None and qp_gone and session.state is not LinkState.CLOSED:
            try:
                session.begin_drain()
                session.reclaim()
            except RuntimeError:
                pass
        if qp_gone:
            link.remote.release_all(attempt)  # (the QP is gone: nothing touches their memory)
        link.wake_all()  # one-sided operations waiting for a completion: the QP is gone
        res.release(attempt, qp_gone, keep_scope=link.remote.exposures > 0)
        callbacks, link.on_destroyed = link.on_destroyed, []
        for callback in callbacks:
            attempt(callback)
        for exc in errors:
            log.warning("aiordma: RDMA teardown: %s", exc)


def _log_close_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("aiordma: closing an RDMA connection failed: %r", task.exception())
