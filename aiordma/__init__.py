"""aiordma: async RDMA queue pairs as easily as sockets, with automatic TCP fallback.

anyio / trio (also asyncio and uvloop)::

    stream = await aiordma.connect("127.0.0.1", 9000)          # anyio ByteStream
    channel = await aiordma.connect_channel("127.0.0.1", 9001)  # ObjectStream[bytes]
    listener = await aiordma.create_listener("127.0.0.1", 9000)

asyncio::

    reader, writer = await aiordma.asyncio.open_connection("127.0.0.1", 9000)
    server = await aiordma.asyncio.start_server(handle, "127.0.0.1", 9000)

Every stream tells what carries it: ``stream.extra(aiordma.TransportAttribute.transport)``
and, after a fallback to TCP, why: ``...fallback_reason``.
"""

from __future__ import annotations

from . import asyncio
from ._api import (
    Channel,
    ChannelListener,
    Stream,
    StreamListener,
    connect,
    connect_channel,
    create_channel_listener,
    create_listener,
)
from ._attributes import ConnectionStats, TransportAttribute
from ._conn.stats import Stats
from . import metrics
from .metrics import serve_stats, stats
from ._conn.memory import (
    BufferBusyError,
    MemoryStats,
    RegisteredBuffer,
    RegisteredMemory,
    memory_stats,
    register,
    set_pinned_limit,
)
from ._proto.onesided import (
    DescriptorRevokedError,
    ForeignDescriptorError,
    RemoteAccessDeniedError,
    RemoteBoundsError,
    RemoteBuffer,
    RemoteMemoryError,
)
from ._errors import MemlockLimitError
from ._rdma.config import RdmaBackend, RdmaConfig
from ._errors import (
    AiordmaError,
    BufferTooSmallError,
    HandshakeError,
    HandshakeTimeoutError,
    AuthenticationError,
    LocalProtocolError,
    ProtocolError,
    RDMAError,
    RDMAUnavailableError,
    RemoteProtocolError,
)

__version__ = "0.1.0"

__all__ = [
    "asyncio",
    "connect",
    "connect_channel",
    "create_listener",
    "create_channel_listener",
    "Stream",
    "Channel",
    "StreamListener",
    "ChannelListener",
    "TransportAttribute",
    "stats",
    "Stats",
    "serve_stats",
    "metrics",
    "ConnectionStats",
    "RegisteredBuffer",
    "RegisteredMemory",
    "register",
    "memory_stats",
    "MemoryStats",
    "set_pinned_limit",
    "BufferBusyError",
    "MemlockLimitError",
    "RemoteBuffer",
    "RemoteMemoryError",
    "DescriptorRevokedError",
    "ForeignDescriptorError",
    "RemoteBoundsError",
    "RemoteAccessDeniedError",
    "RdmaBackend",
    "RdmaConfig",
    "AiordmaError",
    "BufferTooSmallError",
    "ProtocolError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "AuthenticationError",
    "RDMAUnavailableError",
    "RDMAError",
    "__version__",
]
