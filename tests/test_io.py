"""The event-loop backends' timers and parking (aiordma/_io/backends.py), under asyncio, uvloop and trio."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from aiordma._io.backends import current_io

pytestmark = pytest.mark.anyio


async def test_a_timer_fires_once_after_its_delay_and_a_closed_one_never(anyio_backend: Any) -> None:
    io = current_io()
    fired: list[tuple[str, float]] = []
    t0 = io.clock()
    io.call_later(0.05, lambda: fired.append(("kept", io.clock())))
    closed = io.call_later(0.02, lambda: fired.append(("closed", io.clock())))
    closed.close()
    closed.close()  # (idempotent)
    await anyio.sleep(0.2)
    assert [name for name, _ in fired] == ["kept"]
    assert fired[0][1] - t0 >= 0.05 - 1e-3


async def test_a_timer_whose_callback_raises_is_logged_and_the_loop_goes_on(anyio_backend: Any,
                                                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    io = current_io()

    def boom() -> None:
        raise RuntimeError("a bug in a timer callback")

    io.call_later(0.0, boom)
    await anyio.sleep(0.05)
    assert "a bug in a timer callback" in caplog.text


async def test_parking_counts_the_tasks_that_wait(anyio_backend: Any) -> None:
    io = current_io()
    parking = io.parking()
    assert len(parking) == 0

    async def wait() -> None:
        await parking.park()

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(wait)
        await anyio.sleep(0.02)
        assert len(parking) == 3
        parking.unpark_all()
        assert len(parking) == 0  # (woken: they wait no more, though they have not run yet)
    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    assert len(parking) == 0  # a cancelled wait leaves nothing behind


async def test_parking_counts_its_wakes_even_with_nobody_waiting(anyio_backend: Any) -> None:
    """``wakes`` lets a task that does synchronous work before it parks see that the work woke
    the waiters (itself included, before it waited): it must then look again, not park."""
    parking = current_io().parking()
    before = parking.wakes
    parking.unpark_all()  # (nobody waits: a bare lot would forget it)
    assert parking.wakes == before + 1
