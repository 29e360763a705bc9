"""Completions of the verbs binding: completion channels (``ibv_create_comp_channel``), queues
(``ibv_create_cq``) and the flat arrays they are polled into, children of a context
(:mod:`aiordma._rdma.verbs`).  Decoding is :mod:`aiordma._rdma.completions`'s."""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from . import completions
from .constants import WC_WITH_IMM as _WC_WITH_IMM
from .lifetime import foreign
from ._native import NativeContext, _Resource, _addr, _check, _count, _fail, _ffi, _lib, _require_native

if TYPE_CHECKING:
    from . import objects as _o

__all__ = ["CompletionChannel", "CompletionQueue", "WCArray", "WorkCompletion"]


# --------------------------------------------------------------------------
# Completions
# --------------------------------------------------------------------------


class WorkCompletion(completions.WorkCompletion):
    """A decoded ``ibv_wc`` (see ``completions.py``), described by libibverbs."""

    __slots__ = ()

    @property
    def status_str(self) -> str:
        """``ibv_wc_status_str()``: ``"success"``, ``"Work Request Flushed Error"``, ..."""
        if _lib is None:
            return self.status_name
        return str(_ffi.string(_lib.ibv_wc_status_str(self.status)).decode())


#: struct aiordma_wc as Python's struct module sees it (native layout, checked below)
_WC_STRUCT: Final = struct.Struct("@QIIIIIIII")
_WC_SIZE: Final = _WC_STRUCT.size
if _ffi is not None and _ffi.sizeof("struct aiordma_wc") != _WC_SIZE:  # pragma: no cover - ABI guard
    raise ImportError("struct aiordma_wc does not have the layout aiordma expects")


class WCArray(completions.CompletionArray):
    """A preallocated array of flat completions for allocation-free polling.

    ``cq.poll_into(arr)`` fills it and returns a count; the data path reads it with
    :meth:`entries`, anything else decodes entries with ``arr[i]``.
    """

    def __init__(self, n: int) -> None:
        _require_native("a WCArray")
        if n <= 0:
            raise ValueError("a WCArray needs at least one entry")
        self.n = n
        self._a: Any = _ffi.new("struct aiordma_wc[]", n)

    def __getitem__(self, i: int) -> WorkCompletion:
        w = self._a[i]
        flags = int(w.wc_flags)
        return WorkCompletion(
            int(w.wr_id), int(w.status), int(w.opcode), int(w.byte_len),
            int(w.imm_data) if flags & _WC_WITH_IMM else None,
            int(w.qp_num), int(w.src_qp), int(w.vendor_err), flags,
        )  # fmt: skip

    def entries(self, count: int) -> list[tuple[int, int, int, int, int, int]]:
        """In one pass: the array is read as bytes and unpacked by ``struct`` in C."""
        if count <= 0:
            return []
        raw = _ffi.buffer(self._a, count * _WC_SIZE)
        return [
            (wr_id, status, op, byte_len, imm if flags & _WC_WITH_IMM else -1, qp)
            for wr_id, status, op, _vendor, byte_len, imm, qp, _src, flags in _WC_STRUCT.iter_unpack(raw)
        ]


class CompletionChannel(_Resource):
    """``ibv_create_comp_channel``; ``fileno()`` is non-blocking.

    The fd becomes readable when a CQ attached to it was armed with
    :meth:`CompletionQueue.req_notify` and a completion arrived.  Then call
    :meth:`drain_events` (which also acknowledges the events), re-arm, and
    poll the CQ.  ``close()`` needs the CQs attached to it closed first.
    """

    _kind = "channels"
    _label = "completion channel"

    def __init__(self, context: NativeContext) -> None:
        _require_native("a CompletionChannel")
        context._ensure_open("ibv_create_comp_channel")
        h = _lib.ibv_create_comp_channel(context._h)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_create_comp_channel")
        fd = int(_lib.aiordma_channel_fd(h))
        rc = int(_lib.aiordma_set_nonblock(fd))
        if rc < 0:  # pragma: no cover
            _lib.ibv_destroy_comp_channel(h)
            raise _fail(-rc, "fcntl(channel fd, O_NONBLOCK)")
        super().__init__((context,))
        self.context = context
        self._h: Any = h
        self._fd = fd
        self._ev_max = 0
        self._ev_cqs: Any = None
        self._ev_counts: Any = None
        self._ev_n: Any = _ffi.new("int *")
        self._cqs: dict[int, CompletionQueue] = {}  # the CQs on this channel, by address
        _count(self._kind, 1)

    def fileno(self) -> int:
        self._ensure_open("fileno")
        return self._fd

    def _drain(self, max_events: int) -> int:
        """Read and ack pending events (until EAGAIN or ``max_events``) into the channel's
        arrays, grown to ``max_events`` first; returns how many events there were."""
        if self._h is None:
            self._ensure_open("ibv_get_cq_event")
        if max_events > self._ev_max:
            self._ev_cqs = _ffi.new("struct ibv_cq *[]", max_events)
            self._ev_counts = _ffi.new("unsigned int[]", max_events)
            self._ev_max = max_events
        total = int(_lib.aiordma_drain_cq_events(self._h, max_events, self._ev_cqs, self._ev_counts, self._ev_n))
        return _check(total, "ibv_get_cq_event")

    def drain_events_per_cq(self, max_events: int = 64) -> dict[CompletionQueue, int]:
        """Read pending events (until EAGAIN or ``max_events``), ack them, and count them per CQ."""
        self._drain(max_events)
        out: dict[CompletionQueue, int] = {}
        for i in range(int(self._ev_n[0])):
            cq = self._cqs.get(_addr(self._ev_cqs[i]))
            if cq is not None:
                out[cq] = out.get(cq, 0) + int(self._ev_counts[i])
        return out

    def drain_events(self, max_events: int = 64) -> int:
        """Read and acknowledge pending events; returns how many (0 if none)."""
        return self._drain(max_events)

    def close(self) -> None:
        """``ibv_destroy_comp_channel``; the CQs using it must be closed first."""
        if self._closed:
            return
        self._check_children("ibv_destroy_comp_channel")
        rc = int(_lib.ibv_destroy_comp_channel(self._h))
        if rc:
            raise _fail(int(_ffi.errno) or rc, "ibv_destroy_comp_channel")
        self._h = None
        self._mark_closed()


class CompletionQueue(_Resource):
    """``ibv_create_cq`` with at least ``cqe`` entries, optionally on a channel.

    ``close()`` (``ibv_destroy_cq``) needs the QPs using it closed first.
    Events read by :meth:`CompletionChannel.drain_events` are already acked,
    so destroying never waits on unacknowledged events.
    """

    _kind = "cqs"
    _label = "completion queue"

    def __init__(
        self, context: NativeContext, cqe: int = 256, channel: CompletionChannel | None = None, comp_vector: int = 0
    ) -> None:
        _require_native("a CompletionQueue")
        context._ensure_open("ibv_create_cq")
        if channel is not None:
            channel._ensure_open("ibv_create_cq")
        h = _lib.ibv_create_cq(context._h, cqe, _ffi.NULL, channel._h if channel else _ffi.NULL, comp_vector)
        if h == _ffi.NULL:
            raise _fail(int(_ffi.errno), "ibv_create_cq", f"cqe={cqe}")
        super().__init__((context, channel) if channel else (context,))
        self.context = context
        self.channel = channel
        self.cqe: int = int(h.cqe)  # what the device granted (>= the cqe asked)
        self._h: Any = h
        self._key = _addr(h)
        context._cqs[self._key] = self
        if channel is not None:
            channel._cqs[self._key] = self
        self._scratch = WCArray(16)
        _count(self._kind, 1)

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm the CQ: the next completion makes the channel fd readable."""
        self._ensure_open("ibv_req_notify_cq")
        _check(int(_lib.aiordma_req_notify(self._h, 1 if solicited_only else 0)), "ibv_req_notify_cq")

    def poll_into(self, arr: _o.WorkCompletions, max_entries: int | None = None) -> int:
        """Poll up to ``max_entries`` (default ``len(arr)``) completions into ``arr``; returns the count."""
        if not isinstance(arr, WCArray):
            raise foreign(arr, WCArray, "ibv_poll_cq")
        self._ensure_open("ibv_poll_cq")
        n = arr.n if max_entries is None else min(max_entries, arr.n)
        return _check(int(_lib.aiordma_poll_batch(self._h, n, arr._a)), "ibv_poll_cq")

    def native_waker(self, channel: _o.CompletionChannel | None) -> Callable[..., int]:
        """``aiordma_wake`` bound to this CQ and ``channel`` (the poller's one call per wake;
        see ``_native/aiordma_fast.h``).  The poller must stop calling it before this CQ closes."""
        if channel is not None and not isinstance(channel, CompletionChannel):
            raise foreign(channel, CompletionChannel, "aiordma_wake")
        self._ensure_open("aiordma_wake")
        return functools.partial(_lib.aiordma_wake, channel._h if channel is not None else _ffi.NULL, self._h)

    def poll(self, max_entries: int = 16) -> list[completions.WorkCompletion]:
        """Poll up to ``max_entries`` completions (an empty list if none)."""
        arr = self._scratch if max_entries <= self._scratch.n else WCArray(max_entries)
        return arr.decode(self.poll_into(arr, max_entries))

    def poll_spin_into(self, arr: WCArray, spin_ns: int, max_entries: int | None = None) -> int:
        """Busy-poll (GIL released) up to ``spin_ns`` ns until something arrives; returns the count."""
        self._ensure_open("ibv_poll_cq")
        n = arr.n if max_entries is None else min(max_entries, arr.n)
        return _check(int(_lib.aiordma_poll_spin(self._h, n, arr._a, int(spin_ns))), "ibv_poll_cq")

    def poll_spin(self, max_entries: int = 16, spin_ns: int = 50_000) -> list[completions.WorkCompletion]:
        arr = self._scratch if max_entries <= self._scratch.n else WCArray(max_entries)
        return arr.decode(self.poll_spin_into(arr, spin_ns, max_entries))

    def close(self) -> None:
        """``ibv_destroy_cq``; the QPs using it must be destroyed first."""
        if self._closed:
            return
        self._check_children("ibv_destroy_cq")
        rc = int(_lib.ibv_destroy_cq(self._h))
        if rc:
            raise _fail(rc, "ibv_destroy_cq")
        self.context._cqs.pop(self._key, None)
        if self.channel is not None:
            self.channel._cqs.pop(self._key, None)
        self._h = None
        self._mark_closed()

