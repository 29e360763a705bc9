"""Poll modes: the poller's spin/arm decisions, the loop backends' spinning watch, the configuration.

The poller is driven with a scripted waker (the contract of ``aiordma_wake``:
what a call polled, whether it armed), so what each mode does after activity
and when idle is checked exactly; the event-loop side is checked with a real
pipe under asyncio, uvloop and trio: a spinning callback is called again
only after the loop ran (another task makes progress between two spins), and
stops when it says so.  The peer-in-this-thread rule is checked over the
simulated wire.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any

import anyio
import pytest

from aiordma import RdmaConfig
from aiordma._io.backends import current_io
from aiordma._rdma.fastpath import native_lib
from aiordma._rdma.poller import Poller
from aiordma.testing import stream_pair
from aiordma.testing._sim import simulated_backend

NATIVE = native_lib()


class ScriptedWaker:
    """Stands in for ``aiordma_wake``: each call takes the next count of completions 'polled'."""

    def __init__(self, polled: list[int]) -> None:
        self.polled = polled
        self.calls: list[tuple[int, int, int]] = []  # (read_event, arm, spin_ns)

    def __call__(self, read_event: int, arm: int, spin_ns: int, *rest: Any) -> int:
        res = rest[-1]
        self.calls.append((read_event, arm, spin_ns))
        res.events_read = read_event
        res.polled = self.polled.pop(0) if self.polled else 0
        res.others = res.more = res.err = 0
        res.armed = 1 if arm else 0
        return 0


class FakeCQ:
    def __init__(self, waker: ScriptedWaker) -> None:
        self.waker = waker

    def native_waker(self, channel: Any) -> ScriptedWaker:
        return self.waker


def _poller(polled: list[int], mode: str, window: float) -> tuple[Poller, ScriptedWaker]:
    assert NATIVE is not None
    waker = ScriptedWaker(polled)
    poller = Poller(FakeCQ(waker), None, None, NATIVE)
    poller.add_mode(mode)
    poller.spin_window = poller.busy_window = window
    poller.spin_budget = 20e-6
    return poller, waker


pytestmark_native = pytest.mark.skipif(NATIVE is None, reason="the native module is not built here")


@pytestmark_native
def test_event_mode_arms_after_every_wake_and_never_spins() -> None:
    poller, waker = _poller([3, 0], "event", 1.0)
    assert poller._native_pass() is False
    assert waker.calls == [(1, 1, 0)]  # read the event, arm solicited-only, no spin
    assert poller.armed


@pytestmark_native
@pytest.mark.parametrize("mode", ["adaptive", "busy"])
def test_spinning_modes_poll_without_arming_while_active_then_arm_and_sleep(mode: str) -> None:
    poller, waker = _poller([2, 1, 0, 0, 0, 0, 0, 0], mode, 0.05)
    assert poller._native_pass() is True  # activity: go on polling, the loop runs in between
    assert waker.calls[-1][1] == 0 and not poller.armed  # not armed while spinning
    assert poller.spin() is True
    read_event, arm, spin_ns = waker.calls[-1]
    assert read_event == 0 and arm == 0 and 0 < spin_ns <= 20_000  # a bounded spin in C
    deadline = time.monotonic() + 5
    while poller.spin():  # nothing more arrives: the window closes
        assert time.monotonic() < deadline, "the poller never went back to sleep"
    assert poller.armed and waker.calls[-1][1] == 1  # armed (arm-then-poll) before sleeping


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytestmark_native
def test_adaptive_stops_spinning_while_completions_come_further_apart_than_a_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiordma._rdma.poller as poller_module

    clock = FakeClock()
    monkeypatch.setattr(poller_module, "_now", clock)
    poller, waker = _poller([1] * 40, "adaptive", 100e-6)
    # a slow peer: a completion every 2 ms (each wake reads the event and finds one)
    spun = []
    for _ in range(20):
        clock.t += 2e-3
        spun.append(poller._native_pass())
        if spun[-1]:  # it spun: the spin finds nothing and the window closes
            waker.polled.insert(0, 0)
            clock.t += 200e-6
            assert poller.spin() is False
    assert spun[-5:] == [False] * 5, spun  # it learned: event mode, armed solicited-only after each wake
    assert waker.calls[-1] == (1, 1, 0) and poller.armed
    assert poller.gap > poller.spin_window
    # the peer speeds up: completions every 10 us; the average comes down and spinning resumes
    for _ in range(40):
        clock.t += 10e-6
        if poller._native_pass():
            break
    else:
        raise AssertionError(f"adaptive never spun again (gap {poller.gap})")
    assert waker.calls[-1][1] == 0 and not poller.armed  # spinning: not armed


@pytestmark_native
def test_a_waiting_sender_gets_the_cq_armed_for_every_completion() -> None:
    poller, waker = _poller([0, 0, 0], "event", 1.0)
    poller._native_pass()
    assert waker.calls[-1][1] == 1
    poller.want_sends(1)  # re-arms for every completion at once (and looks again)
    assert waker.calls[-1][1] == 2
    poller.want_sends(-1)
    poller.armed = False
    poller._native_pass()
    assert waker.calls[-1][1] == 1


@pytestmark_native
def test_no_mode_spins_while_a_peer_is_in_this_thread() -> None:
    poller, waker = _poller([5, 5, 5], "busy", 1.0)
    poller.add_local_peer(1)
    assert poller.mode == "event"
    assert poller._native_pass() is False and waker.calls[-1] == (1, 1, 0)
    poller.add_local_peer(-1)
    assert poller.mode == "busy"


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["adaptive", "busy"])
async def test_a_pair_in_one_loop_never_spins(anyio_backend: Any, mode: str) -> None:
    """Both ends in this thread: the poller knows it (the peer's QP is on a device of this loop)."""
    async with stream_pair("sim", rdma_backend=simulated_backend(RdmaConfig(poll=mode))) as (a, b):
        poller = a._core.link.device.poller
        assert poller.local_peers == 2 and poller.mode == "event"
        for _ in range(20):
            await a.send(b"ping")
            assert await b.receive() == b"ping"
    assert poller.local_peers == 0


@pytest.mark.anyio
async def test_a_spinning_watch_lets_the_loop_run_between_spins(anyio_backend: Any) -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    progress = 0
    seen: list[int] = []
    spins = 0

    def on_fd() -> bool:
        os.read(r, 100)
        return True  # activity: spin

    def spin() -> bool:
        nonlocal spins
        spins += 1
        seen.append(progress)
        return spins < 10

    async def other_task() -> None:
        nonlocal progress
        while spins < 10:
            progress += 1
            await anyio.sleep(0)

    watch = current_io().watch(r, on_fd, spin)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other_task)
            await anyio.sleep(0)
            os.write(w, b"x")
            with anyio.fail_after(5):
                while spins < 10:
                    await anyio.sleep(0.001)
        assert spins == 10
        # the other task ran between spins: the loop was never starved.  (Under trio a batch
        # runs its tasks in random order, so two spins in a row may see the same progress --
        # (other, spin) then (spin, other) -- but never three: that would be a batch without it.)
        longest = max(sum(1 for _ in group) for _, group in itertools.groupby(seen))
        assert longest <= 2 and seen[-1] > seen[0], seen
        await anyio.sleep(0.05)
        assert spins == 10  # it stopped when spin() said so, and the fd is quiet
    finally:
        watch.close()
        os.close(r)
        os.close(w)


def test_poll_mode_comes_from_the_config_then_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_POLL", raising=False)
    assert RdmaConfig().poll_mode == "event"
    monkeypatch.setenv("AIORDMA_POLL", "busy")
    assert RdmaConfig().poll_mode == "busy"
    assert RdmaConfig(poll="adaptive").poll_mode == "adaptive"
    monkeypatch.setenv("AIORDMA_POLL", "spin")
    with pytest.raises(ValueError, match="AIORDMA_POLL"):
        _ = RdmaConfig().poll_mode
    with pytest.raises(ValueError, match="poll must be"):
        RdmaConfig(poll="fast")
    with pytest.raises(ValueError, match="hot_path"):
        RdmaConfig(hot_path="fast")
    monkeypatch.setenv("AIORDMA_HOT_PATH", "checked")
    assert RdmaConfig().use_native(True) is False
    monkeypatch.setenv("AIORDMA_HOT_PATH", "")
    assert RdmaConfig().use_native(True) is True
    assert RdmaConfig().use_native(False) is False


ECHO_SERVER = r"""
import sys, anyio, aiordma
from aiordma import RdmaBackend, RdmaConfig
async def main():
    backend = RdmaBackend(RdmaConfig(poll=sys.argv[2]))
    async with await aiordma.create_channel_listener(sys.argv[1], 0, transport="rdma", rdma_backend=backend,
                                                     max_message_size=1 << 20) as lst:
        print(lst.port, flush=True)
        async def echo(ch):
            async with ch:
                async for m in ch:
                    await ch.send(m)
        with anyio.move_on_after(300):
            await lst.serve(echo)
anyio.run(main)
"""


@pytest.mark.rdma
@pytest.mark.parametrize("mode", ["adaptive", "busy"])
def test_spinning_modes_across_processes_on_a_device(mode: str) -> None:
    """The peer in another process: the poller really polls without being woken, every message
    comes back byte-exact, and the poller goes back to sleep (armed) once the traffic stopped."""
    import random
    import subprocess
    import sys

    import aiordma
    from aiordma import RdmaBackend
    from aiordma.testing import rdma_address

    host = rdma_address()
    assert host is not None
    server = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, host, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())

        async def main() -> None:
            backend = RdmaBackend(RdmaConfig(poll=mode))
            async with await aiordma.connect_channel(host, port, transport="rdma", rdma_backend=backend,
                                                     max_message_size=1 << 20) as ch:  # fmt: skip
                poller = ch._core.link.device.poller  # type: ignore[attr-defined]
                assert poller.mode == mode and poller.local_peers == 0
                rnd = random.Random(7)
                for _ in range(100):
                    msg = rnd.randbytes(rnd.choice([1, 64, 300, 5000, 70_000]))
                    await ch.send(msg)
                    assert await ch.receive() == msg
                assert poller.passes > poller.wakes, (poller.passes, poller.wakes)  # it polled unwoken
                with anyio.fail_after(10):
                    while not poller.armed:  # the window closes: armed, asleep
                        await anyio.sleep(0.05)

        anyio.run(main)
    finally:
        server.kill()
        server.wait()
