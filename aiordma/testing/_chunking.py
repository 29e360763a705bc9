"""A byte stream seen through a drawn chunking: where its receives split and coalesce.

TCP, TLS and RDMA all carry a byte stream without its ``send`` boundaries: one ``receive()``
may return part of what one ``send()`` wrote, or the end of one and the start of the next.
Code that assumes otherwise passes on a quiet loopback and fails under load.  A
:class:`Rechunked` stream makes the boundaries a parameter: its ``receive()`` returns exactly
the next size of the chunking (coalescing the inner stream's pieces until it has that many
bytes; fewer only at the end), whatever the timing -- so a property test that draws the
chunking (:func:`aiordma.testing.strategies.chunkings`) replays the same boundaries for the
same example, and hypothesis shrinks a failure to a minimal one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from anyio.abc import ByteStream

__all__ = ["Rechunked"]


class Rechunked(ByteStream):
    """``stream`` whose receives return the sizes of ``chunking`` in turn (cycled); sends pass
    through.  Cancellation: a receive cancelled while it gathers keeps what it had for the
    next one (nothing is lost).  Closing closes ``stream``."""

    def __init__(self, stream: ByteStream, chunking: Sequence[int]) -> None:
        if not chunking or any(size < 1 for size in chunking):
            raise ValueError("a chunking is one or more sizes of at least one byte")
        self.stream = stream
        self.chunking = tuple(chunking)
        self._next = 0
        self._buffer = bytearray()
        self._ended = False

    async def receive(self, max_bytes: int = 65536) -> bytes:
        want = min(self.chunking[self._next % len(self.chunking)], max_bytes)
        buffer = self._buffer
        if len(buffer) >= want:
            await anyio.lowlevel.checkpoint()
        while len(buffer) < want and not self._ended:
            try:
                buffer += await self.stream.receive(max(want - len(buffer), 65536))
            except anyio.EndOfStream:
                self._ended = True
        if not buffer:
            raise anyio.EndOfStream
        self._next += 1
        data = bytes(buffer[:want])
        del buffer[:want]
        return data

    async def send(self, item: bytes) -> None:
        await self.stream.send(item)

    async def send_eof(self) -> None:
        await self.stream.send_eof()

    async def aclose(self) -> None:
        await self.stream.aclose()

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        return self.stream.extra_attributes
