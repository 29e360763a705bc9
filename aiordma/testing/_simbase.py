"""The plumbing of the simulated wire (:mod:`aiordma.testing._simverbs`): what every simulated
verbs object stands on -- its fabric's accounts (counters, live objects, the ids it hands out),
readiness pipes, queued completions and the arrays they are polled into -- and the bases a child
names its parent by (:class:`_SimContextBase`, :class:`_SimDomainBase`), so that the simulated
verbs have no import circle: :mod:`._simmemory` and :mod:`._simcq` stand on this module,
:mod:`._simwire` (the queue pairs and the wire between them) on those, and
:mod:`._simverbs` (the fabric, contexts and protection domains) on all of them."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

from .._errors import PostError
from .._rdma.completions import CompletionArray, WorkCompletion
from .._rdma.constants import WC_WITH_IMM, AsyncEvent, Numbered, Opcode, WCOpcode, WCStatus, event_type_name
from .._rdma.lifetime import Resource

__all__ = ["SimWCArray", "SimWorkCompletion"]

_T = TypeVar("_T")


class _PyBuffer(ctypes.Structure):
    """``Py_buffer``: what ``PyObject_GetBuffer`` fills (the address of a read-only buffer, which
    ``ctypes.c_char.from_buffer`` refuses)."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]  # fmt: skip


def _pin_readonly(obj: Any) -> tuple[_PyBuffer, int]:
    """A buffer export of ``obj`` (released by :func:`_unpin`) and its address."""
    view = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(obj), ctypes.byref(view), 0) != 0:  # PyBUF_SIMPLE
        raise TypeError("the object has no contiguous buffer")
    return view, int(view.buf or 0)


def _unpin(view: _PyBuffer) -> None:
    ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))
_LIVE_KEYS: Final = ("contexts", "pds", "mrs", "mws", "cqs", "channels", "qps", "srqs", "registered_bytes")
_COUNTERS: Final = (
    "posts", "recv_posts", "polls", "polled", "req_notify", "events", "async_events",
    "completions", "errors", "rnr_errors", "bytes", "cq_overruns", "dropped",
)  # fmt: skip
#: ibv_event_type_str(), by event type
_EVENT_TEXT: Final = (
    "CQ error", "local work queue catastrophic error", "invalid request local work queue error",
    "local access violation work queue error", "communication established", "send queue drained",
    "path migrated", "path migration request error", "local catastrophic error", "port active",
    "port error", "LID change", "P_Key change", "SM change", "SRQ catastrophic error",
    "SRQ limit reached", "last WQE reached", "client reregistration", "GID table change", "WQ fatal",
)  # fmt: skip
_EVENT_KIND: Final = {0: "cq", 8: "device", 14: "srq", 15: "srq", 19: "wq"} | dict.fromkeys(
    (9, 10, 11, 12, 13, 17, 18), "port"
)
#: send WR opcode -> completion opcode
#: the send opcode of a BIND_MW (``IBV_WR_BIND_MW``; posted only through post_bind_mw)
_OP_BIND: Final = 8
_WC_OF: Final = {
    Opcode.RDMA_WRITE: WCOpcode.RDMA_WRITE,
    Opcode.RDMA_WRITE_WITH_IMM: WCOpcode.RDMA_WRITE,
    Opcode.SEND: WCOpcode.SEND,
    Opcode.SEND_WITH_IMM: WCOpcode.SEND,
    Opcode.RDMA_READ: WCOpcode.RDMA_READ,
}
_WC_OP: Final = {**{int(k): int(v) for k, v in _WC_OF.items()}, _OP_BIND: int(WCOpcode.BIND_MW)}
_MAX_SGE: Final = 32
_GID_TBL_LEN: Final = 16
_OK: Final = int(WCStatus.SUCCESS)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _post_recvs(post: Callable[[int, int, int, int], int], addrs: Sequence[int], lens: Sequence[int], lkey: int,
                wr_ids: Sequence[int], call: str) -> None:  # fmt: skip
    """Post receive buffers one by one through ``post(wr_id, addr, length, lkey)`` (0 or an errno),
    as a chained ``ibv_post_recv``/``ibv_post_srq_recv``: :class:`PostError` says how many went."""
    n = len(addrs)
    if not (len(lens) == len(wr_ids) == n):
        raise ValueError("addrs, lens and wr_ids must have the same length")
    for i in range(n):
        err = post(wr_ids[i], addrs[i], lens[i], lkey)
        if err:
            raise PostError(err, call, i, n)

class _Retiring(Protocol):
    """A QP as a polled send completion sees it: polling frees its send-queue slots."""

    _sq_retired: int


class _Failable(Protocol):
    """A QP as its CQ sees it: an overrun of the CQ moves it to ERROR."""

    def _enter_error(self) -> None: ...


class _Recording(Protocol):
    """A QP the native path records work requests for (record mode: ``_native/aiordma_fast.h``)."""

    def post_records(self, chan: Any) -> None: ...


class _ReadyQueue(Generic[_T]):
    """A FIFO whose pipe read end is readable exactly while the FIFO is non-empty."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._items: deque[_T] = deque()

    def fileno(self) -> int:
        return self._r

    def push(self, item: _T) -> None:
        if not self._items:
            os.write(self._w, b"\x01")
        self._items.append(item)

    def pop(self, max_items: int) -> list[_T]:
        out: list[_T] = []
        while self._items and len(out) < max_items:
            out.append(self._items.popleft())
        if out and not self._items:
            try:
                os.read(self._r, 1)
            except BlockingIOError:  # pragma: no cover - someone else read it
                pass
        return out

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)



class _Completion:
    """A queued completion; ``qp``/``sq_seq`` let polling retire send-queue slots."""

    __slots__ = ("wr_id", "status", "opcode", "byte_len", "imm", "qp_num", "src_qp", "solicited", "qp", "sq_seq")

    def __init__(self, wr_id: int, status: int, opcode: int, byte_len: int, imm: int, qp_num: int, *,
                 src_qp: int = 0, solicited: bool = False, qp: _Retiring | None = None,
                 sq_seq: int = 0) -> None:  # fmt: skip
        self.wr_id, self.status, self.opcode, self.byte_len = wr_id, status, opcode, byte_len
        self.imm, self.qp_num, self.src_qp, self.solicited = imm, qp_num, src_qp, solicited
        self.qp, self.sq_seq = qp, sq_seq



SimWorkCompletion = WorkCompletion


class SimWCArray(CompletionArray):
    """The counterpart of ``verbs.WCArray``: ``cq.poll_into(arr)`` fills it."""

    def __init__(self, n: int) -> None:
        if n <= 0:
            raise ValueError("a WCArray needs at least one entry")
        self.n = n
        self._wc: list[_Completion | None] = [None] * n

    def _get(self, i: int) -> _Completion:
        c = self._wc[i]
        if c is None:
            raise IndexError(f"entry {i} was never filled")
        return c

    def __getitem__(self, i: int) -> WorkCompletion:
        c = self._get(i)
        imm = None if c.imm < 0 else c.imm
        return WorkCompletion(c.wr_id, c.status, c.opcode, c.byte_len, imm, c.qp_num, c.src_qp, 0,
                              0 if imm is None else WC_WITH_IMM)  # fmt: skip

    def entries(self, count: int) -> list[tuple[int, int, int, int, int, int]]:
        return [(c.wr_id, c.status, c.opcode, c.byte_len, c.imm, c.qp_num) for c in map(self._get, range(count))]



class _Accounts:
    """What a fabric keeps for every object of its own: the :attr:`counters` of posts, polls and
    events, the live objects, the numbers and keys it handed out (never reused), and the QPs the
    native path records for (by the address of their chan)."""

    def __init__(self, seed: int) -> None:
        self.counters: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self.live: dict[str, int] = dict.fromkeys(_LIVE_KEYS, 0)
        self.recorders: dict[int, _Recording] = {}
        self._rng = random.Random(seed)
        self._issued: set[int] = set()

    def new_id(self, lo: int, hi: int) -> int:
        while True:
            v = self._rng.randrange(lo, hi)
            if v not in self._issued:
                self._issued.add(v)
                return v


class _SimResource(Resource):
    """A simulated verbs object under the same lifetime rule as the native ones
    (:mod:`aiordma._rdma.lifetime`), counted in its fabric's ``live_objects()``."""

    def __init__(self, accounts: _Accounts, parents: Sequence[_SimResource]) -> None:
        super().__init__(parents)
        self._accounts = accounts
        accounts.live[self._kind] += 1

    def _counted(self, kind: str, delta: int) -> None:
        self._accounts.live[kind] += delta


@dataclass(frozen=True, slots=True)
class _Device:
    name: str
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    gids: tuple[ipaddress.IPv6Address, ipaddress.IPv6Address]  # index 0 link-local, 1 from the IP
    node_guid: int
    active_mtu: int
    max_qp_wr: int
    max_cqe: int
    max_inline_data: int
    max_qp_rd_atom: int
    memory_windows: bool = True



class _SimContextBase(_SimResource):
    """What the children of a context (:class:`aiordma.testing._simverbs.SimContext`) use of it:
    its device, its QPs (by number) and its async-event queue."""

    _device: _Device
    _events: _ReadyQueue[AsyncEvent]
    _qps: dict[int, Numbered]

    def _post_event(self, etype: int, *, qp: Numbered | None = None, cq: object = None, srq: object = None,
                    qp_event: bool = False) -> None:  # fmt: skip
        kind = "qp" if qp_event or qp is not None else _EVENT_KIND.get(etype, "qp")
        text = _EVENT_TEXT[etype] if 0 <= etype < len(_EVENT_TEXT) else "unknown"
        self._events.push(AsyncEvent(etype, event_type_name(etype), text, kind, qp=qp, cq=cq, srq=srq,
                                     port=1 if kind == "port" else None))  # fmt: skip
        self._accounts.counters["async_events"] += 1


class _SimDomainBase(_SimResource):
    """What the children of a protection domain use of it: its context."""

    context: _SimContextBase

