"""``aiordma perf``: the client and server measure, print a table, JSON and a plot.

On the host over TCP (the RDMA lines are tested in the guest stage, marked
``rdma``); the figures themselves are not asserted (a benchmark is not a
pass/fail test), only that every requested line and size was measured, with
sane numbers, and that the outputs are written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from aiordma import _perf
from aiordma.testing import rdma_address

CLI = [sys.executable, "-c", "from aiordma._cli import main; raise SystemExit(main())"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def test_perf_local_tcp_prints_json_and_writes_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "perf.png"
    proc = _run("perf", "client", "--local", "--transports", "tcp", "--sizes", "64,4K,1M", "--iterations", "30",
                "--bw-bytes", "2M", "--json", "--plot", str(plot), "--no-progress")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    (line,) = data["lines"]
    assert line["transport"] == "tcp" and line["note"] == ""
    assert [r["size"] for r in line["results"]] == [64, 4096, 1 << 20]
    for r in line["results"]:
        assert 0 < r["lat_p50_us"] <= r["lat_p99_us"] <= r["lat_p999_us"]
        assert r["lat_iterations"] >= 10 and r["bw_mb_s"] > 0
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def _local_run(**kw: Any) -> list[_perf.PerfLine]:
    """A perf server in this loop and the client against it, over TCP."""
    ports: list[int] = []
    ready = anyio.Event()

    def on_ready(p: list[int]) -> None:
        ports.extend(p)
        ready.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _perf.serve("127.0.0.1", 0, on_ready=on_ready))
        await ready.wait()
        lines = await _perf.run_client("127.0.0.1", ports, transports=["tcp"], **kw)
        tg.cancel_scope.cancel()
    return lines


def test_perf_table_has_every_line_and_the_ratios() -> None:
    async def main() -> list[_perf.PerfLine]:
        return await _local_run(sizes=[64, 1024], iterations=20, bw_bytes=64 << 10)

    lines = anyio.run(main)
    text = _perf.format_table(lines)
    assert "== tcp" in text and "64 B" in text and "1 KiB" in text
    assert all(not line.note for line in lines)


def test_perf_measures_one_sided_reads_and_writes() -> None:
    async def main() -> list[_perf.PerfLine]:
        return await _local_run(sizes=[64, 1 << 20], iterations=10, bw_bytes=4 << 20, ops=["read", "write"])

    lines = anyio.run(main)
    assert [line.label for line in lines] == ["tcp read", "tcp write"]
    for line in lines:
        assert not line.note, line.note
        for r in line.results:
            assert r.lat_iterations >= 10 and 0 < r.lat_p50_us and r.bw_mb_s > 0
    assert "== tcp read" in _perf.format_table(lines)


def test_perf_server_and_client_in_two_processes() -> None:
    server = subprocess.Popen([*CLI, "perf", "server", "--host", "127.0.0.1", "--port", "0", "--max-connections", "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        assert "listening on 127.0.0.1 ports" in first, first
        port = first.split("ports ")[1].split("-")[0]
        proc = _run("perf", "client", "127.0.0.1", "--port", port, "--transports", "tcp", "--sizes", "64,64K",
                    "--iterations", "20", "--bw-bytes", "1M", "--no-progress")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "ratios" not in proc.stdout or "tcp" in proc.stdout
        assert "64 KiB" in proc.stdout
        assert server.wait(timeout=30) == 0  # it stops after its 4 connections
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_perf_refuses_bad_arguments() -> None:
    proc = _run("perf", "client", "--local", "--transports", "udp")
    assert proc.returncode != 0 and "unknown transport" in proc.stderr
    proc = _run("perf", "client", "--local", "--poll", "spin")
    assert proc.returncode != 0 and "unknown poll mode" in proc.stderr
    proc = _run("perf", "client")
    assert proc.returncode != 0 and "HOST" in proc.stderr


@pytest.mark.rdma
def test_perf_over_rdma_in_every_poll_mode() -> None:
    host = rdma_address()
    assert host is not None
    # (small: in the guest every line is a process's worth of Python run ~20x slower; the figures
    # themselves are the benchmarks' business, docs/benchmarks.md.  No --plot: drawing is the same
    # for any lines, and matplotlib under TCG cost ~10 s; the host's TCP test draws one)
    proc = _run("perf", "client", "--local", "--sizes", "64,4K", "--iterations", "10", "--bw-bytes", "256K",
                "--bw-messages", "200", "--json", "--no-progress", timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    labels = [(ln["transport"], ln["poll"]) for ln in data["lines"]]
    assert labels == [("rdma", "event"), ("rdma", "adaptive"), ("rdma", "busy"), ("tcp", "-")]
    for line in data["lines"]:
        assert line["note"] == "", line
        assert all(r["lat_p50_us"] and r["bw_mb_s"] for r in line["results"])


@pytest.mark.rdma
def test_perf_one_sided_over_rdma() -> None:
    host = rdma_address()
    assert host is not None
    proc = _run("perf", "client", "--local", "--ops", "read,write", "--poll", "event", "--sizes", "64,1M",
                "--iterations", "10", "--bw-bytes", "4M", "--bw-messages", "100", "--json", "--no-progress",
                timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [(ln["transport"], ln["op"]) for ln in data["lines"]] == [
        ("rdma", "read"), ("tcp", "read"), ("rdma", "write"), ("tcp", "write")]
    for line in data["lines"]:
        assert line["note"] == "", line
        assert all(r["lat_p50_us"] and r["bw_mb_s"] for r in line["results"])
