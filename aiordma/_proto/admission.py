"""Who gets a handshake, and when: a listener's admission, sans I/O.

A listener that accepted every socket and refused the ones over its handshake budget would let
anyone who opens sockets -- a burst of legitimate clients, or a few hundred that never speak or
start and stall -- keep everyone else out.  :class:`Admission` decides instead.  A connection
goes through these states:

=============  ===================================================  ===========================
state          what it means                                        it leaves when
=============  ===================================================  ===========================
``waiting``    accepted, **silent**: not one byte has come          its first byte comes
                                                                    (``speaking``); the glue's
                                                                    first-byte deadline
                                                                    (``hello_timeout``); it is
                                                                    the oldest silent one and
                                                                    the queue is full
``speaking``   bytes came, its first frame (the HELLO, or a TLS     the frame is whole
               record) is not whole yet                             (``ready``); the handshake
                                                                    deadline
``ready``      its first frame is whole: it waits for a slot         a slot is free (oldest first)
``handshaking`` it holds a slot: its handshake runs                  the handshake ends; it is
                                                                    **stalled** and a ready one
                                                                    needs the slot
=============  ===================================================  ===========================

The rules:

* **Accept only while there is room.**  At most ``pending`` accepted connections wait for a
  slot; beyond that the listener stops accepting and the kernel's listen backlog queues (the
  client sees a slow connect, never a refusal).  When the queue is full and one of it is
  silent, the oldest silent one is dropped to make room: silence cannot fill the queue.
* **A slot only for a whole first frame.**  At most ``max_handshakes`` handshakes run at once,
  and at most ``per_address`` for one peer address; they go to ready connections, oldest first.
  A connection whose bytes have started to come is never dropped as silent: it has until the
  handshake deadline to finish its first frame, and no slot meanwhile.
* **Stalled, not slow, gives way.**  A handshake is *stalled* when nothing moved on its
  connection -- no byte from the peer, none to it -- for ``stall_after`` seconds (the glue
  measures it: the kernel's TCP_INFO).  When a ready connection finds no slot, the handshake
  stalled the longest (of its address, when the address's share is the limit) is dropped for
  it.  A handshake that moves is never dropped for another, and none is dropped while a slot
  is free: a client that is slow but alone still connects within the handshake deadline.

Keys are the glue's (any hashable).  Every call returns the keys to start (their handshake may
run now) and to drop (close them, each with its reason), and changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final

from .protocol import HEADER, MAGIC, MAX_CONTROL_PAYLOAD

__all__ = [
    "Admission",
    "Decision",
    "DEFAULT_HELLO_TIMEOUT",
    "DEFAULT_BACKLOG",
    "DEFAULT_STALL_AFTER",
    "first_frame_size",
    "MAX_FIRST_FRAME",
]

#: how long an accepted connection may stay silent (not one byte); the handshake's own deadline
#: (``handshake_timeout``) bounds the rest.  Long enough for a client whose loop is busy for
#: seconds right after it connected: a silent socket holds no handshake slot meanwhile.
DEFAULT_HELLO_TIMEOUT: Final = 10.0
#: the listen backlog, and how many accepted connections may wait for a handshake slot
DEFAULT_BACKLOG: Final = 1024
#: a handshake on which nothing moved this long may be dropped for a ready connection (the
#: listeners use half their ``handshake_timeout``)
DEFAULT_STALL_AFTER: Final = 5.0

WAITING: Final = "waiting"  # accepted, silent
SPEAKING: Final = "speaking"  # bytes came; its first frame is not whole yet
READY: Final = "ready"  # its first frame is whole; waits for a slot
HANDSHAKING: Final = "handshaking"

#: dropping reasons (in :attr:`Decision.drop`)
SILENT: Final = "silent"
STALLED: Final = "stalled"

#: the largest first frame waited for whole: a TLS record (16 KiB + its 5-byte header, plus the
#: expansion TLS allows), more than a HELLO (MAX_CONTROL_PAYLOAD); a longer claim is the
#: protocol's (or TLS's) to refuse, and counts as whole at once
MAX_FIRST_FRAME: Final = max(5 + (16 << 10) + 2048, len(MAGIC) + HEADER.size + MAX_CONTROL_PAYLOAD)


def first_frame_size(head: bytes, tls: bool) -> int:
    """How many bytes the client's first frame takes, judged from its first bytes ``head``
    (a peek): a TLS record (header and body), or aiordma's magic and HELLO frame.  While
    ``head`` is too short to tell, the size of what is needed to tell; bytes that are neither
    (garbage, another protocol) count as whole as they are, so that the protocol refuses them
    with a reason.  Never more than :data:`MAX_FIRST_FRAME`."""
    if tls:
        if len(head) < 5:
            return 5
        if head[0] != 0x16:  # (not a handshake record: TLS refuses it)
            return len(head)
        return min(5 + int.from_bytes(head[3:5], "big"), MAX_FIRST_FRAME)
    need = len(MAGIC) + HEADER.size
    if head[: len(MAGIC)] != MAGIC[: len(head)]:
        return len(head)  # (not aiordma: the protocol says so)
    if len(head) < need:
        return need
    length: int = HEADER.unpack_from(head, len(MAGIC))[3]
    return min(need + length, MAX_FIRST_FRAME)


@dataclass
class Decision:
    start: list[Hashable] = field(default_factory=list)
    #: (key, reason): :data:`SILENT` or :data:`STALLED`
    drop: list[tuple[Hashable, str]] = field(default_factory=list)

    def __iadd__(self, other: Decision) -> Decision:
        self.start += other.start
        self.drop += other.drop
        return self


@dataclass
class _Entry:
    address: str
    state: str
    #: seconds since anything moved on the connection (a byte either way, or its slot began)
    idle: Callable[[], float] | None = None


class Admission:
    """The admission state of one listener (see the module docs)."""

    def __init__(self, max_handshakes: int, per_address: int, pending: int,
                 stall_after: float = DEFAULT_STALL_AFTER) -> None:  # fmt: skip
        if max_handshakes < 1 or per_address < 1 or pending < 1:
            raise ValueError("max_handshakes, the per-address cap and the pending bound must be at least 1")
        if not stall_after > 0:
            raise ValueError("stall_after must be a positive number of seconds")
        self.max_handshakes = max_handshakes
        self.per_address = per_address
        self.pending = pending
        self.stall_after = stall_after
        self._entries: dict[Hashable, _Entry] = {}  # insertion order: oldest first
        self._handshaking = 0
        self._by_address: dict[str, int] = {}  # handshakes running per peer address
        self._waiting = 0  # WAITING + SPEAKING + READY
        self._ready = 0  # READY
        #: counters (for tests, logs and stats): connections dropped, by reason
        self.dropped_silent = 0
        self.dropped_stalled = 0

    # -- questions ---------------------------------------------------------------------

    def may_accept(self) -> bool:
        """Whether the listener may accept another connection now."""
        if self._waiting < self.pending:
            return True
        return any(e.state is WAITING for e in self._entries.values())

    @property
    def handshaking(self) -> int:
        return self._handshaking

    @property
    def waiting(self) -> int:
        return self._waiting

    def state(self, key: Hashable) -> str | None:
        entry = self._entries.get(key)
        return entry.state if entry is not None else None

    # -- events ----------------------------------------------------------------------------

    def accepted(self, key: Hashable, address: str, idle: Callable[[], float] | None = None) -> Decision:
        """A connection was accepted (silent so far).  ``idle()``: seconds since anything moved
        on it (asked only of running handshakes, when a slot is wanted); without it, a
        handshake never counts as stalled."""
        if key in self._entries:
            raise ValueError(f"{key!r} is admitted already")
        out = Decision()
        if self._waiting >= self.pending:
            victim = next((k for k, e in self._entries.items() if e.state is WAITING), None)
            if victim is not None:
                self._remove(victim)
                self.dropped_silent += 1
                out.drop.append((victim, SILENT))
        self._entries[key] = _Entry(address, WAITING, idle)
        self._waiting += 1
        return out

    def speaking(self, key: Hashable) -> None:
        """Its first byte came: never silent again (its first frame is not whole yet)."""
        entry = self._entries.get(key)
        if entry is not None and entry.state is WAITING:
            entry.state = SPEAKING

    def spoke(self, key: Hashable) -> Decision:
        """Its first frame is whole: it may get a handshake slot."""
        entry = self._entries.get(key)
        if entry is None or entry.state not in (WAITING, SPEAKING):
            return Decision()
        entry.state = READY
        self._ready += 1
        return self._schedule()

    def finished(self, key: Hashable) -> Decision:
        """The connection left admission: its handshake ended (either way), or it was dropped or
        closed by the glue.  Unknown keys are ignored (a connection dropped already)."""
        if key not in self._entries:
            return Decision()
        self._remove(key)
        return self._schedule()

    def reschedule(self) -> Decision:
        """Look again (the glue's timer): a handshake may have stalled since the last look while
        a ready connection waits."""
        return self._schedule()

    # -- internals -------------------------------------------------------------------------

    def _remove(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        if entry.state is HANDSHAKING:
            self._handshaking -= 1
            left = self._by_address[entry.address] - 1
            if left:
                self._by_address[entry.address] = left
            else:
                del self._by_address[entry.address]
        else:
            self._waiting -= 1
            if entry.state is READY:
                self._ready -= 1

    def _stalled(self) -> list[tuple[float, Hashable, str]]:
        """The running handshakes that stalled, the longest first (asks each one's ``idle()``
        once)."""
        found = []
        for key, entry in self._entries.items():
            if entry.state is HANDSHAKING and entry.idle is not None:
                idle = entry.idle()
                if idle >= self.stall_after:
                    found.append((idle, key, entry.address))
        found.sort(key=lambda item: -item[0])
        return found

    def _schedule(self) -> Decision:
        out = Decision()
        if self._waiting == 0:
            return out
        stalled: list[tuple[float, Hashable, str]] | None = None  # (looked up once, when first wanted)
        for key, entry in list(self._entries.items()):
            if entry.state is not READY:
                continue
            by_address = self._by_address.get(entry.address, 0) >= self.per_address
            if not by_address and self._handshaking < self.max_handshakes:
                self._start(key, entry, out)
                continue
            if stalled is None:
                stalled = self._stalled()
            pick = next((i for i, s in enumerate(stalled) if not by_address or s[2] == entry.address), None)
            if pick is None:
                continue  # it waits for a slot (and so does everyone behind it for that reason)
            victim = stalled.pop(pick)[1]
            self._remove(victim)
            self.dropped_stalled += 1
            out.drop.append((victim, STALLED))
            self._start(key, entry, out)
        return out

    def _start(self, key: Hashable, entry: _Entry, out: Decision) -> None:
        entry.state = HANDSHAKING
        self._waiting -= 1
        self._ready -= 1
        self._handshaking += 1
        self._by_address[entry.address] = self._by_address.get(entry.address, 0) + 1
        out.start.append(key)

    @property
    def ready(self) -> int:
        """Ready connections waiting for a slot (while there are, the glue looks again on a
        timer: :meth:`reschedule`)."""
        return self._ready
