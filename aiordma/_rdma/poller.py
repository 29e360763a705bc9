"""The push poller: one per device and event loop, run when the completion channel fd fires.

Theory of operation
-------------------
A CQ raises one event on its completion channel per arming
(``ibv_req_notify_cq``), for the first qualifying completion after the
arming.  So:

1. the channel fd is watched by the event loop for as long as the device is
   open (``add_reader`` once; on trio one system task) -- never a per-wait
   registration, never a private epoll;
2. when it fires, **one native call** (``aiordma_wake``, with the native
   module) reads and acknowledges the event, polls the CQ until it is empty,
   processes every completion of a native-path connection in C (checks,
   credits, payloads copied into this poller's delivery buffer, receive
   buffers re-posted in one batch, credit SENDs posted), arms the CQ and polls
   once more (*arm-then-poll*: a completion that landed between the last poll
   and the arming raised no event).  Python then hands each connection its
   delivered bytes (:meth:`on_native`) and routes the other completions
   (connections on the checked path) by ``qp_num``;
3. **selective wake-ups**: the CQ is armed *solicited-only* while every
   connection on it runs the native path and no task waits for a send
   completion.  Data and credit SENDs carry the SOLICITED flag, so they
   wake the loop; our own send completions do not (they are polled with the
   next wake or send).  Error completions still wake it: a QP that fails
   flushes its posted receives, and flushed receives are solicited
   completions (rxe posts them with ``solicited=1``; the IB spec asks the
   same of every device for unsuccessful completions).  A task that waits for
   a send completion (send queue or send ring full, the path probe, close,
   drain) asks for :meth:`want_sends`: the CQ is armed for every completion
   until it is done.

Poll modes (``RdmaConfig(poll=...)``, ``AIORDMA_POLL``): ``event`` sleeps on
the fd after every wake.  ``adaptive`` keeps polling after activity for
``spin_window`` seconds: each pass spins in C (GIL released) for at most
``spin_budget``, then the callback returns to the event loop and asks to be
called again at once (``call_soon`` / a trio checkpoint) -- the loop runs
between two spins; once the window passed without a completion it arms and
sleeps.  It spins only while spinning pays: the poller keeps a moving
average (1/8 weight) of the time between two passes that found completions,
and while that average is longer than ``spin_window`` (the peer answers
slower than a spin lasts: a slow network, a slow peer, a sparse stream) it
behaves like ``event`` and only measures; once the gaps shorten it spins
again.  A spin that cannot catch the next completion only burns the CPU the
peer or the kernel (rxe does its work in softirqs) would have used.  ``busy`` does the same with ``busy_window`` (a second by default):
it costs a core while traffic flows and sleeps when a connection idles.
The poller uses the most eager mode among its connections, and never spins
while a connection's peer is on this same poller (same event loop and
thread: spinning would only delay the peer).

Connections never poll the CQ themselves; they ask for a synchronous pass
(:meth:`poll_now`) where ordering matters.  Completions for a QP nobody
owns any more (destroyed after its drain) are dropped.  A receiver may not
raise: its errors are its own connection's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .objects import CompletionChannel, CompletionQueue, WorkCompletions

__all__ = ["Poller", "CompletionReceiver", "NativeReceiver", "POLL_MODES"]

log = logging.getLogger("aiordma")

Entry = tuple[int, int, int, int, int, int]

#: the poll modes, least eager first
POLL_MODES = ("event", "adaptive", "busy")

_MAX_CHANS = 1 << 16  # the cid field of a wr_id has 16 bits; cid 0 is never used
_BATCH = 32  # completions per native wake pass, at most (the delivery buffer holds this many payloads)
_DELIVERY_BYTES = 32 << 20  # ... and at most this many bytes: fewer completions per pass for large buffers
_GAP_WEIGHT = 0.125  # adaptive: the weight of the newest gap in the moving average
_now = time.monotonic  # (a module global so that tests can drive the clock)


class CompletionReceiver(Protocol):
    def on_completions(self, entries: list[Entry]) -> None: ...


class NativeReceiver(CompletionReceiver, Protocol):
    """A native-path connection: the C pass of a wake processed its completions."""

    def on_native(self, view: memoryview | None, early: int) -> None: ...

    def on_fatal(self, exc: BaseException) -> None: ...


class Poller:
    """Polls one CQ and routes its completions (see the module docs).

    ``native`` is ``(ffi, lib)`` of the native module, or None (every
    connection then runs the checked path and completions are polled into
    ``wc`` and decoded in Python).
    """

    def __init__(self, cq: CompletionQueue, channel: CompletionChannel, wc: WorkCompletions,
                 native: tuple[Any, Any] | None = None) -> None:  # fmt: skip
        self.cq = cq
        self.channel = channel
        self.wc = wc
        self.routes: dict[int, CompletionReceiver] = {}  # qp_num -> every connection's link
        self.armed = False
        self._busy = False
        self._again = False
        self.wakes = 0  # channel events handled (for tests and figures)
        self.passes = 0  # native wake calls
        self.on_error: Callable[[BaseException], None] | None = None
        self.want_any = 0  # tasks waiting for a send completion
        self.checked = 0  # connections on the checked path (they need every completion)
        self.local_peers = 0  # connections whose peer QP is on this poller
        self._modes = [0, 0, 0]  # connections per poll mode
        #: the poll mode in force (see the module docs)
        self.mode = "event"
        self.spin_budget = 50e-6
        self.spin_window = 100e-6
        self.busy_window = 1.0
        self._last_activity = 0.0
        #: adaptive: moving average of the time between two passes that found completions
        self.gap = 0.0
        self.native = native
        if native is not None:
            ffi, lib = native
            self._ffi = ffi
            self._with_imm = int(lib.IBV_WC_WITH_IMM)
            self._wake: Callable[..., int] = cq.native_waker(channel)
            self.chans = ffi.new("struct aiordma_chan *[]", _MAX_CHANS)
            self.links: dict[int, NativeReceiver] = {}
            # freed cids are reused oldest first, and only after every fresh one was handed
            # out, each time with the next generation (see _native/aiordma_fast.h)
            self._free: deque[int] = deque()
            self._gens = bytearray(_MAX_CHANS)
            self._next_cid = 1
            self._out = ffi.new("struct aiordma_delivery[]", _BATCH)
            self._others = ffi.new("struct aiordma_wc[]", _BATCH)
            self._res = ffi.new("struct aiordma_wake_result *")
            self._stamp = 0
            self._deliv_cap = 0
            self._batch = _BATCH
            self._largest = 0
            self._deliv: bytearray = bytearray()
            self._deliv_c: Any = None
            self._deliv_mv = memoryview(self._deliv)
            self.ensure_buffer(64 << 10)

    # -- connections ------------------------------------------------------------------

    def ensure_buffer(self, buffer_size: int) -> None:
        """The delivery buffer holds a full pass of payloads of the largest buffer size (grown between
        wakes); a pass polls fewer completions when the buffers are large (at most 32 MiB held)."""
        self._largest = largest = max(self._largest, buffer_size)
        self._batch = max(1, min(_BATCH, _DELIVERY_BYTES // largest))
        need = self._batch * largest
        if need > self._deliv_cap:
            self._deliv_mv.release()
            self._deliv = bytearray(need)
            self._deliv_c = self._ffi.from_buffer(self._deliv)
            self._deliv_mv = memoryview(self._deliv)
            self._deliv_cap = need

    def add_native(self, link: NativeReceiver) -> tuple[int, int]:
        """A cid and its generation for a native-path connection (its chan is set with :meth:`set_chan`)."""
        if self._next_cid < _MAX_CHANS:
            cid = self._next_cid
            self._next_cid += 1
        elif self._free:
            cid = self._free.popleft()
        else:
            raise OSError(24, f"more than {_MAX_CHANS - 1} RDMA connections on one device and event loop")
        gen = self._gens[cid] = (self._gens[cid] + 1) & 0xFF
        self.links[cid] = link
        return cid, gen

    def set_chan(self, cid: int, chan: Any) -> None:
        self.chans[cid] = chan

    def remove_native(self, cid: int) -> None:
        """The connection's QP is destroyed: nothing of it can complete any more."""
        if self.links.pop(cid, None) is not None:
            self.chans[cid] = self._ffi.NULL
            self._free.append(cid)

    def add_mode(self, mode: str, delta: int = 1) -> None:
        self._modes[POLL_MODES.index(mode)] += delta
        self._update_mode()

    def add_local_peer(self, delta: int) -> None:
        """A connection whose peer QP is on this poller comes (+1) or goes (-1)."""
        self.local_peers += delta
        self._update_mode()

    def _update_mode(self) -> None:
        modes = self._modes
        if self.local_peers:
            self.mode = "event"
        else:
            self.mode = "busy" if modes[2] else "adaptive" if modes[1] else "event"

    def add_checked(self, delta: int) -> None:
        """A checked-path connection comes (+1) or goes (-1): it needs every completion to wake us."""
        self.checked += delta
        if delta > 0 and self.native is not None and self.armed:
            self.armed = False  # re-arm for every completion, then look (arm-then-poll)
            self.poll_now()

    def want_sends(self, delta: int) -> None:
        """A task starts (+1) or stops (-1) waiting for a send completion."""
        self.want_any += delta
        if delta > 0 and self.native is not None:
            self.armed = False  # re-arm for every completion, then look (arm-then-poll)
            self.poll_now()

    # -- the fd callback --------------------------------------------------------------------

    def on_readable(self) -> bool:
        """The channel fd fired (or, while spinning, the loop came back to us); returns True
        to be called again after the loop ran once (spinning), False to wait for the fd."""
        if self.native is not None:
            return self._native_pass(True)
        self.wakes += 1
        try:
            # one CQ on the channel, armed once: at most one event is pending, so one read
            if self.channel.drain_events(1):
                self.armed = False
        except OSError as exc:  # the device is gone
            self._fail(exc)
            return False
        self.poll_now()
        return False

    def spin(self) -> bool:
        """One more spinning pass (called by the event loop backend between loop iterations)."""
        return self._native_pass(False)

    def poll_now(self) -> None:
        """Poll until empty and dispatch; arm before the last poll (see the module docs)."""
        if self._busy:  # a receiver asked for it while we dispatch: one more round
            self._again = True
            return
        if self.native is not None:
            self._native_pass(False, spin=False)
            return
        self._busy = True
        cq, wc, routes = self.cq, self.wc, self.routes
        try:
            while True:
                n = cq.poll_into(wc)
                if n:
                    entries = wc.entries(n)
                    qp = entries[0][5]
                    if entries[-1][5] == qp and (n < 3 or all(e[5] == qp for e in entries)):
                        receiver = routes.get(qp)
                        if receiver is not None:
                            self._deliver(receiver, entries)
                    else:
                        self._dispatch(entries)
                    continue
                if self._again:
                    self._again = False
                    continue
                if self.armed:
                    return
                cq.req_notify()
                self.armed = True
        except OSError as exc:
            self._fail(exc)
        finally:
            self._busy = False

    def _native_pass(self, read_event: bool = True, spin: bool = True) -> bool:
        """One wake (the fd callback itself with the native module: no frame in between)."""
        if read_event:
            self.wakes += 1
        if self._busy:
            self._again = True
            return False
        mode = self.mode if spin else "event"
        if mode == "adaptive":
            # spin only while completions come closer together than a spin window lasts
            window = self.spin_window if self.gap <= self.spin_window else 0.0
        else:
            window = 0.0 if mode == "event" else self.busy_window
        # a spinning mode polls without arming; whether to go on is decided after the pass
        spinning = window > 0.0
        spin_ns = int(self.spin_budget * 1e9) if spinning and not read_event else 0
        self._busy = True
        res, out, links = self._res, self._out, self.links
        wake, chans, others = self._wake, self.chans, self._others
        activity = False
        try:
            while True:
                stamp = self._stamp + 1
                if stamp > 0xFFFFFFFF:  # wrapped: no chan may still hold a stamp of the last round
                    stamp = 1
                    for cid in links:
                        chans[cid].stamp = 0
                self._stamp = stamp
                self.passes += 1
                # (decided per round: a want_sends() made while we dispatch re-arms for every completion)
                arm = 0 if spinning else 2 if (self.want_any or self.checked) else 1
                # arm unless armed already (reading the channel event disarms)
                batch = self._batch
                n = wake(1 if read_event else 0, arm if read_event or not self.armed else 0, spin_ns, batch,
                         chans, _MAX_CHANS, others, _BATCH, out, _BATCH, stamp, self._deliv_c, self._deliv_cap,
                         res)  # fmt: skip
                read_event = False
                if res.events_read:
                    self.armed = False
                if res.armed:
                    self.armed = True
                if res.err:
                    raise OSError(-res.err, "aiordma_wake failed")
                if res.polled:
                    activity = True
                if res.others:  # first: they came first on their QP (a foreign WR, then its flushes)
                    self._route_others(min(res.others, _BATCH))
                if n:
                    mv = self._deliv_mv
                    for i in range(n):
                        d = out[i]
                        link = links.get(d.cid)
                        if link is not None:
                            length = d.length
                            try:
                                link.on_native(mv[d.offset : d.offset + length] if length else None, d.early)
                            except Exception as exc:  # a bug: that connection fails alone
                                log.exception("aiordma: handling RDMA completions failed")
                                link.on_fatal(exc)
                if res.more or self._again:
                    self._again = False
                    spin_ns = 0
                    continue
                break
        except OSError as exc:
            self._fail(exc)
            return False
        finally:
            self._busy = False
        if mode == "adaptive":
            now = _now()
            if activity:
                # a gap longer than four windows counts as four: an idle spell must not
                # keep a connection that turned busy from spinning for long
                gap = min(now - self._last_activity, 4 * self.spin_window)
                self.gap += (gap - self.gap) * _GAP_WEIGHT
                self._last_activity = now
        elif not spinning:
            return False
        else:
            now = _now()
            if activity:
                self._last_activity = now
        if not spinning:
            return False
        if now - self._last_activity < window:
            return True  # go on polling after the loop ran once
        self._native_pass(False, spin=False)  # the window closed: arm (arm-then-poll) and sleep
        return False

    def _route_others(self, n: int) -> None:
        """Completions of checked-path connections (or of none): decoded and routed by qp_num."""
        others = self._others
        entries: list[Entry] = []
        for i in range(n):
            w = others[i]
            entries.append((int(w.wr_id), int(w.status), int(w.opcode), int(w.byte_len),
                            int(w.imm_data) if w.wc_flags & self._with_imm else -1, int(w.qp_num)))  # fmt: skip
        self._dispatch(entries)

    def _dispatch(self, entries: list[Entry]) -> None:
        by_qp: dict[int, list[Entry]] = {}
        for entry in entries:
            by_qp.setdefault(entry[5], []).append(entry)
        for qp, group in by_qp.items():
            receiver = self.routes.get(qp)
            if receiver is not None:
                self._deliver(receiver, group)

    def _deliver(self, receiver: CompletionReceiver, entries: list[Entry]) -> None:
        """Hand a batch over; a receiver that raises (a bug) fails alone, the poller goes on
        (a poller that stopped here would leave the CQ unarmed and every connection hanging)."""
        try:
            receiver.on_completions(entries)
        except Exception as exc:
            log.exception("aiordma: handling RDMA completions failed")
            on_fatal = getattr(receiver, "on_fatal", None)
            if on_fatal is not None:
                on_fatal(exc)

    def _fail(self, exc: BaseException) -> None:
        log.warning("aiordma: polling the completion queue failed: %s", exc)
        if self.on_error is not None:
            self.on_error(exc)
