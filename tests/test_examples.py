"""The scripts in examples/ run as they stand: exit 0 and say what happened."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aiordma._handshake.negotiate import local_offer

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 60


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIORDMA_TRANSPORT"}
    env.update(extra)
    return env


def expected_transport_lines() -> list[str]:
    offer = local_offer("auto", "client")
    if offer.rdma:
        return ["transport: rdma", "fallback reason: (none: RDMA)"]
    return ["transport: tcp", f"fallback reason: {offer.reason}"]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=clean_env(),
        cwd=EXAMPLES.parent,
    )


@pytest.mark.parametrize(
    ("name", "args", "key_lines"),
    [
        pytest.param(
            "echo_asyncio.py",
            (),
            [
                "client: 19 bytes echoed: b'hello over aiordma'",
                "client: 100001 bytes echoed: b'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...'",
                "echo: all lines came back intact",
            ],
            id="echo_asyncio",
        ),
        pytest.param(
            "trio_example.py",
            (),
            [
                "client: 15 bytes sent, answer b'HELLO FROM TRIO'",
                "client: 200000 bytes sent, answer b'ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ...'",
                "trio: all answers correct",
            ],
            id="trio",
        ),
        pytest.param(
            "channel_example.py",
            (),
            [
                "client: b'GET empty' -> 0-byte answer, as expected",
                "client: b'GET big' -> 1048576-byte answer, as expected",
                "channel: message boundaries kept, empty messages included",
            ],
            id="channel_asyncio",
        ),
        pytest.param(
            "protocol_echo.py",
            (),
            ["client: 300000 bytes echoed, intact"],
            id="protocol_echo",
        ),
        pytest.param(
            "grpc_service.py",
            (),
            [
                "unary: Reverse -> b'amdroia revo olleh'",
                "stream: Running 1..5 -> [1, 3, 6, 10, 15]",
                "grpc: all answers correct",
            ],
            id="grpc_service",
        ),
        pytest.param(
            "channel_example.py",
            ("--backend", "trio"),
            ["channel: message boundaries kept, empty messages included"],
            id="channel_trio",
        ),
    ],
)
def test_example_runs(name: str, args: tuple[str, ...], key_lines: list[str]) -> None:
    proc = run_example(name, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for line in expected_transport_lines() + key_lines:
        assert line in lines, f"{line!r} not in the output:\n{proc.stdout}\n{proc.stderr}"
    assert "FAILED" not in proc.stdout and "WRONG" not in proc.stdout and "MISMATCH" not in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


def test_examples_honour_transport_tcp() -> None:
    for name in ("echo_asyncio.py", "trio_example.py", "channel_example.py", "protocol_echo.py", "grpc_service.py"):
        proc = run_example(name, "--transport", "tcp")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "fallback reason: client: transport='tcp' was requested" in proc.stdout.splitlines()


def test_echo_asyncio_as_separate_server_and_client() -> None:
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "echo_asyncio.py"), "server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(PYTHONUNBUFFERED="1"),
    )
    watchdog = threading.Timer(TIMEOUT, server.kill)  # bounds the readline below
    watchdog.start()
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # "server: listening on 127.0.0.1:PORT"
        assert first.startswith("server: listening on 127.0.0.1:"), first + (server.stderr.read() if server.stderr else "")
        port = first.rsplit(":", 1)[1].strip()
        client = run_example("echo_asyncio.py", "client", "--port", port)
        assert client.returncode == 0, client.stdout + client.stderr
        lines = client.stdout.splitlines()
        assert f"client: connected to 127.0.0.1:{port}" in lines
        for line in expected_transport_lines():
            assert line in lines
        assert "client: 4 bytes echoed: b'bye'" in lines
    finally:
        watchdog.cancel()
        server.terminate()
        server.wait(timeout=TIMEOUT)
        if server.stdout is not None:
            server.stdout.close()
        if server.stderr is not None:
            server.stderr.close()
