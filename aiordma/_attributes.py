"""Typed attributes that every aiordma stream, channel and listener provides.

Read them with anyio's ``extra()``::

    stream.extra(aiordma.TransportAttribute.transport)        # "tcp" or "rdma"
    stream.extra(aiordma.TransportAttribute.fallback_reason)  # "" on RDMA
    stream.extra(aiordma.TransportAttribute.stats)            # aiordma.ConnectionStats

The asyncio front end exposes the same values through ``get_extra_info`` under
the names ``aiordma_transport``, ``aiordma_fallback_reason``,
``aiordma_device``, ``aiordma_qp_num`` and ``aiordma_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass

from anyio import TypedAttributeSet, typed_attribute

__all__ = ["TransportAttribute", "ConnectionStats"]


@dataclass(frozen=True)
class ConnectionStats:
    """One connection's counts (``stream.extra(TransportAttribute.stats)``, ``Stats.connections``).

    Bytes are payload bytes (what the application sent and what arrived for it; frame headers
    are not counted); messages count on message channels only.  A large message or stream piece
    sent by rendezvous counts in both (and in ``rendezvous_*``)."""

    #: this process's number for the connection (1, 2, ... in the order their handshakes ended)
    id: int = 0
    #: ``"tcp"`` or ``"rdma"``, and why TCP (``""`` on RDMA)
    transport: str = "tcp"
    fallback_reason: str = ""
    #: ``"stream"`` or ``"messages"``
    mode: str = "stream"
    #: ``"client"`` or ``"server"``
    role: str = "client"
    #: the TCP peer's address (``"host:port"``), ``""`` if unknown
    peer: str = ""
    #: the RDMA device and local QP number (``""`` and 0 on TCP)
    device: str = ""
    qp_num: int = 0
    #: seconds since the handshake ended
    age: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    #: received bytes not read by the application yet
    unread_bytes: int = 0
    rendezvous_sent: int = 0
    rendezvous_received: int = 0
    #: one-sided operations on this connection's QP (rendezvous READs included)
    reads: int = 0
    writes: int = 0
    read_bytes: int = 0
    written_bytes: int = 0
    #: times a sender waited for the peer's credits (RDMA flow control)
    credit_stalls: int = 0
    #: registered bytes this connection holds (its rings; RDMA)
    pinned_bytes: int = 0


class TransportAttribute(TypedAttributeSet):
    #: ``"tcp"`` or ``"rdma"``: what carries this connection's data.
    transport: str = typed_attribute()
    #: Why the data runs on TCP: a readable sentence naming the side and the
    #: cause ("client: no RDMA device ..."); ``""`` when it runs on RDMA.
    fallback_reason: str = typed_attribute()
    #: ``"stream"`` (bytes) or ``"messages"`` (boundaries kept).
    mode: str = typed_attribute()
    #: Largest message this side accepts (message channels).
    max_message_size: int = typed_attribute()
    #: Largest message the peer accepts (message channels).
    peer_max_message_size: int = typed_attribute()
    #: RDMA device name (``"rxe0"``) -- only on RDMA connections.
    device: str = typed_attribute()
    #: Local queue pair number -- only on RDMA connections.
    qp_num: int = typed_attribute()
    #: This connection's counters now (an ``aiordma.ConnectionStats``: bytes and messages each
    #: way, rendezvous, one-sided operations, credit stalls, pinned bytes).
    stats: ConnectionStats = typed_attribute()
