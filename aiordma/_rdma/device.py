"""One opened RDMA device per event loop, shared by every connection on that loop.

A :class:`Device` holds the device context, one protection domain, one
completion channel and one CQ, the push :class:`~aiordma._rdma.poller.Poller`
watching the channel fd, the async-event fd watcher, and a cache of
registered regions (registered once, recycled by later connections).  It is
reference-counted: :func:`acquire_device` opens it on first use in a loop
(the device is opened once per process and loop, never per connect) and
:meth:`Device.release` closes it when the last user is done, in order:
watchers, CQ, channel, cached regions, PD, context.

**Remote keys are scoped to one connection.**  Where the device has type 2
memory windows (probed once, when it opens: rxe has them, siw does not), the
PD is shared and nothing in it carries remote access itself: what a peer may
reach is a window bound, by a work request on *its connection's* QP, to the
part of a region it was granted (an exposure, a staged rendezvous message);
the window's rkey works through that QP only, and ``dealloc`` kills it at
once (revocation, RNDV_DONE, close).  Where the device has none, every
connection gets a protection domain of its own (:class:`PrivateScope`): its
QP, rings, staging and registrations live there, so an rkey it grants is
refused on every other QP.  Either way, ``scope.windows`` says which.

The CQ is sized once (up to the device's ``max_cqe``) and every QP reserves
its send and receive queue depths from it, so it cannot overflow even when a
busy QP is flushed; a connection that does not fit is refused at setup (and
falls back to TCP with the reason).

The device also runs the liveness plan of its connections
(:mod:`aiordma._rdma.liveness`): one timer for all of them, armed only while
some task waits on a connection that probes.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

from .objects import CompletionChannel, CompletionQueue, Context, Domain, Region, WorkCompletions

from .._errors import RDMAError
from .._io.backends import IOBackend, Watch
from .constants import GidEntry, gid_bytes
from .discovery import Probe
from . import thresholds
from .liveness import ProbePlan
from .poller import Poller

if TYPE_CHECKING:
    from .._conn.memory import RegisteredMemory, Registration

__all__ = ["Device", "DeviceHold", "VerbsProvider", "acquire_device", "open_devices"]

log = logging.getLogger("aiordma")

#: Completion queue entries asked for per device (capped by the device's max_cqe).
CQ_ENTRIES = 16384
#: Registered regions kept for reuse per device, at most (count and bytes).
REGION_CACHE = 16
REGION_CACHE_BYTES = 256 << 20


class VerbsProvider(Protocol):
    """Where verbs objects come from: the native module, or :mod:`aiordma.testing`'s simulated wire."""

    name: str
    #: what identifies the provider's devices: providers with the same key share per-loop devices
    key: object

    def open_context(self, name: str) -> Context: ...
    def device_names(self) -> list[str]: ...
    def WCArray(self, n: int) -> WorkCompletions: ...  # noqa: N802
    def gid_for_ip(self, ip: str) -> GidEntry | None: ...
    def probe(self) -> Probe: ...
    def live_objects(self) -> dict[str, int]: ...
    def native(self) -> tuple[Any, Any] | None:
        """``(ffi, lib)`` of the native module when its data path can run on these verbs, else None."""
        ...


# (loop key, provider, device name) -> Device.  Entries live exactly as long as
# their device is referenced: this is per loop, not a process-wide context.
_devices: dict[tuple[object, object, str], Device] = {}


def open_devices() -> list[Device]:
    """The devices open right now (any loop): for tests and ``aiordma info``."""
    return list(_devices.values())


def acquire_device(io: IOBackend, provider: VerbsProvider, name: str) -> Device:
    """The device ``name`` for this event loop, opened on first use; the caller must ``release()`` it."""
    key = (io.key, provider.key, name)
    device = _devices.get(key)
    if device is None or device.closed:
        device = Device(io, provider, name)
        _devices[key] = device
        device._key = key
    device.refs += 1
    return device


class Watched(Protocol):
    """A connection in the device's liveness plan (``watch.PeerWatch``)."""

    def __hash__(self) -> int: ...

    @property
    def liveness_path(self) -> Hashable:
        """Its path: (our GID, the peer's GID) -- the plan probes per path."""
        ...

    def liveness_mark(self) -> int | None:
        """Its progress mark while a task waits on it, else None (it leaves the plan)."""
        ...

    def probe_liveness(self) -> None:
        """It went silent for a whole gap while a task waits: probe its peer."""


class Device:
    """See the module docs.  Do not create directly: use :func:`acquire_device`."""

    def __init__(self, io: IOBackend, provider: VerbsProvider, name: str) -> None:
        self.io = io
        self.provider = provider
        self.name = name
        self.refs = 0
        self.closed = False
        self._key: tuple[object, object, str] | None = None
        self._ctx: Context | None = None
        self._pd: Domain | None = None
        self._channel: CompletionChannel | None = None
        self._cq: CompletionQueue | None = None
        self._watches: list[Watch] = []
        self._regions: dict[int, list[Region]] = {}
        #: user memory registered here (aiordma.RegisteredBuffer / register()) -> its region
        self._user: dict[RegisteredMemory, Registration] = {}
        #: connections a task waits on, looked at by one timer (see the module docs)
        self.liveness: ProbePlan[Watched] = ProbePlan()
        self._liveness_timer: Watch | None = None
        self._liveness_due = 0.0
        try:
            self._ctx = ctx = provider.open_context(name)
            self.attr = ctx.query_device()
            #: the rendezvous threshold measured on this device (``aiordma info
            #: --measure-rendezvous``), else None: connections then use the default
            self.rendezvous_measured = thresholds.load(thresholds.device_key(name, self.attr))
            self.port_attr = ctx.query_port(1)
            self.gids: list[GidEntry] = list(ctx.query_gid_table())  # one verbs call, not a sysfs walk
            self._pd = ctx.alloc_pd()
            self.windows = self._has_windows()
            self._channel = channel = ctx.create_comp_channel()
            self._cq = cq = ctx.create_cq(max(64, min(CQ_ENTRIES, int(self.attr.max_cqe) or CQ_ENTRIES)), channel)
            self.cq_free: int = int(cq.cqe)
            native_of = getattr(provider, "native", None)
            self.poller = Poller(cq, channel, provider.WCArray(64), native_of() if native_of else None)
            self.poller.on_error = self._fail_all
            on_fd = self.poller._native_pass if self.poller.native is not None else self.poller.on_readable
            self._watches.append(io.watch(channel.fileno(), on_fd, self.poller.spin))
            self._watches.append(io.watch(ctx.fileno(), self._on_async_event))
            self.poller.poll_now()  # arms the CQ
        except BaseException:
            self._close_resources()
            raise

    def _has_windows(self) -> bool:
        """Whether this device has type 2 memory windows (one allocation tells)."""
        alloc = getattr(self.pd, "alloc_mw", None)
        if alloc is None:
            return False
        try:
            alloc().close()
        except (RDMAError, OSError) as exc:
            log.info("aiordma: %s has no type 2 memory windows (%s): a protection domain per connection", self.name, exc)
            return False
        return True

    @property
    def pd(self) -> Domain:
        """The device's protection domain (shared by the connections of this loop that use windows)."""
        pd = self._pd
        if pd is None:
            raise RDMAError(errno.ENODEV, "ibv_alloc_pd", f"the device {self.name} is not open")
        return pd

    @property
    def ctx(self) -> Context:
        """The device context (raises once the device is closed)."""
        ctx = self._ctx
        if ctx is None or self.closed:
            raise RDMAError(errno.ENODEV, "ibv_open_device", f"the device {self.name} is not open")
        return ctx

    @property
    def cq(self) -> CompletionQueue:
        """The CQ every connection of this loop on the device shares."""
        cq = self._cq
        if cq is None or self.closed:
            raise RDMAError(errno.ENODEV, "ibv_create_cq", f"the device {self.name} is not open")
        return cq

    def scope(self) -> Device | PrivateScope:
        """Where one new connection's memory lives: this device's shared PD (with windows), or a
        protection domain of its own (see the module docs)."""
        return self if self.windows else PrivateScope(self)

    def find_gid(self, ip: str) -> GidEntry | None:
        """The RoCEv2 GID entry of a local address on this device (the table is asked again on a miss:
        addresses come and go)."""
        want = gid_bytes(ip)
        for refresh in (False, True):
            if refresh:
                self.gids = list(self.ctx.query_gid_table())
            for entry in self.gids:
                if entry.gid.packed == want and entry.gid_type == "RoCEv2":
                    return entry
        return None

    @property
    def active_mtu(self) -> int:
        return int(self.port_attr.active_mtu) or 1024

    # -- the CQ budget ----------------------------------------------------------------

    def reserve_cq(self, entries: int) -> None:
        if entries > self.cq_free:
            raise RDMAError(
                errno.ENOSPC,
                "reserve CQ entries",
                f"the device's completion queue has {self.cq_free} of {self.cq.cqe} entries left, a connection needs {entries}",
            )
        self.cq_free -= entries

    def unreserve_cq(self, entries: int) -> None:
        self.cq_free += entries

    # -- registered regions ------------------------------------------------------------

    def take_region(self, length: int) -> Region:
        """A registered, local-only region of ``length`` bytes (recycled when possible)."""
        cached = self._regions.get(length)
        if cached:
            return cached.pop()
        from .constants import Access

        return self.pd.reg_mr(length, Access.LOCAL_WRITE)

    def give_region(self, mr: Region) -> None:
        """Return a region whose QP is destroyed (the device can no longer touch it)."""
        if self.closed:
            mr.close()
            return
        cached = self._regions.setdefault(mr.length, [])
        regions = [r for v in self._regions.values() for r in v]
        if len(regions) < REGION_CACHE and sum(int(r.length) for r in regions) + mr.length <= REGION_CACHE_BYTES:
            cached.append(mr)
        else:
            mr.close()

    def register_user(self, mem: RegisteredMemory, view: memoryview) -> Region:
        """Register user memory (local access: sources of sends and WRITEs, targets of READs;
        ``MW_BIND``, which grants nothing by itself, lets a window bound to one connection's QP
        lend it to that peer's READ: a zero-copy send)."""
        from .constants import Access

        if self.closed:
            raise RDMAError(errno.ENODEV, "ibv_reg_mr", f"the device {self.name} is closed")
        mr = self.pd.reg_buffer(view, Access.LOCAL_WRITE | Access.MW_BIND)
        self._user[mem] = mr
        return mr

    def unregister_user(self, mem: RegisteredMemory, mr: Registration) -> None:
        self._user.pop(mem, None)
        mr.close()

    def register_exposed(self, view: memoryview, access: int) -> Region:
        """A region a window may make reachable (``access``: what the window will grant; the
        region itself grants nothing remote).  Read-only memory needs no local write."""
        from .constants import Access

        return self.pd.reg_buffer(view, (Access.LOCAL_WRITE if access & Access.REMOTE_WRITE else 0) | Access.MW_BIND)

    def staging_region(self, length: int) -> Region:
        """A region for staged rendezvous messages (local-only; windows grant the READs)."""
        from .constants import Access

        return self.pd.reg_mr(length, Access.LOCAL_WRITE | Access.MW_BIND)

    def close_scope(self) -> None:
        """(The shared scope is the device's: it closes with the device.)"""

    @property
    def rendezvous_threshold(self) -> int:
        """From which size messages go by rendezvous on this device when the config leaves it
        open: the measured threshold, else :data:`thresholds.DEFAULT_RENDEZVOUS`."""
        measured = self.rendezvous_measured
        return measured.threshold if measured is not None else thresholds.DEFAULT_RENDEZVOUS

    # -- liveness ------------------------------------------------------------------------

    def watch_liveness(self, link: Watched, gap: float, mark: int) -> None:
        """A task started to wait on ``link`` (``gap``: its ``liveness_probe`` > 0; ``mark``: its
        progress mark now): the timer looks at its path (``link.liveness_mark()`` of each of the
        path's waiting connections) and probes it (``link.probe_liveness()``) when the path went
        silent."""
        if self.closed:
            return
        now = self.io.clock()
        due = self.liveness.add(link, link.liveness_path, gap, mark, now)
        if self._liveness_timer is None or due < self._liveness_due:
            self._arm_liveness(due, now)

    def unwatch_liveness(self, link: Watched, failed: bool = False) -> None:
        """``link`` leaves the plan (if it is in it): closed, or ``failed`` -- its path is then
        suspect: the path's waiting connections are probed at once."""
        now = self.io.clock()
        self.liveness.discard(link)
        if failed:
            self.liveness.suspect(link.liveness_path, now)
        due = self.liveness.next_due()
        if due is None:
            if self._liveness_timer is not None:
                self._liveness_timer.close()
                self._liveness_timer = None
        elif not self.closed and (self._liveness_timer is None or due < self._liveness_due):
            self._arm_liveness(due, now)

    def _arm_liveness(self, due: float, now: float) -> None:
        if self._liveness_timer is not None:
            self._liveness_timer.close()
        self._liveness_due = due
        self._liveness_timer = self.io.call_later(max(0.0, due - now), self._on_liveness_timer)

    def _on_liveness_timer(self) -> None:
        self._liveness_timer = None
        if self.closed:
            return
        now = self.io.clock()
        for link in self.liveness.tick(now, _look):
            try:
                link.probe_liveness()
            except Exception:  # pragma: no cover - a bug; the other connections are probed all the same
                log.exception("aiordma: a liveness probe failed to post")
        due = self.liveness.next_due()
        if due is not None and self._liveness_timer is None:
            self._arm_liveness(due, now)

    # -- async events -------------------------------------------------------------------

    def _on_async_event(self) -> None:
        routes = self.poller.routes
        while True:
            try:
                event = self.ctx.get_async_event()
            except OSError as exc:
                self._fail_all(exc)
                return
            if event is None:
                return
            log.warning("aiordma: RDMA async event on %s: %s (%s)", self.name, event.name, event.description)
            error = RDMAError(errno.EIO, "async event", f"{event.name}: {event.description}")
            if event.element_kind == "qp" and event.qp is not None:
                receiver = routes.get(int(event.qp.qp_num))
                if receiver is not None and event.name in _FATAL_QP_EVENTS:
                    getattr(receiver, "on_fatal")(error)
            elif event.name in _FATAL_DEVICE_EVENTS:
                self._fail_all(error)

    def _fail_all(self, exc: BaseException) -> None:
        for receiver in list(self.poller.routes.values()):
            getattr(receiver, "on_fatal")(exc)

    # -- lifetime -----------------------------------------------------------------------

    def release(self) -> None:
        """One user is done; the last one closes the device."""
        self.refs -= 1
        if self.refs > 0 or self.closed:
            return
        if self.poller.routes:  # pragma: no cover - a link releases only after its QP is gone
            log.warning("aiordma: closing device %s with %d QPs still routed", self.name, len(self.poller.routes))
        self._close_resources()

    def _close_resources(self) -> None:
        self.closed = True
        if self._key is not None and _devices.get(self._key) is self:
            del _devices[self._key]
        for watch in self._watches:
            watch.close()
        self._watches.clear()
        if self._liveness_timer is not None:
            self._liveness_timer.close()
            self._liveness_timer = None
        errors: list[BaseException] = []

        def attempt(action: Callable[[], object]) -> None:
            try:
                action()
            except Exception as exc:  # teardown goes on whatever one step says
                errors.append(exc)

        channel, ctx, cq = self._channel, self._ctx, self._cq
        if channel is not None:
            self.io.notify_closing(channel.fileno())
            attempt(channel.drain_events)
        if ctx is not None:
            self.io.notify_closing(ctx.fileno())
        if cq is not None:
            attempt(cq.close)
        if channel is not None:
            attempt(channel.close)
        for regions in self._regions.values():
            for mr in regions:
                attempt(mr.close)
        self._regions.clear()
        for mem in list(self._user):
            registration = mem.forget_device(self)
            self._user.pop(mem, None)
            if registration is not None:
                attempt(registration.close)
        if self._pd is not None:
            attempt(self._pd.close)
        if ctx is not None:
            attempt(ctx.close)
        for exc in errors:
            log.warning("aiordma: closing RDMA device %s: %s", self.name, exc)


_FATAL_QP_EVENTS = frozenset({"IBV_EVENT_QP_FATAL", "IBV_EVENT_QP_REQ_ERR", "IBV_EVENT_QP_ACCESS_ERR"})
_FATAL_DEVICE_EVENTS = frozenset({"IBV_EVENT_DEVICE_FATAL", "IBV_EVENT_CQ_ERR", "IBV_EVENT_PORT_ERR"})


class PrivateScope:
    """One connection's own protection domain, on a device without memory windows: its QP,
    rings, staging regions and registrations of user memory are there, and what it registers
    for remote access is reachable through its QP only.  :meth:`close_scope` after the QP is
    destroyed deregisters everything and deallocates the PD."""

    windows = False

    def __init__(self, device: Device) -> None:
        self.device = device
        self.name = device.name
        self.pd: Domain = device.ctx.alloc_pd()
        self.closed = False
        self._user: dict[RegisteredMemory, Registration] = {}

    def take_region(self, length: int) -> Region:
        from .constants import Access

        return self.pd.reg_mr(length, Access.LOCAL_WRITE)

    def give_region(self, mr: Region) -> None:
        mr.close()

    def register_user(self, mem: RegisteredMemory, view: memoryview) -> Region:
        from .constants import Access

        if self.closed:
            raise RDMAError(errno.ENODEV, "ibv_reg_mr", "the connection's protection domain is gone")
        mr = self.pd.reg_buffer(view, Access.LOCAL_WRITE)
        self._user[mem] = mr
        return mr

    def unregister_user(self, mem: RegisteredMemory, mr: Registration) -> None:
        self._user.pop(mem, None)
        mr.close()

    def register_exposed(self, view: memoryview, access: int) -> Region:
        """The region itself carries the remote access: this PD is this connection's alone."""
        from .constants import Access

        return self.pd.reg_buffer(view, (Access.LOCAL_WRITE if access & Access.REMOTE_WRITE else 0) | access)

    def staging_region(self, length: int) -> Region:
        from .constants import Access

        return self.pd.reg_mr(length, Access.LOCAL_WRITE | Access.REMOTE_READ)

    def close_scope(self) -> None:
        """Deregister what is left, then deallocate the PD (its QP must be destroyed first)."""
        if self.closed:
            return
        self.closed = True
        errors: list[BaseException] = []
        for mem in list(self._user):
            mr = mem.forget_device(self)
            self._user.pop(mem, None)
            if mr is not None:
                try:
                    mr.close()
                except Exception as exc:  # every later step runs regardless
                    errors.append(exc)
        try:
            self.pd.close()
        except Exception as exc:
            errors.append(exc)
        for error in errors:
            log.warning("aiordma: closing a connection's protection domain: %s", error)


class DeviceHold:
    """The devices a listener keeps open while it listens: its RDMA connections come and go,
    and each new one then finds the device (and its cached regions) ready instead of
    opening it again.  :meth:`release` when the listener closes."""

    def __init__(self) -> None:
        self._held: list[Device] = []

    def keep(self, link: object) -> None:
        device = getattr(link, "device", None)
        if isinstance(device, Device) and not device.closed and device not in self._held:
            device.refs += 1
            self._held.append(device)

    def release(self) -> None:
        held, self._held = self._held, []
        for device in held:
            device.release()


def _look(link: Watched) -> int | None:
    """The liveness plan's look at a connection (``RdmaLink.liveness_mark``); one that fails
    leaves the plan (logged), so that a bug cannot stop the device's timer."""
    try:
        mark: int | None = link.liveness_mark()
    except Exception:  # pragma: no cover - a bug
        log.exception("aiordma: a liveness look failed")
        return None
    return mark
