"""An echo server and client with aiordma's asyncio API.

    python examples/echo_asyncio.py                  # server and client in one process, then exit
    python examples/echo_asyncio.py server --port 9000
    python examples/echo_asyncio.py client --port 9000 [--host 127.0.0.1]

``aiordma.asyncio.open_connection`` / ``start_server`` work like asyncio's: the
reader and writer have the same methods.  With ``--transport auto`` (the
default, or ``$AIORDMA_TRANSPORT``) the data runs on RDMA when both hosts can,
else on TCP; ``writer.get_extra_info("aiordma_fallback_reason")`` says why.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import aiordma.asyncio

#: Longest line we read: as with asyncio, readline() refuses longer ones (default 64 KiB).
LIMIT = 1 << 20
LINES = [b"hello over aiordma\n", b"a second line\n", b"x" * 100_000 + b"\n", b"bye\n"]


async def handle(reader: aiordma.asyncio.StreamReader, writer: aiordma.asyncio.StreamWriter) -> None:
    peer = writer.get_extra_info("peername")
    print(f"server: client {peer} connected over {writer.get_extra_info('aiordma_transport')}")
    try:
        async for line in reader:  # line by line, until the client's EOF
            writer.write(line)
            await writer.drain()
    except ConnectionResetError as exc:
        print(f"server: client {peer} went away: {exc}")
    finally:
        writer.close()
        await writer.wait_closed()
    print(f"server: client {peer} done")


async def run_client(host: str, port: int, transport: str | None) -> bool:
    reader, writer = await aiordma.asyncio.open_connection(host, port, transport=transport, limit=LIMIT)
    print(f"client: connected to {host}:{port}")
    print(f"transport: {writer.get_extra_info('aiordma_transport')}")
    print(f"fallback reason: {writer.get_extra_info('aiordma_fallback_reason') or '(none: RDMA)'}")
    ok = True
    try:
        for line in LINES:
            writer.write(line)
            await writer.drain()
            echoed = await reader.readuntil(b"\n")
            shown = line[:40].rstrip(b"\n") + (b"..." if len(line) > 41 else b"")
            if echoed == line:
                print(f"client: {len(line)} bytes echoed: {shown!r}")
            else:
                print(f"client: MISMATCH for {shown!r}: got {len(echoed)} bytes back")
                ok = False
        writer.write_eof()
        rest = await reader.read()  # the server closes after our EOF
        if rest:
            print(f"client: unexpected {len(rest)} extra bytes")
            ok = False
    finally:
        writer.close()
        await writer.wait_closed()
    return ok


async def run_server(host: str, port: int, transport: str | None) -> None:
    server = await aiordma.asyncio.start_server(handle, host, port, transport=transport, limit=LIMIT)
    bound_host, bound_port = server.addresses[0][:2]
    print(f"server: listening on {bound_host}:{bound_port}", flush=True)
    async with server:
        await server.serve_forever()


async def run_both(transport: str | None) -> bool:
    server = await aiordma.asyncio.start_server(handle, "127.0.0.1", 0, transport=transport, limit=LIMIT)
    host, port = server.addresses[0][:2]
    print(f"server: listening on {host}:{port}")
    async with server:  # closes the server and waits for its handlers on exit
        ok = await run_client(host, port, transport)
    print("echo: all lines came back intact" if ok else "echo: FAILED")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("role", nargs="?", choices=("both", "server", "client"), default="both")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--transport", choices=("auto", "tcp", "rdma"), default=None)
    args = parser.parse_args()
    if args.role == "server":
        try:
            asyncio.run(run_server(args.host, args.port, args.transport))
        except KeyboardInterrupt:
            pass
        return 0
    if args.role == "client":
        return 0 if asyncio.run(run_client(args.host, args.port, args.transport)) else 1
    return 0 if asyncio.run(run_both(args.transport)) else 1


if __name__ == "__main__":
    sys.exit(main())
