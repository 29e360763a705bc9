"""A message channel: every send arrives as one receive, boundaries kept.

    python examples/channel_example.py [--backend asyncio|trio] [--transport auto|tcp|rdma]

``aiordma.create_channel_listener`` / ``aiordma.connect_channel`` give anyio
object streams of bytes: no framing code of your own, and empty messages are
messages too.  This runs a small "key-value" server and a client in one
process under anyio (asyncio by default, or trio).
"""

from __future__ import annotations

import argparse
import sys

import anyio

import aiordma


async def kv_server(channel: aiordma.Channel) -> None:
    """Requests: b"SET key value" -> b"OK", b"GET key" -> the value (b"" when unset)."""
    store: dict[bytes, bytes] = {}
    async with channel:
        async for request in channel:  # ends at the client's EOF
            command, _, rest = request.partition(b" ")
            if command == b"SET":
                key, _, value = rest.partition(b" ")
                store[key] = value
                await channel.send(b"OK")
            elif command == b"GET":
                await channel.send(store.get(rest, b""))
            else:
                await channel.send(b"ERR unknown command")


async def main(transport: str | None) -> bool:
    listener = await aiordma.create_channel_listener("127.0.0.1", 0, transport=transport)
    print(f"server: listening on 127.0.0.1:{listener.port}")
    ok = True
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, kv_server)
        async with await aiordma.connect_channel("127.0.0.1", listener.port, transport=transport) as channel:
            print(f"transport: {channel.extra(aiordma.TransportAttribute.transport)}")
            print(f"fallback reason: {channel.extra(aiordma.TransportAttribute.fallback_reason) or '(none: RDMA)'}")
            limit = channel.extra(aiordma.TransportAttribute.peer_max_message_size)
            print(f"the server accepts messages up to {limit} bytes")
            big = bytes(range(256)) * 4096  # 1 MiB, arrives as one message
            exchanges = [
                (b"SET greeting hello", b"OK"),
                (b"SET empty ", b"OK"),
                (b"GET empty", b""),  # an empty message is delivered as such
                (b"GET greeting", b"hello"),
                (b"SET big " + big, b"OK"),
                (b"GET big", big),
                (b"GET missing", b""),
            ]
            # send them all before reading: the answers still come back one per request
            for request, _ in exchanges:
                await channel.send(request)
            for request, expected in exchanges:
                answer = await channel.receive()
                name = request[:20] + (b"..." if len(request) > 20 else b"")
                if answer == expected:
                    print(f"client: {name!r} -> {len(answer)}-byte answer, as expected")
                else:
                    print(f"client: {name!r} -> WRONG answer of {len(answer)} bytes")
                    ok = False
            await channel.send_eof()
        tg.cancel_scope.cancel()
    print("channel: message boundaries kept, empty messages included" if ok else "channel: FAILED")
    return ok


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an aiordma message channel, server and client in one process")
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--transport", choices=("auto", "tcp", "rdma"), default=None)
    args = parser.parse_args()
    sys.exit(0 if anyio.run(main, args.transport, backend=args.backend) else 1)
