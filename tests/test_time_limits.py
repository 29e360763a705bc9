"""The suite's per-test time limit (tests/_time_limits.py): a hang fails with a traceback and the
run goes on; ``slow`` tests, explicit markers and the guest get their own limits."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = """
import sys
sys.path.insert(0, {root!r})
from tests import _time_limits

_time_limits.GRACE = {grace}

def pytest_configure(config):
    config.pluginmanager.register(_time_limits.TimeLimits(), "aiordma-tests-time-limits")

def pytest_collection_modifyitems(config, items):
    _time_limits.apply(config, items)
"""


def _ini(pytester: pytest.Pytester, timeout: float, extra: str = "", grace: float = 2.0) -> None:
    """The inner run's ini and conftest: *timeout* the default limit, *grace* how long after an
    async test's limit SIGALRM fails it."""
    pytester.makeini(f"[pytest]\ntimeout = {timeout}\ntimeout_method = signal\n{extra}")
    pytester.makeconftest(CONFTEST.format(root=str(ROOT), grace=grace))


def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, float]:
    """The inner run (a process of its own, killed after 90 s), and how long it took."""
    started = time.monotonic()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *args, timeout=90)
    return result, time.monotonic() - started


@pytest.mark.paced
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_hung_async_test_fails_with_its_traceback_and_the_next_one_runs(
    pytester: pytest.Pytester, backend: str
) -> None:
    _ini(pytester, 2)
    pytester.makepyfile(
        test_hang=f"""
import anyio
import pytest

@pytest.fixture
def anyio_backend():
    return {backend!r}

async def wait_for_a_peer_that_never_speaks():
    await anyio.Event().wait()

@pytest.mark.anyio
async def test_hangs():
    await wait_for_a_peer_that_never_speaks()

@pytest.mark.anyio
async def test_after():
    await anyio.sleep(0)
"""
    )
    result, took = _run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "time limit: the test ran over 2 s" in out, out
    assert "in wait_for_a_peer_that_never_speaks" in out, out  # where it hung
    assert took < 60, took  # and nothing waited for the hung task at the end


def test_a_hung_synchronous_test_fails_too(pytester: pytest.Pytester) -> None:
    _ini(pytester, 1)
    pytester.makepyfile(test_hang="import time\ndef test_sleeps():\n    time.sleep(30)\n")
    result, _ = _run(pytester)
    result.assert_outcomes(failed=1)
    assert "Timeout" in result.stdout.str()


LIMITS = """
import pytest

def limit(request):
    marker = request.node.get_closest_marker("timeout")
    return None if marker is None else marker.args[0]

def test_default(request):
    assert limit(request) == {default}

@pytest.mark.slow
def test_slow(request):
    assert limit(request) == {slow}

@pytest.mark.timeout(300)
def test_own(request):
    assert limit(request) == {own}

@pytest.mark.slow
@pytest.mark.timeout(30)
def test_own_wins_over_slow(request):
    assert limit(request) == {own_slow}

@pytest.fixture
def anyio_backend():
    return "asyncio"

@pytest.mark.anyio
async def test_async(request):
    from tests import _time_limits
    assert request.node.stash[_time_limits.LIMIT] == {async_limit}
    assert limit(request) == {async_alarm}
"""


@pytest.mark.paced
@pytest.mark.parametrize("in_guest", [False, True], ids=["host", "guest"])
def test_limits_per_marker_and_in_the_guest(pytester: pytest.Pytester, in_guest: bool) -> None:
    from . import _time_limits

    _ini(pytester, 120, "markers =\n    slow: slow\n")
    factor = _time_limits.GUEST_FACTOR if in_guest else 1
    pytester.makepyfile(
        test_limits=LIMITS.format(
            # on the host the default comes from the ini (no marker added)
            default=120 * factor if in_guest else None,
            slow=_time_limits.SLOW * factor,
            own=300 * factor,
            own_slow=30 * factor,
            async_limit=120 * factor,
            async_alarm=(120 + 2.0) * factor,  # GRACE is 2 s in CONFTEST
        )
    )
    env = dict(os.environ)
    env.pop("AIORDMA_IN_VM", None)
    if in_guest:
        env["AIORDMA_IN_VM"] = "1"
    pytester._monkeypatch.setattr(os, "environ", env)  # the subprocess inherits os.environ
    result, _ = _run(pytester)
    result.assert_outcomes(passed=5)


def test_a_limit_on_the_command_line_rules(pytester: pytest.Pytester) -> None:
    _ini(pytester, 120)
    pytester.makepyfile(
        test_cli="""
import pytest

@pytest.mark.slow
def test_slow(request):
    assert request.node.get_closest_marker("timeout") is None
"""
    )
    result, _ = _run(pytester, "--timeout=50")
    result.assert_outcomes(passed=1)


@pytest.mark.paced
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_async_test_that_blocks_its_loop_fails_by_the_alarm(pytester: pytest.Pytester, backend: str) -> None:
    """A test that does not answer cancellation (it blocks the loop) is failed by SIGALRM, GRACE
    after its limit, with the stack of where it blocked."""
    _ini(pytester, 1)
    pytester.makepyfile(
        test_block=f"""
import time
import anyio
import pytest

@pytest.fixture
def anyio_backend():
    return {backend!r}

def block_the_loop():
    time.sleep(30)

@pytest.mark.anyio
async def test_blocks():
    await anyio.sleep(0)
    block_the_loop()

@pytest.mark.anyio
async def test_after():
    await anyio.sleep(0)
"""
    )
    result, took = _run(pytester)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert "Timeout (>3.0s) from pytest-timeout" in out, out
    assert "def block_the_loop" in out and "test_block.py:10: Failed" in out, out
    assert took < 25, took


@pytest.mark.slow
def test_hypothesis_async_tests_are_limited_too(pytester: pytest.Pytester) -> None:
    # After the limit hypothesis goes on shrinking: every example fails at once (its deadline has
    # passed), ~100 of them in ~0.7 s here and several times that on a loaded CI host -- so the
    # alarm's grace is long and the test checks that the in-loop cancellation ended both cases
    # (a 2 s grace once let SIGALRM land in pytest's own report hook: an INTERNALERROR)
    _ini(pytester, 2, grace=30.0)
    pytester.makepyfile(
        test_hyp="""
import anyio
import pytest
from hypothesis import given, settings, strategies as st

@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param

@pytest.mark.anyio
@settings(deadline=None, max_examples=3, database=None)
@given(st.integers())
async def test_hangs(n):
    await anyio.Event().wait()
"""
    )
    result, took = _run(pytester)
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert out.count("time limit: the test ran over 2 s") >= 2, out
    assert "from pytest-timeout" not in out, out  # the alarm never had to fail them
    assert took < 60
