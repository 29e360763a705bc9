"""Links that carry the aiordma protocol over byte transports, and opening one.

* :class:`AsyncioLink` -- an ``asyncio.BufferedProtocol`` on a TCP (or TLS)
  transport: the kernel's bytes are received straight into the protocol's
  buffer (``get_buffer``/``buffer_updated``), no ``StreamReader`` in between.
  Used under asyncio and uvloop by every front end.
* :class:`StreamLink` -- any ``anyio.abc.ByteStream``: trio's sockets (through
  anyio), TLS streams, the in-memory streams of :mod:`aiordma.testing`.  It
  pulls: a task that waits for data reads from the stream itself, so nothing
  runs in the background.

The links (``asyncio_link.py``, ``stream_link.py``) are the one boundary where OS and anyio
transport errors become the Core's error (and so ``BrokenResourceError`` on the anyio API).  Here:
:func:`open_tcp_link` (the link of the running event loop) and :func:`set_keepalive`; their
shared helpers are in ``common.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketAttribute

from .._conn.core import Link
from .._io.backends import asyncio_loop
from .._proto.protocol import Connection
from .asyncio_link import AsyncioLink
from .common import CLOSE_TIMEOUT, DEFAULT_KEEPALIVE, unacknowledged, write_chunks
from .stream_link import StreamLink, wrap_tls
from .window import WindowWatch

__all__ = ["AsyncioLink", "StreamLink", "CLOSE_TIMEOUT", "DEFAULT_KEEPALIVE", "set_keepalive", "open_tcp_link",
           "unacknowledged", "write_chunks"]

log = logging.getLogger("aiordma")


def set_keepalive(link: Link, seconds: float | None) -> bool:
    """Bound how long a dead peer host goes unnoticed on ``link``'s TCP connection.

    A crashed host, or a cable pulled, sends nothing: no FIN, no RST.  Idle, TCP would never
    notice; with unacknowledged bytes it retransmits for up to ~15 minutes.  So the socket gets
    keepalive probes (``TCP_KEEPIDLE`` + ``TCP_KEEPCNT`` x ``TCP_KEEPINTVL`` <= ``seconds`` - 1)
    and ``TCP_USER_TIMEOUT`` (bytes unacknowledged for ``seconds`` - 1 end the connection): the
    second left over covers the kernel's probe-interval granularity and a late timer.  An RDMA
    connection's TCP link carries no data but watches the connection: when it ends, the RDMA
    link fails too (with traffic the QP's own retries fail first, within about a second).
    The user timeout would also end a connection whose peer only stopped reading (its window
    closed): the link's :class:`~aiordma._tcp.window.WindowWatch` turns it off while that lasts
    and judges the peer by its kernel's answers instead.  ``None`` leaves the socket as the OS
    made it.  Returns whether it could be set (not on every platform or socket)."""
    if seconds is None:
        return False
    get = link.extra_attributes.get(SocketAttribute.raw_socket)
    sock = get() if get is not None else None
    if sock is None:
        return False
    import socket

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        # the kernel checks once per probe interval (1 s) and its timers run late on a busy host:
        # aim a second early, so that the connection has ended within ``seconds`` (measured
        # across two TCG guests: 5.56 s with the kernel's budget at the full 5 s)
        budget = max(1.0, seconds - 1.0) if seconds >= 2 else seconds
        total = max(2, int(budget))
        idle = max(1, total // 2)
        count = max(1, total - idle)  # probes one second apart after ``idle`` quiet seconds
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, count)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(budget * 1000)))
            if isinstance(link, (AsyncioLink, StreamLink)):
                # a peer whose window is closed is slow, not dead: see aiordma._tcp.window
                link.watch_window(sock, WindowWatch(budget))
    except (OSError, AttributeError, TypeError) as exc:  # (a socket wrapper without setsockopt)
        log.debug("aiordma: could not set TCP keepalive: %s", exc)
        return False
    return True
async def open_tcp_link(
    host: str, port: int, make_protocol: Callable[[float], Connection], *, ssl: Any = None,
    server_hostname: str | None = None, keepalive: float | None = None,
) -> Link:
    """Connect over TCP (TLS with ``ssl``): the link of this event loop (asyncio: an
    :class:`AsyncioLink`; trio: a :class:`StreamLink` on anyio's socket) with a Core on the
    protocol object ``make_protocol(now)`` makes, and ``keepalive`` set (:func:`set_keepalive`)."""
    link: Link
    loop = asyncio_loop()
    if loop is not None:
        proto = make_protocol(loop.time())
        _, link = await loop.create_connection(
            lambda: AsyncioLink(proto, loop), host, port, ssl=ssl,
            server_hostname=server_hostname if ssl is not None else None,
        )  # fmt: skip
    else:
        stream: ByteStream
        stream = await anyio.connect_tcp(host, port)
        if ssl is not None:
            try:
                stream = await wrap_tls(stream, server_side=False, ssl_context=ssl, hostname=server_hostname or host)
            except BaseException:
                await anyio.aclose_forcefully(stream)
                raise
        link = StreamLink(stream, make_protocol(anyio.current_time()))
    set_keepalive(link, keepalive)
    return link
