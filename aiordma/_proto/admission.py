"""Who gets a handshake, and when: a listener's admission, sans I/O.

A listener that accepted every socket and refused the ones over its handshake budget would let
anyone who opens sockets -- a burst of legitimate clients, or a few hundred that never speak --
keep everyone else out.  :class:`Admission` decides instead:

* **Accept only while there is room.**  At most ``pending`` accepted connections wait for their
  turn; beyond that the listener stops accepting and the kernel's listen backlog queues (the
  client sees a slow connect, never a refusal).  When every waiting one is still *silent* (it
  has not sent a byte), the oldest of them is dropped to make room: silence cannot fill the
  queue.
* **Handshake only what spoke.**  A connection gets a handshake slot (the Connection, its
  receive buffer, perhaps RDMA resources) once its first byte arrived, oldest first.  At most
  ``max_handshakes`` run at once, and at most ``per_address`` for one peer address.
* **Silence is dropped first.**  A handshake whose peer has not completed its HELLO holds its
  slot only until someone who did speak needs it: then the oldest such one is dropped.  The glue
  also drops a connection whose HELLO did not come within ``hello_timeout`` of its accept.

Keys are the glue's (any hashable); times are the glue's clock.  Every call returns the keys to
start (their handshake may run now) and to drop (close them), and changes nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["Admission", "Decision", "DEFAULT_HELLO_TIMEOUT", "DEFAULT_BACKLOG"]

#: how long an accepted connection may take to deliver its HELLO (the client's first frame)
DEFAULT_HELLO_TIMEOUT: Final = 3.0
#: the listen backlog, and how many accepted connections may wait for a handshake slot
DEFAULT_BACKLOG: Final = 1024

WAITING: Final = "waiting"  # accepted, silent
READY: Final = "ready"  # its first byte arrived; waits for a slot
HANDSHAKING: Final = "handshaking"


@dataclass
class Decision:
    start: list[Hashable] = field(default_factory=list)
    drop: list[Hashable] = field(default_factory=list)

    def __iadd__(self, other: Decision) -> Decision:
        self.start += other.start
        self.drop += other.drop
        return self


@dataclass
class _Entry:
    address: str
    state: str
    #: while handshaking: whether the peer completed its HELLO (then it is no longer silent)
    spoke: Callable[[], bool] | None = None


class Admission:
    """The admission state of one listener (see the module docs)."""

    def __init__(self, max_handshakes: int, per_address: int, pending: int) -> None:
        if max_handshakes < 1 or per_address < 1 or pending < 1:
            raise ValueError("max_handshakes, the per-address cap and the pending bound must be at least 1")
        self.max_handshakes = max_handshakes
        self.per_address = per_address
        self.pending = pending
        self._entries: dict[Hashable, _Entry] = {}  # insertion order: oldest first
        self._handshaking = 0
        self._by_address: dict[str, int] = {}  # handshakes running per peer address
        self._waiting = 0  # WAITING + READY
        #: counters (for tests, logs and stats): connections dropped while silent, by reason
        self.dropped_silent = 0

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

    def accepted(self, key: Hashable, address: str) -> Decision:
        """A connection was accepted (silent so far)."""
        if key in self._entries:
            raise ValueError(f"{key!r} is admitted already")
        out = Decision()
        if self._waiting >= self.pending:
            victim = next((k for k, e in self._entries.items() if e.state is WAITING), None)
            if victim is not None:
                self._remove(victim)
                self.dropped_silent += 1
                out.drop.append(victim)
        self._entries[key] = _Entry(address, WAITING)
        self._waiting += 1
        return out

    def spoke(self, key: Hashable) -> Decision:
        """Its first byte arrived: it may get a handshake slot."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not WAITING:
            return Decision()
        entry.state = READY
        return self._schedule()

    def started(self, key: Hashable, hello: Callable[[], bool]) -> None:
        """The glue tells how to see that a started handshake's HELLO came (``hello()``)."""
        entry = self._entries.get(key)
        if entry is not None and entry.state is HANDSHAKING:
            entry.spoke = hello

    def finished(self, key: Hashable) -> Decision:
        """The connection left admission: its handshake ended (either way), or it was dropped or
        closed by the glue.  Unknown keys are ignored (a connection dropped already)."""
        if key not in self._entries:
            return Decision()
        self._remove(key)
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

    def _silent_handshake(self, address: str | None) -> Hashable | None:
        """The oldest running handshake (of ``address``, if given) whose HELLO has not come."""
        for key, entry in self._entries.items():
            if entry.state is HANDSHAKING and (address is None or entry.address == address):
                if entry.spoke is None or not entry.spoke():
                    return key
        return None

    def _schedule(self) -> Decision:
        out = Decision()
        for key, entry in list(self._entries.items()):
            if entry.state is not READY:
                continue
            if self._by_address.get(entry.address, 0) >= self.per_address:
                victim = self._silent_handshake(entry.address)
            elif self._handshaking >= self.max_handshakes:
                victim = self._silent_handshake(None)
            else:
                victim = None
                self._start(key, entry, out)
                continue
            if victim is None:
                continue  # it waits for a slot (and so does everyone behind it for that reason)
            self._remove(victim)
            self.dropped_silent += 1
            out.drop.append(victim)
            self._start(key, entry, out)
        return out

    def _start(self, key: Hashable, entry: _Entry, out: Decision) -> None:
        entry.state = HANDSHAKING
        self._waiting -= 1
        self._handshaking += 1
        self._by_address[entry.address] = self._by_address.get(entry.address, 0) + 1
        out.start.append(key)
