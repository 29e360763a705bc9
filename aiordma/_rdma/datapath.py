"""What the RDMA link asks of a connection's session: one interface, two sessions.

A connection's session decides what to post and what a completion means; the link
(``link.py``) feeds the Core and wakes tasks.  Two sessions implement :class:`DataPath`:

* :class:`~aiordma._rdma.fastpath.NativeSession` keeps its state in a C struct; a send is one
  C call that posts, and the device's poller processes its completions in C (one call per
  wake, ``link.on_native``);
* :class:`~aiordma._rdma.checked.CheckedSession` is the sans-IO
  :class:`~aiordma._rdma.session.RdmaSession` (the reference, ``RdmaConfig(hot_path="checked")``)
  with the QP it posts on; its completions come polled to Python (``link.on_completions``).

Either way the session owns posting: the link never builds a work request, never reads a
session's private fields, and calls one :meth:`DataPath.send` per send.  A post the QP refuses
fails the session (:attr:`DataPath.error`); the link checks ``error`` after the calls that post
and fails the Core (one error boundary, ``RdmaLink.broke``).

Buffer ownership is the device's from post until the completion is polled, in both sessions
(``session.py``, "Buffers").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .objects import Completion, Poster
from .params import RdmaParams
from .session import Ring
from .states import LinkState

__all__ = ["DataPath", "OneSidedPath", "Poster", "ChanView", "Completion", "Chunk"]

#: bytes to send (the caller's: see :meth:`DataPath.send` for how long the session may keep them)
Chunk = bytes | bytearray | memoryview


class DataPath(Protocol):
    """One connection's session as the link uses it (see the module docs).

    The life cycle is ``states.py``'s: set-up (:meth:`post_receives`, :meth:`start`, the probe),
    :meth:`activate`, sends and completions, :meth:`close`, :meth:`begin_drain` once the QP is
    in ERROR, :meth:`reclaim` once it is destroyed.  Every method that posts sets :attr:`error`
    when the QP refuses (the QP's state is then unknown: the connection is over)."""

    #: why the session failed (the first reason), else None
    error: BaseException | None
    state: LinkState
    #: bytes ever queued (compare with :attr:`posted_bytes`)
    enqueued: int
    #: post nothing more (the peer said goodbye: its QP is going away); receives go on
    quiet: bool

    @property
    def posted_bytes(self) -> int:
        """Bytes ever posted."""
        ...

    @property
    def backlog(self) -> bool:
        """Bytes are queued that could not be posted yet (no credit, send queue or slot)."""
        ...

    @property
    def withheld(self) -> int:
        """Receive buffers re-posted whose credits wait for the reader (it holds too much)."""
        ...

    @property
    def blocked_on_sends(self) -> bool:
        """Posting stopped for the send queue or ring: only a send completion makes room."""
        ...

    @property
    def wants_send_completions(self) -> bool:
        """Posting waits for room that only a send completion makes, with something to post
        (a backlog, a credit owed, the close's fence): the CQ must wake for every completion."""
        ...

    @property
    def close_sent(self) -> bool:
        """The CLOSE (the last send before it) completed: the peer's NIC has everything."""
        ...

    @property
    def drained(self) -> bool:
        """Every posted receive and signaled send came back (after :meth:`begin_drain`)."""
        ...

    @property
    def rq_posted(self) -> int: ...

    @property
    def signaled_out(self) -> int: ...

    @property
    def progress(self) -> int:
        """A mark that moves when data arrives or bytes are posted (probes do not move it)."""
        ...

    @property
    def probe_outstanding(self) -> bool:
        """A probe is posted and has not completed (its retry budget runs)."""
        ...

    @property
    def probe_status(self) -> int | None:
        """The last probe's completion status, None while it is out (or none was posted)."""
        ...

    # -- set-up ---------------------------------------------------------------------------

    def post_receives(self) -> None:
        """Post every receive slot (before the HELLO goes out); raises what the QP refused."""

    def start(self, peer: RdmaParams, *, sq_depth: int, send: Ring, max_inline: int = 0, signal_every: int = 8,
              high_water: int = 1 << 20) -> None:  # fmt: skip
        """The peer's parameters and the granted send side are known."""

    def post_probe(self) -> None:
        """Post a probe (a signaled zero-length RDMA WRITE), unless the send queue is full."""

    def activate(self) -> None:
        """The connection carries data from now on."""

    def take_deferred(self) -> list[Completion]:
        """Receive completions that came before :meth:`activate` (for :meth:`complete`)."""
        ...

    # -- the data path ------------------------------------------------------------------------

    def send(self, chunks: Sequence[Chunk]) -> int:
        """Post ``chunks`` where credits, send-queue entries and slots allow, queue the rest in
        order.  Returns 0 when all of it was posted, else the byte mark that ends it: the
        caller's buffers are read until :attr:`posted_bytes` reaches it (or :meth:`detach`)."""
        ...

    def detach(self, end: int, count: int | None = None) -> None:
        """Copy what is still queued of the bytes up to ``end`` out of the caller's buffers."""

    def complete(self, entries: Sequence[Completion], buffered: int) -> list[memoryview]:
        """Account polled completions; returns the received payloads, in order, valid until
        :meth:`settle` (which re-posts their buffers).  ``buffered``: what the reader holds."""
        ...

    def settle(self) -> None:
        """After :meth:`complete`'s views were consumed: re-post, post what may go now."""

    def reader_took(self, buffered: int) -> None:
        """The reader took bytes (it holds ``buffered``): withheld credits may flow back."""

    def release_withheld(self) -> None:
        """Return every withheld credit now (a reader wants more, or this side reads no more)."""

    def close(self, final: bytes) -> None:
        """Queue ``final`` (the CLOSE frame) after everything queued, take no more sends, and
        post; :attr:`close_sent` says when the last of it completed."""

    def fail(self, exc: BaseException) -> None:
        """The connection is broken: post nothing more but the teardown."""

    # -- teardown --------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """The QP goes to ERROR now: what is posted comes back flushed."""

    def reclaim(self) -> None:
        """The QP was destroyed: the device can touch nothing any more."""


class OneSidedPath(DataPath, Protocol):
    """A session that posts one-sided work requests (the native one)."""

    def post_onesided(self, write: bool, laddr: int, length: int, lkey: int, raddr: int, rkey: int) -> int:
        """Post a signaled RDMA READ or WRITE; its sequence number, 0 while the send queue is full."""
        ...

    def reserve_wr(self) -> tuple[int, int]:
        """A send-queue entry for a work request the caller posts (a BIND_MW): ``(seq, wr_id)``,
        ``(0, 0)`` while the send queue is full."""
        ...

    def take_onesided(self) -> list[tuple[int, int]]:
        """One-sided work requests completed since the last call: ``(seq, wc status)``."""
        ...

    def on_events(self, events: int) -> None:
        """Account what C reported in a wake (:attr:`ChanView.events`, cleared by the caller)."""


class ChanView(Protocol):
    """What the link reads and writes of a native session's C struct in a wake
    (``struct aiordma_chan``, shared with the poller's C pass)."""

    #: what happened since the last wake (``EVT_*``); the reader clears it
    events: int
    #: bytes delivered that the reader has not taken (C withholds credits above the high water)
    unread: int
    withheld: int
    #: why the last send stopped (``BLOCK_SQ``: only a send completion makes room)
    blocked: int
