"""The far end of the cross-host tests: a small aiordma service for host a of the two-guest bed.

    python -m aiordma.testing.peer [--host ADDR] [--timeout S]

Listens on ``ADDR`` (default ``$AIORDMA_HOST_ADDRESS``) with ``transport="rdma"`` (strict: a
cross-host test that silently ran on TCP would prove nothing; ``--transport tcp`` only for the
host's check of the suite itself):

* port 7100, message channels (16 MiB messages at most):
  * ``ECHO <payload>`` -> ``<payload>`` back;
  * ``SUM <n>`` -> receives the next message into a ``RegisteredBuffer`` of ``n`` bytes
    (``receive_into``: zero copy on a rendezvous) and answers its SHA-256;
  * ``EXPOSE <n> <seed>`` -> exposes ``n`` bytes (``seed``'s pattern) for reading and writing,
    sends the descriptor, and on the next message (``DONE``) answers the SHA-256 of what the
    buffer then holds (what the client wrote landed, and nothing else changed);
  * ``QUIT`` -> the service ends (so does ``--timeout``, 1800 s by default: bounded);
* port 7101, byte streams: echoes everything until EOF.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys

import anyio

import aiordma

CHANNEL_PORT = 7100
STREAM_PORT = 7101
MAX_MESSAGE = 16 << 20


def pattern(n: int, seed: int) -> bytes:
    """``n`` bytes both hosts can make from ``seed``."""
    return random.Random(seed).randbytes(n)


async def _channel(ch: aiordma.Channel, stop: anyio.Event) -> None:
    async with ch:
        while True:
            try:
                msg = await ch.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            verb, _, rest = msg.partition(b" ")
            if verb == b"ECHO":
                await ch.send(rest)
            elif verb == b"SUM":
                with aiordma.RegisteredBuffer(int(rest)) as buf:
                    n = await ch.receive_into(buf)
                    await ch.send(hashlib.sha256(memoryview(buf)[:n]).hexdigest().encode())
            elif verb == b"EXPOSE":
                size, seed = (int(x) for x in rest.split())
                with aiordma.RegisteredBuffer(size) as buf:
                    memoryview(buf)[:] = pattern(size, seed)
                    async with ch.expose(buf, read=True, write=True) as remote:
                        await ch.send(remote.to_bytes())
                        await ch.receive()  # DONE
                    await ch.send(hashlib.sha256(buf).hexdigest().encode())
            elif verb == b"QUIT":
                stop.set()
                return


async def _stream(s: aiordma.Stream) -> None:
    async with s:
        try:
            while True:
                await s.send(await s.receive(1 << 20))
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass


async def serve(host: str, timeout: float, transport: str = "rdma") -> None:
    stop = anyio.Event()
    channels = await aiordma.create_channel_listener(host, CHANNEL_PORT, transport=transport,
                                                     max_message_size=MAX_MESSAGE)  # fmt: skip
    streams = await aiordma.create_listener(host, STREAM_PORT, transport=transport)
    async with channels, streams, anyio.create_task_group() as tg:
        tg.start_soon(channels.serve, lambda ch: _channel(ch, stop), tg)
        tg.start_soon(streams.serve, _stream, tg)
        print(f"peer: serving on {host}:{CHANNEL_PORT} (channels) and :{STREAM_PORT} (streams)", flush=True)
        with anyio.move_on_after(timeout):
            await stop.wait()
        tg.cancel_scope.cancel()
    print("peer: done", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.testing.peer", description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("AIORDMA_HOST_ADDRESS", "198.18.0.1"))
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--transport", default="rdma", help="rdma (the bed), or tcp (the suite's own host check)")
    args = p.parse_args()
    anyio.run(serve, args.host, args.timeout, args.transport)
    return 0


if __name__ == "__main__":
    sys.exit(main())
