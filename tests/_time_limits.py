"""The per-test time limit: a test that hangs fails in minutes, with a traceback, and the stage goes on.

Every test has a limit *L*: its own ``@pytest.mark.timeout(S)``, else :data:`SLOW` for a test
marked ``slow``, else ``timeout`` in pyproject.toml (120 s).  In the Soft-RoCE guest
(``AIORDMA_IN_VM=1``) Python runs ~20x slower under TCG and every limit is multiplied by
:data:`GUEST_FACTOR`; the guest stage's own timeout stays the last resort.

Two mechanisms enforce it, because one is not enough:

* **An async test (anyio) is cancelled inside its own event loop** when *L* has passed since its
  set-up began (``anyio.fail_after`` around the test function).  The failure's cause is the
  ``TimeoutError`` raised at the ``await`` that hung, so the traceback shows *where*; the test's
  ``finally`` blocks and fixtures run, and the loop is left clean for the next test.  A signal
  cannot do this: SIGALRM lands in the loop's ``epoll_wait`` (asyncio), or in the main thread
  while anyio runs trio in guest mode in another, and after that trio's runner waited for the
  hung task for ever at the module's end (seen: a run that never finished).
* **pytest-timeout's SIGALRM** for everything else -- synchronous tests, fixtures, a loop that
  does not answer cancellation (blocked in C, spinning without an ``await``) -- at *L* for a
  synchronous test and at *L* + :data:`GRACE` for an async one.  It fails the test with the stack
  of every thread.

A limit on the command line (``--timeout S``) replaces all of this with pytest-timeout's plain
behaviour; ``--timeout 0`` turns limits off (for a debugger).
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import pytest

#: the limit of a test marked ``slow`` (floods, the wheel, subprocess clusters), in seconds
SLOW: Final = 600.0
#: how much longer every limit is in the Soft-RoCE guest
GUEST_FACTOR: Final = 5.0
#: how long after an async test's limit SIGALRM fails it, if cancelling it did not end it
GRACE: Final = 30.0

LIMIT = pytest.StashKey[float]()
#: when the running test's limit runs out (time.monotonic()), for the in-loop cancellation
_deadline: float | None = None
_limit: float = 0.0


def default_limit(config: pytest.Config) -> float:
    """The ``timeout`` ini value (pytest-timeout's), 0 when it is unset or the plugin is off."""
    try:
        value = config.getini("timeout")
    except ValueError:  # pytest-timeout is not loaded
        return 0.0
    return float(value or 0)


def limit_for(item: pytest.Item, default: float, in_guest: bool) -> float:
    """The time limit of *item*: its own ``timeout`` marker, else :data:`SLOW` for ``slow`` tests,
    else *default*; times :data:`GUEST_FACTOR` in the guest.  0 means none (as in pytest-timeout)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        limit = float(marker.args[0] if marker.args else marker.kwargs["timeout"])
    elif item.get_closest_marker("slow") is not None:
        limit = max(SLOW, default)
    else:
        limit = default
    if limit and in_guest:
        limit *= GUEST_FACTOR
    return limit


def _async_test(item: pytest.Item) -> bool:
    """An anyio test: a coroutine function (or a hypothesis test around one) with a backend."""
    fn = getattr(item, "obj", None)
    if fn is None or "anyio_backend" not in getattr(item, "fixturenames", ()):
        return False
    inner = getattr(getattr(fn, "hypothesis", None), "inner_test", fn)
    inner = getattr(inner, "_anyio_original_func", inner)
    return inspect.iscoroutinefunction(inner)


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every collected test its limit: stashed for the in-loop cancellation, and as its
    closest ``timeout`` marker (the SIGALRM one, later by :data:`GRACE` for an async test)."""
    default = default_limit(config)
    if not default or config.getoption("timeout", None) is not None:
        return  # no limit, or one given on the command line: that one rules
    in_guest = os.environ.get("AIORDMA_IN_VM") == "1"
    grace = GRACE * (GUEST_FACTOR if in_guest else 1.0)
    for item in items:
        limit = limit_for(item, default, in_guest)
        if not limit:
            continue
        alarm = limit
        if _async_test(item):
            item.stash[LIMIT] = limit
            alarm = limit + grace
        if alarm != default:
            item.add_marker(pytest.mark.timeout(alarm), append=False)


def _limited(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def run(*args: Any, **kwargs: Any) -> Any:
        deadline = _deadline
        if deadline is None:
            return await fn(*args, **kwargs)
        try:
            with anyio.fail_after(max(deadline - time.monotonic(), 0.0)):
                return await fn(*args, **kwargs)
        except TimeoutError as exc:
            if time.monotonic() < deadline:
                raise  # the test's own TimeoutError
            raise pytest.fail.Exception(
                f"time limit: the test ran over {_limit:g} s and was cancelled where it waited "
                "(the TimeoutError above; tests/_time_limits.py)"
            ) from exc

    run._aiordma_limited = True  # type: ignore[attr-defined]
    return run


class TimeLimits:
    """The hooks (registered by tests/conftest.py)."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        global _deadline, _limit
        limit = item.stash.get(LIMIT, None)
        _limit = limit or 0.0
        _deadline = None if limit is None else time.monotonic() + limit

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        global _deadline
        _deadline = None

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem: pytest.Function) -> Any:
        if LIMIT not in pyfuncitem.stash:
            yield
            return
        fn = pyfuncitem.obj
        settings = getattr(fn, "hypothesis", None)
        if settings is not None:
            # anyio wraps hypothesis' inner test once per backend (keeping the original as
            # _anyio_original_func); ours goes under it, once
            inner = settings.inner_test
            base = getattr(inner, "_anyio_original_func", inner)
            if not getattr(base, "_aiordma_limited", False) and inspect.iscoroutinefunction(base):
                settings.inner_test = _limited(base)
            yield
            return
        pyfuncitem.obj = _limited(fn)
        try:
            yield
        finally:
            pyfuncitem.obj = fn
