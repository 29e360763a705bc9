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
2. then every other frame, in order, in pieces: of ``TCP_PIECE`` (16 MiB) over TCP, each read by
   the socket straight into the frame's buffer and sent from Dask's own (paced sends, see
   ``aiordma._tcp.asyncio_link``); over RDMA of ``RDMA_PIECE`` (8 MiB) or the link's rendezvous
   threshold (``RdmaConfig.rendezvous``, else the device's measured one) if larger, so that each
   piece is one rendezvous; never more than the peer's ``max_message_size``.  Empty frames send nothing.

The receiver allocates each frame's buffer (``distributed.protocol.utils.host_array``: writable,
as Dask's TCP comm gives) and ``receive_into``\\s it, so a large frame lands in its final place.
Over RDMA a message of the link's rendezvous threshold or more goes by rendezvous (the sender
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

try:
    import distributed  # noqa: F401  (the comm backend is distributed's)
except ImportError as _exc:  # pragma: no cover - depends on the install
    raise ImportError(f"the rdma:// Dask backend needs distributed: pip install 'aiordma[dask]' ({_exc})") from _exc

from .comm import RDMAComm
from .framing import decode_head, encode
from .listener import RDMABackend, RDMAConnector, RDMAListener

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener", "encode", "decode_head"]
