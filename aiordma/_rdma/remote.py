"""What a peer reaches of ours, and we of it, on one RDMA connection: one-sided READ and WRITE,
the grants that scope remote keys to this connection's QP, and rendezvous (staging, granting,
fetching).  :class:`RemoteOps` is the RDMA link's collaborator for them: the Core reaches it as
``Core.nic`` (:class:`~aiordma._conn.core.NicOps`), and it asks of the link only what
:class:`LinkSide` names (the link's set-up, send path and teardown are in ``link.py``).

Ownership: the local memory of an operation is the device's from its post until its completion
is polled.  A cancelled operation therefore waits (shielded) for that completion before it lets
the cancellation through: a posted WR always completes -- done, failed, or flushed once the QP is
in ERROR -- or the QP is destroyed, after which the device touches nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, cast

import anyio
from anyio import BrokenResourceError

from .._conn.core import RECEIVE_HIGH_WATER, Core, NicExposure, NicRegion
from .._conn.memory import RegisteredMemory, count_staged, find_registered, release_pinned, reserve_pinned
from .._errors import RDMAError
from .._proto.onesided import READ, WRITE, Rendezvous, RemoteMemoryError
from .constants import Access, WCStatus, wc_status_name
from .datapath import OneSidedPath
from .device import Device
from .objects import QueuePair, Region, Scope, Window

__all__ = ["RemoteOps", "LinkSide", "StreamFetch"]

#: one-sided operations: the largest piece one work request moves, and the staging size for
#: memory outside any registration
MAX_RDMA_MESSAGE = 1 << 30
STAGE = 4 << 20
#: a rendezvous message up to this size is READ into one staging region (larger: in STAGE pieces)
STAGE_BYTES_MAX = 64 << 20


def _ours(staged: NicRegion) -> Region:
    """A staging region the Core hands back: one :meth:`RemoteOps.rndv_take` gave it (the Core
    only sees its address and bytes)."""
    return cast(Region, staged)


class _Exposed:
    """One exposure of this connection: its region, the window that grants it, what to announce."""

    __slots__ = ("region", "nbytes", "window", "rkey")

    def __init__(self, region: Region, nbytes: int) -> None:
        self.region = region
        self.nbytes = nbytes
        self.window: Window | None = None
        self.rkey = 0

    @property
    def addr(self) -> int:
        return int(self.region.addr)



class _Lent:
    """A loan: part of the caller's registered memory the peer may READ (a sender's zero-copy
    rendezvous), through a window bound to this QP -- or, in a connection's own PD, an exposure
    registered for it alone -- until its RNDV_DONE."""

    __slots__ = ("mem", "addr", "rkey", "window", "exposed")

    def __init__(self, mem: RegisteredMemory, addr: int, rkey: int, window: Window | None, exposed: _Exposed | None) -> None:
        self.mem = mem
        self.addr = addr
        self.rkey = rkey
        self.window = window
        self.exposed = exposed


class StreamFetch:
    """A byte stream's rendezvous being READ into a staging region (see :meth:`RemoteOps.stream_fetch`)."""

    __slots__ = ("rv", "region", "seq", "wanted")

    def __init__(self, rv: Rendezvous, region: Region) -> None:
        self.rv = rv
        self.region = region
        self.seq = 0  # the READ's sequence number (0: not posted yet)
        self.wanted = False  # the CQ is armed for every completion on its behalf


class LinkSide(Protocol):
    """What :class:`RemoteOps` asks of its RDMA link."""

    core: Core
    @property
    def native(self) -> OneSidedPath | None:
        """The session that posts one-sided work requests (the native path's), else None."""
        ...

    needs_consumed: bool

    @property
    def scope(self) -> Scope | None: ...

    @property
    def qp(self) -> QueuePair | None: ...

    @property
    def device(self) -> Device | None: ...

    def want_sends(self) -> bool:
        """Be woken by every completion (one-sided ones are not solicited); returns whether armed."""
        ...

    def unwant_sends(self, wanted: bool) -> None: ...

    def park(self) -> Awaitable[Any]:
        """Wait for the link's next wake (a completion, a failure, teardown)."""
        ...

    def wake_all(self) -> None: ...

    def check_usable(self) -> None:
        """Raise if the connection is closed or failed."""

    def broke(self) -> None:
        """The session failed: the Core learns why, the QP goes to ERROR."""


class RemoteOps:
    """The remote half of an RDMA link (see the module docs): a :class:`~aiordma._conn.core.NicOps`."""

    def __init__(self, link: LinkSide, *, qp_access: int, rndv_limit: int) -> None:
        self._link = link
        self._qp_access = qp_access  # what the peer may do on our QP (grows: _allow)
        self._exposed: dict[int, _Exposed] = {}  # id -> an exposure (its region and grant)
        # rendezvous: regions the peer may READ (this connection's only), staged or free
        self._rndv_held: dict[int, tuple[Region, Window | None]] = {}  # message id -> (region, window)
        self._rndv_free: dict[int, list[Region]] = {}
        #: loans out (a sender's zero copy): message id -> the caller's memory, granted
        self._lent: dict[int, _Lent] = {}
        self.rndv_staged = 0
        self.rndv_limit = rndv_limit
        #: a byte stream's rendezvous being READ (one at a time: the protocol pauses after it)
        self.fetch: StreamFetch | None = None
        self._os_done: dict[int, int] = {}  # one-sided WRs completed: seq -> wc status
        #: one-sided WRs posted whose completion nobody took yet (the device's: see rdma())
        self.os_inflight: set[int] = set()

    @property
    def qp_access(self) -> int:
        """What the peer may do on our QP (``Access`` flags)."""
        return self._qp_access

    def _scope(self) -> Scope:
        """Where this connection's memory lives; gone once the link is torn down."""
        scope = self._link.scope
        if scope is None:
            raise BrokenResourceError("the RDMA connection is gone")
        return scope

    def completed(self, done: list[tuple[int, int]]) -> None:
        """One-sided work requests completed (``(seq, wc status)``, from the session)."""
        for seq, status in done:
            self._os_done[seq] = status

    # -- teardown (the link's: revoke_all before the QP is destroyed, release_all after) ---------

    @property
    def exposures(self) -> int:
        """Exposures still registered (a connection's own PD closes only without any)."""
        return len(self._exposed)

    def revoke_all(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        """Every grant dies (before the QP is destroyed: a bound window holds a reference on it);
        ``attempt`` runs each step, keeping its error and going on."""
        for exposed in self._exposed.values():
            window, exposed.window = exposed.window, None
            attempt(partial(self._revoke, window))
        for key, (region, window) in list(self._rndv_held.items()):
            self._rndv_held[key] = (region, None)
            attempt(partial(self._revoke, window))
        for lent in self._lent.values():
            window, lent.window = lent.window, None
            attempt(partial(self._revoke, window))

    def release_all(self, attempt: Callable[[Callable[[], None]], None]) -> None:
        """The QP is destroyed (nothing touches the memory any more): every exposure, staging and
        rendezvous region goes back or is closed."""
        link = self._link
        for exposed in list(self._exposed.values()):
            attempt(partial(self.release_region, exposed))  # (an exposure still open: revoked here)
        fetch, self.fetch = self.fetch, None
        if fetch is not None:
            link.unwant_sends(fetch.wanted)
            scope = link.scope
            if scope is not None:
                attempt(partial(scope.give_region, fetch.region))
        for region, _ in self._rndv_held.values():  # (their windows are dead: revoke_all)
            attempt(partial(self._close_rndv, region))
        lent, self._lent = list(self._lent.values()), {}
        for loan in lent:  # (the caller's memory is the caller's again)
            attempt(partial(self._end_loan, loan))
        for region in (r for rs in self._rndv_free.values() for r in rs):
            attempt(partial(self._close_rndv, region))
        self._rndv_held.clear()
        self._rndv_free.clear()
        self.rndv_staged = 0

    # -- one-sided RDMA READ / WRITE (the native path) ----------------------------------------
    #
    # Ownership: the local memory of an operation is the device's from its post until its
    # completion is polled.  A cancelled operation therefore waits (shielded) for that
    # completion before it lets the cancellation through: a posted WR always completes --
    # done, failed, or flushed once the QP is in ERROR -- or the QP is destroyed, after which
    # the device touches nothing.

    # -- grants: what the peer may reach, through this QP only (device.py, "Remote keys") ------

    def _allow(self, access: int) -> None:
        """Our QP lets the peer do ``access`` (REMOTE_READ / REMOTE_WRITE) from now on."""
        want = self._qp_access | (access & (Access.REMOTE_READ | Access.REMOTE_WRITE))
        if want != self._qp_access and self._link.qp is not None:
            self._link.qp.set_access(want)
            self._qp_access = want

    async def _grant(self, mr: Region, addr: int, length: int, access: int) -> tuple[Window | None, int]:
        """Let the peer reach ``[addr, addr + length)`` of ``mr`` with ``access``, through this QP
        only: ``(window, rkey)``; the window is None in a connection's own PD (the region's rkey
        is the grant).  Returns once the grant is in force (the window's bind completed)."""
        self._allow(access)
        scope = self._scope()
        if not scope.windows:
            return None, int(mr.rkey)
        qp = self._link.qp
        if qp is None:
            raise BrokenResourceError("the RDMA connection is gone")
        mw = scope.pd.alloc_mw()
        try:
            session = self._onesided()

            def post() -> int:
                seq: int
                seq, wr_id = session.reserve_wr()
                if seq:
                    try:
                        qp.post_bind_mw(wr_id, mw, mr, addr, length, access)
                    except (RDMAError, OSError) as exc:
                        session.fail(exc)  # (a refused post: the QP's state is unknown)
                        self._link.broke()
                        raise BrokenResourceError(f"granting remote access failed: {exc}") from exc
                return seq

            status = await self._post_and_wait(post)
            if status:
                raise RemoteMemoryError(f"binding a memory window failed: {wc_status_name(status)}")
        except BaseException:
            mw.close()  # (its bind completed, or was never posted, or the QP is gone)
            raise
        return mw, int(mw.rkey)

    @staticmethod
    def _revoke(window: Window | None) -> None:
        """End a grant: the window's rkey is dead when this returns (``ibv_dealloc_mw``)."""
        if window is not None:
            window.close()

    async def expose_region(self, view: memoryview, access: int) -> _Exposed:
        """Register ``view`` for the peer alone to reach (REMOTE_READ / REMOTE_WRITE as granted);
        the returned exposure has the ``addr`` and ``rkey`` to announce."""
        device = self._link.device
        if device is None or device.closed or self._link.scope is None:
            raise BrokenResourceError("the RDMA connection is gone")
        flags = (Access.REMOTE_READ if access & READ else 0) | (Access.REMOTE_WRITE if access & WRITE else 0)
        reserve_pinned(view.nbytes)
        try:
            region = self._link.scope.register_exposed(view, flags)
        except BaseException:
            release_pinned(view.nbytes)
            raise
        exposed = _Exposed(region, view.nbytes)
        self._exposed[id(exposed)] = exposed
        try:
            exposed.window, exposed.rkey = await self._grant(region, int(region.addr), view.nbytes, flags)
        except BaseException:
            self.release_region(exposed)
            raise
        return exposed

    def release_region(self, handle: NicExposure) -> None:
        """End an exposure (after the revocation; idempotent): its window dies, then its region
        is deregistered.  A region whose deregistration fails stays listed (the teardown tries
        again); its window is dead already, so nothing of it is reachable."""
        exposed = self._exposed.get(id(handle))
        if exposed is None:
            return
        window, exposed.window = exposed.window, None
        self._revoke(window)
        exposed.region.close()
        del self._exposed[id(exposed)]
        release_pinned(exposed.nbytes)

    async def rdma(self, write: bool, view: memoryview, raddr: int, rkey: int) -> None:
        """RDMA WRITE ``view`` to ``[raddr, rkey]``, or READ into it; returns once it completed.

        ``view`` inside live registered memory goes as it is (zero copy); anything else is staged
        through this connection's registered regions, ``STAGE`` bytes at a time."""
        n = view.nbytes
        found = find_registered(view)
        scope = self._link.scope
        if self._link.device is None or scope is None:
            raise BrokenResourceError("the RDMA connection is gone")
        if found is not None:
            mem, offset = found
            mr = mem.mr_for(scope)
            mem.hold()
            try:
                pos = 0
                while pos < n:
                    piece = min(n - pos, MAX_RDMA_MESSAGE)
                    await self._one_sided(write, mr.addr + offset + pos, piece, mr.lkey, raddr + pos, rkey)
                    pos += piece
            finally:
                mem.unhold()
            return
        size = min(n, STAGE)
        region = scope.take_region(size)
        try:
            stage = region.view()
            try:
                pos = 0
                while pos < n:
                    piece = min(n - pos, size)
                    if write:
                        stage[:piece] = view[pos : pos + piece]
                    await self._one_sided(write, region.addr, piece, region.lkey, raddr + pos, rkey)
                    if not write:
                        view[pos : pos + piece] = stage[:piece]
                    count_staged(piece)
                    pos += piece
            finally:
                stage.release()
        finally:
            # _one_sided returns only once its WR completed (or was never posted, or the QP is
            # gone): the region is reusable
            scope.give_region(region)

    # -- rendezvous (the Core's steps: Core._send_rendezvous, Core._fetch_rendezvous) ---------
    #
    # A staged message's region is granted to the peer for READ (a window bound to this QP, or the
    # region itself in this connection's own PD) from its announcement until the peer's RNDV_DONE:
    # then the grant dies (the window is deallocated; a private region is deregistered) and only a
    # region that grants nothing by itself goes back to the free list.

    def rndv_take(self, n: int) -> Region:
        """A region of at least ``n`` bytes to stage a message in (sizes are powers of two, reused)."""
        size = max(64 << 10, 1 << max(0, n - 1).bit_length())
        free = self._rndv_free.get(size)
        if free:
            return free.pop()
        device = self._link.device
        if device is None or device.closed or self._link.scope is None:
            raise BrokenResourceError("the RDMA connection is gone")
        reserve_pinned(size)
        try:
            return self._link.scope.staging_region(size)
        except BaseException:
            release_pinned(size)
            raise

    async def rndv_grant(self, staged: NicRegion, n: int) -> tuple[Window | None, int]:
        """Let the peer READ the first ``n`` bytes of a staged region: ``(window, rkey)``.  On an
        error the region is given back (not announced)."""
        region = _ours(staged)
        try:
            return await self._grant(region, int(region.addr), n, Access.REMOTE_READ)
        except BaseException:
            self._rndv_put_back(region)
            raise

    def rndv_hold(self, mid: int, staged: NicRegion, grant: object = None) -> None:
        region = _ours(staged)
        self._rndv_held[mid] = (region, cast("Window | None", grant))  # (rndv_grant's)
        self.rndv_staged += int(region.length)

    def rndv_release(self, mid: int) -> None:
        """The peer READ message ``mid`` (its RNDV_DONE): its rkey dies now; the region may be
        reused, or the lent memory is the caller's again."""
        lent = self._lent.pop(mid, None)
        if lent is not None:
            self._end_loan(lent)
            self._link.wake_all()  # (the sender waits for it)
            return
        held = self._rndv_held.pop(mid, None)
        if held is None:
            return
        region, window = held
        self.rndv_staged -= int(region.length)
        self._revoke(window)
        self._rndv_put_back(region)
        self._link.wake_all()  # a sender may wait for room

    # -- loans: the sender's zero copy (Core._lend_and_announce) ------------------------------

    async def rndv_lend(self, view: memoryview) -> _Lent | None:
        """Let the peer READ ``view`` where it lies, inside the caller's registered memory: a
        window bound to this QP over the memory's registration on the device (which itself grants
        nothing remote), or in a connection's own PD an exposure registered for the loan.  None
        when ``view`` is not inside registered memory.  The memory is held (it cannot be closed)
        until the loan ends (:meth:`rndv_release`, :meth:`rndv_take_back`, the teardown)."""
        found = find_registered(view)
        if found is None:
            return None
        mem, offset = found
        scope = self._scope()
        mem.hold()
        try:
            if scope.windows:
                mr = cast(Region, mem.mr_for(scope))  # (registered with MW_BIND: device.register_user)
                addr = int(mr.addr) + offset
                window, rkey = await self._grant(mr, addr, view.nbytes, Access.REMOTE_READ)
                return _Lent(mem, addr, rkey, window, None)
            # (registered from a view of our own: the region holds its export until the loan
            # ends, and the caller's view must stay free to be released at once)
            exposed = await self.expose_region(mem.view[offset : offset + view.nbytes], READ)
            return _Lent(mem, exposed.addr, exposed.rkey, None, exposed)
        except BaseException:
            mem.unhold()
            raise

    def rndv_hold_lent(self, mid: int, lent: NicExposure) -> None:
        self._lent[mid] = cast(_Lent, lent)  # (rndv_lend's)

    def rndv_lent_out(self, mid: int) -> bool:
        return mid in self._lent

    def rndv_take_back(self, lent: NicExposure, mid: int | None = None) -> None:
        """End a loan before its RNDV_DONE: the grant dies now and the memory is the caller's
        again.  An announced one (``mid``) can no longer be READ: the connection fails (the
        peer's READ would fail anyway, with a remote access error)."""
        loan = cast(_Lent, lent)  # (rndv_lend's)
        if mid is not None:
            if self._lent.pop(mid, None) is None:
                return  # (its RNDV_DONE came, or the teardown ended it)
        self._end_loan(loan)
        if mid is None:
            return
        session = self._link.native
        if session is not None and session.error is None:
            session.fail(BrokenResourceError("a zero-copy send was cancelled before the peer READ it: its grant was revoked"))
            self._link.broke()
        self._link.wake_all()

    def _end_loan(self, lent: _Lent) -> None:
        """The loan's grant dies (its window, or its exposure's registration), then the memory is
        released to the caller."""
        try:
            window, lent.window = lent.window, None
            self._revoke(window)
            if lent.exposed is not None:
                exposed, lent.exposed = lent.exposed, None
                self.release_region(exposed)
        finally:
            lent.mem.unhold()

    def rndv_discard(self, staged: NicRegion, grant: object) -> None:
        """A staged region that is not announced after all: its grant dies, the region goes back."""
        self._revoke(cast("Window | None", grant))  # (rndv_grant's)
        self._rndv_put_back(_ours(staged))

    def _rndv_put_back(self, region: Region) -> None:
        """A staging region no grant reaches any more: cached for the next message (when it grants
        nothing by itself), else closed."""
        cached = sum(int(r.length) for rs in self._rndv_free.values() for r in rs)
        if self._link.scope is not None and self._link.scope.windows and cached + int(region.length) <= self.rndv_limit:
            self._rndv_free.setdefault(int(region.length), []).append(region)
        else:
            self._close_rndv(region)

    def _close_rndv(self, region: Region) -> None:
        n = int(region.length)
        try:
            region.close()
        finally:
            release_pinned(n)

    def stream_fetch(self, rv: Rendezvous) -> None:
        """A byte stream's rendezvous: READ it into a staging region, from the callback (nothing
        awaits it); when it completes, its bytes go to ``rbuf`` and the protocol resumes."""
        if self._link.core.closed:
            # this side reads no more: the bytes are not fetched, what follows is parsed on (the
            # peer learns from our CLOSE that nobody takes them)
            self._link.core.resume_after_rendezvous()
            return
        device = self._link.device
        scope = self._link.scope
        if device is None or device.closed or scope is None or self.fetch is not None:
            self._link.core.on_error(BrokenResourceError("a rendezvous arrived while the connection cannot READ it"))
            return
        size = max(64 << 10, 1 << max(0, rv.length - 1).bit_length())
        self.fetch = StreamFetch(rv, scope.take_region(size))
        self.fetch_step()

    def fetch_step(self, force: bool = False) -> None:
        """Post the stream's rendezvous READ (deferred while the reader is behind, unless
        ``force``: a reader waits for more), or finish it once its completion came."""
        fetch = self.fetch
        assert fetch is not None
        rv, region, seq = fetch.rv, fetch.region, fetch.seq
        session = self._link.native
        if not seq:
            if rv.length == 0:
                self._stream_fetch_done(0)
                return
            if self._link.core.buffered >= RECEIVE_HIGH_WATER and not force:
                # the reader is behind: READ it when the reader took some (consumed(), or a
                # reader that waits for more) -- the sender's staged bytes are its backpressure
                self._link.needs_consumed = True
                return
            if session is None or session.error is not None:
                return  # the connection failed: teardown gives the region back
            try:
                seq = session.post_onesided(False, int(region.addr), rv.length, int(region.lkey), rv.addr, rv.rkey)
            except Exception as exc:
                self._link.core.on_error(exc)
                return
            if not seq:
                return  # the send queue is full: tried again at the next wake
            fetch.seq = seq
            fetch.wanted = self._link.want_sends()  # (its completion is not solicited)
            return
        if seq in self._os_done:
            self._stream_fetch_done(self._os_done.pop(seq))

    def _stream_fetch_done(self, status: int) -> None:
        fetch = self.fetch
        assert fetch is not None
        self.fetch = None
        rv, region = fetch.rv, fetch.region
        self._link.unwant_sends(fetch.wanted)
        core = self._link.core
        device = self._link.device
        try:
            if status:
                core.on_error(RemoteMemoryError(f"the rendezvous READ failed: {wc_status_name(status)}"))
                return
            if rv.length:
                core.counts.reads += 1
                core.counts.read_bytes += rv.length
                stage = region.view(0, rv.length)
                try:
                    core.rbuf += stage
                finally:
                    stage.release()
                count_staged(rv.length)
        finally:
            if device is not None and self._link.scope is not None:
                self._link.scope.give_region(region)  # (its WR completed)
        core.send_memory_nowait(core.memory.rendezvous_done(rv), after_peer_close=True)
        core.resume_after_rendezvous()
        # (this may run in a reader's consumed() or a waiter's incoming(), not in a wake: what
        # the resumed protocol parsed -- the peer's CLOSE, its RNDV_DONEs -- concerns the other
        # waiters too, a sender waiting for staging room or credits above all)
        self._link.wake_all()

    async def rdma_read_bytes(self, n: int, raddr: int, rkey: int) -> bytes:
        """RDMA READ ``n`` bytes into a staging region and return them (one copy)."""
        if not n:
            await self._link.core.checkpoint()
            return b""
        device = self._link.device
        if device is None:
            raise BrokenResourceError("the RDMA connection is gone")
        if n > STAGE_BYTES_MAX:
            buf = bytearray(n)
            await self.rdma(False, memoryview(buf), raddr, rkey)
            return bytes(buf)
        size = max(64 << 10, 1 << (n - 1).bit_length())
        scope = self._scope()
        region = scope.take_region(size)
        try:
            await self._one_sided(False, int(region.addr), n, int(region.lkey), raddr, rkey)
            stage = region.view(0, n)
            try:
                count_staged(n)
                return bytes(stage)
            finally:
                stage.release()
        finally:
            scope.give_region(region)  # (as in rdma(): the WR is done)

    def _onesided(self) -> OneSidedPath:
        """The session that posts one-sided work requests (the native path's)."""
        session = self._link.native
        if session is None:
            raise BrokenResourceError("one-sided operations need the native path (RdmaConfig.hot_path)")
        return session

    async def _one_sided(self, write: bool, laddr: int, length: int, lkey: int, raddr: int, rkey: int) -> None:
        session = self._onesided()
        status = await self._post_and_wait(lambda: session.post_onesided(write, laddr, length, lkey, raddr, rkey))
        if not status:
            counts = self._link.core.counts
            if write:
                counts.writes += 1
                counts.written_bytes += length
            else:
                counts.reads += 1
                counts.read_bytes += length
        if status in (WCStatus.WR_FLUSH_ERR, WCStatus.RETRY_EXC_ERR):
            # the connection failed (or our NIC gave up on a silent peer): not the memory's fault
            broken = BrokenResourceError(f"the RDMA connection failed during the operation ({wc_status_name(status)})")
            broken.__cause__ = self._link.core.broken() if self._link.core.error is not None else None
            raise broken
        if status:
            what = "WRITE" if write else "READ"
            err = RemoteMemoryError(
                f"the RDMA {what} failed: {wc_status_name(status)} (on RC this ends the connection)"
            )
            err.__cause__ = self._link.core.broken() if self._link.core.error is not None else None
            raise err

    async def _post_and_wait(self, post: Callable[[], int]) -> int:
        """Post one signaled work request of ours (``post()``: its sequence number, 0 while the send
        queue is full) and wait for its completion; returns its status.

        Ownership: what the work request names is the device's until its completion is polled.
        Cancelled, this still waits (shielded) for that completion -- a posted WR always
        completes (done, failed, or flushed once the QP is in ERROR) -- or for the QP's end."""
        await self._link.core.checkpoint()
        wanted = self._link.want_sends()  # our completion is not solicited: be woken by every one
        try:
            while True:
                self._link.check_usable()
                try:
                    seq = post()
                except RDMAError as exc:  # the session failed (its error): the Core learns it once
                    self._link.broke()
                    raise BrokenResourceError(f"the RDMA connection failed: {exc}") from exc
                if seq:
                    break
                await self._link.park()  # the send queue is full: a send completion makes room
            self.os_inflight.add(seq)
            try:
                while seq not in self._os_done and self._link.qp is not None:
                    await self._link.park()
            except BaseException:
                # cancelled (or the loop stops): the NIC may still use the memory -- wait for it
                with anyio.CancelScope(shield=True):
                    while seq not in self._os_done and self._link.qp is not None:
                        await self._link.park()
                self._os_done.pop(seq, None)
                self.os_inflight.discard(seq)
                raise
        finally:
            self._link.unwant_sends(wanted)
        self.os_inflight.discard(seq)
        status = self._os_done.pop(seq, None)
        if status is None:
            raise BrokenResourceError("the RDMA connection ended before the operation completed")
        return status

