"""Typed attributes that every aiordma stream, channel and listener provides.

Read them with anyio's ``extra()``::

    stream.extra(aiordma.TransportAttribute.transport)        # "tcp" or "rdma"
    stream.extra(aiordma.TransportAttribute.fallback_reason)  # "" on RDMA

The asyncio front end exposes the same values through ``get_extra_info`` under
the names ``aiordma_transport``, ``aiordma_fallback_reason``,
``aiordma_device`` and ``aiordma_qp_num``.
"""

from __future__ import annotations

from anyio import TypedAttributeSet, typed_attribute

__all__ = ["TransportAttribute"]


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
