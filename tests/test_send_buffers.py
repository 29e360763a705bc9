"""Sends keep no reference to the caller's buffer once they returned.

On Python 3.12+ asyncio's socket transport keeps a reference to the part of a write it could not
send at once (3.11 copied it), and uvloop keeps the objects it is given: a reused ``bytearray``
(or a ``RegisteredBuffer``) changed after ``await send()`` returned would change bytes not yet
on the wire.  ``aiordma._tcp.links.write_chunks`` -- what every asyncio path writes through -- must
leave the transport only bytes that cannot change.  The transport here keeps references, as
3.12's does; the RDMA links copy what they did not post (tests/test_rdma_transport.py)."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from aiordma._tcp.links import write_chunks
from aiordma._proto.protocol import HEADER, FrameType


class KeepingTransport(asyncio.WriteTransport):
    """Keeps what it is given, by reference, as asyncio's transport does on 3.12 with what it
    could not send at once (``buffered``: it holds data already, so everything is kept)."""

    def __init__(self, buffered: int) -> None:
        super().__init__()
        self.kept: list[Any] = []
        self.buffered = buffered

    def write(self, data: Any) -> None:
        self.kept.append(data)  # (no copy)

    def get_write_buffer_size(self) -> int:
        return self.buffered + sum(memoryview(d).nbytes for d in self.kept)

    def is_closing(self) -> bool:
        return False


def frames(payload: Any) -> list[Any]:
    view = memoryview(payload)
    return [HEADER.pack(FrameType.DATA, 0, 0, view.nbytes), view]


@pytest.mark.parametrize("kind", ["bytearray", "registered-like"])
def test_buffered_mutable_chunks_are_copied(kind: str) -> None:
    payload = bytearray(os.urandom(100_000)) if kind == "bytearray" else memoryview(bytearray(os.urandom(100_000)))
    original = bytes(payload)
    transport = KeepingTransport(buffered=1)
    write_chunks(transport, frames(payload), -1)
    payload[:] = bytes(len(payload))  # the caller reuses its buffer at once
    sent = b"".join(bytes(memoryview(d)) for d in transport.kept)
    assert sent[HEADER.size :] == original  # without the copy: zeros


def test_immutable_chunks_are_not_copied() -> None:
    payload = os.urandom(100_000)
    transport = KeepingTransport(buffered=1)
    chunks = frames(payload)
    write_chunks(transport, chunks, -1)
    assert transport.kept[1] is chunks[1]  # a view of bytes: nothing to copy


def test_an_empty_transport_gets_only_what_the_socket_did_not_take_as_a_copy() -> None:
    a, b = socket.socketpair()
    try:
        a.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
        payload = bytearray(os.urandom(4 << 20))  # far more than the socket takes at once
        original = bytes(payload)
        transport = KeepingTransport(buffered=0)
        write_chunks(transport, frames(payload), a.fileno())
        payload[:] = bytes(len(payload))
        direct = b""
        b.setblocking(False)
        while True:
            try:
                got = b.recv(1 << 20)
            except BlockingIOError:
                break
            if not got:
                break
            direct += got
        rest = b"".join(bytes(memoryview(d)) for d in transport.kept)
        assert direct and rest, "the socket should take a part, the transport the rest"
        assert (direct + rest)[HEADER.size :] == original
        assert all(type(d) is bytes for d in transport.kept)  # (copies: the caller's buffer is free)
    finally:
        a.close()
        b.close()
