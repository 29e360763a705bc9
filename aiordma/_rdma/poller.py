"""The push poller: one per device and event loop, run when the completion channel fd fires.

Theory of operation
-------------------
A CQ raises one event on its completion channel per arming
(``ibv_req_notify_cq``), for the first completion after the arming.  So:

1. the channel fd is watched by the event loop for as long as the device is
   open (``add_reader`` once; on trio one system task) -- never a per-wait
   registration, never a private epoll;
2. when it fires: read and acknowledge the events (the CQ is now disarmed),
   then poll the CQ in batches until it is empty and hand each batch, split
   by ``qp_num``, to the connection that owns that QP;
3. when a poll comes back empty, arm the CQ and poll *once more*
   (arm-then-poll): a completion that landed between the last poll and the
   arming raised no event, and would otherwise wait for the next one.

Connections never poll the CQ themselves; they only ask for a synchronous
pass (:meth:`Poller.poll_now`) at moments where ordering matters (the TCP
connection ended: was the CLOSE frame already in the CQ?).  Completions for a
QP nobody owns any more (destroyed after its drain) are dropped.  A receiver
may not raise: its errors are its own connection's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Poller", "CompletionReceiver"]

log = logging.getLogger("aiordma")

Entry = tuple[int, int, int, int, int, int]


class CompletionReceiver(Protocol):
    def on_completions(self, entries: list[Entry]) -> None: ...


class Poller:
    """Polls one CQ and routes its completions by QP number (see the module docs)."""

    def __init__(self, cq: Any, channel: Any, wc: Any) -> None:
        self.cq = cq
        self.channel = channel
        self.wc = wc
        self.routes: dict[int, CompletionReceiver] = {}
        self.armed = False
        self._busy = False
        self._again = False
        self.wakes = 0  # channel events handled (for tests and figures)
        self.on_error: Callable[[BaseException], None] | None = None

    def on_readable(self) -> None:
        """The channel fd fired: ack the events, then poll until empty, arming at the end."""
        self.wakes += 1
        try:
            # one CQ on the channel, armed once: at most one event is pending, so one read
            # does (no second read() that only says EAGAIN); a leftover would only make the
            # fd readable again
            if self.channel.drain_events(1):
                self.armed = False
        except OSError as exc:  # the device is gone
            self._fail(exc)
            return
        self.poll_now()

    def poll_now(self) -> None:
        """Poll until empty and dispatch; arm before the last poll (see the module docs)."""
        if self._busy:  # a receiver asked for it while we dispatch: one more round
            self._again = True
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
