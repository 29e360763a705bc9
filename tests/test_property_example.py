"""The worked example of issue 24 (``examples/property_test_rpc.py``): a property test over
aiordma's pairs and strategies finds the classic byte-stream bug planted in a small RPC server
(one ``receive()`` taken for one request) within 200 examples on the memory pair, shrinks it to
a minimal chunking, and holds with the bug fixed on every kind of pair, under asyncio and trio;
the example's client, against a server that fails by any drawn fault schedule, never hangs and
ends with the answers it got or a typed error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "property_test_rpc.py"


def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("property_test_rpc", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.paced
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_property_finds_the_planted_bug_and_shrinks_it(backend: str) -> None:
    found = example().check("memory", buggy=True, max_examples=200, backend=backend)
    assert found is not None, "200 examples did not find the bug"
    requests, chunking = found
    # minimal: one request, one receive size, and a size that cuts the 4-byte length prefix
    assert len(requests) == 1 and len(chunking) == 1 and chunking[0] < 4, found


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["memory", "tcp", "sim"])
def test_the_fixed_server_holds_on_every_kind(kind: str, backend: str) -> None:
    assert example().check(kind, buggy=False, max_examples=200 if kind == "memory" else 40, backend=backend) is None


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["memory", "tcp", "sim"])
def test_the_client_survives_every_fault(kind: str, backend: str) -> None:
    assert example().check_faults(kind, max_examples=100 if kind == "memory" else 50, backend=backend) is None


@pytest.mark.slow
def test_the_fault_property_can_fail() -> None:
    # the same property against a client that waits for every answer whatever happens (it treats
    # the end of the stream as "not yet"): a fault makes it hang, and the property says so
    module = example()

    async def stubborn(stream, requests):  # type: ignore[no-untyped-def]
        for request in requests:
            await stream.send(module.frame(request))
        await stream.send_eof()
        reader = module.BufferedByteReceiveStream(stream)
        answers = []
        while len(answers) < len(requests):
            try:
                (n,) = module._LENGTH.unpack(await reader.receive_exactly(4))
                answers.append(await reader.receive_exactly(n))
            except module.anyio.IncompleteRead:
                await module.anyio.sleep(0.05)  # ("not yet": and again -- a hang)
        return answers

    module.call_all = stubborn
    module.TIME_LIMIT = 0.5
    found = module.check_faults("memory", max_examples=300)
    assert found is not None and len(found) == 1 and found[0].kind in ("close", "abort"), found  # (an end in order)


@pytest.mark.rdma
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_example_on_rdma(backend: str) -> None:
    # (a plain test running its own loops: ``backend``, not anyio's fixture, so both run in the guest)
    module = example()
    assert module.check("rdma", buggy=False, max_examples=10, backend=backend) is None
    assert module.check_faults("rdma", max_examples=10, backend=backend) is None


@pytest.mark.slow
def test_the_example_runs_as_it_stands() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300,
                         cwd=EXAMPLE.parent.parent)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "buggy server: fails on" in out.stdout and "fixed server: the property holds" in out.stdout, out.stdout
