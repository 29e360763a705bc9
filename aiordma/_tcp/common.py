"""What the TCP links share: the constants of closing and keepalive, writing chunks to an asyncio
transport without keeping a caller's mutable buffer, the kernel's count of unacknowledged bytes,
the linger of a close in order, and the socket's typed attributes."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from anyio import BrokenResourceError
from anyio.abc import SocketAttribute

from .._proto.protocol import Chunk
from .._proto.receiving import RECV_BUFFER_SIZE


__all__ = ["CLOSE_TIMEOUT", "DEFAULT_KEEPALIVE", "RECEIVE_SIZE", "Linger", "closing_failed", "ignore_control", "receive_scratch", "socket_attributes", "unacknowledged", "write_chunks"]

log = logging.getLogger("aiordma")

#: How long closing may wait to flush the CLOSE frame before it aborts.
CLOSE_TIMEOUT = 5.0
#: The default bound (seconds) on noticing a peer host that died without a word (see set_keepalive).
DEFAULT_KEEPALIVE = 5.0


#: How much a pull link asks its stream for at once.
RECEIVE_SIZE = 256 << 10


def socket_attributes(get: Callable[[str], Any]) -> dict[Any, Callable[[], Any]]:
    attrs: dict[Any, Callable[[], Any]] = {}
    sock = get("socket")
    if sock is not None:
        attrs[SocketAttribute.raw_socket] = lambda: sock
        attrs[SocketAttribute.family] = lambda: sock.family
    sockname = get("sockname")
    if sockname is not None:
        attrs[SocketAttribute.local_address] = lambda: sockname
        if isinstance(sockname, tuple):
            attrs[SocketAttribute.local_port] = lambda: sockname[1]
    peername = get("peername")
    if peername is not None:
        attrs[SocketAttribute.remote_address] = lambda: peername
        if isinstance(peername, tuple):
            attrs[SocketAttribute.remote_port] = lambda: peername[1]
    return attrs


def ignore_control(data: bytes | None) -> None:
    pass


def _immutable(chunk: Chunk) -> bool:
    """Whether a chunk's bytes can never change (``bytes``, or a read-only view of ``bytes``)."""
    if type(chunk) is bytes:
        return True
    return type(chunk) is memoryview and chunk.readonly and type(chunk.obj) is bytes


def write_chunks(writer: asyncio.WriteTransport, chunks: Sequence[Chunk], fd: int) -> None:
    """Write ``chunks`` to an asyncio transport, in order, so that it keeps no reference to a
    buffer of the caller's that could still change: on Python 3.12+ (and on uvloop) a transport
    keeps a reference to what it could not send at once, and a reused ``bytearray`` would change
    bytes not yet on the wire.

    Immutable chunks go to the transport as they are.  Otherwise, while the transport holds
    nothing (its buffer is empty), the chunks go to the socket at once in one gathered write
    (``writev``: header and payload, never joined) and only what the kernel did not take is
    copied into the transport; with data already buffered, mutable chunks are copied first.
    ``fd`` is the plain socket's descriptor, or -1 (TLS: the transport encrypts, always copy)."""
    if len(chunks) == 1 and type(chunks[0]) is bytes:
        writer.write(chunks[0])
        return
    if all(_immutable(c) for c in chunks):
        for chunk in chunks:
            writer.write(chunk)
        return
    sent = 0
    if fd >= 0 and writer.get_write_buffer_size() == 0:
        try:
            sent = os.writev(fd, chunks)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0  # (the transport reports the connection's end itself)
    for chunk in chunks:
        n = len(chunk) if type(chunk) is bytes else memoryview(chunk).nbytes
        if sent >= n:
            sent -= n
            continue
        rest = memoryview(chunk)[sent:] if sent else chunk
        sent = 0
        writer.write(rest if _immutable(rest) else bytes(rest))


def unacknowledged(sock: Any) -> int:
    """Bytes the kernel still holds for the peer on a TCP socket (queued or sent but not
    acknowledged: ``SIOCOUTQ``); 0 where it cannot tell."""
    try:
        import fcntl
        import termios

        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError, AttributeError, ImportError):
        return 0
    return int.from_bytes(raw, "little", signed=True)


class Linger:
    """How a closing TCP connection waits for its peer (see ``AsyncioLink.close_nowait``).

    Our CLOSE is out and our half is ending (a FIN after it).  The wait ends in order when the
    peer's half ends (its FIN: it parsed our CLOSE), or once the peer's kernel has acknowledged
    every byte we sent, the CLOSE included: the peer has everything, and learns of our close
    at its next receive -- or at its next send, since closing a socket that still receives
    resets the connection (what the peer's kernel holds for its application stays readable).
    So a producer that never reads stops our linger at once, and learns of it from the reset.

    While bytes are unacknowledged it waits, however long: a slow reader is waited for as long
    as its kernel answers.  Whether the peer is alive is the link's window watch's to judge
    (:mod:`aiordma._tcp.window`), or without keepalive the kernel's retransmission timeout --
    never a timer on progress.  Looks back off from 10 ms to 0.5 s."""

    def __init__(self) -> None:
        self.tick = 0.01

    def look(self, outstanding: int) -> bool:
        """Whether everything was delivered (``outstanding``: bytes not yet acknowledged)."""
        self.tick = min(self.tick * 2, 0.5)
        return outstanding == 0


def closing_failed(exc: BaseException) -> BrokenResourceError:
    """What a close raises when the peer may not have everything (its host died, it reset)."""
    err = BrokenResourceError(f"the connection broke before the peer had everything: {exc}")
    err.__cause__ = exc
    return err


_local = threading.local()


def receive_scratch() -> bytearray:
    """This thread's receive buffer, shared by the plain-socket connections its loops read
    (``Connection.share_receive_buffer``): a loop -- asyncio's, uvloop's, a trio run -- is one
    thread, and both links read and parse with nothing in between."""
    scratch: bytearray | None = getattr(_local, "scratch", None)
    if scratch is None:
        scratch = _local.scratch = bytearray(RECV_BUFFER_SIZE)
    return scratch
