"""aiordma under trio: a byte-stream server and client in one process.

    python examples/trio_example.py [--transport auto|tcp|rdma]

``aiordma.create_listener`` and ``aiordma.connect`` give anyio byte streams
(``send`` / ``receive`` / ``send_eof`` / ``aclose``), so the same code runs
under trio and asyncio.  The client sends a few requests, the server answers
each one in upper case, then both close in order.
"""

from __future__ import annotations

import argparse
import sys

import anyio
import trio

import aiordma

REQUESTS = [b"hello from trio", b"rdma or tcp?", b"z" * 200_000]


async def serve_one(stream: aiordma.Stream) -> None:
    """Upper-case every request; a request is a 4-byte length and its bytes."""
    async with stream:
        print(f"server: a client connected over {stream.transport}")
        buffer = bytearray()
        served = 0
        while True:
            try:
                buffer += await stream.receive()
            except anyio.EndOfStream:
                break
            while len(buffer) >= 4 and len(buffer) >= 4 + int.from_bytes(buffer[:4], "big"):
                size = int.from_bytes(buffer[:4], "big")
                request = bytes(buffer[4 : 4 + size])
                del buffer[: 4 + size]
                await stream.send(size.to_bytes(4, "big") + request.upper())
                served += 1
        await stream.send_eof()
        print(f"server: answered {served} requests, client done")


async def receive_exactly(stream: aiordma.Stream, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        data += await stream.receive(n - len(data))
    return bytes(data)


async def main(transport: str | None) -> bool:
    listener = await aiordma.create_listener("127.0.0.1", 0, transport=transport)
    print(f"server: listening on 127.0.0.1:{listener.port}")
    ok = True
    async with listener, trio.open_nursery() as nursery:
        nursery.start_soon(listener.serve, serve_one)
        stream = await aiordma.connect("127.0.0.1", listener.port, transport=transport)
        async with stream:
            print(f"transport: {stream.extra(aiordma.TransportAttribute.transport)}")
            print(f"fallback reason: {stream.extra(aiordma.TransportAttribute.fallback_reason) or '(none: RDMA)'}")
            for request in REQUESTS:
                await stream.send(len(request).to_bytes(4, "big") + request)
                size = int.from_bytes(await receive_exactly(stream, 4), "big")
                answer = await receive_exactly(stream, size)
                shown = answer[:30] + (b"..." if len(answer) > 30 else b"")
                if answer == request.upper():
                    print(f"client: {len(request)} bytes sent, answer {shown!r}")
                else:
                    print(f"client: WRONG answer to a {len(request)}-byte request: {shown!r}")
                    ok = False
            await stream.send_eof()
            try:
                extra = await stream.receive()
            except anyio.EndOfStream:
                pass
            else:
                print(f"client: unexpected {len(extra)} extra bytes")
                ok = False
        nursery.cancel_scope.cancel()  # stop listener.serve
    print("trio: all answers correct" if ok else "trio: FAILED")
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="aiordma under trio: a server and a client in one process")
    parser.add_argument("--transport", choices=("auto", "tcp", "rdma"), default=None)
    args = parser.parse_args()
    sys.exit(0 if trio.run(main, args.transport) else 1)
