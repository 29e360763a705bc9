"""grpclib over aiordma: a gRPC client channel and server start on aiordma's asyncio Transports.

grpclib (pure-Python gRPC over HTTP/2 for asyncio) opens its connections with
``loop.create_connection`` and ``loop.create_server``; these two helpers make it use
:func:`aiordma.asyncio.create_connection` and :func:`aiordma.asyncio.create_server` instead, so
the HTTP/2 frames travel over RDMA where both sides can, over TCP otherwise (and say why)::

    from grpclib.server import Server
    import aiordma.grpc

    server = Server([Greeter()])
    await aiordma.grpc.start_server(server, "0.0.0.0", 50051)      # instead of server.start(...)
    ...
    async with aiordma.grpc.Channel("10.0.0.1", 50051) as channel:  # instead of grpclib's Channel
        stub = GreeterStub(channel)
        reply = await stub.SayHello(HelloRequest(name="you"))

Both ends must use aiordma (the connection starts with aiordma's handshake, not HTTP/2); a plain
gRPC client cannot talk to this server.  grpclib has no public hook for its transport: the
helpers set what ``Server.start`` and ``Channel._create_connection`` would (checked against
grpclib 0.4).  Needs ``pip install aiordma[grpc]``.
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
from typing import Any

try:
    from grpclib.client import Channel as _GrpclibChannel
    from grpclib.server import Server
except ImportError as _exc:  # pragma: no cover - depends on the install
    raise ImportError(f"aiordma.grpc needs grpclib: pip install 'aiordma[grpc]' ({_exc})") from _exc

from . import asyncio as _aa
from ._proto.protocol import DEFAULT_HANDSHAKE_TIMEOUT
from ._rdma.config import RdmaBackend

__all__ = ["Channel", "start_server"]


class Channel(_GrpclibChannel):
    """grpclib's ``Channel`` whose connection is an aiordma connection.

    Arguments as grpclib's (``host``, ``port``, ``codec``, ``ssl``, ``config``...), plus
    aiordma's ``transport`` (None/"auto", "rdma" strict, "tcp"), ``handshake_timeout``,
    ``rdma_backend`` and ``auth`` (the handshake's pre-shared key).  After the first call, :attr:`aiordma_transport` and
    :attr:`aiordma_fallback_reason` tell what carries it.
    """

    def __init__(self, host: str | None = None, port: int | None = None, *, transport: str | None = None,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT, rdma_backend: RdmaBackend | None = None,
                 auth: str | bytes | bool | None = None, **kwargs: Any) -> None:  # fmt: skip
        if kwargs.get("path") is not None:
            raise ValueError("aiordma.grpc.Channel connects to a host and port, not a unix socket path")
        super().__init__(host, port, **kwargs)
        self._aiordma_transport = transport
        self._aiordma_timeout = handshake_timeout
        self._aiordma_backend = rdma_backend
        self._aiordma_auth = auth
        self._aiordma_tr: Any = None

    async def _create_connection(self) -> Any:
        ssl: Any = self._ssl
        transport, protocol = await _aa.create_connection(
            self._protocol_factory,
            self._host,
            self._port,
            transport=self._aiordma_transport,
            ssl=ssl,
            server_hostname=self._config.ssl_target_name_override if ssl is not None else None,
            handshake_timeout=self._aiordma_timeout,
            rdma_backend=self._aiordma_backend,
            auth=self._aiordma_auth,
        )
        self._aiordma_tr = transport
        return protocol

    @property
    def aiordma_transport(self) -> str | None:
        """``"rdma"`` or ``"tcp"`` once connected, else None."""
        return None if self._aiordma_tr is None else str(self._aiordma_tr.get_extra_info("aiordma_transport"))

    @property
    def aiordma_fallback_reason(self) -> str | None:
        return None if self._aiordma_tr is None else str(self._aiordma_tr.get_extra_info("aiordma_fallback_reason"))


async def start_server(server: Server, host: str | None = None, port: int | None = None, *,
                       transport: str | None = None, ssl: _ssl.SSLContext | None = None, backlog: int = 100,
                       handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                       rdma_backend: RdmaBackend | None = None,
                       auth: str | bytes | bool | None = None) -> _aa.Server:  # fmt: skip
    """Start grpclib's ``server`` on aiordma (what ``await server.start(host, port)`` does, on
    :func:`aiordma.asyncio.create_server`).  Returns the listening :class:`aiordma.asyncio.Server`
    (for ``sockets``); stop with grpclib's ``server.close()`` and ``await server.wait_closed()``."""
    if getattr(server, "_server", None) is not None:
        raise RuntimeError("Server is already started")
    listening = await _aa.create_server(
        server._protocol_factory,  # (what Server.start passes to loop.create_server)
        host,
        port,
        transport=transport,
        ssl=ssl,
        backlog=backlog,
        handshake_timeout=handshake_timeout,
        rdma_backend=rdma_backend,
        auth=auth,
    )
    server._server = listening
    server._server_closed_fut = asyncio.get_running_loop().create_future()
    return listening
