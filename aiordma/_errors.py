"""The exception hierarchy of aiordma.

On the anyio API (``aiordma.connect`` and friends) the errors a user sees while a
connection is in use are anyio's own: ``ClosedResourceError`` (this side closed
it), ``BrokenResourceError`` (the peer or the link failed), ``EndOfStream`` (the
peer sent EOF) and ``BusyResourceError`` (two tasks receiving at once on a byte
stream).  On the asyncio API (``aiordma.asyncio``) they are the ones asyncio's
streams raise: ``ConnectionResetError``, ``asyncio.IncompleteReadError`` and
``asyncio.LimitOverrunError``.

The classes below are aiordma's own; each is raised where no standard class says
what happened:

* :class:`ProtocolError` -- the bytes on the wire broke the aiordma protocol.
  :class:`LocalProtocolError` means *we* were asked to do something the protocol
  forbids (send after EOF, a message over the peer's limit); :class:`RemoteProtocolError`
  means the *peer* sent something malformed.  Both carry ``side`` ("local" or
  "remote").  The anyio front end wraps a remote protocol error in
  ``BrokenResourceError`` (its ``__cause__`` is the protocol error).
* :class:`HandshakeError` -- the connection setup failed (timeout, version or
  mode mismatch).
* :class:`RDMAUnavailableError` -- ``transport="rdma"`` was demanded but RDMA
  cannot be used; the message says why.
* :class:`RDMAError` -- a verbs call or a work completion failed.  It is an
  ``OSError`` with ``errno``, the verbs call's name and, where a work completion
  is involved, the status name (``IBV_WC_RETRY_EXC_ERR`` ...).
"""

from __future__ import annotations

import errno as _errno
import os
from typing import Any, Literal

__all__ = [
    "AiordmaError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "RDMAUnavailableError",
    "RDMAError",
    "MemlockLimitError",
]


class AiordmaError(Exception):
    """Base class of every exception defined by aiordma."""

    #: Set by the sans-IO protocol when it raises while parsing: the events it
    #: decoded from the same input before the error, in order.  Deliver them
    #: first, so that nothing the peer sent correctly is lost.
    pending_events: list[Any] = []


class ProtocolError(AiordmaError):
    """The aiordma wire protocol was violated.

    ``side`` tells who broke it: ``"local"`` (this program asked for something
    the protocol forbids) or ``"remote"`` (the peer sent malformed bytes).
    """

    side: Literal["local", "remote"]

    def __init__(self, message: str) -> None:
        super().__init__(f"{self.side} protocol error: {message}")
        self.message = message


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol does not allow."""

    side = "local"


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol."""

    side = "remote"


class HandshakeError(AiordmaError, ConnectionError):
    """The connection setup did not complete (mismatch of version or mode, peer gone)."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """The peer did not complete the handshake before the deadline."""


class AuthenticationError(HandshakeError):
    """The handshake's mutual authentication failed: a wrong key, or a key on one side only
    (``auth=`` / ``AIORDMA_AUTH``).  The message says which side and why."""


class RDMAUnavailableError(AiordmaError, ConnectionError):
    """``transport="rdma"`` was required, but this connection cannot use RDMA.

    ``reason`` is the same readable sentence that ``fallback_reason`` would
    have given under ``transport="auto"``.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"RDMA is not available: {reason}")
        self.reason = reason


class BufferTooSmallError(AiordmaError, ValueError):
    """``receive_into``: the next message is larger than the buffer (it stays queued)."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(f"the next message has {needed} bytes, the buffer {available}; it stays queued")
        self.needed = needed
        self.available = available


class RDMAError(AiordmaError, OSError):
    """A verbs call or a work completion failed.

    ``errno`` is the errno the call reported (``EIO`` for a failed work
    completion), ``call`` the verbs function (``"ibv_modify_qp(RTR)"``), and
    ``wc_status`` the work completion status name where one applies.
    """

    def __init__(
        self,
        err: int,
        call: str,
        detail: str = "",
        *,
        wc_status: str | None = None,
    ) -> None:
        text = f"{call} failed: {os.strerror(err) if err else 'error'}"
        if wc_status:
            text += f" (work completion status {wc_status})"
        if detail:
            text += f": {detail}"
        OSError.__init__(self, err or _errno.EIO, text)
        self.call = call
        self.wc_status = wc_status
        self.detail = detail


class PostError(RDMAError):
    """``ibv_post_send``/``ibv_post_recv`` rejected a batch; ``posted`` were accepted before it."""

    def __init__(self, err: int, call: str, posted: int, total: int) -> None:
        super().__init__(err, call, f"posted {posted} of {total} work requests")
        self.posted = posted
        self.total = total


class MemlockLimitError(RDMAError):
    """Registering more memory would exceed (or hit) RLIMIT_MEMLOCK; the message says what to raise."""
