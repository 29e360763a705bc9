"""The Core's non-blocking API: what asyncio's own interfaces need beyond the Core's awaitable one.

``asyncio.StreamWriter.write`` and ``asyncio.Transport.write`` return at once and never wait;
``drain`` and the protocol's ``pause_writing`` carry the backpressure, ``close()`` starts a close
that ``wait_closed`` waits for, and a Transport is called back when bytes arrive instead of
awaiting them.  :class:`Nowait` is that API over a :class:`~aiordma._conn.core.Core`, for the two
asyncio front ends (``aiordma.asyncio``'s reader and writer, ``aiordma._transport``): they talk
to it and to the Core, never to a link.

It needs a link that can queue without waiting: a :class:`NowaitLink` (the TCP link under asyncio,
and the RDMA link that takes over from it); the anyio links (trio, memory) are not, and the
asyncio front ends do not run on them (:class:`Nowait` raises ``TypeError``).

Errors: ``write``, ``write_eof`` and ``drain`` raise anyio's ``BrokenResourceError`` /
``ClosedResourceError`` like the Core; the front ends translate them at their own boundary
(asyncio's ``write`` never raises for a lost connection; ``drain`` raises
``ConnectionResetError``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._proto.protocol import Chunk
from .core import Core

__all__ = ["Nowait", "NowaitLink", "PassThroughLink", "PassedThrough", "WriteFlags"]


@runtime_checkable
class NowaitLink(Protocol):
    """A link that queues without waiting (beyond the :class:`~aiordma._conn.core.Link` contract).

    * ``write_nowait(chunks)`` queues the chunks in order and returns at once (raises
      ``BrokenResourceError`` when the connection is gone); nothing of a caller's mutable buffer
      is kept once it returns.
    * ``paused_writing``: more than the link's high mark is queued; ``drain(low)`` waits until at
      most ``low`` bytes (or the link's own low mark, for 0) are queued and not handed on.
    * ``lost``: the connection is gone or going (writes would be dropped).
    * ``close_nowait(final)`` writes ``final`` (a CLOSE) after what is queued and starts
      closing; ``wait_closed()`` waits for it (``BrokenResourceError`` when the peer may not
      have everything); ``abort()`` drops what is queued and closes now.
    * ``tcp_writer``: the asyncio transport the link writes to (its write-buffer size and
      limits are the connection's), or None (the RDMA link: its queue is its own).
    * ``unsent()``: bytes queued and not handed to the kernel or the NIC yet.
    * ``set_callbacks(on_data, on_write_paused)``: a push link calls ``on_data()`` each time it
      fed the Core and ``on_write_paused(paused)`` when its transport pauses or resumes writing,
      and returns True; a link that cannot returns False (then wait on ``incoming()``).
      ``set_callbacks(None, None)`` stops the calls.
    * ``transport``: the asyncio transport of the TCP connection under it, for
      ``get_extra_info`` (None if there is none).
    """

    needs_consumed: bool

    def incoming(self) -> Awaitable[None]: ...

    def consumed(self) -> None: ...

    @property
    def lost(self) -> bool: ...

    @property
    def paused_writing(self) -> bool: ...

    @property
    def tcp_writer(self) -> asyncio.WriteTransport | None: ...

    @property
    def transport(self) -> asyncio.BaseTransport | None: ...

    def write_nowait(self, chunks: Sequence[Chunk]) -> None: ...

    async def drain(self, low: int = 0) -> None: ...

    def unsent(self) -> int: ...

    def close_nowait(self, final: bytes) -> None: ...

    def abort(self) -> None: ...

    async def wait_closed(self) -> None: ...

    def set_callbacks(
        self, on_data: Callable[[], None] | None, on_write_paused: Callable[[bool], None] | None
    ) -> bool: ...


class WriteFlags(Protocol):
    """What a writer looks at before each write and drain (attributes: no call to read them)."""

    @property
    def lost(self) -> bool: ...

    @property
    def paused_writing(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class PassedThrough:
    """A connection handed over after it passed through (see :class:`PassThroughLink`)."""

    #: the TCP connection's asyncio transport, now calling the new protocol itself
    transport: asyncio.Transport
    #: the data's first bytes, read before the handover: the new protocol's, before any other
    first: bytes
    #: the peer ended its side (EOF) before the handover
    eof: bool
    #: the connection was lost before the handover (and why: None for an orderly end)
    lost: bool
    error: Exception | None
    #: the link paused reading until the handover: resume it once the protocol has the above
    reading_paused: bool
    #: close the connection in order, as a framed close lingers: our FIN after the data, what
    #: comes dropped, the socket closed once the peer's kernel acknowledged everything (however
    #: long a live peer takes), then ``done(error)`` -- None, or why the peer may not have it all
    close_in_order: Callable[[Callable[[Exception | None], None]], None]


@runtime_checkable
class PassThroughLink(Protocol):
    """A TCP link that can hand its connection over after the handshake, when both sides offered
    it and the protocol passed through (``Connection.passed_through``).

    * ``can_pass_through``: a plain TCP socket under asyncio's (or uvloop's) transport (not TLS:
      its transport is a layer of its own).
    * ``pass_through(protocol)``: stop being the transport's protocol -- ``protocol`` is, from now
      on -- and return what the link held (:class:`PassedThrough`).  The link and its Core are
      done: nothing is framed, watched or closed through them any more.
    * or ``unframe()``: go on carrying the connection, unframed -- what the socket reads goes
      into the Core's ``rbuf`` as it is (aiordma's own reader reads it), writes go as the
      protocol returns them (unframed), the peer's FIN is the stream's EOF and a reset its
      error, ``close_nowait(b"")`` lingers after a FIN as a framed close does, and the link's
      watch still judges slow from dead.  ``end_half()`` then ends our half (our EOF: a FIN)."""

    @property
    def can_pass_through(self) -> bool: ...

    def pass_through(self, protocol: asyncio.BaseProtocol) -> PassedThrough: ...

    def unframe(self) -> None: ...

    def end_half(self) -> None: ...


class Nowait:
    """The non-blocking API of one connection (see the module docs).

    ``incoming()`` waits until the link fed the Core (the hot path: the link's own future, no
    frame of ours); ``consumed()`` tells the link a reader took bytes out of the Core (it may
    resume reading or return credits)."""

    __slots__ = ("core", "_link", "incoming", "flags")

    def __init__(self, core: Core) -> None:
        link = core.link
        if not isinstance(link, NowaitLink):
            raise TypeError(f"aiordma's asyncio API runs on asyncio's links, not on {type(link).__name__}")
        self.core = core
        self._link: NowaitLink = link
        self.incoming: Callable[[], Awaitable[None]] = link.incoming
        #: ``lost`` and ``paused_writing`` as attributes, for the hot path of a writer (the same
        #: as this object's properties of those names)
        self.flags: WriteFlags = link

    def consumed(self) -> None:
        link = self._link
        if link.needs_consumed:
            link.consumed()

    # -- state -------------------------------------------------------------------------------

    @property
    def lost(self) -> bool:
        """The connection is gone or going: a write now would be dropped."""
        return self._link.lost

    @property
    def writable(self) -> bool:
        """A write now goes out: this side did not close, the connection did not fail, the peer
        did not close."""
        core = self.core
        return not (core.closed or core.error is not None or core.peer_close is not None or self._link.lost)

    @property
    def paused_writing(self) -> bool:
        return self._link.paused_writing

    @property
    def tcp_writer(self) -> asyncio.WriteTransport | None:
        return self._link.tcp_writer

    @property
    def transport(self) -> asyncio.BaseTransport | None:
        """The TCP connection's asyncio transport (``get_extra_info``), None if there is none."""
        return self._link.transport

    def unsent(self) -> int:
        """Bytes written and not handed to the kernel or the NIC yet."""
        return self._link.unsent()

    # -- writing -----------------------------------------------------------------------------

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Frame ``data`` (DATA) and queue it; returns at once.  Nothing of ``data`` is kept."""
        self._link.write_nowait(self.core.proto.send_data(data))

    def write_eof(self) -> None:
        """Queue our EOF after what was written (the protocol's half-close; unframed, a FIN)."""
        final = self.core.proto.send_eof()
        link = self._link
        if final:
            link.write_nowait([final])
        elif isinstance(link, PassThroughLink):
            link.end_half()

    async def drain(self, low: int = 0) -> None:
        await self._link.drain(low)

    def set_callbacks(
        self, on_data: Callable[[], None] | None, on_write_paused: Callable[[bool], None] | None
    ) -> bool:
        return self._link.set_callbacks(on_data, on_write_paused)

    # -- passing through ---------------------------------------------------------------------

    def pass_through(self, protocol: asyncio.BaseProtocol) -> PassedThrough | None:
        """The connection passed through (both sides offered it, TCP): hand it to ``protocol``
        (see :class:`PassThroughLink`).  None when it did not: it stays framed."""
        link = self._link
        if not self.core.proto.passed_through or not isinstance(link, PassThroughLink):
            return None
        return link.pass_through(protocol)

    def unframe(self) -> bool:
        """The connection passed through (both sides offered it, TCP): the link carries it on,
        unframed, under this Core's readers and writers (see :class:`PassThroughLink`).  False
        when it did not pass through: it stays framed."""
        link = self._link
        if not self.core.proto.passed_through or not isinstance(link, PassThroughLink):
            return False
        link.unframe()
        return True

    # -- closing -----------------------------------------------------------------------------

    def close(self) -> None:
        """This side closes: what was written goes first, then our CLOSE (if one is due), and the
        link closes in order; :meth:`wait_closed` waits for it."""
        core = self.core
        final = b"" if core.closed else core.begin_close()
        core.closed = True
        self._link.close_nowait(final)

    def release(self) -> None:
        """The connection ended (the peer's CLOSE, then its end): release our side, sending
        nothing more; :meth:`wait_closed` waits for it."""
        self.core.closed = True
        self._link.close_nowait(b"")

    def abort(self) -> None:
        """Close now: drop what was received and what is queued (the peer sees the connection fail)."""
        core = self.core
        core.closed = True
        core.discard()
        self._link.abort()

    async def wait_closed(self) -> None:
        await self._link.wait_closed()
