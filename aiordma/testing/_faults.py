"""Scheduled faults for a test pair: what breaks, on which side, after how many of its steps.

Theory of operation
-------------------
A *step* is one call a side's code makes on its endpoint -- ``send``, ``receive``,
``receive_into`` or ``send_eof`` (an ``async for`` over a channel is one ``receive`` per message).
A :class:`Fault` with ``after=k`` fires in the faulted side's own task, when that side starts its
``k+1``-th call: before the call, so what the call then meets is the fault's result.  Counting the
side's own calls (not bytes, not wake-ups) makes a schedule mean the same on every kind of pair and
under every event loop, and makes it replay: the side's calls come in the order its code makes
them, so the same schedule fires at the same point of the same conversation.

What the faulted side's code meets afterwards: after ``close``, ``abort``, ``reset`` and ``dead``
its endpoint is closed -- its next calls raise ``ClosedResourceError``, as when another task of its
own closed it.  After the wire faults (``lost_link``, ``rnr``, the holds) it goes on, and meets
what the wire does.  What the *other* side meets is what a real peer would produce (see
:data:`FAULT_KINDS`), and that is what a property test of the user's code looks at.

Holds end when the program is quiet (``anyio.wait_all_tasks_blocked``): every ACK or completion
held comes after everything else that could happen first -- the latest a NIC may deliver it, and
a point that does not depend on timing.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import anyio
from anyio.abc import SocketAttribute, TaskGroup

from .._api import Channel, Stream, core_of
from .._attributes import TransportAttribute

if TYPE_CHECKING:
    from .._conn.core import Core
    from ._simverbs import SimFabric

__all__ = ["Fault", "FaultKind", "FAULT_KINDS", "FaultyStream", "FaultyChannel", "supported_faults"]

FaultKind = Literal["close", "abort", "reset", "dead", "lost_link", "rnr", "hold_acks", "hold_completions"]
Side = Literal["client", "server"]

#: every kind of fault, in the order hypothesis shrinks them (simplest first), with what it does
#: and what the other side's code sees
FAULT_KINDS: dict[str, str] = {
    "close": "the side closes its endpoint in order (aclose): the peer reads everything, then the end",
    "abort": "the side's close is cancelled (an abort): the peer sees the end, or the connection broken",
    "dead": "the side's process dies: no CLOSE, its kernel ends the connection (a FIN; on the "
    "simulated wire its QP vanishes too): the peer sees the connection broken",
    "reset": "the connection is reset (an RST, no CLOSE): the peer sees the connection broken",
    "lost_link": "the RDMA link between the two QPs is lost (both vanish from the wire): the next "
    "send either way fails with retry exceeded",
    "rnr": "the side has no receive posted when the peer's next message comes (receiver not "
    "ready, retries exhausted): the peer's send fails, the connection breaks",
    "hold_acks": "the ACKs of the side's sends come late -- after everything else that can happen",
    "hold_completions": "the side's receive completions come late: the data is placed and ACKed, "
    "the side learns of it after everything else that can happen",
}

_EVERYWHERE = ("close", "abort", "dead", "reset")
_SUPPORTED: dict[str, tuple[str, ...]] = {
    "memory": _EVERYWHERE,
    "tcp": _EVERYWHERE,
    "rdma": _EVERYWHERE,
    "sim": tuple(FAULT_KINDS),
}


def supported_faults(kind: str) -> tuple[str, ...]:
    """The fault kinds a pair of ``kind`` can apply (the wire faults need the simulated wire)."""
    try:
        return _SUPPORTED[kind]
    except KeyError:
        raise ValueError(f"no pair kind {kind!r} (have: {', '.join(_SUPPORTED)})") from None


@dataclass(frozen=True)
class Fault:
    """``kind`` happens to ``side`` when it starts its ``after+1``-th step (see the module docs)."""

    kind: FaultKind
    side: Side = "server"
    after: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"no fault kind {self.kind!r} (have: {', '.join(FAULT_KINDS)})")
        if self.side not in ("client", "server"):
            raise ValueError(f"a fault's side is 'client' or 'server', not {self.side!r}")
        if self.after < 0:
            raise ValueError("a fault's step (after) is 0 or more")

    def __str__(self) -> str:
        return f"{self.kind} of the {self.side} after its step {self.after}"


class _Resettable(Protocol):
    """A pipe end that can end the connection as a TCP reset does (``MemoryByteStream``)."""

    def reset(self) -> None: ...


class _Injector:
    """Applies a schedule to one pair: counts each side's steps, fires what is due."""

    def __init__(self, kind: str, faults: Sequence[Fault], fabric: SimFabric | None,
                 pipes: dict[str, _Resettable] | None = None) -> None:  # fmt: skip
        have = supported_faults(kind)
        for fault in faults:
            if fault.kind not in have:
                raise ValueError(f"a {kind!r} pair cannot apply {fault.kind!r} (it can: {', '.join(have)}; "
                                 "the wire faults need the simulated wire, kind 'sim')")  # fmt: skip
        self.kind = kind
        self.faults = tuple(faults)
        self.fabric = fabric
        self.pipes = pipes or {}
        self.steps: dict[str, int] = {"client": 0, "server": 0}
        self.ends: dict[str, Stream | Channel] = {}
        self.fired: list[Fault] = []
        self.task_group: TaskGroup | None = None
        self._held: set[int] = set()
        #: whether the schedule needs tasks of its own (a hold's release)
        self.needs_tasks = any(fault.kind.startswith("hold_") for fault in self.faults)

    async def step(self, side: str) -> None:
        n = self.steps[side]
        self.steps[side] = n + 1
        for fault in self.faults:
            if fault.side == side and fault.after == n:
                self.fired.append(fault)
                await self._apply(fault)

    def _qp(self, side: str) -> int:
        qp: int = self.ends[side].extra(TransportAttribute.qp_num)
        return qp

    async def _apply(self, fault: Fault) -> None:
        side = fault.side
        other = "server" if side == "client" else "client"
        me = self.ends[side]
        kind = fault.kind
        if kind == "close":
            await me.aclose()
        elif kind == "abort":
            with anyio.CancelScope() as scope:
                scope.cancel()
                await me.aclose()
        elif kind in ("dead", "reset"):
            if self.fabric is not None and kind == "dead":
                self.fabric.kill_qp(self._qp(side))
            if kind == "reset":
                pipe = self.pipes.get(side)
                if pipe is not None:
                    pipe.reset()
                else:
                    sock = me.extra(SocketAttribute.raw_socket, None)
                    if sock is not None:  # (closing now sends an RST)
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await _die(me, f"injected fault: {fault}")
        elif kind == "lost_link":
            assert self.fabric is not None
            self.fabric.kill_qp(self._qp(side))
            self.fabric.kill_qp(self._qp(other))
        elif kind == "rnr":
            assert self.fabric is not None
            self.fabric.not_ready(self._qp(side))
        else:  # the holds
            assert self.fabric is not None and self.task_group is not None
            qp = self._qp(side)
            self.fabric.hold(qp, acks=kind == "hold_acks", recvs=kind == "hold_completions")
            self._held.add(qp)
            self.task_group.start_soon(self._release_when_quiet, qp)

    async def _release_when_quiet(self, qp: int) -> None:
        await anyio.wait_all_tasks_blocked()
        assert self.fabric is not None
        self._held.discard(qp)
        self.fabric.release(qp)

    def release(self) -> None:
        """The pair ends: what is still held comes now (a close must not wait on it)."""
        if self.fabric is not None:
            for qp in sorted(self._held):
                self.fabric.release(qp)
            self._held.clear()


async def _die(endpoint: Stream | Channel, why: str) -> None:
    """End ``endpoint``'s connection as a dying process's kernel does: no CLOSE frame, the
    transport closed (what was queued is flushed first, as a kernel does)."""
    core_of(endpoint).on_error(ConnectionAbortedError(why))
    with anyio.CancelScope(shield=True), suppress(anyio.BrokenResourceError, OSError):
        await endpoint.aclose()


class _Steps:
    """What both faulty endpoints share: each call is a step of the schedule, then the call."""

    _injector: _Injector
    _side: str

    async def receive_into(self, buffer: Any) -> int:
        await self._injector.step(self._side)
        got: int = await super().receive_into(buffer)  # type: ignore[misc]
        return got

    async def send(self, item: bytes) -> None:
        await self._injector.step(self._side)
        await super().send(item)  # type: ignore[misc]

    async def send_eof(self) -> None:
        await self._injector.step(self._side)
        await super().send_eof()  # type: ignore[misc]


class FaultyStream(_Steps, Stream):
    """A :class:`aiordma.Stream` whose calls are the steps of a fault schedule (see the module docs)."""

    def __init__(self, core: Core, injector: _Injector, side: str) -> None:
        super().__init__(core)
        self._injector = injector
        self._side = side

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await self._injector.step(self._side)
        return await super().receive(max_bytes)


class FaultyChannel(_Steps, Channel):
    """A :class:`aiordma.Channel` whose calls are the steps of a fault schedule (see the module docs)."""

    def __init__(self, core: Core, injector: _Injector, side: str) -> None:
        super().__init__(core)
        self._injector = injector
        self._side = side

    async def receive(self) -> bytes:
        await self._injector.step(self._side)
        return await super().receive()
