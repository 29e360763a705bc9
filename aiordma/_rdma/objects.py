"""The verbs objects as the RDMA transport uses them: the device context, completion channels
and queues and their decoded completions, queue pairs, memory regions, memory windows,
protection domains, and the scope a connection's memory lives in.

Two implementations satisfy these interfaces: the native binding (``verbs.py``) and the
simulated wire (``aiordma.testing._simverbs``); mypy holds both to them (the checks at the end
of each module).  Their lifetime rule is ``lifetime.Resource``'s: ``close()`` is idempotent, and
memory a work request names stays the device's until its completion is polled or its QP is
destroyed -- a region is given back (:meth:`Scope.give_region`) or closed only then.

Each interface names what the transport asks, not all an implementation offers.  An object
handed back to its provider (a CQ to ``create_qp``, a window to ``post_bind_mw``) must be that
provider's own: the other raises ``TypeError`` (as verbs refuse objects of another context).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .constants import AsyncEvent, DeviceAttr, GidEntry, PortAttr, QPCaps, SendWR

if TYPE_CHECKING:
    from .._conn.memory import RegisteredMemory, Registration

__all__ = [
    "Region", "Window", "Domain", "Scope", "Context", "CompletionChannel", "CompletionQueue",
    "WorkCompletions", "Poster", "QueuePair", "Completion",
]  # fmt: skip

#: one polled work completion, decoded: (wr_id, status, opcode, byte_len, imm or -1, qp_num)
Completion = tuple[int, int, int, int, int, int]


class Context(Protocol):
    """An open device (``ibv_context``): its attributes, its asynchronous events (``fileno()``
    is readable when one is pending), and the objects made on it."""

    def fileno(self) -> int: ...

    def query_device(self) -> DeviceAttr: ...

    def query_port(self, port: int = ...) -> PortAttr: ...

    def query_gid_table(self) -> list[GidEntry]: ...

    def get_async_event(self) -> AsyncEvent | None:
        """The next asynchronous event, acknowledged, or None when none is pending."""
        ...

    def alloc_pd(self) -> Domain: ...

    def create_comp_channel(self) -> CompletionChannel: ...

    def create_cq(self, cqe: int = ..., channel: CompletionChannel | None = ...) -> CompletionQueue:
        """A CQ of at least ``cqe`` entries whose events go to ``channel``."""
        ...

    def close(self) -> None:
        """``ibv_close_device``; every object made on it is closed already."""


class CompletionChannel(Protocol):
    """A completion channel: ``fileno()`` is readable when an armed CQ on it has a completion."""

    def fileno(self) -> int: ...

    def drain_events(self, max_events: int = ...) -> int:
        """Read and acknowledge the pending events (at most ``max_events``); returns how many."""
        ...

    def close(self) -> None: ...


class WorkCompletions(Protocol):
    """An array a CQ is polled into (``verbs.WCArray``), and its entries decoded."""

    def __len__(self) -> int: ...

    def entries(self, count: int) -> list[Completion]:
        """The first ``count`` entries as :data:`Completion` tuples."""
        ...


class CompletionQueue(Protocol):
    """A completion queue (``ibv_cq``) on a channel."""

    #: the entries the device granted (at least those asked for)
    cqe: int

    def req_notify(self, solicited_only: bool = ...) -> None:
        """Arm: the next completion signals the channel once."""

    def poll_into(self, arr: WorkCompletions, max_entries: int | None = ...) -> int:
        """Poll into ``arr`` (one of this provider's); returns the count polled."""
        ...

    def native_waker(self, channel: CompletionChannel | None) -> Callable[..., int]:
        """The native module's wake function bound to this CQ and ``channel`` (see ``poller.py``)."""
        ...

    def close(self) -> None: ...


class Poster(Protocol):
    """The QP, as a session posts on it."""

    def post_send(self, wr: SendWR) -> None: ...

    def post_send_imm(self, wr_id: int, addr: int, length: int, lkey: int, imm_data: int, flags: int) -> None: ...

    def post_send_batch(self, wrs: Sequence[SendWR]) -> None: ...

    def post_recv_one(self, addr: int, length: int, lkey: int, wr_id: int) -> None: ...

    def post_recv_batch(self, addrs: Sequence[int], lens: Sequence[int], lkey: int, wr_ids: Sequence[int]) -> None: ...


class QueuePair(Poster, Protocol):
    """An RC queue pair (``ibv_qp``): its transitions, its posts, and what it was granted."""

    qp_num: int
    caps: QPCaps

    def to_init(self, port_num: int = ..., pkey_index: int = ..., access: int = ...) -> None: ...

    def to_rtr(self, dest_qp_num: int, dgid: bytes, *, sgid_index: int, rq_psn: int = ..., path_mtu: int = ...,
               port_num: int | None = ..., max_dest_rd_atomic: int = ...) -> None: ...  # fmt: skip

    def to_rts(self, sq_psn: int = ..., *, timeout: int = ..., retry_cnt: int = ..., rnr_retry: int = ...,
               max_rd_atomic: int = ...) -> None: ...  # fmt: skip

    def to_error(self) -> None:
        """Into ERROR: every outstanding work request completes flushed."""

    def set_access(self, access: int) -> None:
        """What the peer may do through this QP (``Access.REMOTE_*``)."""

    def post_bind_mw(self, wr_id: int, mw: Window, mr: Region, addr: int, length: int, access: int,
                     signaled: bool = ...) -> int:  # fmt: skip
        """Bind ``mw`` (this provider's) over ``[addr, addr + length)`` of ``mr``; returns the rkey."""
        ...

    def close(self) -> None:
        """``ibv_destroy_qp``: what its work requests named is the caller's again."""


class Region(Protocol):
    """A registered memory region (``ibv_mr``): ``[addr, addr + length)`` under ``lkey``, and
    ``rkey`` when it grants remote access by itself (a connection's own PD)."""

    addr: int
    length: int
    lkey: int
    rkey: int

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable view of its bytes (release it before the region is closed)."""
        ...

    def close(self) -> None:
        """Deregister (``ibv_dereg_mr``); idempotent."""


class Window(Protocol):
    """A type-2 memory window (``ibv_mw``): a grant bound to one QP; ``close`` kills its rkey."""

    @property
    def rkey(self) -> int: ...

    def close(self) -> None: ...


class Domain(Protocol):
    """A protection domain (``ibv_pd``)."""

    def reg_mr(self, length: int, access: int = ...) -> Region:
        """A fresh registered region of ``length`` bytes."""
        ...

    def reg_buffer(self, buffer: Any, access: int = ...) -> Region:
        """Register the caller's memory (anything with the buffer protocol)."""
        ...

    def alloc_mw(self) -> Window:
        """A type-2 memory window, not bound yet."""
        ...

    def create_qp(self, send_cq: CompletionQueue, recv_cq: CompletionQueue | None = ..., *, max_send_wr: int = ...,
                  max_recv_wr: int = ..., max_inline_data: int = ...) -> QueuePair:  # fmt: skip
        """An RC QP in RESET on this provider's CQs (``recv_cq`` defaults to ``send_cq``)."""
        ...

    def close(self) -> None: ...


class Scope(Protocol):
    """Where one connection's memory lives (``device.py``, "Remote keys"): the device's shared PD,
    where memory windows grant remote access per QP, or the connection's own PD."""

    #: grants are memory windows (else a region's own rkey, in the connection's own PD)
    windows: bool

    @property
    def pd(self) -> Domain: ...

    def take_region(self, length: int) -> Region:
        """A registered, local-only region of ``length`` bytes (recycled when possible)."""
        ...

    def give_region(self, mr: Region) -> None:
        """Give back a region no QP can touch any more."""

    def staging_region(self, length: int) -> Region:
        """A region for a staged rendezvous message."""
        ...

    def register_user(self, mem: RegisteredMemory, view: memoryview) -> Region:
        """Register a user's memory for local access (``aiordma.register``); remembered until
        :meth:`unregister_user` or the scope closes."""
        ...

    def unregister_user(self, mem: RegisteredMemory, mr: Registration) -> None: ...

    def register_exposed(self, view: memoryview, access: int) -> Region:
        """Register ``view`` for an exposure (``access``: what its grant will allow)."""
        ...

    def close_scope(self) -> None:
        """A connection's own PD: deregister what is left, deallocate (after its QP is destroyed)."""
