"""Event-loop backends for the RDMA transport: fd watchers, waiters, checkpoints.

The RDMA transport is push-based: a device's completion channel fd is watched
for as long as the device is open, and what the watcher finds wakes the tasks
that wait.  Each backend gives three things, in the spirit of httpcore's
``_backends``:

* ``watch(fd, callback, spin=None)``: call ``callback()`` (synchronously, in
  the loop's thread) each time ``fd`` is readable, until the returned watch is
  closed.  asyncio/uvloop: ``loop.add_reader`` once; trio: one system task
  looping on ``wait_readable``.  A callback must not raise (an exception is
  logged: a watcher that dies would leave its connections hanging).  A
  callback that returns True asks to go on polling without the fd: ``spin()``
  is then called after the loop ran once (asyncio: ``call_soon``; trio: a
  checkpoint), again and again while it returns True -- the loop runs
  between two calls, so a spinning poller never starves it.
* parking: ``parking()`` gives a place where tasks wait (``await
  parking.park()``) until ``parking.unpark_all()``; a cancelled wait leaves
  nothing behind (asyncio: futures, the cancelled ones pruned; trio: a
  ``ParkingLot``).  ``parking.wakes`` counts the ``unpark_all`` calls: a task
  that does synchronous work before it parks (work that may itself wake the
  others -- parse what arrived, finish a READ) compares it before and after,
  and does not park if it changed (it would sleep through its own wake).
* ``checkpoint()``: a schedule point and cancel point; :func:`send_points`: a send's pair
  (a cancel point before it writes, a schedule point after), as trio's sockets have them.
* timers: ``clock()`` is the loop's clock (seconds) and ``call_later(delay, callback)``
  calls ``callback()`` once, in the loop's thread, ``delay`` seconds from now, unless the
  returned watch is closed first (asyncio: ``loop.call_later``; trio: a system task that
  sleeps).  The device's liveness probes run on one (:mod:`aiordma._rdma.liveness`).

Backends are chosen per event loop by :func:`current_io`; the loop's identity
(``key``) is what the per-loop device registry is keyed by.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any, Protocol

import sniffio

__all__ = ["IOBackend", "AsyncioIO", "TrioIO", "current_io", "current_checkpoint", "send_points", "Watch", "Parking"]

log = logging.getLogger("aiordma")


class Watch:
    """A registered fd watcher; :meth:`close` stops it (idempotent)."""

    def __init__(self, stop: Callable[[], None]) -> None:
        self._stop: Callable[[], None] | None = stop

    def close(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()


def _guarded(callback: Callable[[], bool | None]) -> Callable[[], bool]:
    def run() -> bool:
        try:
            return bool(callback())
        except Exception:  # pragma: no cover - a bug; keep the watcher alive and say so
            log.exception("aiordma: an fd watcher callback failed")
            return False

    return run


class Parking(Protocol):
    """A place where tasks wait for the same thing, woken together (see the module docs)."""

    #: how many times ``unpark_all`` ran: a task that did synchronous work before it parks
    #: compares it to see whether a wake came meanwhile (it would sleep through it otherwise)
    wakes: int

    def __len__(self) -> int:
        """How many tasks wait here now."""
        ...

    def park(self) -> Awaitable[None]:
        """Wait until the next ``unpark_all`` (cancellable)."""
        ...

    def unpark_all(self) -> None:
        """Wake every task parked here."""
        ...


class AsyncioParking:
    """Tasks waiting for the same thing, woken together (asyncio futures)."""

    __slots__ = ("_new", "_waiters", "wakes")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._new = loop.create_future
        self._waiters: list[asyncio.Future[None]] = []
        self.wakes = 0

    def __len__(self) -> int:
        """How many tasks wait here now (trio's ``ParkingLot`` has the same)."""
        return sum(1 for w in self._waiters if not w.done())

    def park(self) -> Awaitable[None]:
        waiters = self._waiters
        if len(waiters) >= 16:  # waits cancelled while nothing happened: drop them
            waiters[:] = [w for w in waiters if not w.done()]
        fut: asyncio.Future[None] = self._new()
        waiters.append(fut)
        return fut

    def unpark_all(self) -> None:
        self.wakes += 1
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)


class TrioParking:
    """Tasks waiting for the same thing, woken together (a trio ``ParkingLot``)."""

    __slots__ = ("_lot", "wakes")

    def __init__(self, lot: Any) -> None:
        self._lot = lot
        self.wakes = 0

    def __len__(self) -> int:
        return len(self._lot)

    def park(self) -> Awaitable[None]:
        return self._lot.park()  # type: ignore[no-any-return]

    def unpark_all(self) -> None:
        self.wakes += 1
        self._lot.unpark_all()


class IOBackend:
    """What the RDMA transport needs of an event loop (see the module docs)."""

    key: object
    name: str

    def watch(self, fd: int, callback: Callable[[], bool | None],
              spin: Callable[[], bool] | None = None) -> Watch:  # fmt: skip
        raise NotImplementedError

    def notify_closing(self, fd: int) -> None:
        """``fd`` is about to be closed (its watch was closed already)."""

    def parking(self) -> Parking:
        """A new place to wait (see the module docs): ``park()`` and ``unpark_all()``."""
        raise NotImplementedError

    def checkpoint(self) -> Awaitable[None]:
        raise NotImplementedError

    def clock(self) -> float:
        """The loop's clock, in seconds (what ``call_later`` counts in)."""
        raise NotImplementedError

    def call_later(self, delay: float, callback: Callable[[], None]) -> Watch:
        """Call ``callback()`` once after ``delay`` seconds unless the watch is closed first.
        Like a watcher's, the callback must not raise (an exception is logged)."""
        raise NotImplementedError


class AsyncioIO(IOBackend):
    name = "asyncio"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.key = loop

    def watch(self, fd: int, callback: Callable[[], bool | None],
              spin: Callable[[], bool] | None = None) -> Watch:  # fmt: skip
        loop = self.loop
        run = _guarded(callback)
        if spin is None:
            loop.add_reader(fd, run)
        else:
            spin_run = _guarded(spin)
            state = {"scheduled": False, "stopped": False}

            def respin() -> None:
                state["scheduled"] = False
                if not state["stopped"] and spin_run():
                    state["scheduled"] = True
                    loop.call_soon(respin)

            def on_fd() -> None:
                try:
                    again = callback()
                except Exception:  # pragma: no cover - a bug; keep the watcher alive and say so
                    log.exception("aiordma: an fd watcher callback failed")
                    again = False
                if again and not state["scheduled"]:
                    state["scheduled"] = True
                    loop.call_soon(respin)

            loop.add_reader(fd, on_fd)

        def stop() -> None:
            if spin is not None:
                state["stopped"] = True
            loop.remove_reader(fd)

        return Watch(stop)

    def parking(self) -> AsyncioParking:
        return AsyncioParking(self.loop)

    def checkpoint(self) -> Awaitable[None]:
        return asyncio.sleep(0)

    def clock(self) -> float:
        return self.loop.time()

    def call_later(self, delay: float, callback: Callable[[], None]) -> Watch:
        return Watch(self.loop.call_later(delay, _guarded(callback)).cancel)


class TrioIO(IOBackend):
    name = "trio"

    def __init__(self) -> None:
        import trio

        self._trio = trio
        self.key = trio.lowlevel.current_root_task()

    def watch(self, fd: int, callback: Callable[[], bool | None],
              spin: Callable[[], bool] | None = None) -> Watch:  # fmt: skip
        trio = self._trio
        scope = trio.CancelScope()
        run = _guarded(callback)
        spin_run = _guarded(spin) if spin is not None else None
        stopped = False

        async def watcher() -> None:
            with scope:
                while True:
                    try:
                        await trio.lowlevel.wait_readable(fd)
                    except (trio.ClosedResourceError, OSError):  # pragma: no cover - fd closed under us
                        return
                    if stopped:  # woken, then stopped before it ran: the fd may be closed already
                        return
                    again = run()
                    while again and spin_run is not None and not stopped:
                        await trio.lowlevel.checkpoint()
                        if stopped:
                            return
                        again = spin_run()

        def stop() -> None:
            nonlocal stopped
            stopped = True
            scope.cancel()

        trio.lowlevel.spawn_system_task(watcher, name=f"aiordma fd {fd} watcher")
        return Watch(stop)

    def notify_closing(self, fd: int) -> None:
        self._trio.lowlevel.notify_closing(fd)

    def parking(self) -> Parking:
        return TrioParking(self._trio.lowlevel.ParkingLot())

    def checkpoint(self) -> Awaitable[None]:
        return self._trio.lowlevel.checkpoint()

    def clock(self) -> float:
        return float(self._trio.current_time())

    def call_later(self, delay: float, callback: Callable[[], None]) -> Watch:
        trio = self._trio
        scope = trio.CancelScope(deadline=trio.current_time() + delay)
        run = _guarded(callback)
        cancelled = False

        async def timer() -> None:
            with scope:
                await trio.sleep_forever()
            if not cancelled:  # (the deadline ended the sleep, not close())
                run()

        def stop() -> None:
            nonlocal cancelled
            cancelled = True
            scope.cancel()

        trio.lowlevel.spawn_system_task(timer, name="aiordma timer")
        return Watch(stop)


_asyncio_checkpoint: Callable[[], Awaitable[None]] = functools.partial(asyncio.sleep, 0)  # (C: no frame of ours)


#: the registry ``asyncio.current_task`` reads (running loop -> its current task); read directly
#: when there is one: ``current_task()`` first asks for the running loop, which in CPython 3.11
#: checks the process id -- a ``getpid`` system call per send (benchmarks/syscalls.py saw two per
#: round trip)
_CURRENT_TASKS: dict[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = getattr(asyncio.tasks, "_current_tasks", None)


def _asyncio_before_send_on(loop: asyncio.AbstractEventLoop | None) -> Callable[[], Awaitable[None]]:
    """asyncio's cancel point before a send, for ``loop``: it yields only when a cancellation
    was requested and not taken back (``Task.cancelling()``), and the cancellation, if it is still
    due, is delivered there, before anything is written.  Otherwise it costs no pass of the loop
    (and no system call)."""
    current = _CURRENT_TASKS
    if current is None or loop is None:  # (another Python, or made outside a loop: ask asyncio)
        get: Callable[[], asyncio.Task[Any] | None] = asyncio.current_task
    else:
        get = functools.partial(current.get, loop)

    @types.coroutine
    def before_send() -> Generator[None, None, None]:
        task = get()
        if task is not None and task.cancelling():
            yield  # (a bare yield, as asyncio.sleep(0): the Task throws a due cancellation in here)

    return before_send


@types.coroutine
def _asyncio_after_send() -> Generator[None, None, None]:
    """asyncio's schedule point after a send: the task runs again at the loop's next pass (a bare
    yield, as ``asyncio.sleep(0)``), and a cancellation that arrives meanwhile is kept for the
    task's next await instead of being raised here -- trio's ``cancel_shielded_checkpoint``.
    The task's cancellation count stays as the canceller made it (``cancel`` then ``uncancel``):
    ``asyncio.timeout`` and task groups still see one request, and the next send's cancel point
    (:func:`_asyncio_before_send_on`) sees it and delivers it before writing."""
    try:
        yield
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None:  # (not driven by a Task: nothing to keep it for)
            raise
        task.cancel(exc.args[0] if exc.args else None)
        task.uncancel()


def send_points() -> tuple[Callable[[], Awaitable[None]], Callable[[], Awaitable[None]]]:
    """A send's cancel point and schedule point for the running loop, as trio's sockets have
    them.  ``before`` raises a cancellation that is already due, and yields only then; ``after``
    yields once the bytes went, and a cancellation that arrives there is kept for the task's next
    await.  So a send that finds room writes at once (no pass of the loop between a receive and
    its answer: a round trip's latency), a send that returns was sent, and one whose task or
    scope was cancelled before it wrote sent nothing.  (On asyncio a cancel scope of anyio's
    that was cancelled while its task ran, and not yet delivered, is delivered at the next
    suspension: the send's ``after``, so the send itself still goes and returns.)"""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = "asyncio"
    if library == "trio":
        import trio

        return trio.lowlevel.checkpoint_if_cancelled, trio.lowlevel.cancel_shielded_checkpoint
    return _asyncio_before_send_on(asyncio_loop()), _asyncio_after_send


def current_checkpoint() -> Callable[[], Awaitable[None]]:
    """The cheapest checkpoint of the running loop (a function to call and await)."""
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return _asyncio_checkpoint
    if library == "trio":
        import trio

        return trio.lowlevel.checkpoint
    return _asyncio_checkpoint


def asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop (uvloop's too), or None: under trio, or outside any loop.

    With :func:`current_io` and :func:`current_checkpoint`, the one place aiordma tells the event
    loops apart; the TCP links and the listener ask here which link to build."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def current_io() -> IOBackend:
    """The backend of the running event loop (asyncio, uvloop or trio)."""
    if sniffio.current_async_library() == "trio":
        return TrioIO()
    return AsyncioIO(asyncio.get_running_loop())
