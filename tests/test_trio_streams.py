"""trio's own stream suite on aiordma streams (issue 31, item 2).

``trio.testing.check_half_closeable_stream`` checks what any trio stream must do: bytes in
order both ways at once, ``send_eof`` then b"", a closed receiver makes the sender's next sends
fail (``BrokenResourceError``), a cancelled ``aclose`` still closes, a receive waiting on a
stream closed under it fails with ``ClosedResourceError``, every call a checkpoint.  It runs on
aiordma byte streams over TCP, TLS, the simulated RC wire and (in the guest) rxe, through a
thin adapter: trio's names and exception classes for anyio's, and trio's one-task-at-a-time
checks (anyio's streams leave those to the caller).  trio's "clogged stream" half is not run: an
aiordma stream has no ``wait_send_all_might_not_block`` that waits for room.
"""

from __future__ import annotations

import operator
import os
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

import aiordma
from aiordma import RdmaConfig
from aiordma.testing import SimFabric, rdma_address, simulated_backend

trio = pytest.importorskip("trio")
import trio.testing  # noqa: E402

pytestmark = pytest.mark.anyio


class _OneAtATime:
    """trio's rule for a stream: one task sending (or receiving) at a time, else BusyResourceError."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.busy = False

    def __enter__(self) -> None:
        if self.busy:
            raise trio.BusyResourceError(f"another task is {self.what} on this stream")
        self.busy = True

    def __exit__(self, *exc: object) -> None:
        self.busy = False


class TrioStream(trio.abc.HalfCloseableStream):  # type: ignore[misc]
    """An aiordma byte stream as a ``trio.abc.HalfCloseableStream``: names and exceptions only."""

    def __init__(self, stream: aiordma.Stream) -> None:
        self._stream = stream
        self._send = _OneAtATime("sending")
        self._receive = _OneAtATime("receiving")
        self._closed = False

    async def _call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        try:
            return await fn(*args)
        except anyio.BrokenResourceError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc
        except anyio.ClosedResourceError as exc:
            raise trio.ClosedResourceError(str(exc)) from exc

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send:
            await self._call(self._stream.send, bytes(data))

    async def wait_send_all_might_not_block(self) -> None:
        with self._send:
            if self._closed:
                raise trio.ClosedResourceError
            await trio.lowlevel.checkpoint()

    async def send_eof(self) -> None:
        with self._send:
            await self._call(self._stream.send_eof)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)  # (a float is a TypeError, as trio wants)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        with self._receive:
            try:
                data: bytes = await self._call(self._stream.receive, max_bytes or 65536)
                return data
            except anyio.EndOfStream:
                return b""

    async def aclose(self) -> None:
        self._closed = True
        await self._call(self._stream.aclose)


KINDS = [
    pytest.param("tcp", id="tcp"),
    pytest.param("tls", id="tls"),
    pytest.param("sim", id="sim"),
    pytest.param("sim-checked", id="sim-checked"),  # the checked (Python) data path
    pytest.param("rxe", id="rxe", marks=pytest.mark.rdma),
]


@pytest.mark.guest_loops("trio")
@pytest.mark.parametrize("anyio_backend", [pytest.param(("trio", {}), id="trio")])
@pytest.mark.parametrize("kind", KINDS)
async def test_trios_stream_suite_passes_on_aiordma_streams(anyio_backend: Any, kind: str, tlsdir: str) -> None:
    fabric: SimFabric | None = None
    host, options, client_options = "127.0.0.1", {}, {}  # type: ignore[var-annotated]
    if kind == "tls":
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_ctx.load_cert_chain(os.path.join(tlsdir, "server.pem"))
        options = {"ssl": server_ctx, "transport": "tcp"}
        client_options = {"ssl": ssl.create_default_context(cafile=os.path.join(tlsdir, "ca.pem")), "transport": "tcp"}
    elif kind == "tcp":
        options = client_options = {"transport": "tcp"}
    elif kind.startswith("sim"):
        fabric = SimFabric()
        fabric.add_device("sim0", "127.0.0.1")
        config = RdmaConfig(hot_path="checked") if kind == "sim-checked" else None
        options = client_options = {"transport": "rdma", "rdma_backend": simulated_backend(config, fabric=fabric)}
    else:
        address = rdma_address()
        assert address is not None, "no RDMA device with an IPv4 RoCEv2 address"
        host = address
        options = client_options = {"transport": "rdma"}
    made: list[TrioStream] = []

    async def stream_maker() -> tuple[TrioStream, TrioStream]:
        send, receive = anyio.create_memory_object_stream[Any](1)
        async with await aiordma.create_listener(host, 0, **options) as listener, send, receive:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve, send.send)
                client = await aiordma.connect(host, listener.port, **client_options)
                server = await receive.receive()
                tg.cancel_scope.cancel()
        pair = TrioStream(client), TrioStream(server)
        made.extend(pair)
        return pair

    try:
        with trio.fail_after(120):
            await trio.testing.check_half_closeable_stream(stream_maker, None)
    finally:
        with trio.CancelScope(shield=True):
            for stream in made:  # (trio's suite closes what it made; a failed check may not have)
                await trio.aclose_forcefully(stream)
        if fabric is not None:
            fabric.release()
            left = {k: v for k, v in fabric.live_objects().items() if v}
            assert not left, f"verbs objects left: {left}"
