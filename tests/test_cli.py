"""The ``aiordma`` command: ``info`` and ``demo``, run as the user runs them."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiordma
from aiordma import _cli
from aiordma._cli import common as cli_common
from aiordma._cli import info as cli_info
from aiordma._errors import RDMAUnavailableError
from aiordma._handshake.negotiate import local_offer

SYSFS_IB = "/sys/class/infiniband"
TIMEOUT = 120


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIORDMA_TRANSPORT"}
    env.update(extra)
    return env


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiordma", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env if env is not None else clean_env(),
    )


def auto_outcome() -> tuple[str, str]:
    """What a client with transport='auto' offers on this host: (transport, reason)."""
    offer = local_offer("auto", "client")
    if offer.rdma:
        return "rdma", ""
    return "tcp", offer.reason


# -- info ----------------------------------------------------------------------


def test_info_says_which_transport_auto_would_use_and_why() -> None:
    proc = run("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"aiordma {aiordma.__version__}" in out
    assert f"anyio {importlib.metadata.version('anyio')}" in out
    assert "AIORDMA_TRANSPORT: (not set)" in out
    transport, reason = auto_outcome()
    if transport == "tcp":
        assert f"auto would use: tcp \u2014 {reason}" in out
    if not os.path.isdir(SYSFS_IB):  # this host: no RDMA in the kernel at all
        assert "auto would use: tcp \u2014 client: no RDMA device" in out
        assert f"{SYSFS_IB} does not exist" in out
        assert "RDMA usable: no" in out
        assert "native verbs module: not available" in out


def test_info_json_has_the_fields() -> None:
    proc = run("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["aiordma"] == aiordma.__version__
    assert info["python"]["version"] == ".".join(map(str, sys.version_info[:3]))
    assert info["packages"]["anyio"] == importlib.metadata.version("anyio")
    assert set(info["packages"]) == {"anyio", "trio", "uvloop", "cffi"}
    assert isinstance(info["native_module"]["available"], bool)
    assert isinstance(info["native_module"]["reason"], str)
    assert isinstance(info["rdma"]["usable"], bool)
    assert isinstance(info["rdma"]["devices"], list)
    assert info["env"] == {"AIORDMA_TRANSPORT": None}
    assert info["default_policy"] == "auto"
    transport, reason = auto_outcome()
    assert info["auto"]["transport"] == transport
    assert info["auto"]["policy"] == "auto"
    if transport == "tcp":
        assert info["auto"]["reason"] == reason
    if not os.path.isdir(SYSFS_IB):
        assert info["rdma"]["sysfs_exists"] is False
        assert info["rdma"]["devices"] == []
        assert info["rdma"]["usable"] is False
        assert info["auto"]["reason"].startswith("client: no RDMA device")


def test_info_reports_the_environment_policy() -> None:
    info = json.loads(run("info", "--json", env=clean_env(AIORDMA_TRANSPORT="tcp")).stdout)
    assert info["env"]["AIORDMA_TRANSPORT"] == "tcp"
    assert info["default_policy"] == "tcp"
    assert info["default"] == {
        "policy": "tcp",
        "transport": "tcp",
        "reason": "client: transport='tcp' was requested",
        "error": False,
    }
    text = run("info", env=clean_env(AIORDMA_TRANSPORT="tcp")).stdout
    assert "AIORDMA_TRANSPORT: tcp" in text
    assert "default policy (tcp, from AIORDMA_TRANSPORT) would use: tcp \u2014 client: transport='tcp' was requested" in text


def test_info_with_a_bad_environment_value_still_reports() -> None:
    proc = run("info", env=clean_env(AIORDMA_TRANSPORT="carrier-pigeon"))
    assert proc.returncode == 0, proc.stderr
    assert "AIORDMA_TRANSPORT: carrier-pigeon" in proc.stdout
    assert "invalid: AIORDMA_TRANSPORT='carrier-pigeon' is not one of 'auto', 'rdma', 'tcp'" in proc.stdout
    info = json.loads(run("info", "--json", env=clean_env(AIORDMA_TRANSPORT="carrier-pigeon")).stdout)
    assert info["default_policy"] is None
    assert "carrier-pigeon" in info["default_policy_error"]


def test_info_strict_rdma_policy_says_it_would_fail_here() -> None:
    info = json.loads(run("info", "--json", env=clean_env(AIORDMA_TRANSPORT="rdma")).stdout)
    try:
        local_offer("rdma", "client")
    except RDMAUnavailableError as exc:
        assert info["default"]["transport"] is None
        assert info["default"]["error"] is True
        assert str(exc) in info["default"]["reason"]
    else:
        assert info["default"]["transport"] == "rdma"


def _fake_sysfs(root: Path) -> None:
    port = root / "rxe0" / "ports" / "1"
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port / sub).mkdir(parents=True)
    (root / "rxe0" / "node_type").write_text("1: CA\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "gids" / "0").write_text("fe80:0000:0000:0000:0250:56ff:fe00:0001\n")
    (port / "gids" / "1").write_text("0000:0000:0000:0000:0000:ffff:7f00:0001\n")
    (port / "gids" / "2").write_text(cli_common.ZERO_GID + "\n")  # unused entry: skipped
    (port / "gid_attrs" / "types" / "0").write_text("IB/RoCE v1\n")
    (port / "gid_attrs" / "types" / "1").write_text("RoCE v2\n")
    (port / "gid_attrs" / "ndevs" / "1").write_text("eth0\n")
    # gid_attrs/ndevs/0 missing: sysfs answers EINVAL for some entries
    (root / "mlx5_0" / "ports").mkdir(parents=True)  # a device without ports


def test_devices_ports_and_gids_are_read_from_sysfs(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    devices = cli_info.read_rdma_devices(str(tmp_path))
    assert [d.name for d in devices] == ["mlx5_0", "rxe0"]
    assert devices[0].ports == []
    rxe = devices[1]
    assert rxe.node_type == "1: CA"
    (port,) = rxe.ports
    assert (port.port, port.state, port.link_layer) == (1, "4: ACTIVE", "Ethernet")
    assert [(g.index, g.gid, g.type, g.netdev) for g in port.gids] == [
        (0, "fe80::250:56ff:fe00:1", "IB/RoCE v1", None),
        (1, "::ffff:127.0.0.1", "RoCE v2", "eth0"),
    ]
    text = cli_info.format_info(cli_info.collect_info(str(tmp_path)))
    assert "  rxe0 (1: CA)" in text
    assert "    port 1: state 4: ACTIVE, link layer Ethernet" in text
    assert "      gid[1] ::ffff:127.0.0.1 (RoCE v2, netdev eth0)" in text
    assert cli_common.ZERO_GID not in text
    assert "  mlx5_0\n    no ports" in text


def test_no_sysfs_means_no_devices(tmp_path: Path) -> None:
    assert cli_info.read_rdma_devices(str(tmp_path / "absent")) == []
    info = cli_info.collect_info(str(tmp_path / "absent"))
    assert info["rdma"]["devices"] == [] and info["rdma"]["sysfs_exists"] is False
    assert f"RDMA devices: none ({tmp_path / 'absent'} does not exist)" in cli_info.format_info(info)


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "aiordma"
    assert script.exists(), "pip install -e . should have created the aiordma console script"
    proc = subprocess.run([str(script), "info"], capture_output=True, text=True, timeout=TIMEOUT, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "auto would use: " in proc.stdout
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=TIMEOUT)
    assert version.stdout.strip() == f"aiordma {aiordma.__version__}"


# -- demo ----------------------------------------------------------------------

DEMO_ARGS = ("--bytes", "8M", "--messages", "2000", "--round-trips", "300")


def check_demo_output(out: str, transport: str, reason: str) -> None:
    lines = out.splitlines()
    assert f"transport: {transport}" in lines
    assert f"fallback reason: {reason}" in lines
    assert any(line.startswith("ok  byte stream: ") and "echoed back intact" in line for line in lines)
    assert any(line.startswith("ok  messages: ") and "3 empty" in line and "boundaries kept" in line for line in lines)
    assert "ok  throughput run: the server counted all 8388608 bytes" in lines
    rows = {line.split("  ")[0]: line for line in lines}
    assert rows["64 B round trip, median"].endswith("\u00b5s")
    assert rows["64 B round trip, p99"].endswith("\u00b5s")
    assert rows["byte stream, 8 MiB in 1 MiB writes"].endswith("MB/s")
    assert rows["messages, 2000 x 64 B echoed"].endswith("msgs/s")
    median = float(rows["64 B round trip, median"].split()[-2])
    p99 = float(rows["64 B round trip, p99"].split()[-2])
    assert 0 < median <= p99


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_demo_runs_and_prints_the_table(backend: str) -> None:
    proc = run("demo", "--backend", backend, *DEMO_ARGS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"aiordma demo: backend {backend}, transport policy auto" in proc.stdout
    transport, reason = auto_outcome()
    check_demo_output(proc.stdout, transport, reason or "(none: the data runs on RDMA)")
    if not os.path.isdir(SYSFS_IB):
        assert "fallback reason: client: no RDMA device" in proc.stdout


def test_demo_with_transport_tcp() -> None:
    proc = run("demo", "--transport", "tcp", *DEMO_ARGS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check_demo_output(proc.stdout, "tcp", "client: transport='tcp' was requested")


def test_demo_takes_the_policy_from_the_environment() -> None:
    proc = run("demo", *DEMO_ARGS, env=clean_env(AIORDMA_TRANSPORT="tcp"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "transport policy tcp" in proc.stdout
    check_demo_output(proc.stdout, "tcp", "client: transport='tcp' was requested")


def test_demo_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert _cli.main(["demo", "--transport", "tcp", *DEMO_ARGS]) == 0
    check_demo_output(capsys.readouterr().out, "tcp", "client: transport='tcp' was requested")


def test_demo_rejects_a_bad_transport() -> None:
    proc = run("demo", "--transport", "carrier-pigeon")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "argument --transport: invalid choice: 'carrier-pigeon' (choose from 'auto', 'tcp', 'rdma')" in proc.stderr


def test_demo_rejects_a_bad_environment_policy() -> None:
    proc = run("demo", *DEMO_ARGS, env=clean_env(AIORDMA_TRANSPORT="carrier-pigeon"))
    assert proc.returncode == 2
    assert "aiordma demo: error: AIORDMA_TRANSPORT='carrier-pigeon' is not one of 'auto', 'rdma', 'tcp'" in proc.stderr


def test_demo_rejects_bad_counts() -> None:
    proc = run("demo", "--bytes", "lots")
    assert proc.returncode == 2
    assert "argument --bytes: not a byte count: 'lots'" in proc.stderr
    proc = run("demo", "--messages", "0")
    assert proc.returncode == 2
    assert "argument --messages: must be at least 1" in proc.stderr


def test_demo_strict_rdma() -> None:
    proc = run("demo", "--transport", "rdma", *DEMO_ARGS)
    try:
        local_offer("rdma", "server")
    except RDMAUnavailableError as exc:  # this host: no RDMA
        assert proc.returncode == 1
        assert proc.stdout == ""
        assert f"aiordma demo: error: transport 'rdma' is not available here: {exc}" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        check_demo_output(proc.stdout, "rdma", "(none: the data runs on RDMA)")


def test_size_argument() -> None:
    assert cli_common.parse_size("65536") == 65536
    assert cli_common.parse_size("64K") == 64 << 10
    assert cli_common.parse_size("64M") == 64 << 20
    assert cli_common.parse_size("1GiB") == 1 << 30


def test_a_command_is_required() -> None:
    proc = run()
    assert proc.returncode == 2
    assert "the following arguments are required: COMMAND" in proc.stderr
