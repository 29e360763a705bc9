"""The ``rdma://`` comm: one Dask ``Comm`` on one aiordma message channel (see :mod:`aiordma._dask`)."""


from __future__ import annotations

import asyncio
import logging
import sys
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import dask
import dask.config
from dask.utils import parse_bytes
from distributed.comm.addressing import unparse_host_port
from distributed.comm.core import Comm, CommClosedError
from distributed.comm.utils import from_frames, to_frames

from .._api import Channel, core_of
from .._attributes import TransportAttribute
from .._errors import AiordmaError
from .._conn.memory import RegisteredMemory, register
from .._conn.nowait import Nowait, NowaitLink
from .._handshake.negotiate import resolve_transport
from .._errors import MemlockLimitError
from .framing import MIN_MESSAGE_SIZE, RDMA_PIECE, TCP_PIECE, _FramingError, decode_head, encode

__all__ = ["RDMAComm", "Settings"]

logger = logging.getLogger("distributed.comm.rdma")

PREFIX = "rdma://"

_DEFAULTS: dict[str, Any] = {
    "transport": None, "max-message-size": "16 MiB", "register-threshold": "1 MiB", "auth": None,
}  # fmt: skip
dask.config.update_defaults({"distributed": {"comm": {"rdma": dict(_DEFAULTS)}}})

#: what ends a connection: mapped to CommClosedError (OSError covers timeouts and refusals)
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    AiordmaError,
    OSError,
)




@dataclass(frozen=True)
class Settings:
    """The Dask config of the backend, read when a connection or listener is made."""

    transport: str | None
    max_message_size: int
    register_threshold: int  # 0: never register
    auth: str | None = None  # the handshake's pre-shared key (None: $AIORDMA_AUTH, if set)

    @classmethod
    def from_config(cls, transport: str | None = None) -> Settings:
        def get(key: str) -> Any:
            return dask.config.get(f"distributed.comm.rdma.{key}", _DEFAULTS[key])

        if transport is None:
            value = get("transport")
            transport = None if value is None else str(value).strip().lower() or None
        max_message_size = max(MIN_MESSAGE_SIZE, _parse_size(get("max-message-size")))
        threshold = get("register-threshold")
        register_threshold = 0 if threshold is False or threshold is None else _parse_size(threshold)
        auth = get("auth")
        return cls(transport, max_message_size, register_threshold, None if auth in (None, "") else str(auth))


def _parse_size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        return value
    return int(parse_bytes(value))


def _check_encryption(address: str, connection_args: dict[str, Any]) -> None:
    """As Dask's TCP backend: rdma:// does not encrypt, so a security policy that demands it refuses."""
    if connection_args.get("require_encryption"):
        raise RuntimeError(
            f"encryption required by Dask configuration, refusing communication from/to {PREFIX + address!r}"
        )


def _address_of(channel: Channel, attribute: Any) -> str:
    address = channel.extra(attribute, None)
    if not isinstance(address, tuple) or len(address) < 2:
        raise CommClosedError(f"the connection has no {attribute} address")
    return PREFIX + unparse_host_port(str(address[0]), int(address[1]))


def _close_nowait(channel: Channel) -> None:
    """Release a channel without waiting (``Comm.abort`` is synchronous): CLOSE is queued and the
    link closes in the background, as ``aiordma.asyncio``'s ``StreamWriter.close()`` does."""
    core = core_of(channel)
    if core.closed:
        return
    try:
        Nowait(core).close()
    except Exception as exc:  # no running loop (a finalizer at shutdown): nothing more to do
        logger.debug("rdma://: could not close a connection without waiting: %r", exc)


async def _wait_released(channel: Channel) -> None:
    """Wait until the teardown :func:`_close_nowait` started is done."""
    core = core_of(channel)
    if isinstance(core.link, NowaitLink):  # (else aclose() released it: nothing to wait for)
        await Nowait(core).wait_closed()


def _peer_gone(channel: Channel) -> bool:
    """The connection ended (the peer closed it, or it broke) and nothing is left to read."""
    core = core_of(channel)
    return (core.closed or core.peer_close is not None or core.error is not None) and not core.messages


class _TransportLog:
    """Logs the transport of new comms, once per fallback reason (later ones at DEBUG).

    A fallback under ``transport="auto"`` is a WARNING: the comm works, but not over RDMA (and
    ``LocalCluster`` shows only warnings by default).  ``transport="tcp"`` was asked for: INFO."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._rdma_seen = False

    def note(self, comm: RDMAComm, side: str) -> None:
        if comm.transport == "rdma":
            level = logging.DEBUG if self._rdma_seen else logging.INFO
            self._rdma_seen = True
            logger.log(
                level,
                "rdma:// %s %s -> %s carries its data over RDMA (device %s)",
                side,
                comm.local_address,
                comm.peer_address,
                comm.extra_info.get("device"),
            )
            return
        reason = comm.fallback_reason
        if reason in self._seen:
            level = logging.DEBUG
        else:
            self._seen.add(reason)
            level = logging.INFO if resolve_transport(comm.settings.transport) == "tcp" else logging.WARNING
        logger.log(
            level,
            "rdma:// %s %s -> %s fell back to TCP: %s%s",
            side,
            comm.local_address,
            comm.peer_address,
            reason,
            "" if level == logging.DEBUG else " (further connections for this reason are logged at DEBUG)",
        )


@contextmanager
def _comm_errors(comm: RDMAComm, what: str) -> Iterator[None]:
    """The one boundary: a connection error becomes CommClosedError; anything else in the middle
    of a read or write aborts the comm and propagates (what went over the wire is unknown)."""
    try:
        yield
    except _CONNECTION_ERRORS as exc:
        comm.abort()
        raise CommClosedError(f"in {comm!r}: {what}: {type(exc).__name__}: {exc}") from exc
    except _FramingError as exc:
        comm.abort()
        raise CommClosedError(f"in {comm!r}: {what}: {exc}") from exc
    except BaseException:
        comm.abort()
        raise




class RDMAComm(Comm):
    """An established ``rdma://`` comm: one aiordma message channel (see the module docs)."""

    max_shard_size: ClassVar[int] = int(parse_bytes(dask.config.get("distributed.comm.shard")))

    def __init__(
        self,
        channel: Channel,
        local_addr: str,
        peer_addr: str,
        deserialize: bool = True,
        *,
        settings: Settings,
    ) -> None:
        self._closed = False
        self._channel: Channel | None = channel
        super().__init__(deserialize=deserialize)
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self.settings = settings
        self._read_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        #: messages written and not sent yet, and the task that sends them (see ``write``)
        self._outbox: deque[tuple[bytes, list[memoryview]]] = deque()
        self._sender: asyncio.Task[None] | None = None
        #: why a background send failed
        self._error: CommClosedError | None = None
        #: the channel abort() released (a later close() waits until its teardown is done)
        self._aborted: Channel | None = None
        self._extra: dict[str, Any] = {
            "transport": channel.transport,
            "fallback_reason": channel.fallback_reason,
        }
        for key, attribute in (("device", TransportAttribute.device), ("qp_num", TransportAttribute.qp_num)):
            value = channel.extra(attribute, None)
            if value is not None:
                self._extra[key] = value
        #: the size of the messages a large frame travels in: over TCP pieces of a size the
        #: protocol buffers cheaply; over RDMA large ones (each a rendezvous), two of which fit
        #: in the default staging budget, so that staging the next overlaps the peer's READ
        peer_max = int(channel.extra(TransportAttribute.peer_max_message_size, MIN_MESSAGE_SIZE))
        #: from this size on our messages go by rendezvous (None: never, as over TCP)
        self._rendezvous: int | None = None
        if channel.transport == "rdma":
            rndv = core_of(channel).rndv_min
            if rndv <= peer_max:  # (else the rendezvous is off, or no piece could reach it)
                self._rendezvous = rndv
            piece = max(RDMA_PIECE, self._rendezvous or 0)
        else:
            piece = TCP_PIECE
        self._piece = min(piece, peer_max)
        self._finalizer = weakref.finalize(self, _finalize_dangling, channel, repr(self))
        self._finalizer.atexit = False

    # -- properties -------------------------------------------------------------------------

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def transport(self) -> str:
        """``"rdma"`` or ``"tcp"``: what carries this comm's data."""
        return str(self._extra["transport"])

    @property
    def fallback_reason(self) -> str:
        """Why this comm runs over TCP (``""`` over RDMA)."""
        return str(self._extra["fallback_reason"])

    @property
    def extra_info(self) -> dict[str, Any]:
        return dict(self._extra)

    def closed(self) -> bool:
        if self._closed:
            return True
        channel = self._channel
        if channel is None or _peer_gone(channel):
            self.abort()  # release it now: whoever asks may drop the comm without closing it
            return True
        return False

    # -- I/O --------------------------------------------------------------------------------

    def _open_channel(self) -> Channel:
        channel = self._channel
        if self._closed or channel is None:
            if self._error is not None:
                raise CommClosedError(f"{self!r} is closed: {self._error}")
            raise CommClosedError(f"{self!r} is closed")
        return channel

    async def write(self, msg: Any, serializers: Any = None, on_error: str | None = "message") -> int:
        """Serialize ``msg`` and send it; returns the bytes it takes on the wire.

        As with Dask's TCP comm (whose writes go to Tornado's unbounded buffer), a write does not
        wait for the peer to read: a message with frames of their own goes to this comm's
        *outbox*, which a task sends in order.  A small message (a head alone) goes at once when
        the outbox is empty.  An error while sending in the background aborts the comm; the next
        ``read``/``write`` raises ``CommClosedError``."""
        self._open_channel()
        frames = await to_frames(  # type: ignore[no-untyped-call]
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
            frame_split_size=self.max_shard_size,
        )
        head, separate = encode(frames, self._rendezvous)
        total = len(head) + sum(view.nbytes for view in separate)
        if not separate and self._sender is None:
            async with self._write_lock:
                if self._sender is None:  # (still nothing queued ahead of it)
                    channel = self._open_channel()
                    with _comm_errors(self, "write"):
                        await channel.send(head)
                    return total
        self._open_channel()
        self._outbox.append((head, separate))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send_outbox())
        return total

    async def _send_outbox(self) -> None:
        """Send the queued messages in order (one task per comm while there are any)."""
        outbox = self._outbox
        try:
            while outbox:
                head, separate = outbox[0]
                async with self._write_lock:
                    channel = self._channel
                    if channel is None or self._closed:
                        break
                    with _comm_errors(self, "write"):
                        await channel.send(head)
                        limit = self._piece
                        for view in separate:
                            for pos in range(0, view.nbytes, limit):
                                await channel.send(view[pos : pos + limit])  # type: ignore[arg-type]  # (any bytes-like)
                outbox.popleft()
        except CommClosedError as exc:  # the comm is aborted: the next read or write says why
            self._error = exc
        except Exception as exc:  # (a bug: nobody awaits this task) -- the comm is aborted
            logger.exception("rdma://: sending on %r failed", self)
            self._error = CommClosedError(f"sending failed: {exc!r}")
        finally:
            self._sender = None
            if self._closed:
                outbox.clear()

    async def read(self, deserializers: Any = None) -> Any:
        self._open_channel()
        async with self._read_lock:
            channel = self._open_channel()
            with _comm_errors(self, "read"):
                plan = decode_head(await channel.receive(), self.settings.register_threshold)
                for target, reg in plan.pending:
                    await self._receive_frame(channel, target, reg)
        try:
            return await from_frames(  # type: ignore[no-untyped-call]
                plan.frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError:
            self.abort()  # frames garbled or truncated
            raise CommClosedError("aborted stream on truncated data") from None

    async def _receive_frame(self, channel: Channel, target: memoryview, reg: bool) -> None:
        """Fill ``target`` with the next messages (a frame may come in pieces).

        Over RDMA with ``reg``, ``target`` is registered for the time of the receive: the
        rendezvous READs land in it with no copy (over TCP registering would buy nothing)."""
        memory: RegisteredMemory | None = None
        if reg and channel.transport == "rdma":
            memory = register(target)
        try:
            pos = 0
            n = target.nbytes
            while pos < n:
                try:
                    got = await channel.receive_into(target[pos:])
                except MemlockLimitError as exc:  # over the pinned limit: stage it (the message stays queued)
                    if memory is None:
                        raise
                    logger.info("rdma://: %s; receiving through the connection's staging regions", exc)
                    memory.close()
                    memory = None
                    continue
                if not got:
                    raise _FramingError("an empty message in the middle of a frame")
                pos += got
        finally:
            if memory is not None:
                try:
                    memory.close()
                except AiordmaError as exc:  # (BufferBusyError: the NIC still has it; it stays registered)
                    logger.warning("rdma://: releasing a receive buffer's registration: %s", exc)

    # -- closing ----------------------------------------------------------------------------

    async def close(self) -> None:
        """Close in order: send what was written, then CLOSE (bounded by aiordma), and release
        the connection.  Cancelled, it aborts.  After ``abort()`` it waits for the teardown that
        started (over RDMA it goes on in a task)."""
        sender = self._sender
        if sender is not None and not self._closed:
            try:
                await asyncio.wait({sender})  # (it catches connection errors itself)
            except BaseException:
                self.abort()
                raise
        self._closed = True
        channel, self._channel = self._channel, None
        try:
            if channel is not None:
                self._finalizer.detach()
                await channel.aclose()
            elif self._aborted is not None:  # aborted: wait for the teardown it started
                await _wait_released(self._aborted)
        except Exception as exc:  # nothing to report to Dask: the comm is closed either way
            logger.debug("rdma://: closing %r: %r", self, exc)

    def abort(self) -> None:
        """Close now, without waiting (the CLOSE frame and the link's teardown go on in the loop);
        what the outbox still held is dropped."""
        self._closed = True
        self._outbox.clear()
        sender = self._sender
        if sender is not None and sender is not _current_task():
            sender.cancel()
        channel, self._channel = self._channel, None
        if channel is not None:
            self._finalizer.detach()
            _close_nowait(channel)
            self._aborted = channel


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None


def _finalize_dangling(channel: Channel, description: str) -> None:
    if sys.is_finalizing() or core_of(channel).closed:
        return
    logger.warning("Closing dangling comm in %s", description)
    _close_nowait(channel)

