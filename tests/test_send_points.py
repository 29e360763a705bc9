"""Where a send yields and where it may be cancelled (issue 33, item 2: a round trip's latency).

A send writes first and yields after, as trio's own socket sends do: a cancel point before it
writes (a cancellation already due raises there, and nothing is sent) and a schedule point after
the bytes went, where a cancellation that arrives is kept for the task's next await.  Before,
every send yielded *before* it wrote, so an answer left one pass of the loop after the message
it answered: in two processes the channels' 64 B round trip cost 1.27-1.43x asyncio streams',
one extra ``epoll_wait`` between each ``recvfrom`` and its ``sendto``.

These tests count passes of the loop (a task that yields at every pass) instead of timing
anything, and they check the cancellation contract on each loop: a send that returns was sent,
one whose task was cancelled before it wrote sent nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from aiordma._api import core_of
from aiordma.testing import stream_pair

from ._send_programs import KINDS, pair

pytestmark = pytest.mark.anyio

MSG = b"m" * 64


class Passes:
    """Counts the passes of the event loop: a task that yields at each one."""

    def __init__(self) -> None:
        self.count = 0

    async def run(self) -> None:
        while True:
            self.count += 1
            await anyio.lowlevel.checkpoint()


@asynccontextmanager
async def counting() -> AsyncIterator[Passes]:
    passes = Passes()
    async with anyio.create_task_group() as tg:
        tg.start_soon(passes.run)
        await anyio.sleep(0.01)
        yield passes
        tg.cancel_scope.cancel()


@asynccontextmanager
async def must_yield(passes: Passes, trio_loop: bool) -> AsyncIterator[None]:
    """The body yields to the loop: on asyncio a pass of the loop ran; on trio (which runs a
    batch's tasks in random order) trio's own check, that a schedule point was reached."""
    if trio_loop:
        import trio.testing

        with trio.testing.assert_checkpoints():
            yield
        return
    at = passes.count
    yield
    assert passes.count > at, "it did not yield"


def record_link_sends(endpoint: Any, passes: Passes) -> list[int]:
    """The pass in which each send reached the endpoint's link (the transport below it)."""
    core = core_of(endpoint)
    real: Callable[[Sequence[Any]], Awaitable[None]] = core.link.send
    seen: list[int] = []

    async def send(chunks: Sequence[Any]) -> None:
        seen.append(passes.count)
        await real(chunks)

    core.link.send = send  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("kind", KINDS)
async def test_a_message_is_written_in_the_pass_its_send_began_and_the_send_yields_after(
    anyio_backend: Any, kind: str, tlsdir: str
) -> None:
    """A channel's send reaches the transport without a pass of the loop first, and it still
    yields (every await on a data path does) -- also an answer sent right after a receive."""
    async with pair(kind, tlsdir) as (a, b), counting() as passes:
        sent_a, sent_b = record_link_sends(a, passes), record_link_sends(b, passes)
        trio_loop = anyio_backend[0] == "trio"
        for i in range(20):  # (on trio a pass before the write shows in half the rounds: 2^-20 to miss)
            at = passes.count
            async with must_yield(passes, trio_loop):
                await a.send(MSG + bytes([i]))
            assert sent_a[-1] == at, "the send yielded before it wrote"
            assert await b.receive() == MSG + bytes([i])
            at = passes.count  # an answer, right after the receive returned
            async with must_yield(passes, trio_loop):
                await b.send(b"answer")
            assert sent_b[-1] == at
            assert await a.receive() == b"answer"


@pytest.mark.parametrize("kind", ["tcp", "sim", "memory"])
async def test_a_stream_write_is_written_in_the_pass_its_send_began(anyio_backend: Any, kind: str) -> None:
    async with stream_pair(kind) as (a, b), counting() as passes:  # type: ignore[arg-type]
        sent = record_link_sends(a, passes)
        for _ in range(20):
            at = passes.count
            async with must_yield(passes, anyio_backend[0] == "trio"):
                await a.send(MSG)
            assert sent[-1] == at
            got = b""
            while len(got) < len(MSG):
                got += await b.receive()
            assert got == MSG


@pytest.mark.parametrize("kind", KINDS)
async def test_a_send_in_a_task_whose_cancellation_is_due_sends_nothing(anyio_backend: Any, kind: str,
                                                                        tlsdir: str) -> None:  # fmt: skip
    """On trio a cancelled scope; on asyncio and uvloop a task that was cancelled while it ran (a
    ``task.cancel()`` from another task, or an ``asyncio.timeout`` that expired): the send raises
    the cancellation before it writes, and the peer receives only what came after."""
    async with pair(kind, tlsdir) as (a, b):
        if anyio_backend[0] == "trio":
            with anyio.CancelScope() as scope:
                scope.cancel()
                await a.send(b"never")
            assert scope.cancelled_caught
        else:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # (as another task would, while this one is ready to run)
            with pytest.raises(asyncio.CancelledError):
                await a.send(b"never")
            assert task.uncancel() == 0
        await a.send(b"after")
        assert await b.receive() == b"after"


@pytest.mark.parametrize("kind", KINDS)
async def test_asyncio_a_cancellation_that_comes_while_a_send_yields_after_writing_is_kept_for_the_next_await(
    anyio_backend: Any, kind: str, tlsdir: str
) -> None:
    """The send returns (its message was sent) and the next await raises; a loop of sends stops
    at the next send, before it writes -- a cancellation is never lost, nor delivered twice."""
    if anyio_backend[0] != "asyncio":
        pytest.skip("trio's cancel_shielded_checkpoint is trio's own (the trio case is in the test above)")
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    async with pair(kind, tlsdir) as (a, b):
        # task.cancel() from a callback that runs in the pass where the send's yield ends
        loop.call_soon(task.cancel, "from another task")
        await a.send(b"one")  # returns: it was sent
        assert task.cancelling() == 1
        with pytest.raises(asyncio.CancelledError, match="from another task"):
            await a.send(b"two")  # (its cancel point: before it writes)
        assert task.uncancel() == 0
        assert await b.receive() == b"one"

        # asyncio.timeout: one cancellation request, so it still becomes a TimeoutError
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as cm:
                cm.reschedule(loop.time() - 1)  # (expires by a callback queued now)
                await a.send(b"three")
                await asyncio.sleep(10)
        assert task.cancelling() == 0
        assert await b.receive() == b"three"

        # anyio's cancel scope on asyncio
        with anyio.CancelScope() as scope:
            loop.call_soon(scope.cancel)
            await a.send(b"four")
            await anyio.sleep(10)
        assert scope.cancelled_caught
        assert await b.receive() == b"four"
        await a.send(b"five")
        assert await b.receive() == b"five"
