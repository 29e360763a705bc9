"""Counters: what each connection and the whole process did (``aiordma.stats()``).

Theory of operation
-------------------
Counting must cost nothing a user can measure on the 64 B round trip, so nothing here runs per
message: the hot paths only add to integer attributes of objects they already hold -- the
protocol (:class:`~aiordma._proto.protocol.Connection`: bytes and messages framed and decoded),
the Core's receive sink (a byte stream's received bytes), and the Core's :class:`Counts` (what
the links count: rendezvous, one-sided operations, credit stalls, pinned ring bytes).  Nothing
is summed until somebody asks: :func:`stats` walks the open connections then.

The registry holds the open connections' Cores weakly, from the end of their handshake
(:func:`opened`) to their close (:func:`retired`), when their counts join the process's totals.
A connection dropped without a close leaves the registry with its Core and its counts with it
(the process totals count closed connections, and open ones).  Everything runs on the event
loop's thread except the stats endpoint's thread, which only reads: a snapshot taken there may
mix counts from a moment apart, never a torn integer.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from anyio import BrokenResourceError
from anyio.abc import SocketAttribute

from .._attributes import ConnectionStats, TransportAttribute
from .._errors import RDMAError
from .._proto.protocol import Connection
from .._proto.receiving import StreamBuffer
from .memory import MemoryStats, memory_stats

__all__ = ["Counts", "Stats", "stats", "opened", "retired", "connection_stats", "reset"]

#: distinct fallback reasons counted one by one; further ones are counted together under OTHER
MAX_REASONS: Final = 64
OTHER: Final = "(other reasons)"


class Counts:
    """What a connection's links count (the RDMA link, its one-sided operations); the Core owns it."""

    __slots__ = ("rendezvous_sent", "rendezvous_received", "reads", "writes", "read_bytes", "written_bytes",
                 "credit_stalls", "pinned_bytes", "opened_at", "peer", "id")  # fmt: skip

    def __init__(self) -> None:
        self.rendezvous_sent = 0  # messages (or stream pieces) the peer READ from us
        self.rendezvous_received = 0  # the same, the other way
        self.reads = 0  # one-sided RDMA READs done (rendezvous fetches included)
        self.writes = 0  # one-sided RDMA WRITEs done
        self.read_bytes = 0
        self.written_bytes = 0
        self.credit_stalls = 0  # waits of a sender for the peer's credits (RDMA)
        self.pinned_bytes = 0  # registered ring bytes this connection holds now
        self.opened_at = 0.0  # time.monotonic() at the end of the handshake
        self.peer = ""  # the TCP peer's address, "host:port" (read at the end of the handshake)
        self.id = 0  # this process's number for the connection (1, 2, ...; 0: not opened)


#: the counters that add up into the process's totals
SUMMED: Final = ("bytes_sent", "bytes_received", "messages_sent", "messages_received", "rendezvous_sent",
                 "rendezvous_received", "reads", "writes", "read_bytes", "written_bytes", "credit_stalls")  # fmt: skip


class _Attributed(Protocol):
    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]: ...


class Counted(Protocol):
    """What the registry reads of a connection (a :class:`~aiordma._conn.core.Core`)."""

    proto: Connection
    rbuf: StreamBuffer
    counts: Counts
    transport: str
    fallback_reason: str
    error: BaseException | None

    @property
    def link(self) -> _Attributed: ...

    @property
    def buffered(self) -> int: ...


@dataclass(frozen=True)
class Stats:
    """What :func:`aiordma.stats` reports: the process's connections and memory."""

    #: connections open now, by transport
    open: dict[str, int] = field(default_factory=dict)
    #: connections that completed their handshake since the process started, by transport
    opened: dict[str, int] = field(default_factory=dict)
    #: connections that fell back to TCP, by reason (at most MAX_REASONS, then OTHER)
    fallbacks: dict[str, int] = field(default_factory=dict)
    #: connections that broke, by cause: the error's class, and for a failed work completion its
    #: status (``"RDMAError: IBV_WC_RNR_RETRY_EXC_ERR"``: the peer had no receive posted, retries ran out)
    failures: dict[str, int] = field(default_factory=dict)
    #: every counter of :data:`SUMMED`, over closed and open connections
    totals: dict[str, int] = field(default_factory=dict)
    #: registered memory (aiordma.memory_stats)
    memory: MemoryStats | None = None
    #: each open connection (when asked for: ``stats(connections=True)``)
    connections: tuple[ConnectionStats, ...] = ()
    #: each RDMA device this process has open: ``connections`` (its users now) and the device's
    #: own RNR and retry counters from sysfs (for the whole device: every process on it)
    devices: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able): what the stats endpoint sends."""
        return asdict(self)


class _Registry:
    def __init__(self) -> None:
        self.live: weakref.WeakSet[Counted] = weakref.WeakSet()
        self.opened: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.retired = dict.fromkeys(SUMMED, 0)
        self.serial = 0


_registry = _Registry()


def opened(core: Counted) -> None:
    """``core`` finished its handshake: count it, by transport (and fallback reason)."""
    reg = _registry
    counts = core.counts
    counts.opened_at = time.monotonic()
    reg.serial += 1
    counts.id = reg.serial
    try:
        get_peer = core.link.extra_attributes.get(SocketAttribute.remote_address)
        peer = get_peer() if get_peer is not None else None
    except Exception:  # (no address to tell: a link of another kind, or gone already)
        peer = None
    if isinstance(peer, tuple) and len(peer) >= 2:
        counts.peer = f"{peer[0]}:{peer[1]}"
    elif peer:
        counts.peer = str(peer)
    reg.opened[core.transport] = reg.opened.get(core.transport, 0) + 1
    if core.fallback_reason:
        _count(reg.fallbacks, core.fallback_reason)
    reg.live.add(core)


def _count(table: dict[str, int], key: str) -> None:
    if key not in table and len(table) >= MAX_REASONS:
        key = OTHER
    table[key] = table.get(key, 0) + 1


def cause(err: BaseException) -> str:
    """How :attr:`Stats.failures` names an error: its class, and a work completion's status."""
    while isinstance(err, BrokenResourceError) and err.__cause__ is not None:
        err = err.__cause__  # (anyio's wrapper: what broke it)
    if isinstance(err, RDMAError) and err.wc_status:
        return f"RDMAError: {err.wc_status}"
    return type(err).__name__


def retired(core: Counted) -> None:
    """``core`` closes: its counts join the totals (once)."""
    reg = _registry
    if core in reg.live:
        reg.live.discard(core)
        if core.error is not None:
            _count(reg.failures, cause(core.error))
        snap = connection_stats(core)
        retired_ = reg.retired
        for name in SUMMED:
            retired_[name] += getattr(snap, name)


def connection_stats(core: Counted) -> ConnectionStats:
    """A snapshot of one connection's counts."""
    proto = core.proto
    counts = core.counts
    attrs = core.link.extra_attributes
    device = qp_num = None
    try:
        get_device = attrs.get(TransportAttribute.device)
        device = get_device() if get_device is not None else None
        get_qp = attrs.get(TransportAttribute.qp_num)
        qp_num = get_qp() if get_qp is not None else None
    except Exception:  # (a link that is gone: no address to tell)
        pass
    return ConnectionStats(
        id=counts.id,
        transport=core.transport,
        fallback_reason=core.fallback_reason,
        mode="messages" if proto.mode else "stream",
        role=proto.role.value,
        peer=counts.peer,
        device=device if isinstance(device, str) else "",
        qp_num=qp_num if isinstance(qp_num, int) else 0,
        age=time.monotonic() - counts.opened_at if counts.opened_at else 0.0,
        bytes_sent=proto.sent_bytes,
        bytes_received=core.rbuf.received + proto.received_message_bytes,
        messages_sent=proto.sent_messages,
        messages_received=proto.received_messages,
        unread_bytes=core.buffered,
        rendezvous_sent=counts.rendezvous_sent,
        rendezvous_received=counts.rendezvous_received,
        reads=counts.reads,
        writes=counts.writes,
        read_bytes=counts.read_bytes,
        written_bytes=counts.written_bytes,
        credit_stalls=counts.credit_stalls,
        pinned_bytes=counts.pinned_bytes,
    )


def _live() -> list[Counted]:
    # (the endpoint's thread reads while the loop's thread may add: copy, and again on a race)
    for _ in range(100):
        try:
            return list(_registry.live)
        except RuntimeError:
            continue
    return []


def stats(connections: bool = False) -> Stats:
    """The process's counters now: connections open and opened (by transport), fallbacks (by
    reason), totals over closed and open connections, registered memory -- and, with
    ``connections=True``, each open connection's :class:`ConnectionStats`.  Nothing is counted
    per message beyond integer additions; this call does the summing."""
    reg = _registry
    snaps = []
    for core in _live():
        try:
            snaps.append(connection_stats(core))
        except Exception:  # (a connection torn down in between, seen from the endpoint's thread)
            continue
    totals = dict(reg.retired)
    open_: dict[str, int] = {}
    for snap in snaps:
        open_[snap.transport] = open_.get(snap.transport, 0) + 1
        for name in SUMMED:
            totals[name] += getattr(snap, name)
    return Stats(
        open=open_,
        opened=dict(reg.opened),
        fallbacks=dict(reg.fallbacks),
        failures=dict(reg.failures),
        totals=totals,
        memory=memory_stats(),
        connections=tuple(snaps) if connections else (),
    )


def reset() -> None:
    """Forget the totals and the reasons (tests; the open connections stay registered)."""
    reg = _registry
    reg.opened.clear()
    reg.fallbacks.clear()
    reg.failures.clear()
    reg.retired = dict.fromkeys(SUMMED, 0)
