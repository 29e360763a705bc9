"""One-sided operations over a :class:`~aiordma._conn.core.Core`: the thin async glue.

The rules live in :mod:`aiordma._proto.onesided` (sans I/O); this module sends its
frames and waits.  Over an RDMA link (native data path) ``read``/``write``
are RDMA READ/WRITE work requests (:meth:`RdmaLink.rdma`); over TCP, or an
RDMA connection on the checked data path, the peer's aiordma serves them
through MEMORY frames.  Both give the same results and the same errors.

Cancellation: ``read`` and ``write`` are cancel points.  A cancelled RDMA
operation returns only after its completion came back (the NIC may use the
memory until then); a cancelled TCP ``read`` leaves ``into`` as it was or
partly written, a cancelled ``write`` may or may not have landed -- as with
a cancelled socket write.  Leaving an ``expose`` block (also by an error or
a cancellation) always revokes: it is shielded, bounded by
``revoke_timeout``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from .core import Core, NicExposure
from .memory import RegisteredMemory
from .._proto.onesided import READ, WRITE, Exposure, RemoteBuffer

__all__ = ["expose", "read", "write", "written", "REVOKE_TIMEOUT"]

#: how long leaving an exposure waits for the peer to confirm the revocation (seconds)
REVOKE_TIMEOUT = 5.0
#: TCP: requests of one read or write in flight at once, at most
_PIPELINE = 8


def _byte_view(obj: Any, writable: bool) -> memoryview:
    if isinstance(obj, RegisteredMemory):
        view = obj.view
    else:
        view = memoryview(obj)
    if writable and view.readonly:
        raise TypeError("the buffer must be writable")
    if not view.c_contiguous:
        raise TypeError("the buffer must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


async def _wait_result(core: Core, op: int) -> bytes:
    mem = core.memory
    while mem.results.get(op) is None:
        if core.closed or core.error is not None or core.peer_close is not None:
            mem.abandon(op)
            core.check_send()
        await core.link.incoming()
    return mem.take_result(op)


@asynccontextmanager
async def expose(
    core: Core, obj: Any, *, read: bool = True, write: bool = False, revoke_timeout: float = REVOKE_TIMEOUT
) -> AsyncIterator[RemoteBuffer]:
    await core.checkpoint()
    core.check_send()
    access = (READ if read else 0) | (WRITE if write else 0)
    view = _byte_view(obj, writable=bool(write))
    if not view.nbytes:
        raise ValueError("cannot expose an empty buffer")
    link = core.link
    nic = core.nic
    region: NicExposure | None = None
    addr = rkey = 0
    if nic is not None:
        region = await nic.expose_region(view, access)
        addr, rkey = region.addr, region.rkey
    held = obj if isinstance(obj, RegisteredMemory) else None
    if held is not None:
        held.hold()
    exp: Exposure | None = None
    try:
        exp, payload = core.memory.expose(view, access, addr, rkey)
        exp.region = region
        await link.send([core.proto.send_memory(payload)])
        if link.pulls:
            # a pull link reads only while a task waits on it: keep one reading, so that the
            # peer's requests and its REVOKED are seen while the application does other things
            async with anyio.create_task_group() as tg:
                tg.start_soon(_serve, core)
                try:
                    yield exp.descriptor
                finally:
                    tg.cancel_scope.cancel()
        else:
            yield exp.descriptor
    finally:
        with anyio.CancelScope(shield=True):
            try:
                if exp is not None:
                    await _revoke(core, exp, revoke_timeout)
            finally:
                if region is not None and nic is not None:
                    nic.release_region(region)
                if held is not None:
                    held.unhold()


async def _serve(core: Core) -> None:
    while not (core.closed or core.error is not None or core.peer_close is not None):
        await core.link.wait_incoming()
    await anyio.sleep_forever()


async def _revoke(core: Core, exp: Exposure, timeout: float) -> None:
    mem = core.memory
    if exp.state == Exposure.ENDED:
        return
    try:
        if core.closed or core.error is not None or core.peer_close is not None:
            return  # the connection is over: the peer can reach nothing any more
        await core.link.send([core.proto.send_memory(mem.revoke(exp))])
        if exp.region is None:
            return  # served by us: from now on we refuse the peer's requests; nothing to wait for
        with anyio.move_on_after(timeout):
            while exp.state != Exposure.ENDED:
                if core.closed or core.error is not None or core.peer_close is not None:
                    return
                await core.link.incoming()
    except Exception:  # the connection failed while revoking: nothing to confirm any more
        return
    finally:
        mem.end(exp)


async def read(core: Core, remote: RemoteBuffer, into: Any, offset: int = 0, length: int | None = None) -> int:
    await core.checkpoint()
    core.check_send()
    view = _byte_view(into, writable=True)
    n = view.nbytes if length is None else length
    if n > view.nbytes:
        raise ValueError(f"length {n} is more than the {view.nbytes} bytes of the destination")
    mem = core.memory
    rec = mem.check(remote, offset, n, READ)
    mem.begin(rec)
    try:
        if not n:
            return 0
        link = core.link
        nic = core.nic
        if nic is not None and remote.rkey:
            await nic.rdma(False, view[:n], remote.addr + offset, remote.rkey)
            return n
        step = mem.max_in
        pos = 0
        pending: list[tuple[int, int, int]] = []  # (op, position, length)
        try:
            while pos < n or pending:
                while pos < n and len(pending) < _PIPELINE:
                    piece = min(step, n - pos)
                    op, payload = mem.read_request(rec, offset + pos, piece)
                    pending.append((op, pos, piece))
                    await link.send([core.proto.send_memory(payload)])
                    pos += piece
                op, at, piece = pending[0]
                data = await _wait_result(core, op)
                pending.pop(0)
                view[at : at + piece] = data
        finally:
            for op, _at, _piece in pending:
                mem.abandon(op)
        return n
    finally:
        revoked = mem.finish(rec)
        if revoked is not None:
            core.send_memory_nowait(revoked)


async def write(core: Core, remote: RemoteBuffer, data: Any, offset: int = 0, notify: bool = False) -> None:
    await core.checkpoint()
    core.check_send()
    view = _byte_view(data, writable=False)
    n = view.nbytes
    mem = core.memory
    rec = mem.check(remote, offset, n, WRITE)
    mem.begin(rec)
    try:
        if not n:
            return
        link = core.link
        nic = core.nic
        if nic is not None and remote.rkey:
            await nic.rdma(True, view, remote.addr + offset, remote.rkey)
            if notify:
                await link.send([core.proto.send_memory(mem.notice(rec, offset, n))])
            return
        step = mem.max_out
        pos = 0
        pending: list[int] = []
        try:
            while pos < n or pending:
                while pos < n and len(pending) < _PIPELINE:
                    piece = min(step, n - pos)
                    op, payload = mem.write_request(rec, offset + pos, view[pos : pos + piece])
                    pending.append(op)
                    await link.send([core.proto.send_memory(payload)])
                    pos += piece
                await _wait_result(core, pending[0])
                pending.pop(0)
        finally:
            for op in pending:
                mem.abandon(op)
    finally:
        revoked = mem.finish(rec)
        if revoked is not None:
            core.send_memory_nowait(revoked)


async def written(core: Core, remote: RemoteBuffer) -> tuple[int, int]:
    """The exposer: wait for the next write into ``remote`` that landed; ``(offset, length)``."""
    await core.checkpoint()
    exp = core.memory.exposures.get(remote.id)
    if exp is None or exp.descriptor != remote:
        raise ValueError("written() takes a descriptor this side exposed (and that is still exposed)")
    while not exp.notices:
        if exp.state != Exposure.LIVE:
            raise anyio.ClosedResourceError("the exposure has ended")
        core.check_receive()
        await core.link.incoming()
    return exp.notices.popleft()
