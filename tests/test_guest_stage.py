"""The suite's guest stage runs every RDMA test there is: ``scripts/test`` names the files the
Soft-RoCE guest runs (collecting all of them under TCG would cost minutes), and a file with
``rdma`` tests left off that list would never run on real verbs in CI -- as happened to five of
them, each run in the guest only by hand."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def guest_paths() -> list[str]:
    script = (ROOT / "scripts" / "test").read_text()
    start = script.index("-m rdma tests/")
    command = script[start : script.index("\nend", start)]
    return re.findall(r"tests/[\w/]*(?:\.py)?", command)


def test_every_file_with_rdma_tests_runs_in_the_guest() -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-m", "rdma", "-p", "no:cacheprovider", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    files = {line.split("::")[0] for line in out.stdout.splitlines() if "::" in line}
    assert files, out.stdout + out.stderr
    listed = guest_paths()
    missing = sorted(f for f in files if not any(f == p or f.startswith(p.rstrip("/") + "/") for p in listed))
    assert not missing, f"scripts/test's guest stage leaves out files with rdma tests: {missing}"
