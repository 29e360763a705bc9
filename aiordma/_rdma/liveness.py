"""When a waiting sender probes its peer: the liveness probe's schedule, as a small object.

Theory of operation
-------------------
An RC queue pair learns that its peer is gone only through a work request of its own that is
not acknowledged: the NIC retries it ``retry_cnt`` times (about half a second with the
defaults) and completes it in error.  A sender that waits for the peer's credits, with
everything it posted already acknowledged, has no such work request -- if the peer's host died
or the wire went silent meanwhile, nothing would ever fail, and only the TCP link's keepalive
would tell, seconds later.  So such a sender posts one: a zero-length RDMA WRITE, which the
peer's NIC acknowledges without its software, a receive buffer or an rkey (IBA C9-88).

The schedule: after ``base`` seconds of waiting without progress, probe; while the peer keeps
answering and the wait goes on (a slow or stopped reader), each further probe waits twice as
long, up to ``cap``; any progress starts over at ``base``.  One probe at a time: the link does
not post another while the last one has not completed.  Nothing here does I/O or reads a clock:
the link asks :attr:`gap` for its next wait's timeout and reports what happened.
``tests/test_liveness.py`` checks the schedule with hypothesis.
"""

from __future__ import annotations

__all__ = ["ProbeSchedule"]


class ProbeSchedule:
    """The liveness probe's schedule for one waiting sender (see the module docs)."""

    __slots__ = ("base", "cap", "gap")

    def __init__(self, base: float, cap: float = 8.0) -> None:
        if base < 0 or cap < base:
            raise ValueError("the probe schedule needs 0 <= base <= cap")
        self.base = base
        self.cap = cap
        #: the timeout of the next wait (0: never probe, wait without one)
        self.gap = base

    def progressed(self) -> None:
        """The wait made progress (the peer granted credits): start over."""
        self.gap = self.base

    def timed_out(self) -> bool:
        """A whole ``gap`` passed without progress: returns whether to probe now (and the next
        gap doubles)."""
        if not self.gap:
            return False
        self.gap = min(self.gap * 2, self.cap)
        return True
