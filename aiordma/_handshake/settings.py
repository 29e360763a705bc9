"""The connection settings of aiordma's eight entry points, one object each.

``aiordma.connect``/``connect_channel`` and ``aiordma.asyncio.open_connection``/
``create_connection`` take the settings of a client (:class:`ClientSettings`);
``aiordma.create_listener``/``create_channel_listener`` and ``aiordma.asyncio.start_server``/
``create_server`` those of a listener (:class:`ListenerSettings`).  Their public signatures spell
the settings out as keyword arguments (what an IDE shows and a user types); each entry point hands
them over at once -- ``ClientSettings.of(locals())`` -- and from there one object carries them:
checked once, defaulted once (``tests/test_settings.py`` holds the eight signatures to these
classes: the same names, the same defaults), turned into the handshake's :class:`Options` and the
listener's admission in one place.
"""

from __future__ import annotations

import ssl as _ssl
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Self

from .._proto.admission import DEFAULT_BACKLOG, DEFAULT_HELLO_TIMEOUT
from .._proto.protocol import DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_MESSAGE_SIZE, Mode
from .._rdma.config import RdmaBackend
from .._tcp.accept import Acceptor
from .._tcp.links import DEFAULT_KEEPALIVE
from .limits import DEFAULT_MAX_HANDSHAKES, ListenerBudget
from .negotiate import Options, local_offer, make_options

__all__ = ["ClientSettings", "ListenerSettings", "listen"]

class _Settings:
    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Self:
        """The settings among an entry point's arguments (its ``locals()``), by name."""
        return cls(**{f.name: arguments[f.name] for f in fields(cls) if f.name in arguments})  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class ClientSettings(_Settings):
    """What a client sets (the keyword arguments of ``aiordma.connect``)."""

    transport: str | None = None
    ssl: _ssl.SSLContext | bool | None = None
    server_hostname: str | None = None
    #: the largest message this side accepts (channels; a byte stream's frames: the default)
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    rdma_backend: RdmaBackend | None = None
    auth: str | bytes | bool | None = None
    keepalive: float | None = DEFAULT_KEEPALIVE
    #: offer to hand a byte stream's TCP connection to the user's protocol after the handshake
    #: (``aiordma.asyncio.create_connection``: see ``State.PASSED_THROUGH``)
    pass_through: bool = False

    def options(self) -> Options:
        """Checked (``ValueError``: a setting out of range), as the handshake takes them."""
        return replace(make_options(
            self.transport, self.ssl, self.server_hostname, self.max_message_size, self.handshake_timeout,
            server=False, backend=self.rdma_backend, auth=self.auth, keepalive=self.keepalive,
        ), pass_through=self.pass_through)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ListenerSettings(_Settings):
    """What a listener sets (the keyword arguments of ``aiordma.create_listener``); admission:
    see :mod:`aiordma._proto.admission`, the RDMA budget: :mod:`aiordma._handshake.limits`."""

    transport: str | None = None
    ssl: _ssl.SSLContext | None = None
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    rdma_backend: RdmaBackend | None = None
    auth: str | bytes | bool | None = None
    keepalive: float | None = DEFAULT_KEEPALIVE
    backlog: int = DEFAULT_BACKLOG
    max_handshakes: int = DEFAULT_MAX_HANDSHAKES
    max_handshakes_per_address: int | None = None
    hello_timeout: float = DEFAULT_HELLO_TIMEOUT
    max_rdma_connections: int | None = None
    max_pinned_bytes: int | None = None
    #: as :attr:`ClientSettings.pass_through` (``aiordma.asyncio.create_server``)
    pass_through: bool = False

    def __post_init__(self) -> None:
        per_address = self.max_handshakes_per_address
        if self.backlog < 1 or self.max_handshakes < 1 or (per_address is not None and per_address < 1):
            raise ValueError("backlog, max_handshakes and max_handshakes_per_address must be at least 1")
        if not self.hello_timeout > 0:
            raise ValueError("hello_timeout must be a positive number of seconds")

    def options(self) -> Options:
        """Checked, as the handshake takes them, with a budget of this listener's own."""
        return replace(make_options(
            self.transport, self.ssl, None, self.max_message_size, self.handshake_timeout, server=True,
            backend=self.rdma_backend, auth=self.auth, keepalive=self.keepalive,
            budget=ListenerBudget(self.max_rdma_connections, self.max_pinned_bytes),
        ), pass_through=self.pass_through)  # fmt: skip


async def listen(host: str | None, port: int, mode: Mode, settings: ListenerSettings) -> tuple[Acceptor, Options]:
    """Bind and listen (``port`` 0: any free port): the acceptor, and the options its handshakes
    run with.  The strict policy (``transport="rdma"``) fails here, before binding, when this host
    cannot do RDMA."""
    opts = settings.options()
    local_offer(opts.transport, "server", tls=opts.ssl is not None, backend=opts.backend)
    acceptor = await Acceptor.create(
        host, port, mode, opts, backlog=settings.backlog, max_handshakes=settings.max_handshakes,
        per_address=settings.max_handshakes_per_address, hello_timeout=settings.hello_timeout,
    )  # fmt: skip
    return acceptor, opts
