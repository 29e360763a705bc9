"""One end of a pair on another host, driven from this one: the conformance suite across hosts.

The conformance suite drives both ends of a pair from one test.  Across two hosts the far end
lives in another process on another machine, so :func:`remote_pair` gives the test a local end
(a real aiordma connection to the other host, over RDMA in the bed) and a :class:`RemoteEnd`:
a stand-in whose ``send``/``receive``/``send_eof``/``aclose``/``extra`` run on the far end's
real object, one request each over a plain TCP control connection to
:func:`serve_remote_ends`.  The data under test crosses the wire on the aiordma connection;
the control connection only carries what the far end was told to send and what it received.

Contracts of the stand-in: requests run concurrently on the far end (two tasks may send at
once; a second receive is answered ``BusyResourceError`` there); an exception raised there is
raised here with the same class (anyio's stream errors, ``TypeError``, aiordma's own errors);
a cancelled call is cancelled there too and returns only once the far end answered, and if the
far end had already received something, the next ``receive`` returns it (nothing is lost).
"""

from __future__ import annotations

import itertools
import json
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

import aiordma

__all__ = ["RemoteEnd", "remote_pair", "serve_remote_ends", "CONTROL_PORT"]

#: where :func:`serve_remote_ends` listens for control connections
CONTROL_PORT = 7103
_LEN = struct.Struct(">II")
_ERRORS: dict[str, type[BaseException]] = {
    cls.__name__: cls
    for cls in (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.BusyResourceError,
                TypeError, ValueError)  # fmt: skip
}


def _error_class(name: str) -> type[BaseException]:
    cls = _ERRORS.get(name) or getattr(aiordma, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else RuntimeError


async def _write(stream: anyio.abc.ByteStream, lock: anyio.Lock, header: dict[str, Any], payload: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    async with lock:
        await stream.send(_LEN.pack(len(raw), len(payload)) + raw + payload)


class _Reader:
    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self.buf += await self.stream.receive(1 << 20)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def read(self) -> tuple[dict[str, Any], bytes]:
        hlen, plen = _LEN.unpack(await self._exactly(_LEN.size))
        header = json.loads(await self._exactly(hlen))
        return header, await self._exactly(plen)


# -- the far end -----------------------------------------------------------------------------


async def serve_remote_ends(host: str, *, transport: str = "rdma", port: int = CONTROL_PORT,
                            task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:  # fmt: skip
    """Serve control connections on ``host:port`` until cancelled: each asks for one pair
    (``{"op": "pair", "mode": "stream"|"channel", "limit": N, "config": {...}}``), gets the port of
    a fresh one-connection listener, and then drives the end that connection gave."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
    task_status.started()
    async with listener:
        await listener.serve(lambda s: _drive(s, host, transport))


async def _drive(ctl: anyio.abc.ByteStream, host: str, transport: str) -> None:
    reader, lock = _Reader(ctl), anyio.Lock()
    async with ctl:
        try:
            first, _ = await reader.read()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            return
        mode = str(first.get("mode"))
        config = first.get("config") or {}
        backend = aiordma.RdmaBackend(aiordma.RdmaConfig(**config)) if config else None
        if mode == "stream":
            listener: Any = await aiordma.create_listener(host, 0, transport=transport, rdma_backend=backend)
        else:
            listener = await aiordma.create_channel_listener(host, 0, transport=transport, rdma_backend=backend,
                                                             max_message_size=int(first.get("limit", 65536)))  # fmt: skip
        ends: list[Any] = []
        got = anyio.Event()
        done = anyio.Event()

        async def handler(end: Any) -> None:
            ends.append(end)
            got.set()
            await done.wait()  # (the end lives as long as its control connection)

        async with anyio.create_task_group() as outer:
            accepting = anyio.CancelScope()

            async def accept() -> None:
                with accepting:
                    await listener.serve(handler, outer)

            outer.start_soon(accept)
            try:
                await _write(ctl, lock, {"port": listener.port})
                with anyio.fail_after(120):
                    await got.wait()
            finally:
                accepting.cancel()  # one connection per pair
                await listener.aclose()
            end = ends[0]
            await _write(ctl, lock, {"extras": _extras(end)})
            scopes: dict[int, anyio.CancelScope] = {}
            try:
                async with end, anyio.create_task_group() as tg:
                    while True:
                        try:
                            header, payload = await reader.read()
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            break
                        if header["op"] == "cancel":
                            scope = scopes.get(int(header["target"]))
                            if scope is not None:
                                scope.cancel()
                            continue
                        scope = anyio.CancelScope()
                        scopes[int(header["id"])] = scope
                        tg.start_soon(_run_op, end, mode, header, payload, scope, scopes, ctl, lock)
                    tg.cancel_scope.cancel()
            finally:
                done.set()


def _extras(end: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, attr in vars(aiordma.TransportAttribute).items():
        if name.startswith("_"):
            continue
        try:
            value = end.extra(attr)
            json.dumps(value)
        except Exception:  # (not provided by this end, or not JSON: left out)
            continue
        out[name] = value
    return out


async def _run_op(end: Any, mode: str, header: dict[str, Any], payload: bytes, scope: anyio.CancelScope,
                  scopes: dict[int, anyio.CancelScope], ctl: anyio.abc.ByteStream, lock: anyio.Lock) -> None:  # fmt: skip
    rid, op = int(header["id"]), header["op"]
    answer: dict[str, Any] = {"id": rid}
    out = b""
    with scope:
        try:
            if op == "send":
                await end.send(payload)
            elif op == "receive":
                out = await (end.receive(int(header["max"])) if mode == "stream" else end.receive())
                answer["value"] = True
            elif op == "send_eof":
                await end.send_eof()
            elif op == "aclose":
                await end.aclose()
            elif op == "extra":
                attr = getattr(aiordma.TransportAttribute, str(header["name"]))
                answer["value"] = end.extra(attr)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # (raised again on the other host)
            answer.update(error=type(exc).__name__, message=str(exc))
    if scope.cancelled_caught:
        answer["cancelled"] = True
    scopes.pop(rid, None)
    try:
        await _write(ctl, lock, answer, out)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass  # (the test went away)


# -- the test's side -------------------------------------------------------------------------


class RemoteEnd:
    """The far end of a :func:`remote_pair`, driven over its control connection."""

    def __init__(self, ctl: anyio.abc.ByteStream, mode: str) -> None:
        self._extras: dict[str, Any] = {}
        self._ctl = ctl
        self._reader = _Reader(ctl)
        self._lock = anyio.Lock()
        self._ids = itertools.count(1)
        self._answers: dict[int, tuple[dict[str, Any], bytes]] = {}
        self._events: dict[int, anyio.Event] = {}
        self._kept: list[bytes] = []  # received there while the call here was cancelled
        self.mode = mode

    async def _pump(self) -> None:
        try:
            while True:
                header, payload = await self._reader.read()
                rid = int(header["id"])
                self._answers[rid] = (header, payload)
                event = self._events.pop(rid, None)
                if event is not None:
                    event.set()
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            for event in self._events.values():
                event.set()

    async def _call(self, op: str, payload: bytes = b"", **args: Any) -> tuple[dict[str, Any], bytes]:
        rid = next(self._ids)
        event = self._events[rid] = anyio.Event()
        await _write(self._ctl, self._lock, {"id": rid, "op": op, **args}, payload)
        try:
            await event.wait()
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.fail_after(60):
                await _write(self._ctl, self._lock, {"id": 0, "op": "cancel", "target": rid})
                await event.wait()
            header, data = self._answers.pop(rid, ({}, b""))
            if header.get("value") is True and not header.get("cancelled"):
                self._kept.append(data)  # it had arrived there already: the next receive gets it
            raise
        if rid not in self._answers:
            raise anyio.BrokenResourceError("the control connection to the far end was lost")
        header, data = self._answers.pop(rid)
        if "error" in header:
            raise _error_class(header["error"])(header.get("message", ""))
        return header, data

    async def send(self, item: Any) -> None:
        if not isinstance(item, (bytes, bytearray, memoryview)):
            raise TypeError(f"(the stand-in sends only bytes-like items, got {type(item).__name__})")
        await anyio.lowlevel.checkpoint()
        await self._call("send", bytes(memoryview(item).cast("B")))

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._kept:
            await anyio.lowlevel.checkpoint()
            return self._kept.pop(0)
        return (await self._call("receive", max=max_bytes))[1]

    async def send_eof(self) -> None:
        await self._call("send_eof")

    async def aclose(self) -> None:
        await self._call("aclose")

    def extra(self, attribute: Any, default: Any = anyio.TypedAttributeLookupError) -> Any:
        """The far end's transport attributes, as they were when the pair was made."""
        name = next((k for k, v in vars(aiordma.TransportAttribute).items() if v is attribute), None)
        if name in self._extras:
            return self._extras[name]
        if default is anyio.TypedAttributeLookupError:
            raise anyio.TypedAttributeLookupError("the far end did not report this attribute")
        return default

    def __aiter__(self) -> RemoteEnd:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None


@asynccontextmanager
async def remote_pair(peer: str, mode: str, *, transport: str = "rdma", limit: int = 65536,
                      config: dict[str, Any] | None = None,
                      control_port: int = CONTROL_PORT) -> AsyncIterator[tuple[Any, RemoteEnd]]:  # fmt: skip
    """``(local, remote)``: ``local`` a real aiordma Stream or Channel connected to ``peer``
    (``mode`` ``"stream"`` or ``"channel"``; ``limit`` both sides' message limit; ``config``
    RdmaConfig fields for both), ``remote`` the stand-in for the end it reached there."""
    with anyio.fail_after(300):  # (host a boots on its own schedule)
        while True:
            try:
                ctl = await anyio.connect_tcp(peer, control_port)
                break
            except OSError:
                await anyio.sleep(0.5)
    async with ctl:
        remote = RemoteEnd(ctl, mode)
        await _write(ctl, remote._lock, {"op": "pair", "mode": mode, "limit": limit, "config": config or {}})
        header, _ = await remote._reader.read()
        backend = aiordma.RdmaBackend(aiordma.RdmaConfig(**config)) if config else None
        if mode == "stream":
            local: Any = await aiordma.connect(peer, int(header["port"]), transport=transport, rdma_backend=backend)
        else:
            local = await aiordma.connect_channel(peer, int(header["port"]), transport=transport,
                                                  rdma_backend=backend, max_message_size=limit)  # fmt: skip
        async with local:
            remote._extras = (await remote._reader.read())[0]["extras"]
            async with anyio.create_task_group() as tg:
                pumped = anyio.Event()

                async def pump() -> None:
                    try:
                        await remote._pump()
                    finally:
                        pumped.set()

                tg.start_soon(pump)
                try:
                    yield local, remote
                finally:
                    with anyio.CancelScope(shield=True):
                        await ctl.send_eof()  # the far end closes its end, then the control connection
                        with anyio.move_on_after(30):
                            await pumped.wait()
                    tg.cancel_scope.cancel()
