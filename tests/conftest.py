"""Shared fixtures: the three event loops, the RDMA marker, leak checks."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import pytest

from . import _time_limits
from ._skips import rdma_device_present

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency
    uvloop = None

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"loop_factory": uvloop.new_event_loop}), id="uvloop")
    if uvloop is not None
    else pytest.param(("asyncio", {}), id="uvloop", marks=pytest.mark.skip(reason="uvloop is not installed")),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


#: the poll modes the conformance suite's ``rdma`` kind runs in besides the default
POLL_MODE_IDS = ("rdma-checked", "rdma-adaptive", "rdma-busy")


def guest_keeps(item: pytest.Item) -> bool:
    """The guest stage's selection (``AIORDMA_IN_VM=1``, unless ``AIORDMA_GUEST_FULL=1``).

    Under TCG the guest runs Python ~20x slower than the host, so there it runs each RDMA test
    under asyncio, in the default poll mode; a test marked ``guest_loops(*loops)`` runs under
    those loops too (all three when none is named), one marked ``guest_poll_modes`` in every
    poll mode.  What is left out runs on the host over the simulated RC wire, which runs the same
    code on every loop and in every mode (docs/testing.md lists each test and its counterpart)."""
    callspec = getattr(item, "callspec", None)
    if "rdma" not in item.keywords or callspec is None:
        return True
    backend = callspec.params.get("anyio_backend")
    if backend is not None:
        loop = ("uvloop" if backend[1] else "asyncio") if backend[0] == "asyncio" else backend[0]
        if loop != "asyncio":
            marker = item.get_closest_marker("guest_loops")
            if marker is None or (marker.args and loop not in marker.args):
                return False
    ids = f"-{callspec.id}-"
    if any(f"-{mode}-" in ids for mode in POLL_MODE_IDS):
        if item.get_closest_marker("guest_poll_modes") is None:
            return False
    return True


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--paced", choices=["all", "first"], default="all",
        help="tests marked paced (they wait on the clock): run every case (default), or only each "
             "one's first case (scripts/test --quick)",
    )  # fmt: skip


def first_cases_of_paced(items: list[pytest.Item]) -> tuple[list[pytest.Item], list[pytest.Item]]:
    """``--paced=first``: of each test marked ``paced``, its first case only (kept, left)."""
    seen: set[tuple[str, str]] = set()
    kept: list[pytest.Item] = []
    left: list[pytest.Item] = []
    for item in items:
        if item.get_closest_marker("paced") is None:
            kept.append(item)
            continue
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        (left if key in seen else kept).append(item)
        seen.add(key)
    return kept, left


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_time_limits.TimeLimits(), "aiordma-tests-time-limits")
    # no test reads this user's rendezvous measurements (aiordma/_rdma/thresholds.py): each run
    # starts from none, in a directory of its own (a test that measures writes there)
    if "AIORDMA_CACHE_DIR" not in os.environ:
        cache = os.environ["AIORDMA_CACHE_DIR"] = tempfile.mkdtemp(prefix="aiordma-test-cache-")
        config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _time_limits.apply(config, items)
    if config.getoption("--paced") == "first":
        items[:], left = first_cases_of_paced(items)
        if left:
            config.hook.pytest_deselected(items=left)
    if os.environ.get("AIORDMA_IN_VM") == "1" and os.environ.get("AIORDMA_GUEST_FULL") != "1":
        kept: list[pytest.Item] = []
        left: list[pytest.Item] = []
        for item in items:
            (kept if guest_keeps(item) else left).append(item)
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = kept
    if rdma_device_present():
        return
    skip = pytest.mark.skip(
        reason="needs an RDMA device: none on this host (the README's test command runs these in the Soft-RoCE guest)"
    )
    for item in items:
        if "rdma" in item.keywords:
            item.add_marker(skip)



@pytest.fixture(scope="session")
def tlsdir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory with ``server.pem`` (key and chain for localhost and 127.0.0.1) and ``ca.pem``."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    path = tmp_path_factory.mktemp("tls")
    cert.private_key_and_cert_chain_pem.write_to_path(str(path / "server.pem"))
    ca.cert_pem.write_to_path(str(path / "ca.pem"))
    return str(path)
