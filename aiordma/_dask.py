"""A Dask distributed comm backend for the ``rdma://`` scheme, on aiordma message channels.

``pip install 'aiordma[dask]'`` registers it through the ``distributed.comm.backends`` entry
point, so ``rdma://host:port`` works wherever Dask takes an address::

    LocalCluster(protocol="rdma://")
    dask scheduler --protocol rdma
    dask worker rdma://10.0.0.1:8786

Every comm is one aiordma message channel: RDMA when both hosts can (and the address is one an
RDMA device serves), otherwise TCP, as with every aiordma connection.  A process logs (logger
``distributed.comm.rdma``) the first connection that falls back for each reason, with the
reason: a WARNING under ``transport="auto"``, INFO when TCP was asked for; the later ones at
DEBUG.  ``comm.transport``, ``comm.fallback_reason`` and ``comm.extra_info`` tell each comm's.

Writes do not wait for the peer to read (as over Dask's TCP comm, whose writes go to Tornado's
unbounded buffer): a message with frames of their own goes to the comm's outbox, which one task
per comm sends in order.

Framing
-------
Dask serializes a message into frames (:func:`distributed.comm.utils.to_frames`).  On the
channel a message is:

1. a *head* message: ``HEAD`` (magic, number of frames, ``nosplit``), the frames' lengths
   (``<Q`` each), one flag byte per frame (``INLINE``: its bytes follow in the head;
   ``SEPARATE``: it follows in messages of its own; ``RENDEZVOUS``: the same, and they go by
   rendezvous), then the bytes of the inline frames.  Small frames (up to ``INLINE_FRAME_MAX``, while the head stays
   within ``INLINE_MAX``) go inline: a small Dask message is one aiordma message.
2. then every other frame, in order, in pieces: of ``TCP_PIECE`` (256 KiB) over TCP, where
   aiordma's framing handles such messages fastest; over RDMA of ``RDMA_PIECE`` (8 MiB) or the
   link's rendezvous threshold (``RdmaConfig.rendezvous``) if larger, so that each piece is
   one rendezvous; never more than the peer's ``max_message_size``.  Empty frames send nothing.

The receiver allocates each frame's buffer (``distributed.protocol.utils.host_array``: writable,
as Dask's TCP comm gives) and ``receive_into``\\s it, so a large frame lands in its final place.
Over RDMA a message of ``RdmaConfig.rendezvous`` bytes or more goes by rendezvous (the sender
stages it once, the receiver's NIC READs it); a frame that comes so (``RENDEZVOUS``) and has
``register-threshold`` bytes or more is received into a buffer registered for that frame alone,
so the READs land in it with no copy on the receiving side.  ``nosplit`` mirrors Dask's TCP comm: the first frames (the header and
the first uncompressed buffer, when the header is small) share one buffer, the others each get
their own, so that a long-lived numpy array does not keep other frames' memory alive.

Errors
------
Anything that ends the connection -- anyio's ``BrokenResourceError`` / ``ClosedResourceError`` /
``EndOfStream``, aiordma's errors, ``OSError`` (timeouts included), a malformed head -- becomes
:class:`~distributed.comm.core.CommClosedError` at one place, :func:`_comm_errors`, and the comm
is aborted.  ``transport="rdma"`` on a host or with a peer that cannot do RDMA is a
:class:`~distributed.comm.core.FatalCommClosedError` on connect (retrying cannot help).  Any
other exception (a cancellation included) in the middle of a read or write aborts the comm too,
as in Dask's TCP comm: what was already sent or read is unknown.

Configuration (Dask config, read when a comm or listener is made; in the environment e.g.
``DASK_DISTRIBUTED__COMM__RDMA__TRANSPORT=tcp``)
-----------------------------------------------------------------------------------------
``distributed.comm.rdma.transport``
    ``"auto"``, ``"rdma"`` (strict) or ``"tcp"``; ``None`` (the default): aiordma's default,
    ``$AIORDMA_TRANSPORT`` or else ``"auto"``.
``distributed.comm.rdma.auth``
    The pre-shared key of aiordma's handshake authentication (``None``, the default:
    ``$AIORDMA_AUTH`` if set, else none).  A connect refused for its key is a
    ``FatalCommClosedError``.
``distributed.comm.rdma.max-message-size``
    The largest aiordma message this side accepts (default 16 MiB, at least 1 MiB); it bounds
    the pieces the peer sends large frames in, never the frames.
``distributed.comm.rdma.register-threshold``
    Over RDMA, frames of at least this size that come by rendezvous are received into
    registered memory (default 1 MiB; ``False`` or 0: never, the READs are staged through the
    connection's regions instead).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import struct
import sys
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import dask
import dask.config
from anyio.abc import SocketAttribute
from dask.utils import parse_bytes
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector, FatalCommClosedError
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, ensure_memoryview, get_ip

from ._api import Channel, ChannelListener, connect_channel, create_channel_listener
from ._attributes import TransportAttribute
from ._errors import AiordmaError, AuthenticationError, RDMAUnavailableError
from ._memory import RegisteredMemory, register
from ._negotiate import resolve_transport
from ._rdma.config import RdmaBackend
from ._rdma.mempool import MemlockLimitError

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener"]

logger = logging.getLogger("distributed.comm.rdma")

PREFIX = "rdma://"

#: magic (4 bytes: b"aDk" and the format version), number of frames, nosplit
HEAD = struct.Struct("<4sII")
MAGIC = b"aDk\x01"
#: a frame of at most this many bytes may travel inside the head message ...
INLINE_FRAME_MAX = 64 << 10
#: ... while the inline bytes of one head stay within this
INLINE_MAX = 64 << 10
#: a frame larger than this travels in messages of this size: over TCP ...
TCP_PIECE = 256 << 10
#: ... and over RDMA (at most the peer's ``max_message_size`` either way)
RDMA_PIECE = 8 << 20
#: the smallest ``max-message-size`` accepted (a head with its inline frames must fit)
MIN_MESSAGE_SIZE = 1 << 20

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
    core = channel._core
    if core.closed:
        return
    final = core.begin_close()
    try:
        core.link.close_nowait(final)
    except Exception as exc:  # no running loop (a finalizer at shutdown): nothing more to do
        logger.debug("rdma://: could not close a connection without waiting: %r", exc)


async def _wait_released(channel: Channel) -> None:
    """Wait until the teardown :func:`_close_nowait` started is done."""
    try:
        await channel._core.link.wait_closed()
    except NotImplementedError:  # (a link without the asyncio stream API: nothing to wait for)
        pass


def _peer_gone(channel: Channel) -> bool:
    """The connection ended (the peer closed it, or it broke) and nothing is left to read."""
    core = channel._core
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


class _FramingError(Exception):
    """The peer's messages do not follow the framing (not an rdma:// comm, or a bug)."""


def _nosplit(frames: Sequence[Any], sizes: Sequence[int]) -> int:
    """How many leading frames share one receive buffer: Dask's TCP rule (the pickled header and
    the first uncompressed buffer with its shards, as long as the header is small)."""
    count = 0
    nosplit_bytes = 0
    first: object = None
    for frame, nb in zip(frames, sizes):
        buffer = frame.obj if isinstance(frame, memoryview) else frame
        if not isinstance(buffer, bytes):  # an uncompressed buffer the deserialized object keeps
            if first is None:
                if nosplit_bytes > max(2048, nb * 0.05):
                    break
                first = buffer
            elif first is not buffer:
                break
        nosplit_bytes += nb
        count += 1
    return count


#: the flag byte of a frame in the head
SEPARATE, INLINE, RENDEZVOUS = 0, 1, 2


def encode(frames: Sequence[Any], rendezvous: int | None = None) -> tuple[bytes, list[memoryview]]:
    """The head message and the frames that follow it, each as a flat byte view.

    ``rendezvous``: over RDMA, the size from which this side's messages go by rendezvous: a
    frame whose first piece does is flagged so, and the receiver may register its buffer."""
    views = [ensure_memoryview(f) if not isinstance(f, bytes) else f for f in frames]
    sizes = [len(v) if isinstance(v, bytes) else v.nbytes for v in views]
    n = len(views)
    flags = bytearray(n)
    inline: list[bytes | memoryview] = []
    separate: list[memoryview] = []
    inline_bytes = 0
    for i, (view, nb) in enumerate(zip(views, sizes)):
        if nb <= INLINE_FRAME_MAX and inline_bytes + nb <= INLINE_MAX:
            flags[i] = INLINE
            inline_bytes += nb
            if nb:
                inline.append(view)
        else:
            flags[i] = RENDEZVOUS if rendezvous is not None and nb >= rendezvous else SEPARATE
            separate.append(view if isinstance(view, memoryview) else memoryview(view))
    head = b"".join([HEAD.pack(MAGIC, n, _nosplit(frames, sizes)), struct.pack(f"<{n}Q", *sizes), flags, *inline])
    return head, separate


@dataclass
class _Plan:
    """What a head announced: the frames (inline ones filled in) and the buffers still to fill."""

    frames: list[Any]
    #: (buffer to receive into, whether to register it) in the order the sender sends them
    pending: list[tuple[memoryview, bool]]


def decode_head(head: bytes, register_threshold: int) -> _Plan:
    """Parse a head message; allocate every frame's buffer and copy the inline frames in."""
    view = memoryview(head)
    if view.nbytes < HEAD.size:
        raise _FramingError(f"a head message of {view.nbytes} bytes is too short")
    magic, n, nosplit = HEAD.unpack_from(view)
    if magic != MAGIC:
        raise _FramingError(f"not an rdma:// comm message (magic {bytes(magic)!r})")
    fixed = HEAD.size + 9 * n
    if view.nbytes < fixed or nosplit > n:
        raise _FramingError("a malformed head message")
    sizes = struct.unpack_from(f"<{n}Q", view, HEAD.size)
    flags = view[HEAD.size + 8 * n : fixed]
    if any(flag > RENDEZVOUS for flag in flags):
        raise _FramingError("a head message with an unknown frame flag")
    inline_end = fixed + sum(nb for nb, flag in zip(sizes, flags) if flag == INLINE)
    if inline_end != view.nbytes:
        raise _FramingError("a head message whose inline frames do not add up")
    frames: list[Any] = []
    pending: list[tuple[memoryview, bool]] = []
    pos = fixed
    # the first `nosplit` frames share one buffer (the header with the first numpy buffer and its
    # shards, as Dask's TCP comm reads them); the others each get their own
    shared_size = sum(sizes[:nosplit])
    shared = host_array(shared_size) if shared_size else None
    shared_pos = 0
    for i, (nb, flag) in enumerate(zip(sizes, flags)):
        if i < nosplit and shared is not None:
            target = shared[shared_pos : shared_pos + nb]
            shared_pos += nb
        else:
            target = host_array(nb)
        if flag == INLINE:
            target[:] = view[pos : pos + nb]
            pos += nb
        elif nb:
            register = flag == RENDEZVOUS and bool(register_threshold) and nb >= register_threshold
            pending.append((target, register))
        frames.append(target)
    return _Plan(frames, pending)


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
            rndv = channel._core.rndv_min
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
    if sys.is_finalizing() or channel._core.closed:
        return
    logger.warning("Closing dangling comm in %s", description)
    _close_nowait(channel)


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
