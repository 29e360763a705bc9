"""The conformance suite: what every aiordma transport must do, under every loop.

Each test runs for each kind of pair (``memory``: the protocol over an
in-memory pipe; ``tcp``; ``sim``: the RDMA transport over the simulated RC
wire, on any host; ``rdma`` on a real device, in the Soft-RoCE guest) and each event loop
(asyncio, uvloop, trio).  Every pair is checked for leaked file descriptors
once closed.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

import anyio
import pytest
from anyio import BrokenResourceError, BusyResourceError, ClosedResourceError, EndOfStream
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiordma

from ._kinds import PEER, SMALL_LIMIT, SUITE_KINDS, VARIANTS, channels, pair_args, read_exactly, read_to_eof, streams
from ._leaks import no_fd_leak
from ._skips import backend_of, one_loop_on_a_device

pytestmark = pytest.mark.anyio


HYPOTHESIS = settings(
    # the guest stage sets fewer (each example there opens a real RDMA connection, ~20x slower)
    max_examples=int(os.environ.get("AIORDMA_HYPOTHESIS_EXAMPLES", "15")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(params=SUITE_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    kind = str(request.param)
    if kind == "twohost":
        if not PEER:
            pytest.skip("needs the two-host bed (AIORDMA_PEER_ADDRESS)")
        one_loop_on_a_device(True, backend_of(request))  # (two TCG guests are slow)
    # on rxe (20x slower) the variants run under one loop; the simulated wire runs all three
    one_loop_on_a_device(kind in VARIANTS and kind.startswith("rdma"), backend_of(request))
    return kind


async def test_transport_is_reported(kind: str) -> None:
    async with streams(kind) as (a, b):
        for end in (a, b):
            transport = end.extra(aiordma.TransportAttribute.transport)
            reason = end.extra(aiordma.TransportAttribute.fallback_reason)
            if pair_args(kind)[0] in ("rdma", "sim"):
                assert (transport, reason) == ("rdma", "")
                assert end.extra(aiordma.TransportAttribute.qp_num) > 0
            else:
                assert transport == "tcp"
                assert "transport='tcp' was requested" in reason
        assert a.extra(aiordma.TransportAttribute.mode) == "stream"


@pytest.mark.guest_loops
@pytest.mark.guest_poll_modes
async def test_stream_echo_round_trips(kind: str) -> None:
    async with streams(kind) as (a, b):
        for i in range(50):
            payload = os.urandom(1 + i * 37)
            await a.send(payload)
            got = await read_exactly(b, len(payload))
            await b.send(got)
            assert await read_exactly(a, len(payload)) == payload


@given(chunks=st.lists(st.binary(min_size=0, max_size=70_000), max_size=12))
@HYPOTHESIS
async def test_any_chunking_of_writes_arrives_in_order(kind: str, chunks: list[bytes]) -> None:
    async with streams(kind) as (a, b):
        async with anyio.create_task_group() as tg:

            async def writer() -> None:
                for chunk in chunks:
                    await a.send(chunk)
                await a.send_eof()

            tg.start_soon(writer)
            assert await read_to_eof(b) == b"".join(chunks)


@pytest.mark.guest_loops("trio")
@pytest.mark.guest_poll_modes
async def test_large_transfer_intact(kind: str) -> None:
    data = os.urandom(8 << 20)
    async with streams(kind) as (a, b):
        async with anyio.create_task_group() as tg:

            async def writer() -> None:
                for pos in range(0, len(data), 3 << 20):
                    await a.send(data[pos : pos + (3 << 20)])
                await a.send_eof()

            tg.start_soon(writer)
            got = await read_to_eof(b)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()


FORMATS = ["B", "b", "h", "H", "i", "I", "q", "Q", "f", "d"]


def _typed(fmt: str, raw: bytes, shape: str) -> memoryview:
    """A view of ``raw`` (trimmed to whole items) in format ``fmt``: 1-D, 2-D, or strided (non-contiguous)."""
    size = struct.calcsize(fmt)
    raw = raw[: len(raw) // size * size]
    view = memoryview(bytearray(raw)).cast(fmt)
    if shape == "2d" and len(view) % 2 == 0 and len(view):
        return view.cast("B").cast(fmt, [2, len(view) // 2])
    if shape == "strided":
        return view[::2]
    return view


@given(
    items=st.lists(st.tuples(st.sampled_from(FORMATS), st.binary(max_size=20_000), st.sampled_from(["1d", "2d", "strided"])),
                   min_size=1, max_size=6),  # fmt: skip
)
@HYPOTHESIS
async def test_typed_memoryviews_are_sent_as_their_bytes(kind: str, items: list[tuple[str, bytes, str]]) -> None:
    """B13: a view of 4-byte items is len() items but nbytes bytes: streams and channels send the bytes."""
    views = [_typed(fmt, raw, shape) for fmt, raw, shape in items]
    expected = [v.tobytes() for v in views]
    async with streams(kind) as (a, b):
        for v in views:
            await a.send(v)  # type: ignore[arg-type]
        total = sum(len(e) for e in expected)
        assert await read_exactly(b, total) == b"".join(expected)
    async with channels(kind, limit=1 << 20) as (c, d):
        for v in views:
            await c.send(v)  # type: ignore[arg-type]
        for e in expected:
            assert await d.receive() == e


@given(sizes=st.lists(st.integers(min_value=0, max_value=SMALL_LIMIT), max_size=20), seed=st.binary(min_size=8))
@HYPOTHESIS
async def test_messages_keep_their_boundaries(kind: str, sizes: list[int], seed: bytes) -> None:
    messages = [(seed * (size // len(seed) + 1))[:size] for size in sizes]
    async with channels(kind) as (a, b):
        async with anyio.create_task_group() as tg:

            async def writer() -> None:
                for message in messages:
                    await a.send(message)
                await a.send_eof()

            tg.start_soon(writer)
            received = [message async for message in b]
    assert received == messages


async def test_empty_messages_and_limit_exactly(kind: str) -> None:
    async with channels(kind) as (a, b):
        for message in (b"", b"x", b"", bytes(SMALL_LIMIT)):
            await a.send(message)
            assert await b.receive() == message


async def test_message_over_peer_limit_is_refused_and_nothing_is_lost(kind: str) -> None:
    async with channels(kind) as (a, b):
        assert a.extra(aiordma.TransportAttribute.peer_max_message_size) == SMALL_LIMIT
        await a.send(b"before")
        with pytest.raises(aiordma.LocalProtocolError, match="exceeds the peer's limit"):
            await a.send(bytes(SMALL_LIMIT + 1))
        await a.send(b"after")
        assert await b.receive() == b"before"
        assert await b.receive() == b"after"


async def test_half_close_both_ways(kind: str) -> None:
    async with streams(kind) as (a, b):
        await a.send(b"request")
        await a.send_eof()
        with pytest.raises(ClosedResourceError):
            await a.send(b"more")
        assert await read_to_eof(b) == b"request"
        with pytest.raises(EndOfStream):  # stays at EOF
            await b.receive()
        # the other direction still works
        await b.send(b"reply")
        await b.send_eof()
        assert await read_to_eof(a) == b"reply"


async def test_channel_eof_ends_iteration_and_reply_still_flows(kind: str) -> None:
    async with channels(kind) as (a, b):
        await a.send(b"1")
        await a.send(b"2")
        await a.send_eof()
        assert [m async for m in b] == [b"1", b"2"]
        await b.send(b"done")
        assert await a.receive() == b"done"


@pytest.mark.guest_loops("trio")
async def test_close_while_receive_waits(kind: str) -> None:
    async with streams(kind) as (a, b):
        result: list[BaseException] = []

        async def waiter() -> None:
            try:
                await a.receive()
            except BaseException as exc:  # noqa: BLE001 - recorded and checked below
                result.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            await a.aclose()
        assert len(result) == 1 and isinstance(result[0], ClosedResourceError), result
        with pytest.raises(ClosedResourceError):
            await a.send(b"x")
        with pytest.raises(ClosedResourceError):
            await a.receive()
        # the peer sees an orderly end
        with pytest.raises(EndOfStream):
            await b.receive()
        with pytest.raises(BrokenResourceError):
            await b.send(b"to nobody")


async def test_channel_close_while_receive_waits(kind: str) -> None:
    async with channels(kind) as (a, b):
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:

                async def closer() -> None:
                    await anyio.sleep(0.05)
                    await a.aclose()

                tg.start_soon(closer)
                with pytest.raises(ClosedResourceError):
                    await a.receive()


async def test_cancelled_receive_loses_nothing(kind: str) -> None:
    async with channels(kind) as (a, b):
        with anyio.move_on_after(0.05):
            await b.receive()
        await a.send(b"kept")
        assert await b.receive() == b"kept"
    async with streams(kind) as (a, b):
        with anyio.move_on_after(0.05):
            await b.receive()
        await a.send(b"kept")
        assert await read_exactly(b, 4) == b"kept"


async def test_two_tasks_sending_at_once_never_interleave(kind: str) -> None:
    block = 100_000
    async with streams(kind) as (a, b):
        async with anyio.create_task_group() as tg:

            async def sender(tag: int) -> None:
                for i in range(10):
                    await a.send(bytes([tag]) * block)

            tg.start_soon(sender, 1)
            tg.start_soon(sender, 2)
            data = await read_exactly(b, 20 * block)
        blocks = [data[i : i + block] for i in range(0, len(data), block)]
        assert all(blk == blk[:1] * block for blk in blocks), "a send was interleaved with another"
        assert sorted(blk[0] for blk in blocks) == [1] * 10 + [2] * 10


async def test_concurrent_senders_and_receivers_on_a_channel(kind: str) -> None:
    async with channels(kind) as (a, b):
        got: list[bytes] = []
        async with anyio.create_task_group() as tg:

            async def sender(tag: int) -> None:
                for i in range(40):
                    await a.send(f"{tag}:{i}:".encode() + bytes(i * 100))

            async def receiver() -> None:
                while True:
                    try:
                        got.append(await b.receive())
                    except EndOfStream:
                        return

            async with anyio.create_task_group() as senders:
                for tag in range(4):
                    senders.start_soon(sender, tag)
                tg.start_soon(receiver)
                tg.start_soon(receiver)
            await a.send_eof()
        expected = {f"{tag}:{i}:".encode() + bytes(i * 100) for tag in range(4) for i in range(40)}
        assert len(got) == len(expected) and set(got) == expected


async def test_second_receiver_on_a_stream_is_busy(kind: str) -> None:
    async with streams(kind) as (a, b):
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.receive)
            await anyio.sleep(0.02)
            with pytest.raises(BusyResourceError):
                await b.receive()
            await a.send(b"x")


async def test_backpressure_blocks_the_sender_and_loses_nothing(kind: str) -> None:
    total = 48 << 20
    async with streams(kind) as (a, b):
        done = anyio.Event()

        async def writer() -> None:
            await a.send(bytes(total))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(writer)
            await anyio.sleep(0.3)
            assert not done.is_set(), "48 MiB were accepted although nobody reads"
            assert len(await read_exactly(b, total)) == total
            with anyio.fail_after(10):
                await done.wait()


async def test_peer_close_then_send_is_broken(kind: str) -> None:
    async with channels(kind) as (a, b):
        await b.send(b"last words")
        await b.aclose()
        assert await a.receive() == b"last words"
        with pytest.raises(EndOfStream):
            await a.receive()
        with pytest.raises(BrokenResourceError):
            await a.send(b"anyone?")


async def test_aclose_is_idempotent_and_send_after_it_is_closed(kind: str) -> None:
    async with channels(kind) as (a, b):
        await a.aclose()
        await a.aclose()
        with pytest.raises(ClosedResourceError):
            await a.send(b"x")
        with pytest.raises(ClosedResourceError):
            await a.send_eof()


async def test_wrong_item_types_are_rejected(kind: str) -> None:
    async with channels(kind) as (a, b):
        with pytest.raises(TypeError):
            await a.send("text")  # type: ignore[arg-type]
        await a.send(bytearray(b"ok"))
        assert await b.receive() == b"ok"


async def test_many_concurrent_clients(anyio_backend: Any) -> None:
    """A server with many clients at once, each echoing a few messages (TCP)."""
    clients = 40
    async with no_fd_leak():
        async with await aiordma.create_listener("127.0.0.1", 0, transport="tcp") as listener:

            async def handler(stream: aiordma.Stream) -> None:
                async with stream:
                    while True:
                        try:
                            data = await stream.receive()
                        except EndOfStream:
                            return
                        await stream.send(data)

            async def client(i: int) -> None:
                async with await aiordma.connect("127.0.0.1", listener.port, transport="tcp") as stream:
                    for j in range(5):
                        msg = f"client {i} message {j}".encode()
                        await stream.send(msg)
                        assert await read_exactly(stream, len(msg)) == msg

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(listener.serve, handler)
                    async with anyio.create_task_group() as clients_tg:
                        for i in range(clients):
                            clients_tg.start_soon(client, i)
                    tg.cancel_scope.cancel()
