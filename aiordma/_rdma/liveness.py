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

**What a probe proves is the path, not the connection.**  A NIC acknowledges a WRITE whatever
its software does, so a probe can only find a dead host or a broken path (our port, the peer's
GID).  Everything else that ends one connection is seen without a probe: a peer process that
dies or aborts ends its TCP connection, which every RDMA link keeps open and watches
(``watch.py``); a QP the peer's NIC moved to ERROR flushes the peer's receives, so its link fails
and ends that TCP connection too.  So the plan probes per *path* -- (our GID, the peer's GID), one
peer host through one port -- not per connection: a host with 1000 connections to another, all
waiting, costs one probe per gap, not 1000 (issue 33's idle CPU: 10 connections cost 10).  Any
connection of a path that makes progress proves the path alive; bytes posted count as progress
too, because they are themselves work requests that fail within the retry budget if the host
is dead.

The schedule (:class:`ProbeSchedule`, one per path with a waiting connection): after ``base``
seconds of waiting without progress, probe; while the peer keeps answering and the wait goes on
(an idle peer, a stopped reader), each further probe waits twice as long, up to ``cap``; any
progress -- or a connection that starts to wait -- starts over at ``base``.  The probe goes to
the path's waiting connections in turn, so each of them is probed now and then.  One probe at a
time per connection: the link does not post another while its last one has not completed.

**When a connection of a path fails** (a probe, its own work, its TCP connection), the host
behind it is suspect: the next look, at once, probes every other waiting connection of the
path that made no progress.  A dead host thus fails all of its connections within one retry
budget, not one after another.

The plan (:class:`ProbePlan`, one per device): which connections to look at, and when.  A
connection joins it when one of its tasks starts to wait (one flag test on the wait's path, the
round trip's hot path) and leaves it at the first look that finds nobody waiting.  One timer
per device runs the plan at its :meth:`~ProbePlan.next_due`; each look asks the path's
connections for their progress marks (bytes received and posted), so progress costs the hot
path nothing: it is seen, not reported.  A connection that went silent is probed between
``base`` and ``2 x base`` after its path's last progress (or its own first wait), and a dead
peer host fails that probe within the retry budget -- which fails the connection and wakes
every waiter.

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


class _Path(Generic[K]):
    """One path's waiting connections (key -> progress mark at the last look) and its schedule."""

    __slots__ = ("schedule", "members", "due", "turn", "suspect")

    def __init__(self, schedule: ProbeSchedule, due: float) -> None:
        self.schedule = schedule
        self.members: dict[K, int] = {}
        self.due = due
        #: which member the next probe goes to (the members take turns)
        self.turn = 0
        #: a connection of the path failed: the next look probes every silent member
        self.suspect = False


class ProbePlan(Generic[K]):
    """The waiting connections of one device, grouped by path, and when each path is looked at
    next (see the module docs).  Keys are the connections, paths any hashable value; times are
    the caller's clock, in seconds."""

    __slots__ = ("_paths", "_path_of")

    def __init__(self) -> None:
        self._paths: dict[Hashable, _Path[K]] = {}
        self._path_of: dict[K, Hashable] = {}

    def __len__(self) -> int:
        return len(self._path_of)

    def __contains__(self, key: object) -> bool:
        return key in self._path_of

    def add(self, key: K, path: Hashable, base: float, mark: int, now: float, cap: float = 8.0) -> float:
        """A task of ``key`` (a connection over ``path``) started to wait, with its progress mark
        ``mark``: its path is looked at within ``base`` seconds (``base`` > 0).  Returns when that
        is.  A key already in the plan changes nothing."""
        where = self._path_of.get(key)
        if where is not None:
            return self._paths[where].due
        if base <= 0:
            raise ValueError("a connection that never probes has no place in the plan")
        group = self._paths.get(path)
        if group is None:
            group = self._paths[path] = _Path[K](ProbeSchedule(base, cap), now + base)
        else:
            schedule = group.schedule
            if base < schedule.base:  # (the path goes by its most watchful connection)
                schedule.base = base
            schedule.progressed()  # (a new wait starts the path's schedule over)
            group.due = min(group.due, now + schedule.base)
        group.members[key] = mark
        self._path_of[key] = path
        return group.due

    def discard(self, key: K) -> None:
        """``key`` is gone (closed, failed): it is not looked at again."""
        path = self._path_of.pop(key, None)
        if path is None:
            return
        group = self._paths[path]
        del group.members[key]
        if not group.members:
            del self._paths[path]

    def suspect(self, path: Hashable, now: float) -> None:
        """A connection over ``path`` failed: the path is looked at now, and every waiting
        connection of it that made no progress is probed."""
        group = self._paths.get(path)
        if group is not None:
            group.suspect = True
            group.due = min(group.due, now)

    def next_due(self) -> float | None:
        """When the next look is due (None: nothing to look at; the timer can stop)."""
        paths = self._paths
        if not paths:
            return None
        return min(group.due for group in paths.values())

    def tick(self, now: float, look: Callable[[K], int | None]) -> list[K]:
        """Look at every path that is due: ``look(key)`` gives each of its connections' progress
        mark, or None when no task of it waits any more (it leaves the plan).  Returns the keys to
        probe now: of a path whose marks did not move during a whole gap, the connection whose
        turn it is -- or, if the path is suspect, every one of them."""
        probe: list[K] = []
        path_of = self._path_of
        for path, group in list(self._paths.items()):
            if group.due > now:
                continue
            members = group.members
            moved = False
            for key, mark in list(members.items()):
                new = look(key)
                if new is None:
                    del members[key]
                    del path_of[key]
                elif new != mark:
                    members[key] = new
                    moved = True
            if not members:
                del self._paths[path]
                continue
            schedule = group.schedule
            if moved:
                schedule.progressed()
            elif schedule.timed_out():
                keys = list(members)
                if group.suspect:
                    probe.extend(keys)
                else:
                    probe.append(keys[group.turn % len(keys)])
                    group.turn += 1
            group.suspect = False
            group.due = now + schedule.gap
        return probe
