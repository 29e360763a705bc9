"""The ``rdma://`` listener, connector and backend (the ``distributed.comm.backends`` entry point)."""


from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import dask
import dask.config
from anyio.abc import SocketAttribute
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host
from distributed.utils import ensure_ip, get_ip

from .._api import Channel, ChannelListener, connect_channel, create_channel_listener
from .._errors import AuthenticationError, RDMAUnavailableError
from .._rdma.config import RdmaBackend
from .comm import PREFIX, RDMAComm, Settings, _CONNECTION_ERRORS, _TransportLog, _address_of, _check_encryption, _close_nowait, logger

__all__ = ["RDMABackend", "RDMAConnector", "RDMAListener"]


class RDMAConnector(Connector):
    def __init__(self, backend: RDMABackend) -> None:
        self._backend = backend

    async def connect(self, address: str, deserialize: bool = True, **connection_args: Any) -> RDMAComm:
        _check_encryption(address, connection_args)
        host, port = parse_host_port(address)
        settings = self._backend.settings()
        try:
            channel = await connect_channel(
                host,
                port,
                transport=settings.transport,
                max_message_size=settings.max_message_size,
                rdma_backend=self._backend.rdma_backend,
                auth=settings.auth,
            )
        except (RDMAUnavailableError, AuthenticationError) as exc:  # strict RDMA, a wrong key: retrying cannot help
            raise FatalCommClosedError(f"{PREFIX}{address}: {exc}") from exc
        except _CONNECTION_ERRORS as exc:
            raise CommClosedError(f"{PREFIX}{address}: {type(exc).__name__}: {exc}") from exc
        try:
            local = _address_of(channel, SocketAttribute.local_address)
        except BaseException:
            await channel.aclose()
            raise
        comm = RDMAComm(channel, local, PREFIX + address, deserialize, settings=settings)
        self._backend.transport_log.note(comm, "connection")
        return comm


class RDMAListener(BaseListener):
    """Listens for ``rdma://`` comms on an aiordma channel listener.

    As Dask's TCP listener, it takes the security arguments (``require_encryption`` refuses,
    since rdma:// does not encrypt) and ignores the others, ``handshake_overrides`` included."""

    prefix = PREFIX

    def __init__(
        self,
        backend: RDMABackend,
        address: str,
        comm_handler: Callable[[Comm], Awaitable[None] | None],
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ) -> None:
        super().__init__()
        _check_encryption(address, connection_args)
        self.ip, self.port = parse_host_port(address, default_port)
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._backend = backend
        self._listener: ChannelListener | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._settings: Settings | None = None
        self.bound_address: tuple[str, int] | None = None

    async def start(self) -> None:
        settings = self._settings = self._backend.settings()
        backlog = int(dask.config.get("distributed.comm.socket-backlog"))
        listener = await create_channel_listener(
            self.ip or None,
            self.port,
            transport=settings.transport,
            backlog=backlog,
            max_message_size=settings.max_message_size,
            rdma_backend=self._backend.rdma_backend,
            auth=settings.auth,
        )
        addresses = listener.addresses
        # listening on both IPv4 and IPv6: the IPv4 address first, as Dask's TCP listener
        ipv4 = [a for a in addresses if len(a) == 2]
        host, port = (ipv4 or addresses)[0][:2]
        self.bound_address = (str(host), int(port))
        self._listener = listener
        self._serve_task = asyncio.create_task(self._serve(listener))
        await asyncio.sleep(0)  # let it start: from now on cancelling it closes the listener

    async def _serve(self, listener: ChannelListener) -> None:
        try:
            await listener.serve(self._accepted)
        except asyncio.CancelledError:
            pass  # stop()
        except Exception:  # (the handler raises nothing: this is aiordma's listener failing)
            logger.exception("rdma://: the listener on %s failed", self.listen_address)
        finally:
            # (also when the loop shuts down and cancels this task: on asyncio, closing the
            # listener does not suspend, so it is done before the loop closes)
            await listener.aclose()

    async def _accepted(self, channel: Channel) -> None:
        """aiordma's handshake is done: hand the comm over (in a task of its own, so that
        ``stop()`` stops accepting and leaves the comms alone)."""
        settings = self._settings
        if self._serve_task is None or settings is None:
            # stopped meanwhile: close it, or the client would wait in Dask's handshake forever
            _close_nowait(channel)
            return
        try:
            local = _address_of(channel, SocketAttribute.local_address)
            peer = _address_of(channel, SocketAttribute.remote_address)
        except CommClosedError:
            _close_nowait(channel)
            return
        comm = RDMAComm(channel, local, peer, self.deserialize, settings=settings)
        comm.allow_offload = self.allow_offload
        self._backend.transport_log.note(comm, "accepted connection")
        task = asyncio.get_running_loop().create_task(self._handle(comm))
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    async def _handle(self, comm: RDMAComm) -> None:
        logger.debug("Incoming connection from %r to %r", comm.peer_address, self.contact_address)
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.info("Connection from %s closed before handshake completed", comm.peer_address)
            return
        except Exception:
            logger.exception("rdma://: the handshake with %s failed", comm.peer_address)
            comm.abort()
            return
        try:
            result = self.comm_handler(comm)
            if inspect.isawaitable(result):
                await result
        except Exception:
            logger.exception("rdma://: the handler of a comm from %s failed", comm.peer_address)

    def stop(self) -> asyncio.Task[None] | None:
        """Stop accepting (comms already handed out stay open).  The listening socket closes in
        the loop right after; the returned task is done once it did (``async with`` awaits it)."""
        task, self._serve_task = self._serve_task, None
        listener, self._listener = self._listener, None
        if task is None or listener is None:
            return None
        task.cancel()
        self._stopping = asyncio.get_running_loop().create_task(_close_listener(task, listener))
        return self._stopping

    def get_host_port(self) -> tuple[str, int]:
        """The listening address as a ``(host, port)`` tuple."""
        if self.bound_address is None:
            raise ValueError("invalid operation on non-started RDMAListener")
        return self.bound_address

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)  # type: ignore[no-untyped-call]
        return self.prefix + unparse_host_port(host, port)


async def _close_listener(serve: asyncio.Task[None], listener: ChannelListener) -> None:
    await asyncio.wait({serve})  # (it closes the listener as it ends ...
    await listener.aclose()  # ... unless it was cancelled before it started: idempotent)


class RDMABackend(Backend):
    """The ``rdma://`` backend (what the ``distributed.comm.backends`` entry point loads).

    ``transport`` overrides the config key ``distributed.comm.rdma.transport``;
    ``rdma_backend`` is handed to aiordma (``aiordma.RdmaBackend``: RDMA sizes and timeouts,
    or a simulated fabric in tests)."""

    def __init__(self, *, transport: str | None = None, rdma_backend: RdmaBackend | None = None) -> None:
        self.transport = transport
        self.rdma_backend = rdma_backend
        self.transport_log = _TransportLog()

    def settings(self) -> Settings:
        return Settings.from_config(self.transport)

    # I/O

    def get_connector(self) -> RDMAConnector:
        return RDMAConnector(self)

    def get_listener(
        self, loc: str, handle_comm: Callable[[Comm], Any], deserialize: bool, **connection_args: Any
    ) -> RDMAListener:
        return RDMAListener(self, loc, handle_comm, deserialize, **connection_args)

    # Address handling (IP addresses, as tcp://)

    def get_address_host(self, loc: str) -> str:
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> tuple[str, int]:
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc: str) -> str:
        host, _port = parse_host_port(loc)
        return unparse_host_port(get_ip(ensure_ip(host)), None)  # type: ignore[no-untyped-call]
