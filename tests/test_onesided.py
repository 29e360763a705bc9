"""One-sided remote memory: expose / read / write, over every transport, with the scoping rules.

The same program runs over the in-memory pipe and TCP (the peer's aiordma serves the
operations through MEMORY frames), over the simulated RC wire on the native path (RDMA
READ/WRITE work requests against the exposure's own registration) and on the checked path
(frames over RDMA SENDs), and on rxe in the guest: the results must be identical, byte for
byte, and so must the errors.  Pinned-byte counters must be back where they were after every
test.
"""

from __future__ import annotations

import os
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aiordma
from aiordma import (
    DescriptorRevokedError,
    ForeignDescriptorError,
    RegisteredBuffer,
    RemoteAccessDeniedError,
    RemoteBoundsError,
    RemoteBuffer,
)
from aiordma.testing import stream_pair

from aiordma._proto.protocol import DEFAULT_MAX_MESSAGE_SIZE

from ._kinds import KINDS, streams
from ._leaks import pinned_unchanged
from ._skips import backend_of, one_loop_on_a_device
from ._kinds import channels as conformance_channels

pytestmark = pytest.mark.anyio

HYPOTHESIS = settings(
    max_examples=int(os.environ.get("AIORDMA_HYPOTHESIS_EXAMPLES", "15")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# the poll modes do not change what one-sided code does (the conformance suite covers them), and on
# rxe the checked data path serves one-sided operations through MEMORY frames -- the same code as
# the sim-checked and tcp kinds on the host: the guest runs the native path only
@pytest.fixture(params=[k for k in KINDS if k.values[0] not in ("sim-adaptive", "sim-busy", "rdma-adaptive", "rdma-busy",
                                                                "rdma-checked")])
def kind(request: pytest.FixtureRequest) -> str:
    kind = str(request.param)
    one_loop_on_a_device(kind.startswith("rdma"), backend_of(request))
    return kind


@pytest.fixture(autouse=True)
def pinned_back_to_zero() -> Any:
    with pinned_unchanged():
        yield


#: the rendezvous threshold these tests configure (lower than the default, measured on rxe under
#: TCG: sizes around it stay small enough for the guest)
RNDV = 256 << 10


def channels(kind: str) -> AbstractAsyncContextManager[tuple[aiordma.Channel, aiordma.Channel]]:
    """The conformance suite's pairs, with the default message limit (rendezvous sizes fit)."""
    return conformance_channels(kind, limit=DEFAULT_MAX_MESSAGE_SIZE, config={"rendezvous": RNDV})


async def cancel_after(scope: anyio.CancelScope, rounds: int) -> None:
    """Cancel ``scope`` after ``rounds`` scheduler rounds (a cancellation at every await in turn)."""
    for _ in range(rounds):
        await anyio.lowlevel.checkpoint()
    scope.cancel()


def _expected_transport(kind: str) -> str:
    return "tcp" if kind in ("memory", "tcp") else "rdma"


def _on_the_nic(kind: str) -> bool:
    """RDMA READ/WRITE work requests (the native path); else the peer serves MEMORY frames."""
    return _expected_transport(kind) == "rdma" and not kind.endswith("checked")


async def test_read_and_write_an_exposed_buffer(anyio_backend: Any, kind: str) -> None:
    async with channels(kind) as (a, b):
        assert a.transport == _expected_transport(kind)
        target = bytearray(os.urandom(100_000))
        original = bytes(target)
        got = bytearray(5000)
        async with anyio.create_task_group() as tg:

            async def peer() -> None:
                desc = RemoteBuffer.from_bytes(await b.receive())
                assert desc.length == len(target) and desc.readable and desc.writable
                n = await b.read(desc, got, offset=1000)
                assert n == 5000 and bytes(got) == original[1000:6000]
                await b.write(desc, b"hello", offset=10, notify=True)
                await b.send(b"done")

            tg.start_soon(peer)
            async with a.expose(target, read=True, write=True) as remote:
                await a.send(remote.to_bytes())
                assert await a.written(remote) == (10, 5)
                assert await a.receive() == b"done"
        assert bytes(target) == original[:10] + b"hello" + original[15:]
        served = a._core.memory.ops_served  # operations this side's aiordma served itself
        if _on_the_nic(kind):
            assert (remote.addr, served) != (0, 0) and served == 0, "the NIC should have moved the bytes"
        else:
            assert remote.rkey == 0 and served == 2


async def test_registered_buffers_move_without_staging(anyio_backend: Any, kind: str) -> None:
    async with channels(kind) as (a, b):
        with RegisteredBuffer(1 << 20) as src, RegisteredBuffer(1 << 20) as dst:
            src[:] = os.urandom(1 << 20)
            staged = aiordma.memory_stats().staged_bytes
            async with anyio.create_task_group() as tg:

                async def peer() -> None:
                    desc = RemoteBuffer.from_bytes(await b.receive())
                    view = memoryview(dst)
                    await b.read(desc, view[4096:], offset=4096)  # a slice of registered memory
                    view.release()
                    await b.send(b"done")

                tg.start_soon(peer)
                async with a.expose(src) as remote:
                    await a.send(remote.to_bytes())
                    assert await a.receive() == b"done"
            assert dst[4096:] == src[4096:] and dst[:4096] == bytes(4096)
            if _on_the_nic(kind):
                assert aiordma.memory_stats().staged_bytes == staged, "registered memory was staged"


async def test_descriptors_are_checked_before_anything_moves(anyio_backend: Any, kind: str) -> None:
    async with channels(kind) as (a, b), channels(kind) as (c, d):
        target = bytearray(b"x" * 4096)
        readonly = bytearray(b"r" * 4096)
        async with a.expose(target, read=True, write=False) as ro_desc:
            async with c.expose(readonly, read=True) as other:
                await a.send(ro_desc.to_bytes())
                desc = RemoteBuffer.from_bytes(await b.receive())
                buf = bytearray(16)
                # access not granted
                with pytest.raises(RemoteAccessDeniedError):
                    await b.write(desc, b"nope")
                # out of range, both ends
                with pytest.raises(RemoteBoundsError):
                    await b.read(desc, buf, offset=4090)
                with pytest.raises(RemoteBoundsError):
                    await b.read(desc, buf, offset=-1)
                # another connection's descriptor
                with pytest.raises(ForeignDescriptorError):
                    await b.read(other, buf)
                # a forged one (right token, wrong key)
                forged = RemoteBuffer(desc.token, desc.id, desc.key ^ 1, desc.length, desc.access, desc.addr, desc.rkey)
                with pytest.raises(ForeignDescriptorError):
                    await b.read(forged, buf)
                # the connection still works after every refusal
                assert await b.read(desc, buf) == 16 and bytes(buf) == b"x" * 16
        assert bytes(target) == b"x" * 4096
        # revoked: the exposure's block has exited
        with pytest.raises(DescriptorRevokedError):
            await b.read(desc, buf)
        await a.send(b"still fine")
        assert await b.receive() == b"still fine"


async def test_revocation_waits_for_operations_in_flight(anyio_backend: Any, kind: str) -> None:
    """The exposer leaves its block while the peer keeps reading: every read either completes
    byte-exact or is refused with DescriptorRevokedError -- never by the NIC (on RC that would
    end the connection): the connection works afterwards, both ways."""
    async with channels(kind) as (a, b):
        target = bytearray(os.urandom(1 << 20))
        got = bytearray(1 << 20)
        first = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def peer() -> None:
                desc = RemoteBuffer.from_bytes(await b.receive())
                await b.send(b"go")
                with pytest.raises(DescriptorRevokedError):
                    while True:
                        got[:] = bytes(len(got))
                        await b.read(desc, got)
                        assert got == target
                        first.set()
                await b.send(b"after")

            tg.start_soon(peer)
            async with a.expose(target) as remote:
                await a.send(remote.to_bytes())
                assert await a.receive() == b"go"
                await first.wait()
            assert await a.receive() == b"after"
        await a.send(b"still fine")
        assert await b.receive() == b"still fine"


@pytest.mark.parametrize("write", [False, True])
async def test_a_cancelled_operation_never_leaves_the_nic_with_the_buffer(anyio_backend: Any, kind: str, write: bool) -> None:
    """Cancel a read / write after 0, 1, 2, ... scheduler rounds (every await it makes): when the
    cancelled call returns, its registered buffer is not in use any more (it can be closed), and
    the connection goes on working."""
    async with channels(kind) as (a, b):
        target = bytearray(1 << 18)
        async with a.expose(target, read=True, write=True) as remote:
            await a.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await b.receive())
            outcomes = set()
            for rounds in range(12):
                local = RegisteredBuffer(1 << 18)
                try:
                    with anyio.CancelScope() as scope:

                        async with anyio.create_task_group() as tg:
                            tg.start_soon(cancel_after, scope, rounds)
                            if write:
                                await b.write(desc, local)
                            else:
                                await b.read(desc, local)
                            outcomes.add("done")
                    if scope.cancelled_caught:
                        outcomes.add("cancelled")
                    assert not getattr(b._core.nic, "os_inflight", ()), "the call returned while its WR was still posted"
                    assert not local.busy, "a cancelled operation returned while the NIC may use its buffer"
                finally:
                    local.close()  # raises BufferBusyError if it is still the device's
            assert "cancelled" in outcomes
            got = bytearray(16)
            assert await b.read(desc, got) == 16  # the connection works on
        await a.send(b"ok")
        assert await b.receive() == b"ok"


async def test_exposed_or_busy_registered_memory_cannot_be_closed(anyio_backend: Any) -> None:
    async with channels("sim") as (a, b):
        buf = RegisteredBuffer(4096)
        async with a.expose(buf) as remote:
            with pytest.raises(aiordma.BufferBusyError):
                buf.close()
            await a.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await b.receive())
            assert await b.read(desc, bytearray(10)) == 10
        buf.close()


@given(
    size=st.integers(1, 200_000),
    data=st.data(),
)
@HYPOTHESIS
async def test_random_ranges_are_byte_exact(anyio_backend: Any, kind: str, size: int, data: st.DataObject) -> None:
    offset = data.draw(st.integers(0, size - 1))
    length = data.draw(st.integers(0, size - offset))
    async with channels(kind) as (a, b):
        target = bytearray(os.urandom(size))
        payload = os.urandom(length)
        async with anyio.create_task_group() as tg:

            async def peer() -> None:
                desc = RemoteBuffer.from_bytes(await b.receive())
                got = bytearray(length)
                assert await b.read(desc, got, offset=offset) == length
                assert bytes(got) == bytes(target[offset : offset + length])
                await b.write(desc, payload, offset=offset)
                await b.send(b"done")

            tg.start_soon(peer)
            before = bytes(target)
            async with a.expose(target, read=True, write=True) as remote:
                await a.send(remote.to_bytes())
                assert await a.receive() == b"done"
        assert bytes(target) == before[:offset] + payload + before[offset + length :]


async def test_streams_expose_too(anyio_backend: Any) -> None:
    async with stream_pair("tcp") as (a, b):
        target = bytearray(b"stream memory")
        async with a.expose(target, read=True) as remote:
            await a.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await b.receive())
            got = bytearray(len(target))
            await b.read(desc, got)
            assert got == target


def test_registered_buffer_basics() -> None:
    before = aiordma.memory_stats()
    buf = RegisteredBuffer(10_000)
    view = memoryview(buf)
    assert len(view) == 10_000 and not view.readonly and bytes(view[:4]) == bytes(4)
    view.release()
    assert aiordma.memory_stats().buffers == before.buffers + 1
    buf.close()
    buf.close()  # idempotent
    assert aiordma.memory_stats().buffers == before.buffers
    arr = bytearray(5000)
    reg = aiordma.register(arr)
    with pytest.raises(BufferError):
        arr.extend(b"x")  # exported: cannot be resized under a registration
    reg.close()
    arr.extend(b"x")
    with pytest.raises(TypeError):
        aiordma.register(b"read-only")
    with pytest.raises(ValueError):
        RegisteredBuffer(0)


def test_the_pinned_limit_is_explained() -> None:
    aiordma.set_pinned_limit(4096)
    try:
        from aiordma._conn.memory import reserve_pinned

        with pytest.raises(aiordma.MemlockLimitError) as ei:
            reserve_pinned(8192)
        text = str(ei.value)
        assert "set_pinned_limit" in text and "RLIMIT_MEMLOCK" in text
    finally:
        aiordma.set_pinned_limit(None)


async def test_receive_into_places_messages_and_keeps_a_too_large_one(anyio_backend: Any, kind: str) -> None:
    async with channels(kind) as (a, b):
        big = os.urandom(50_000)
        await a.send(b"small")
        await a.send(big)
        await a.send(b"")
        with RegisteredBuffer(1 << 16) as reg:
            assert await b.receive_into(reg) == 5 and reg[:5] == b"small"
            tiny = bytearray(100)
            with pytest.raises(aiordma.BufferTooSmallError) as ei:
                await b.receive_into(tiny)
            assert ei.value.needed == len(big)
            assert await b.receive_into(reg) == len(big) and reg[: len(big)] == big  # still there
            assert await b.receive_into(tiny) == 0  # the empty message


async def test_stream_receive_into(anyio_backend: Any, kind: str) -> None:
    async with streams(kind, config={"rendezvous": RNDV}) as (a, b):
        data = os.urandom(300_000)
        await a.send(data)
        got = bytearray()
        buf = bytearray(70_000)
        while len(got) < len(data):
            n = await b.receive_into(buf)
            assert 1 <= n <= len(buf)
            got += buf[:n]
        assert got == data


# -- rendezvous: large messages by RDMA READ ---------------------------------------------------


async def test_large_messages_go_by_rendezvous_in_order(anyio_backend: Any, kind: str) -> None:
    """Messages around the rendezvous threshold, interleaved with small ones, arrive whole and in
    order; on the native path the large ones went by READ (no 64 KiB SENDs)."""
    async with channels(kind) as (a, b):
        threshold = RNDV
        sizes = [10, threshold - 1, threshold, 3, threshold + 1, 2 << 20, 0, 5 << 20, 7]
        msgs = [os.urandom(n) for n in sizes]
        async with anyio.create_task_group() as tg:

            async def sender() -> None:
                for m in msgs:
                    await a.send(m)

            tg.start_soon(sender)
            for m in msgs:
                assert await b.receive() == m
        staged_by_rendezvous = a._core.memory._next_mid - 1
        if _on_the_nic(kind):
            assert staged_by_rendezvous == sum(1 for n in sizes if n >= threshold)
        else:
            assert staged_by_rendezvous == 0


async def test_receive_into_registered_memory_takes_a_rendezvous_without_copies(anyio_backend: Any, kind: str) -> None:
    async with channels(kind) as (a, b), anyio.create_task_group() as tg:
        big = os.urandom(3 << 20)

        async def sender() -> None:  # (3 MiB is more than the credit window of a SEND path)
            await a.send(big)
            await a.send(b"after")

        tg.start_soon(sender)
        with RegisteredBuffer(4 << 20) as reg:
            with pytest.raises(aiordma.BufferTooSmallError):
                await b.receive_into(bytearray(1 << 20))  # too small: it stays queued
            staged = aiordma.memory_stats().staged_bytes
            assert await b.receive_into(reg) == len(big)
            assert reg[: len(big)] == big
            if _on_the_nic(kind):
                assert aiordma.memory_stats().staged_bytes == staged, "the READ was staged"
            assert await b.receive() == b"after"


async def test_a_cancelled_receive_of_a_rendezvous_loses_nothing(anyio_backend: Any, kind: str) -> None:
    async with channels(kind) as (a, b), anyio.create_task_group() as senders:
        big = os.urandom(1 << 20)

        async def sender() -> None:
            for _ in range(6):
                await a.send(big)

        senders.start_soon(sender)
        cancelled = 0
        for rounds in range(6):
            with anyio.CancelScope() as scope:

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_after, scope, rounds)
                    assert await b.receive() == big
                    tg.cancel_scope.cancel()
            if scope.cancelled_caught:
                cancelled += 1
                assert await b.receive() == big  # still there, whole
        assert cancelled
        assert getattr(a._core.nic, "rndv_staged", 0) == 0  # every staged region came back


async def test_large_stream_writes_go_by_rendezvous_in_order(anyio_backend: Any, kind: str) -> None:
    """A byte stream with large writes among small ones: every byte arrives in order (the bytes
    behind a rendezvous wait until it is READ); on the native path the large ones went by READ."""
    async with streams(kind, config={"rendezvous": RNDV}) as (a, b):
        threshold = RNDV
        sizes = [10, threshold, 5, 3 << 20, 1, threshold - 1, 2 << 20, 7]
        chunks = [os.urandom(n) for n in sizes]
        expected = b"".join(chunks)
        got = bytearray()
        async with anyio.create_task_group() as tg:

            async def sender() -> None:
                for c in chunks:
                    await a.send(c)

            tg.start_soon(sender)
            buf = bytearray(1 << 20)
            while len(got) < len(expected):
                n = await b.receive_into(buf)
                got += buf[:n]
        assert got == expected
        rendezvous = a._core.memory._next_mid - 1
        assert rendezvous == (sum(1 for n in sizes if n >= threshold) if _on_the_nic(kind) else 0)


async def test_a_cancelled_rendezvous_send_is_whole_or_absent(anyio_backend: Any, kind: str) -> None:
    """Cancel a large send after 0, 1, 2, ... scheduler rounds: the receiver gets it whole or not
    at all, the connection goes on in order, and every staged region comes back."""
    if _expected_transport(kind) != "rdma":
        pytest.skip("over TCP a cancelled send may cut a frame (docs/architecture.md, Cancellation)")
    async with channels(kind) as (a, b):
        big = os.urandom(1 << 20)
        for rounds in range(8):
            with anyio.CancelScope() as scope:

                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_after, scope, rounds)
                    await a.send(big)
                    tg.cancel_scope.cancel()
            marker = b"end %d" % rounds
            await a.send(marker)
            while True:
                got = await b.receive()
                if got == marker:
                    break
                assert got == big, "a cancelled send arrived cut"
        with anyio.fail_after(10):
            while getattr(a._core.nic, "rndv_staged", 0):
                await a.send(b"")  # (each send lets the link take the peer's RNDV_DONEs)
                assert await b.receive() == b""


async def test_a_failed_connection_releases_an_operation_the_peer_never_acknowledges(anyio_backend: Any) -> None:
    """A WRITE whose ACK never comes (a silent wire, a dead host) and then the connection fails
    (here its TCP link ends): the QP goes to ERROR at once, the WRITE flushes, and the caller gets
    ``BrokenResourceError`` with its buffer back -- not a wait for a completion that never comes
    (the two-host bed's long outage hung so before)."""
    import socket

    from anyio.abc import SocketAttribute

    from aiordma.testing import channel_pair, simulated_backend

    backend = simulated_backend(aiordma.RdmaConfig())
    fabric = backend.fabric  # type: ignore[attr-defined]
    async with channel_pair("sim", rdma_backend=backend) as (a, b):
        target = bytearray(1 << 16)
        async with a.expose(target, write=True) as remote:
            await a.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await b.receive())
            fabric.hold_acks = fabric.flush_held_on_error = True
            local = RegisteredBuffer(1 << 16)
            outcome: list[str] = []
            done = anyio.Event()
            try:
                async with anyio.create_task_group() as tg:

                    async def write() -> None:
                        try:
                            await b.write(desc, local)
                            outcome.append("completed")
                        except anyio.BrokenResourceError as exc:
                            outcome.append(f"broken: {exc}")
                        finally:
                            done.set()

                    tg.start_soon(write)
                    for _ in range(20):
                        await anyio.lowlevel.checkpoint()
                    assert b._core.nic.os_inflight, "the WRITE is waiting for its ACK"  # type: ignore[union-attr]
                    raw = a._core.link.control.extra_attributes[SocketAttribute.raw_socket]()  # type: ignore[union-attr]
                    with socket.socket(fileno=os.dup(raw.fileno())) as sock:  # (uvloop's socket has no shutdown)
                        sock.shutdown(socket.SHUT_RDWR)  # the peer's end of the TCP link goes
                    with anyio.move_on_after(5):
                        await done.wait()
                    stuck = not done.is_set()
                    fabric.hold_acks = False
                    fabric.release_acks()  # (what would have freed it: the ACK that never comes)
                assert not stuck, "the WRITE waited for an ACK after its connection had failed"
                assert outcome and "WR_FLUSH_ERR" in outcome[0], outcome
                assert not local.busy
            finally:
                fabric.hold_acks = False
                fabric.release_acks()
                local.close()


def test_a_registered_buffer_left_by_an_error_keeps_the_error_and_its_registration_goes() -> None:
    """An error that leaves ``with RegisteredBuffer(...)`` holds its frames, and with them views
    of the buffer (receive_into's own, the caller's): closing cannot unmap it then.  The error
    in flight is what the caller sees (found across two hosts: a failed rendezvous READ turned
    into ``BufferError: cannot close exported pointers exist``), and the buffer is deregistered
    all the same; closing again once the views are gone unmaps it."""
    before = aiordma.memory_stats().buffers
    with pytest.raises(KeyError, match="the real error"):
        with RegisteredBuffer(8192) as buf:
            view = memoryview(buf)[:100]  # (alive in this frame while the error leaves)
            raise KeyError("the real error")
    assert aiordma.memory_stats().buffers == before  # deregistered
    assert not buf.closed  # still mapped: the view is alive
    with pytest.raises(BufferError, match="views of it are alive"):
        buf.close()  # without an error in flight, it says why it cannot unmap
    view[0] = 7  # (the memory is still the view's)
    view.release()
    buf.close()
    assert buf.closed
    buf.close()  # idempotent


# -- the sender's zero copy: registered memory lent to the peer's READ -------------------------


async def test_a_registered_send_is_read_from_the_callers_memory(anyio_backend: Any, kind: str) -> None:
    """A ``RegisteredBuffer`` (or a view inside one) larger than a SEND slot is lent to the peer's
    READ where it lies: nothing is staged, the memory is the NIC's -- it cannot be closed -- and
    ``send`` returns only once the peer READ it all (its RNDV_DONE); READ into the receiver's
    registered memory, no byte is copied on either side.  Elsewhere (TCP, MEMORY frames) the same
    program gets the same bytes."""
    async with channels(kind) as (a, b):
        with RegisteredBuffer(3 << 20) as reg:
            reg[:] = os.urandom(len(reg))
            for start, n in ((None, len(reg)), (100, 1 << 20)):
                expected = bytes(reg[start or 0 : (start or 0) + n])
                sent = anyio.Event()
                staged = aiordma.memory_stats().staged_bytes

                async def send(start: int | None = start, n: int = n, sent: anyio.Event = sent) -> None:
                    if start is None:
                        await a.send(reg)  # type: ignore[arg-type]  # (send takes registered memory)
                    else:
                        with memoryview(reg) as whole, whole[start : start + n] as view:
                            await a.send(view)
                    sent.set()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(send)
                    await anyio.sleep(0.3)
                    if _on_the_nic(kind):
                        assert not sent.is_set(), "send returned before the peer READ it"
                        assert a._core.nic.rndv_staged == 0 and a._core.memory._next_mid > 1  # lent, not staged
                        with pytest.raises(aiordma.BufferBusyError):
                            reg.close()  # (the NIC's until the send returns)
                    with RegisteredBuffer(4 << 20) as landing:  # (READ straight in: nothing staged)
                        assert await b.receive_into(landing) == n
                        assert landing[:n] == expected
                    with anyio.fail_after(10):
                        await sent.wait()
                if _on_the_nic(kind):
                    assert aiordma.memory_stats().staged_bytes == staged  # memory to memory, no copy


async def test_a_cancelled_zero_copy_send_gives_the_memory_back_at_once(anyio_backend: Any, kind: str) -> None:
    """Cancel a lent send after 0, 1, 2, ... scheduler rounds while the peer does not read: the
    memory is the caller's again when ``send`` raises (it can be closed at once -- no paused
    reader holds it).  Cancelled before its announcement nothing was sent and the connection
    goes on; after it, the peer can no longer READ what was announced, so the connection fails
    at both ends -- never a message cut or made of other bytes."""
    if not _on_the_nic(kind):
        pytest.skip("only the native path lends memory (elsewhere a registered send is copied)")
    outcomes: set[str] = set()
    for rounds in range(0, 10, 3):
        async with channels(kind) as (a, b):
            reg = RegisteredBuffer(1 << 20)
            reg[:] = os.urandom(len(reg))
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_after, scope, rounds)
                    await a.send(reg)  # type: ignore[arg-type]  # (send takes registered memory)
            assert scope.cancelled_caught  # (nobody reads: it cannot have been READ)
            reg.close()  # the caller's again: no BufferBusyError, unmapped now
            with anyio.fail_after(10):
                if a._core.memory._next_mid == 1:  # cancelled before the announcement
                    outcomes.add("absent")
                    await a.send(b"after")
                    assert await b.receive() == b"after"
                else:
                    outcomes.add("failed")
                    with pytest.raises(anyio.BrokenResourceError, match="zero-copy send was cancelled"):
                        await a.send(b"after")
                    with pytest.raises(anyio.BrokenResourceError):
                        await b.receive()
    assert outcomes == {"absent", "failed"}, outcomes


async def test_a_peer_that_closes_without_reading_ends_a_lent_send(anyio_backend: Any, kind: str) -> None:
    """The peer closes with our lent message unread: ``send`` raises ``BrokenResourceError``
    (it was not delivered) and the memory is ours again."""
    async with channels(kind) as (a, b):
        with RegisteredBuffer(1 << 20) as reg:
            async with anyio.create_task_group() as tg:

                async def close_b() -> None:
                    await anyio.sleep(0.3)
                    await b.aclose()

                tg.start_soon(close_b)
                with anyio.fail_after(10):
                    if _on_the_nic(kind):
                        with pytest.raises(anyio.BrokenResourceError):
                            await a.send(reg)  # type: ignore[arg-type]  # (send takes registered memory)
                    else:
                        await a.send(reg)  # type: ignore[arg-type]  # (copied: gone before the peer closes)
            reg.close()  # (not busy)


async def test_large_registered_stream_writes_are_lent_in_pieces(anyio_backend: Any, kind: str) -> None:
    """A byte stream writes from registered memory: lent (zero copy) in pieces, every byte in
    order with small writes around it; nothing staged on the sender."""
    async with streams(kind, config={"rendezvous": RNDV}) as (a, b):
        with RegisteredBuffer(5 << 20) as reg:
            reg[:] = os.urandom(len(reg))
            expected = b"head" + bytes(reg) + b"tail"
            got = bytearray()
            async with anyio.create_task_group() as tg:

                async def sender() -> None:
                    await a.send(b"head")
                    await a.send(reg)  # type: ignore[arg-type]  # (send takes registered memory)
                    if _on_the_nic(kind):
                        assert a._core.nic.rndv_staged == 0 and a._core.memory._next_mid > 1  # lent
                    await a.send(b"tail")

                tg.start_soon(sender)
                buf = bytearray(1 << 20)
                with anyio.fail_after(30):
                    while len(got) < len(expected):
                        n = await b.receive_into(buf)
                        got += buf[:n]
            assert got == expected
