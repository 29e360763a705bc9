"""When a waiting task probes its peer: the liveness probe's schedule and plan, as small objects.

Theory of operation
-------------------
An RC queue pair learns that its peer is gone only through a work request of its own that is
not acknowledged: the NIC retries it ``retry_cnt`` times (about half a second with the
defaults) and completes it in error.  A task that waits for the peer -- a reader for its next
bytes, a sender for its credits -- usually has no such work request: everything it posted was
acknowledged.  If the peer's host died or the wire went silent meanwhile, nothing would ever
fail, and only the TCP link's keepalive would tell, seconds later.  So a connection on which a
task has waited without progress posts one: a zero-length RDMA WRITE, which the peer's NIC
acknowledges without its software, a receive buffer or an rkey (IBA C9-88).

The schedule (:class:`ProbeSchedule`, one per waiting connection): after ``base`` seconds of
waiting without progress, probe; while the peer keeps answering and the wait goes on (an idle
peer, a stopped reader), each further probe waits twice as long, up to ``cap``; any progress
starts over at ``base``.  One probe at a time: the link does not post another while the last one
has not completed.

The plan (:class:`ProbePlan`, one per device): which connections to look at, and when.  A
connection joins it when one of its tasks starts to wait (one flag test on the wait's path, the
round trip's hot path) and leaves it at the first look that finds nobody waiting.  One timer
per device runs the plan at its :meth:`~ProbePlan.next_due`; each look asks the connection for
its progress mark (bytes received and posted), so progress costs the hot path nothing: it is
seen, not reported.  A connection that went silent is probed between ``base`` and ``2 x base``
after its last progress, and a dead peer fails that probe within the retry budget -- which
fails the connection and wakes every waiter.

Nothing here does I/O or reads a clock: the device's glue gives the time in and carries out the
probes that come out.  ``tests/test_liveness.py`` checks both with hypothesis.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

__all__ = ["ProbeSchedule", "ProbePlan"]


class ProbeSchedule:
    """The liveness probe's schedule for one waiting connection (see the module docs)."""

    __slots__ = ("base", "cap", "gap")

    def __init__(self, base: float, cap: float = 8.0) -> None:
        if base < 0 or cap < base:
            raise ValueError("the probe schedule needs 0 <= base <= cap")
        self.base = base
        self.cap = cap
        #: the time to the next look (0: never probe)
        self.gap = base

    def progressed(self) -> None:
        """The wait made progress (bytes arrived, credits came): start over."""
        self.gap = self.base

    def timed_out(self) -> bool:
        """A whole ``gap`` passed without progress: returns whether to probe now (and the next
        gap doubles)."""
        if not self.gap:
            return False
        self.gap = min(self.gap * 2, self.cap)
        return True


class _Entry:
    __slots__ = ("schedule", "mark", "due")

    def __init__(self, schedule: ProbeSchedule, mark: int, due: float) -> None:
        self.schedule = schedule
        self.mark = mark
        self.due = due


class ProbePlan(Generic[K]):
    """The waiting connections of one device and when each is looked at next (see the module
    docs).  Keys are the connections; times are the caller's clock, in seconds."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[K, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def add(self, key: K, base: float, mark: int, now: float, cap: float = 8.0) -> float:
        """A task of ``key`` started to wait, with its progress mark ``mark``: look at it after
        ``base`` seconds (``base`` > 0).  Returns when that is.  A key already in the plan keeps
        its schedule."""
        entry = self._entries.get(key)
        if entry is None:
            if base <= 0:
                raise ValueError("a connection that never probes has no place in the plan")
            entry = self._entries[key] = _Entry(ProbeSchedule(base, cap), mark, now + base)
        return entry.due

    def discard(self, key: K) -> None:
        """``key`` is gone (closed, failed): it is not looked at again."""
        self._entries.pop(key, None)

    def next_due(self) -> float | None:
        """When the next look is due (None: nothing to look at; the timer can stop)."""
        entries = self._entries
        if not entries:
            return None
        return min(entry.due for entry in entries.values())

    def tick(self, now: float, look: Callable[[K], int | None]) -> list[K]:
        """Look at every key that is due: ``look(key)`` gives its progress mark, or None when no
        task of it waits any more (it leaves the plan).  Returns the keys to probe now: those
        whose mark did not move during a whole gap."""
        probe: list[K] = []
        for key, entry in list(self._entries.items()):
            if entry.due > now:
                continue
            mark = look(key)
            if mark is None:
                del self._entries[key]
                continue
            schedule = entry.schedule
            if mark != entry.mark:
                entry.mark = mark
                schedule.progressed()
            elif schedule.timed_out():
                probe.append(key)
            entry.due = now + schedule.gap
        return probe
