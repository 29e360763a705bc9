"""Slow is not dead: a TCP peer whose window is closed, and the user timeout (sans-IO).

Theory of operation
-------------------
:func:`~aiordma._tcp.links.set_keepalive` bounds how long a dead peer host goes unnoticed with
``TCP_USER_TIMEOUT``: bytes unacknowledged for that long end the connection.  But Linux also
applies the user timeout to a peer that *advertises a zero window* -- its application does not
read, its receive buffer is full -- for that long, even though its kernel answers every window
probe (``tcp_probe_timer``: "the window has been closed for longer than the user timeout";
``tcp_rtx_probe0_timed_out`` for a window that shrank under data in flight).  A reader that
pauses for a few seconds (a Dask worker computing, a slow consumer) would lose its connection,
and its sender the bytes ``send()`` had accepted.

So a :class:`WindowWatch` looks at the socket (``TCP_INFO``: a :class:`TcpSample`) while it
holds bytes for the peer, every :attr:`WindowWatch.tick` seconds -- a fraction of the user
timeout, so that it always looks before the kernel would give up:

=================  ====================================================  =====================
state              sample                                                 then
=================  ====================================================  =====================
KERNEL (timeout    nothing queued                                         IDLE (stop looking)
on: the kernel     the window closed (below one segment), bytes queued    timeout off, JUDGING
judges)            otherwise                                              look again
JUDGING (timeout   the peer dead (below) at two looks a grace apart       DEAD
off: the watch     nothing queued                                         timeout on, IDLE
judges)            data in flight, no backoff (the window opened)         timeout on, KERNEL
                   otherwise                                              look again
=================  ====================================================  =====================

While the timeout is off, the watch tells slow from dead by what the peer's *kernel* does, never
by what its application does: a live host answers window probes (and retransmissions) with
ACKs; a dead one answers nothing.  The peer counts as dead once nothing was acknowledged for the
budget (the user timeout) **and** two probes in a row went unanswered (the kernel's count of
unanswered probes, ``tcpi_probes``, or -- for retransmitted probes, which it does not count
there -- two back-offs since the last ACK the watch saw).  One unanswered probe is normal for a
live peer: Linux answers out-of-window segments at most every 500 ms (``tcp_invalid_ratelimit``)
and the first probes come 200 and 400 ms apart; the probes back off after that, so two never
both fall inside the limit.  But the kernel counts a probe the moment it sends it, and its answer
takes a round trip -- or, on a loaded host, until the softirq gets the CPU: a live peer that let
one probe pass unanswered has a second one "unanswered" while its ACK is on the way (seen on a
busy two-core host, a budget of one second, loopback).  So the verdict needs a second look: the
peer is dead only if it still is at least :meth:`WindowWatch.grace` later (a tick, or four round
trips if that is longer) with nothing acknowledged in between.

The probes back off exponentially while the window stays closed (up to two minutes apart), so a
host that dies while its window is closed is found after about twice the time the window had
been closed by then (more than the budget, at most about four minutes); a host that dies with
the window open, or idle, is found within the budget, by the kernel (the user timeout, the
keepalive).  Restoring the timeout is safe only once the kernel has forgotten how long the window
was closed: it does so when the window opens (``tcp_ack_probe`` resets the back-off with the
probe timestamp) or when nothing is queued.
"""

from __future__ import annotations

import enum
import errno
import socket
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = ["TcpSample", "Step", "WindowWatch", "read_sample", "set_user_timeout", "apply_user_timeout", "TCP_INFO_SIZE"]

#: struct tcp_info (linux/tcp.h), the fields the watch reads, in one unpack: tcpi_probes and
#: tcpi_backoff (bytes 3-4), tcpi_snd_mss (16), tcpi_unacked (24), tcpi_last_ack_recv (56),
#: tcpi_rtt (68), tcpi_bytes_acked (120), tcpi_notsent_bytes (144), tcpi_bytes_sent (200),
#: tcpi_bytes_retrans (208), tcpi_snd_wnd (228)
_FIELDS = struct.Struct("=3xBB11xI4xI28xI8xI48xQ16xI52xQQ12xI")
#: bytes of TCP_INFO asked for (tcpi_snd_wnd ends at 232: Linux 5.4 and later)
TCP_INFO_SIZE = _FIELDS.size


class TcpSample(NamedTuple):
    """What the kernel says of one TCP socket's sending side (from ``TCP_INFO``)."""

    #: window probes sent since the peer last acknowledged anything (``tcpi_probes``)
    probes: int
    #: retransmission/probe back-off exponent (``tcpi_backoff``)
    backoff: int
    #: the sending segment size (``tcpi_snd_mss``)
    mss: int
    #: segments in flight, not acknowledged (``tcpi_unacked``)
    unacked: int
    #: milliseconds since the last ACK from the peer (``tcpi_last_ack_recv``)
    last_ack_ms: int
    #: the smoothed round-trip time, microseconds (``tcpi_rtt``)
    rtt_us: int
    #: bytes written and not sent yet (``tcpi_notsent_bytes``)
    notsent: int
    #: the peer's advertised window, bytes (``tcpi_snd_wnd``)
    window: int
    #: bytes sent and not acknowledged (``tcpi_bytes_sent - tcpi_bytes_retrans - tcpi_bytes_acked``)
    in_flight: int = 0

    @property
    def queued(self) -> bool:
        """Whether the kernel holds bytes for the peer (in flight or not sent yet)."""
        return self.unacked > 0 or self.notsent > 0

    @property
    def window_closed(self) -> bool:
        """Bytes wait and the peer's window cannot take a segment."""
        return self.queued and self.window < max(1, self.mss)

    @property
    def may_meet_a_closed_window(self) -> bool:
        """What is queued may not fit in the peer's window (counting a full segment for each
        one in flight): the window could close on it with nobody looking."""
        return self.window_closed or (self.notsent > 0 and self.notsent + self.unacked * self.mss > self.window)


#: the least room worth resting with (less: the watch looks; a sample per few KiB written at most)
MIN_ROOM = 4096

_IPPROTO_TCP = socket.IPPROTO_TCP
_TCP_INFO = getattr(socket, "TCP_INFO", 11)


def parse_sample(info: bytes) -> TcpSample | None:
    """A :class:`TcpSample` from raw ``TCP_INFO`` bytes; None if the kernel's is too short."""
    if len(info) < TCP_INFO_SIZE:
        return None
    probes, backoff, mss, unacked, last_ack, rtt, acked, notsent, sent, retrans, window = _FIELDS.unpack_from(info)
    return TcpSample(probes, backoff, mss, unacked, last_ack, rtt, notsent, window, max(0, sent - retrans - acked))


def read_sample(sock: Any) -> TcpSample | None:
    """Sample ``sock`` (a TCP socket, or a socket-like object with ``getsockopt``); None where
    the platform or the socket cannot say (then the watch does nothing)."""
    try:
        info = sock.getsockopt(_IPPROTO_TCP, _TCP_INFO, TCP_INFO_SIZE)
    except (OSError, AttributeError, TypeError, ValueError):
        return None
    return parse_sample(info)


def set_user_timeout(sock: Any, ms: int) -> bool:
    """``TCP_USER_TIMEOUT`` (0: off, the kernel's own rules); whether it could be set."""
    import socket

    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)
    except (OSError, AttributeError, TypeError, ValueError):
        return False
    return True


def apply_user_timeout(sock: Any, watch: WindowWatch, step: Step) -> None:
    """What ``step`` says of the kernel's user timeout, on ``sock``: on at the watch's budget
    (the peer acknowledges), off (the window closed: the watch judges), or as it is."""
    if step.user_timeout is not None:
        set_user_timeout(sock, int(watch.budget * 1000) if step.user_timeout else 0)


class State(enum.Enum):
    IDLE = "idle"  # nothing queued at the last look: no looks until the next write
    KERNEL = "kernel"  # the user timeout is on
    JUDGING = "judging"  # the user timeout is off: the watch judges the peer
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Step:
    """What the driver does after a look."""

    #: set the user timeout on (True) or off (False), or leave it (None)
    user_timeout: bool | None = None
    #: look again after ``tick`` seconds
    again: bool = False
    #: the peer is dead: end the connection with this error
    dead: OSError | None = None


_STAY = Step(again=True)
_STOP = Step()


class WindowWatch:
    """The sans-IO watch (see module docs).  ``budget`` is the user timeout in seconds."""


    def __init__(self, budget: float) -> None:
        if budget <= 0:
            raise ValueError("budget must be positive")
        self.budget = budget
        #: how often to look while bytes are queued: well inside the kernel's own timeout
        self.tick = min(0.5, max(0.05, budget / 4))
        self.state = State.IDLE
        #: resting (IDLE), the bytes that may still be written before the watch looks: half of
        #: what the peer's window left beyond everything queued at the last sample (:meth:`begin`,
        #: :meth:`resample`, a look that found nothing queued).  Fewer bytes than that cannot
        #: close the window (TCP does not shrink a window it offered), so until they add up to it
        #: the kernel's timeout is right to judge them -- and a loop without a timer of ours is
        #: cheaper per round trip (asyncio computes its select timeout every pass while one waits).
        #: A driver may take a write that fits out of it itself (``room -= n`` while resting and
        #: ``n < room``): :meth:`wrote_within` without the call
        self.room = 0
        self._seen_at: float | None = None  # when the last sample was taken
        self._backoff_at_ack = 0  # the back-off when the last ACK was seen (JUDGING)
        self._suspected_at: float | None = None  # the first look that found the peer dead

    def grace(self, sample: TcpSample) -> float:
        """How long a peer found dead must stay so before the verdict: the answer to the last
        probe may be on its way (a tick, or four round trips if that is longer)."""
        return max(self.tick, 4 * sample.rtt_us / 1e6)

    @property
    def looking(self) -> bool:
        """Whether the watch wants looks (bytes were queued at the last one)."""
        return self.state is State.KERNEL or self.state is State.JUDGING

    def wrote(self) -> bool:
        """Bytes were written (the driver does not count them against the :attr:`room`):
        returns whether the driver must start looking."""
        if self.state is State.IDLE:
            self.room = 0
            self.state = State.KERNEL
            return True
        return False

    def begin(self, sample: TcpSample | None) -> None:
        """The socket as the watch finds it when it begins (resting): its room is half of what
        the peer's window leaves (unknown: none, the first write starts the looks)."""
        if self.state is State.IDLE and sample is not None:
            self.room = self._free(sample) // 2

    def wrote_within(self, nbytes: int) -> bool:
        """``nbytes`` were written while the watch rests: True while they fit in its
        :attr:`room` (nothing to do); False once it is used up -- the driver then takes a
        sample at once for :meth:`resample`."""
        room = self.room - nbytes
        self.room = room
        return room > 0

    def resample(self, sample: TcpSample | None, pending: int) -> bool:
        """The sample taken when writes used up the room, with ``pending``: the bytes the driver
        still holds, not handed to the kernel yet (an asyncio transport's buffer -- written to
        the socket later, by no call that counts them).  Rests again, with half of what the
        peer's window leaves beyond all that is queued or pending as the new room (True: nothing
        to do), or -- too little left, or the socket cannot say -- starts looking, as
        :meth:`wrote` does (False: the driver looks every :attr:`tick`)."""
        if self.state is State.IDLE and sample is not None:
            room = (self._free(sample) - pending) // 2
            if room >= MIN_ROOM:
                self.room = room
                return True
        self.wrote()
        return False

    @staticmethod
    def _free(sample: TcpSample) -> int:
        """The bytes the peer's window takes beyond what is queued (in flight or not sent)."""
        return max(0, sample.window - sample.in_flight - sample.notsent)

    def _rest(self, sample: TcpSample) -> None:
        """Nothing is queued: rest, with half the peer's window as the room (see :attr:`room`)."""
        self.state = State.IDLE
        self.room = self._free(sample) // 2

    def look(self, sample: TcpSample | None, now: float) -> Step:
        """One look at the socket, at ``now`` (seconds, any monotonic clock)."""
        state = self.state
        if state is State.DEAD:
            return _STOP
        if sample is None:  # (the socket is gone, or the platform cannot say)
            self.state = State.IDLE
            self.room = 0
            return _STOP
        seen_at, self._seen_at = self._seen_at, now
        if state is not State.JUDGING:
            if not sample.queued:
                self._rest(sample)
                return _STOP
            if sample.window_closed:
                self.state = State.JUDGING
                self._backoff_at_ack = sample.backoff
                self._suspected_at = None
                return Step(user_timeout=False, again=True)
            self.state = State.KERNEL
            return _STAY
        # JUDGING: was anything acknowledged since the last look?  (The clock of TCP_INFO ticks
        # in jiffies: an ACK near the last look counts as after it -- the later verdict.)
        if seen_at is None or sample.last_ack_ms <= (now - seen_at) * 1000 + 20:
            self._backoff_at_ack = sample.backoff
            self._suspected_at = None
        if self._dead(sample):
            suspected_at = self._suspected_at
            if suspected_at is None:
                self._suspected_at = now
                return _STAY
            if now - suspected_at >= self.grace(sample):
                self.state = State.DEAD
                return Step(dead=self._error(sample))
            return _STAY
        self._suspected_at = None
        if not sample.queued:
            self._rest(sample)
            return Step(user_timeout=True)
        if sample.unacked > 0 and sample.backoff == 0:
            self.state = State.KERNEL
            return Step(user_timeout=True, again=True)
        return _STAY

    def unattended(self, sample: TcpSample | None) -> Step:
        """Nobody will look for a while (a pull link whose tasks all left it).  Bytes not sent
        yet may meet a closed window meanwhile, which the kernel must not judge: the timeout goes
        off, and the next look judges.  Bytes only in flight cannot (a window is probed only for
        bytes waiting to be sent), nor bytes that fit in the peer's window: the kernel's timeout
        judges those, and the watch rests."""
        if self.state is not State.KERNEL or sample is None:
            return _STOP
        if sample.notsent == 0 and (sample.unacked == 0 or sample.window >= sample.mss):
            self.state = State.IDLE  # (the common case, without a call)
            return _STOP
        if not sample.may_meet_a_closed_window:
            self.state = State.IDLE
            return _STOP
        self.state = State.JUDGING
        self._backoff_at_ack = sample.backoff
        self._suspected_at = None
        self._seen_at = None
        return Step(user_timeout=False)

    def _dead(self, s: TcpSample) -> bool:
        if s.last_ack_ms < self.budget * 1000 or not s.queued:
            return False
        return s.probes >= 2 or s.backoff - self._backoff_at_ack >= 2

    def _error(self, s: TcpSample) -> OSError:
        probes = max(s.probes, s.backoff - self._backoff_at_ack)
        return TimeoutError(
            errno.ETIMEDOUT,
            f"the peer host stopped answering: {probes} probes unanswered, nothing acknowledged for "
            f"{s.last_ack_ms / 1000:.1f} s",
        )
