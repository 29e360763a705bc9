"""The worked example of issue 24 (``examples/property_test_rpc.py``): a property test over
aiordma's pairs and strategies finds the classic byte-stream bug planted in a small RPC server
(one ``receive()`` taken for one request) within 200 examples on the memory pair, shrinks it to
a minimal chunking, and holds with the bug fixed on every kind of pair."""

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


def test_the_property_finds_the_planted_bug_and_shrinks_it() -> None:
    found = example().check("memory", buggy=True, max_examples=200)
    assert found is not None, "200 examples did not find the bug"
    requests, chunking = found
    # minimal: one request, one receive size, and a size that cuts the 4-byte length prefix
    assert len(requests) == 1 and len(chunking) == 1 and chunking[0] < 4, found


@pytest.mark.parametrize("kind", ["memory", "tcp", "sim"])
def test_the_fixed_server_holds_on_every_kind(kind: str) -> None:
    assert example().check(kind, buggy=False, max_examples=200 if kind == "memory" else 40) is None


@pytest.mark.slow
def test_the_example_runs_as_it_stands() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300,
                         cwd=EXAMPLE.parent.parent)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "buggy server: fails on" in out.stdout and "fixed server: the property holds" in out.stdout, out.stdout
