"""An echo service written against asyncio's Protocol API, run over aiordma.

    python examples/protocol_echo.py [--transport auto|rdma|tcp]

The two protocol classes below are plain asyncio (they would run on ``loop.create_server`` /
``loop.create_connection`` unchanged); only the two calls that open the server and the
connection are aiordma's: ``aiordma.asyncio.create_server`` and ``create_connection``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os

import aiordma.asyncio


class EchoServer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        return False  # asyncio closes the transport for us


class EchoClient(asyncio.Protocol):
    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.received = bytearray()
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: asyncio.Transport = transport  # type: ignore[assignment]
        for i in range(0, len(self.payload), 4096):
            tr.write(self.payload[i : i + 4096])
        tr.write_eof()  # half close: the server still answers

    def data_received(self, data: bytes) -> None:
        self.received += data

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self.done.set_exception(exc)
        else:
            self.done.set_result(bytes(self.received))


async def main(transport: str | None) -> int:
    server = await aiordma.asyncio.create_server(EchoServer, "127.0.0.1", 0, transport=transport)
    async with server:
        port = server.sockets[0].getsockname()[1]
        payload = os.urandom(300_000)
        tr, client = await aiordma.asyncio.create_connection(
            lambda: EchoClient(payload), "127.0.0.1", port, transport=transport
        )
        print(f"transport: {tr.get_extra_info('aiordma_transport')}")
        print(f"fallback reason: {tr.get_extra_info('aiordma_fallback_reason') or '(none: RDMA)'}")
        echoed = await asyncio.wait_for(client.done, 30)  # type: ignore[attr-defined]
        same = hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
        print(f"client: {len(echoed)} bytes echoed, {'intact' if same else 'MISMATCH'}")
        return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default=None, help="auto (default), rdma or tcp")
    raise SystemExit(asyncio.run(main(parser.parse_args().transport)))
