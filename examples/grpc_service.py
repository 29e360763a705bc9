"""A gRPC service (grpclib) over aiordma: a unary call and a bidirectional stream.

    python examples/grpc_service.py [--transport auto|rdma|tcp]

grpclib's ``Server`` and generated-style stubs as usual; two lines are aiordma's:
``aiordma.grpc.start_server(server, host, port)`` instead of ``server.start(host, port)`` and
``aiordma.grpc.Channel`` instead of ``grpclib.client.Channel``.  To stay self-contained the
service uses a bytes codec instead of protobuf-generated messages; a protobuf service works the
same way (``pip install aiordma[grpc]`` brings grpclib).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from grpclib.client import Stream as ClientStream
from grpclib.client import UnaryUnaryMethod, StreamStreamMethod
from grpclib.const import Cardinality, Handler
from grpclib.encoding.base import CodecBase
from grpclib.server import Server, Stream

import aiordma.grpc


class RawCodec(CodecBase):
    """Messages are bytes, sent as they are."""

    __content_subtype__ = "raw"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return bytes(data)


class Calculator:
    """``Reverse`` (unary) and ``Running`` (a stream of numbers in, running sums out)."""

    async def reverse(self, stream: Stream[bytes, bytes]) -> None:
        request = await stream.recv_message()
        assert request is not None
        await stream.send_message(request[::-1])

    async def running(self, stream: Stream[bytes, bytes]) -> None:
        total = 0
        async for message in stream:
            total += int(message)
            await stream.send_message(str(total).encode())

    def __mapping__(self) -> dict[str, Handler]:
        return {
            "/demo.Calculator/Reverse": Handler(self.reverse, Cardinality.UNARY_UNARY, bytes, bytes),
            "/demo.Calculator/Running": Handler(self.running, Cardinality.STREAM_STREAM, bytes, bytes),
        }


class CalculatorStub:
    def __init__(self, channel: aiordma.grpc.Channel) -> None:
        self.Reverse = UnaryUnaryMethod(channel, "/demo.Calculator/Reverse", bytes, bytes)
        self.Running = StreamStreamMethod(channel, "/demo.Calculator/Running", bytes, bytes)


async def main(transport: str | None) -> int:
    server = Server([Calculator()], codec=RawCodec())
    listening = await aiordma.grpc.start_server(server, "127.0.0.1", 0, transport=transport)
    port = listening.sockets[0].getsockname()[1]
    ok = True
    try:
        async with aiordma.grpc.Channel("127.0.0.1", port, transport=transport, codec=RawCodec()) as channel:
            stub = CalculatorStub(channel)
            reply = await stub.Reverse(b"hello over aiordma")
            print(f"transport: {channel.aiordma_transport}")
            print(f"fallback reason: {channel.aiordma_fallback_reason or '(none: RDMA)'}")
            print(f"unary: Reverse -> {reply!r}")
            ok &= reply == b"amdroia revo olleh"
            big = bytes(range(256)) * 4096  # 1 MiB in one message
            ok &= await stub.Reverse(big) == big[::-1]
            sums = []
            stream: ClientStream[bytes, bytes]
            async with stub.Running.open() as stream:
                for n in (1, 2, 3, 4, 5):
                    await stream.send_message(str(n).encode())
                    answer = await stream.recv_message()
                    assert answer is not None
                    sums.append(int(answer))
                await stream.end()
            print(f"stream: Running 1..5 -> {sums}")
            ok &= sums == [1, 3, 6, 10, 15]
    finally:
        server.close()
        await server.wait_closed()
    print("grpc: all answers correct" if ok else "grpc: WRONG answer")
    return 0 if ok else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default=None, help="auto (default), rdma or tcp")
    raise SystemExit(asyncio.run(main(parser.parse_args().transport)))
