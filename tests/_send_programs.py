"""Programs of concurrent, cancelled sends and their checks (test_cancelled_sends, test_copies).

Each message carries its own id and a checksum of its body, so that the receiver can tell a
message that was sent from one made of pieces of several.
"""

from __future__ import annotations

import hashlib
import os
import ssl
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio

import aiordma
from aiordma.testing import channel_pair

from ._pairs import served_pair

KINDS = ["tcp", "tls", "sim", "memory"]
_HEAD = struct.Struct("!I32s")


def message(ident: int, size: int) -> bytes:
    body = bytes([ident % 251]) * max(0, size - _HEAD.size)
    return _HEAD.pack(ident, hashlib.sha256(body).digest()) + body


def check(msg: bytes) -> int:
    """The id of a message that was sent as it is; fails on anything else."""
    assert len(msg) >= _HEAD.size, f"a {len(msg)}-byte message that was never sent"
    ident, digest = _HEAD.unpack_from(msg)
    assert hashlib.sha256(msg[_HEAD.size :]).digest() == digest, (
        f"message {ident} ({len(msg)} bytes) is not the one that was sent: pieces of others"
    )
    return ident


@asynccontextmanager
async def pair(kind: str, tlsdir: str) -> AsyncIterator[tuple[aiordma.Channel, aiordma.Channel]]:
    if kind != "tls":
        async with channel_pair(kind) as p:  # type: ignore[arg-type]
            yield p
        return
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(os.path.join(tlsdir, "server.pem"))
    client_ctx = ssl.create_default_context(cafile=os.path.join(tlsdir, "ca.pem"))
    listener = await aiordma.create_channel_listener("127.0.0.1", 0, ssl=server_ctx)
    async with served_pair(listener, partial(aiordma.connect_channel, "127.0.0.1", ssl=client_ctx)) as p:
        yield p


async def run_program(kind: str, tlsdir: str, senders: list[list[tuple[int, float | None]]],
                      reader_delay: float) -> None:  # fmt: skip
    """Each sender sends its messages (size, cancel after seconds or None) in turn, all
    concurrently; the reader starts after ``reader_delay`` and reads until the end.  Checks:
    every message received is one that was sent, whole, at most once; every send that returned
    normally was received (in order, per sender); a send that failed did so with
    BrokenResourceError, only where the stream cannot finish a cut frame."""
    returned: list[list[int]] = [[] for _ in senders]
    broken: list[BaseException] = []
    reader_error: list[BaseException] = []
    got: list[int] = []
    async with pair(kind, tlsdir) as (client, server):

        async def sender(index: int, program: list[tuple[int, float | None]]) -> None:
            for n, (size, cancel_after) in enumerate(program):
                ident = index * 1000 + n
                with anyio.move_on_after(cancel_after if cancel_after is not None else 60):
                    try:
                        await client.send(message(ident, size))
                    except anyio.BrokenResourceError as exc:
                        broken.append(exc)
                        return
                    returned[index].append(ident)

        async def reader() -> None:
            await anyio.sleep(reader_delay)
            try:
                while True:
                    got.append(check(await server.receive()))
            except anyio.EndOfStream:
                pass
            except anyio.BrokenResourceError as exc:  # (the sender's side broke on a cut frame)
                reader_error.append(exc)
            await server.aclose()  # (as a handler leaving ``async with channel:`` does)

        with anyio.fail_after(180 if kind == "rdma" else 60):  # (the guest runs Python ~20x slower)
            async with anyio.create_task_group() as tg:
                tg.start_soon(reader)
                async with anyio.create_task_group() as senders_tg:
                    for index, program in enumerate(senders):
                        senders_tg.start_soon(sender, index, program)
                await client.aclose()  # (delivers what is queued, a cancelled send's rest too)
    assert len(got) == len(set(got)), f"a message came twice: {got}"
    for index, idents in enumerate(returned):
        mine = [i for i in got if i // 1000 == index]
        assert [i for i in mine if i in idents] == idents, f"sender {index}: returned {idents}, received {mine}"
    for exc in broken:
        assert kind == "tls" and "cancelled in the middle of its frame" in str(exc), repr(exc)
    # (a stream that cannot finish a cut frame ends in the middle of it: the reader is told so)
    # (or just after one, when the cut fell between two frames of one send)
    assert not reader_error or (kind == "tls" and any(
        text in str(reader_error[0]) for text in ("middle of a frame", "without a CLOSE frame"))), \
        repr(reader_error)  # fmt: skip
    if not reader_error and not broken:
        assert set(got) >= {i for idents in returned for i in idents}
