"""A property test of your own protocol over aiordma: a tiny length-prefixed RPC, and the classic
bug hypothesis finds in it.

    python examples/property_test_rpc.py

Each request is a 4-byte big-endian length and that many bytes; the server answers each, framed
the same way, with the request upper-cased.  ``serve_rpc(stream, buggy=True)`` assumes that one
``receive()`` is one request -- true on a quiet loopback, false on any byte stream (TCP, TLS or
RDMA): a receive may hold part of a request, or the end of one and the start of the next.

The property: whatever the requests and wherever the server's receives split and coalesce (a
chunking drawn by :func:`aiordma.testing.strategies.chunkings`, applied by
:class:`aiordma.testing.Rechunked`, so the same example replays the same boundaries), the client
gets every answer, in order.  Against the buggy server hypothesis finds a failing example and
shrinks it to a minimal chunking; the fixed server passes, over every kind of pair and under
asyncio and trio.

A second property checks the client against a server that fails: whatever fault schedule
:func:`aiordma.testing.strategies.faults` draws (the server closes, aborts, dies or is reset after
any of its steps; on the simulated wire also a lost link, RNR, late ACKs and completions), the
client never hangs, and returns a prefix of the answers or raises one of anyio's typed errors.
The pair applies the schedule at the same step on every run, so a failure replays and shrinks.

The test suite runs both (tests/test_property_example.py).
"""

from __future__ import annotations

import struct
from functools import partial

import anyio
from anyio.abc import ByteStream
from anyio.streams.buffered import BufferedByteReceiveStream
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.testing import Fault, Rechunked, stream_pair
from aiordma.testing.strategies import chunkings, faults

_LENGTH = struct.Struct("!I")
#: seconds an exchange may take: longer is a hang, and the property fails
TIME_LIMIT = 10.0


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def serve_rpc(stream: ByteStream, *, buggy: bool = False) -> None:
    """Answer every request until the client's EOF, then close."""
    async with stream:
        if buggy:  # one receive() is one request: wrong on any byte stream
            while True:
                try:
                    data = await stream.receive()
                except anyio.EndOfStream:
                    return
                (n,) = _LENGTH.unpack(data[:4])
                await stream.send(frame(data[4 : 4 + n].upper()))
        reader = BufferedByteReceiveStream(stream)
        while True:
            try:
                (n,) = _LENGTH.unpack(await reader.receive_exactly(4))
            except anyio.IncompleteRead:
                return  # (the client's EOF, between requests)
            await stream.send(frame((await reader.receive_exactly(n)).upper()))


async def call_all(stream: ByteStream, requests: list[bytes]) -> list[bytes]:
    """Send every request (pipelined), then EOF; the answers, until the server's end."""
    for request in requests:
        await stream.send(frame(request))
    await stream.send_eof()
    reader = BufferedByteReceiveStream(stream)
    answers = []
    while True:
        try:
            (n,) = _LENGTH.unpack(await reader.receive_exactly(4))
        except anyio.IncompleteRead:
            return answers
        answers.append(await reader.receive_exactly(n))


async def exchange(kind: str, requests: list[bytes], chunking: tuple[int, ...], *, buggy: bool,
                   faults: tuple[Fault, ...] = ()) -> list[bytes]:  # fmt: skip
    """One round over a ``kind`` pair, the server's receives split and coalesced by ``chunking``
    (and the pair's ``faults`` applied)."""
    async with stream_pair(kind, faults=faults) as (client, server):  # type: ignore[arg-type]
        answers: list[bytes] = []
        failure: Exception | None = None

        async def server_side() -> None:
            try:
                await serve_rpc(Rechunked(server, chunking), buggy=buggy)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                if not faults:
                    raise  # (with a fault, the server's end of it is the fault's doing)

        with anyio.fail_after(TIME_LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(server_side)
                try:
                    answers = await call_all(client, requests)
                except Exception as exc:  # noqa: BLE001 -- raised below, as the client's own error
                    failure = exc
                    tg.cancel_scope.cancel()  # (the client gives up: so does this exchange)
        if failure is not None:
            raise failure
        return answers


REQUESTS = st.lists(st.binary(max_size=100), min_size=1, max_size=5)


def check(kind: str, *, buggy: bool, max_examples: int = 200,
          backend: str = "asyncio") -> tuple[list[bytes], tuple[int, ...]] | None:  # fmt: skip
    """Run the property under ``backend`` (``"asyncio"`` or ``"trio"``); the minimal failing
    example (requests, chunking), or None if it held."""
    failing: list[tuple[list[bytes], tuple[int, ...]]] = []

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(requests=REQUESTS, chunking=chunkings(max_chunk=64))
    def prop(requests: list[bytes], chunking: tuple[int, ...]) -> None:
        try:
            answers = anyio.run(partial(exchange, kind, requests, chunking, buggy=buggy), backend=backend)
            assert answers == [r.upper() for r in requests], answers
        except BaseException:
            failing.append((requests, chunking))  # (the last one recorded is the shrunk example)
            raise

    try:
        prop()
    except Exception:  # noqa: BLE001 - the property failed: report its minimal example
        return failing[-1]
    return None


def check_faults(kind: str, *, max_examples: int = 100, backend: str = "asyncio") -> tuple[Fault, ...] | None:
    """The client against a failing (fixed) server: under any fault schedule it returns a prefix
    of the answers or raises a typed error, within ``TIME_LIMIT``.  The minimal failing schedule, or None."""
    failing: list[tuple[Fault, ...]] = []

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(requests=REQUESTS, schedule=faults(kind, sides=["server"]))
    def prop(requests: list[bytes], schedule: tuple[Fault, ...]) -> None:
        try:
            try:
                answers = anyio.run(partial(exchange, kind, requests, (64,), buggy=False, faults=schedule),
                                    backend=backend)  # fmt: skip
            except (anyio.BrokenResourceError, anyio.EndOfStream, anyio.ClosedResourceError):
                return  # (a typed end: what a client of a failing server should see)
            assert answers == [r.upper() for r in requests][: len(answers)], answers
            if not schedule:
                assert len(answers) == len(requests), answers
        except BaseException:
            failing.append(schedule)
            raise

    try:
        prop()
    except Exception:  # noqa: BLE001 - the property failed: report its minimal schedule
        return failing[-1]
    return None


def main() -> None:
    found = check("memory", buggy=True)
    print(f"buggy server: {'fails on ' + repr(found) if found else 'no failure found'}")
    held = check("memory", buggy=False) is None
    print(f"fixed server: {'the property holds' if held else 'FAILS'}")
    survived = check_faults("memory") is None
    print(f"failing server: {'the client survives every fault' if survived else 'the client FAILS'}")
    raise SystemExit(0 if found and held and survived else 1)


if __name__ == "__main__":
    main()
