"""Completion channels and completion queues on the simulated wire."""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._errors import RDMAError
from .._rdma.lifetime import foreign
from ._simbase import (
    _OK,
    SimWCArray,
    SimWorkCompletion,
    _Completion,
    _Failable,
    _ReadyQueue,
    _SimContextBase,
    _SimResource,
)

if TYPE_CHECKING:
    from .._rdma import objects as _o

__all__ = ["SimCompletionChannel", "SimCompletionQueue"]


class SimCompletionChannel(_SimResource):
    """``fileno()`` becomes readable when an armed CQ on this channel gets a qualifying completion."""

    _kind = "channels"
    _label = "completion channel"

    def __init__(self, context: _SimContextBase) -> None:
        context._ensure_open("ibv_create_comp_channel")
        self._ready: _ReadyQueue[SimCompletionQueue] = _ReadyQueue()
        super().__init__(context._accounts, (context,))
        self.context = context

    def fileno(self) -> int:
        self._ensure_open("fileno")
        return self._ready.fileno()

    def drain_events(self, max_events: int = 64) -> int:
        """Read and acknowledge pending events; returns how many (0 if none)."""
        self._ensure_open("ibv_get_cq_event")
        return len(self._ready.pop(max_events))

    def drain_events_per_cq(self, max_events: int = 64) -> dict[SimCompletionQueue, int]:
        self._ensure_open("ibv_get_cq_event")
        out: dict[SimCompletionQueue, int] = {}
        for cq in self._ready.pop(max_events):
            out[cq] = out.get(cq, 0) + 1
        return out

    def _signal(self, cq: SimCompletionQueue) -> None:
        self._ready.push(cq)
        self._accounts.counters["events"] += 1

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_destroy_comp_channel")
        self._ready.close()
        self._mark_closed()


class SimCompletionQueue(_SimResource):
    """A CQ of exactly ``cqe`` entries (as rxe grants); see :meth:`_push` for overrun."""

    _kind = "cqs"
    _label = "completion queue"

    def __init__(self, context: _SimContextBase, cqe: int = 256, channel: SimCompletionChannel | None = None) -> None:
        context._ensure_open("ibv_create_cq")
        if not 1 <= cqe <= context._device.max_cqe:
            raise RDMAError(errno.EINVAL, "ibv_create_cq", f"cqe={cqe} (device max {context._device.max_cqe})")
        super().__init__(context._accounts, (context, channel) if channel else (context,))
        self.context = context
        self.channel = channel
        self.cqe: int = cqe
        self.overrun = False
        self._queue: deque[_Completion] = deque()
        self._armed = 0  # 0: not armed, 1: solicited only, 2: any completion
        self._qps: list[_Failable] = []  # the QPs on this CQ, which an overrun moves to ERROR
        self._scratch = SimWCArray(16)

    def __repr__(self) -> str:
        return f"<SimCompletionQueue cqe={self.cqe} queued={len(self._queue)}>"

    def req_notify(self, solicited_only: bool = False) -> None:
        """Arm once: the next qualifying completion *from now on* writes one channel event."""
        self._ensure_open("ibv_req_notify_cq")
        self._armed = max(self._armed, 1 if solicited_only else 2)
        self._accounts.counters["req_notify"] += 1

    def poll_into(self, arr: _o.WorkCompletions, max_entries: int | None = None) -> int:
        """Move up to ``max_entries`` (default ``len(arr)``) completions into ``arr``; returns the count.

        Polling a send completion frees its send-queue slot and those of the
        unsignaled WRs before it.
        """
        if not isinstance(arr, SimWCArray):
            raise foreign(arr, SimWCArray, "ibv_poll_cq")
        self._ensure_open("ibv_poll_cq")
        n = arr.n if max_entries is None else min(max_entries, arr.n)
        q, slots, count = self._queue, arr._wc, 0
        while count < n and q:
            c = slots[count] = q.popleft()
            count += 1
            if c.qp is not None and c.sq_seq > c.qp._sq_retired:
                c.qp._sq_retired = c.sq_seq
        self._accounts.counters["polls"] += 1
        self._accounts.counters["polled"] += count
        return count

    def poll_spin_into(self, arr: SimWCArray, spin_ns: int, max_entries: int | None = None) -> int:
        """Same as :meth:`poll_into`: nothing can arrive while spinning, the wire is synchronous."""
        return self.poll_into(arr, max_entries)

    def native_waker(self, channel: _o.CompletionChannel | None) -> Callable[..., int]:
        """``aiordma_wake``'s contract over this CQ: the completions are polled here, and
        processed by the native module's own C (``aiordma_chan_process``), as on a device."""
        if channel is not None and not isinstance(channel, SimCompletionChannel):
            raise foreign(channel, SimCompletionChannel, "aiordma_wake")
        from aiordma._rdma.fastpath import native_lib

        native = native_lib()
        if native is None:  # pragma: no cover - the provider offers no native path then
            raise RuntimeError("the native module is not built")
        ffi, lib = native
        raw = ffi.new("struct aiordma_wc[]", 32)
        used = ffi.new("uint64_t *")
        n_others = ffi.new("int *")
        with_imm = int(lib.IBV_WC_WITH_IMM)
        accounts = self._accounts

        def wake(read_event: int, arm: int, spin_ns: int, max_polled: int, chans: Any, nchans: int, others: Any,
                 others_cap: int, out: Any, out_cap: int, stamp: int, deliv: Any, deliv_cap: int, res: Any) -> int:  # fmt: skip
            res.events_read = res.polled = res.others = res.armed = res.more = res.err = 0
            res.deliv_used = res.spun_ns = 0
            if read_event and channel is not None:
                res.events_read = channel.drain_events(1)
            used[0] = 0
            n_others[0] = 0
            n_out = 0
            armed = False
            queue = self._queue
            while True:
                want = min(max_polled - res.polled, 32)
                if want <= 0:
                    res.more = 1
                    break
                got = 0
                while got < want and queue:
                    c = queue.popleft()
                    if c.qp is not None and c.sq_seq > c.qp._sq_retired:
                        c.qp._sq_retired = c.sq_seq
                    w = raw[got]
                    w.wr_id, w.status, w.opcode, w.byte_len, w.qp_num = c.wr_id, c.status, c.opcode, c.byte_len, c.qp_num
                    w.src_qp, w.vendor_err = c.src_qp, 0
                    if c.imm >= 0:
                        w.imm_data, w.wc_flags = c.imm, with_imm
                    else:
                        w.imm_data, w.wc_flags = 0, 0
                    got += 1
                accounts.counters["polls"] += 1
                accounts.counters["polled"] += got
                if got:
                    res.polled += got
                    n_out = lib.aiordma_chan_process(chans, nchans, raw, got, out, out_cap, n_out, stamp, deliv,
                                                     deliv_cap, used, others, others_cap, n_others)  # fmt: skip
                    continue
                if arm and not armed:
                    self.req_notify(arm == 1)
                    armed = True
                    res.armed = 1
                    continue
                break
            res.others = n_others[0]
            res.deliv_used = used[0]
            lib.aiordma_chan_finish(chans, nchans, out, n_out)
            recorders = accounts.recorders
            for i in range(n_out):
                chan = chans[out[i].cid]
                if chan != ffi.NULL:
                    qp = recorders.get(int(ffi.cast("uintptr_t", chan)))
                    if qp is not None:
                        qp.post_records(chan)
            return n_out

        return wake

    def poll(self, max_entries: int = 16) -> list[SimWorkCompletion]:
        arr = self._scratch if max_entries <= self._scratch.n else SimWCArray(max_entries)
        return arr.decode(self.poll_into(arr, max_entries))

    def _push(self, c: _Completion) -> None:
        counters = self._accounts.counters
        if self.overrun:
            counters["dropped"] += 1
            return
        if len(self._queue) >= self.cqe:
            # overrun: the entry is lost, the CQ is in error, and so is every QP on it
            self.overrun = True
            counters["dropped"] += 1
            counters["cq_overruns"] += 1
            self.context._post_event(0, cq=self)
            for qp in list(self._qps):
                qp._enter_error()
            return
        self._queue.append(c)
        counters["completions"] += 1
        if c.status != _OK:
            counters["errors"] += 1
        if self._armed == 2 or (self._armed == 1 and c.solicited):
            self._armed = 0
            if self.channel is not None:
                self.channel._signal(self)

    def close(self) -> None:
        if self._closed:
            return
        self._check_children("ibv_destroy_cq")
        self._queue.clear()
        self._mark_closed()

