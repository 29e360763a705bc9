"""Host-side checks of the verbs wrapper when RDMA is absent (no device, or no native module).

The native module's absence is simulated in a subprocess (a meta-path hook
hides ``aiordma._verbs_cffi``), so this runs the same with or without the
libibverbs headers at install time.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aiordma._rdma import discovery as d
from aiordma._rdma import verbs as v
from aiordma._errors import RDMAError

ROOT = Path(__file__).resolve().parent.parent
HAS_DEVICE = os.path.isdir(v.SYSFS_IB) and bool(os.listdir(v.SYSFS_IB))


def run_py(code: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        check=False,
    )


HIDE_NATIVE = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name == "aiordma._verbs_cffi":
            raise {exc}("No module named 'aiordma._verbs_cffi'", name=name)
        return None
sys.meta_path.insert(0, Hide())
"""


def test_not_built_reason_and_errors() -> None:
    proc = run_py(
        HIDE_NATIVE.format(exc="ModuleNotFoundError")
        + """
from aiordma._rdma import discovery as d
from aiordma._rdma import verbs as v
from aiordma._errors import RDMAUnavailableError
ok, why = v.native_available()
assert (ok, why) == (False, v.NOT_BUILT_REASON), why
print(why)
for make in (lambda: v.Context(), lambda: v.WCArray(4)):
    try:
        make()
    except RDMAUnavailableError as exc:
        assert v.NOT_BUILT_REASON in exc.reason, exc.reason
    else:
        raise AssertionError("no error")
assert isinstance(d.list_devices(), list)
assert v.live_objects() == dict.fromkeys(v._LIVE_KEYS, 0)
print("ok")
"""
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "native module not built (it was installed with AIORDMA_NO_NATIVE, or without a C compiler)", "ok"]


def test_load_failure_reason() -> None:
    proc = run_py(
        HIDE_NATIVE.format(exc="ImportError")
        + """
from aiordma._rdma import verbs as v
ok, why = v.native_available()
assert not ok and why.startswith("native module cannot be loaded: "), why
print("ok")
"""
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.skipif(HAS_DEVICE, reason="this host has an RDMA device")
def test_no_device_reason_on_this_host() -> None:
    ok, why = v.native_available()
    assert not ok
    if v._lib is None:
        assert why == v.NOT_BUILT_REASON
    else:
        # Debian's kernel without InfiniBand: libibverbs fails to list devices
        assert why.startswith("libibverbs cannot list devices: ") or why == "no RDMA device", why
        if not os.path.isdir(v.SYSFS_IB):
            assert "no RDMA support in this kernel" in why
        with pytest.raises(RDMAError) as ei:
            v.Context()
        assert ei.value.call == "ibv_get_device_list"
    assert d.list_devices() == []
    assert d.gid_for_ip("198.18.0.1") is None
    v.assert_no_live_objects()


def _fake_sysfs(root: Path) -> None:
    port = root / "rxe0" / "ports" / "1"
    (port / "gids").mkdir(parents=True)
    (port / "gid_attrs" / "types").mkdir(parents=True)
    (port / "gid_attrs" / "ndevs").mkdir(parents=True)
    (root / "rxe0" / "node_guid").write_text("0024:13ff:fec5:518f\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    gids = {
        0: ("fe80:0000:0000:0000:0024:13ff:fec5:518f", "RoCE v2", "veth0"),
        1: ("0000:0000:0000:0000:0000:ffff:c612:0001", "RoCE v2", "veth0"),
        2: ("0000:0000:0000:0000:0000:ffff:c612:0001", "IB/RoCE v1", "veth0"),
        3: ("0000:0000:0000:0000:0000:0000:0000:0000", None, None),  # empty entry: attrs unreadable
    }
    for i, (gid, typ, ndev) in gids.items():
        (port / "gids" / str(i)).write_text(gid + "\n")
        if typ:
            (port / "gid_attrs" / "types" / str(i)).write_text(typ + "\n")
            (port / "gid_attrs" / "ndevs" / str(i)).write_text(ndev + "\n")
    down = root / "rxe1" / "ports" / "1"
    (down / "gids").mkdir(parents=True)
    (down / "gid_attrs" / "types").mkdir(parents=True)
    (down / "state").write_text("1: DOWN\n")
    (down / "link_layer").write_text("Ethernet\n")
    (down / "gids" / "0").write_text("0000:0000:0000:0000:0000:ffff:c612:0001\n")
    (down / "gid_attrs" / "types" / "0").write_text("RoCE v2\n")


def test_list_devices_from_sysfs(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    devs = d.list_devices(sysfs_root=str(tmp_path))
    assert [d.name for d in devs] == ["rxe0", "rxe1"]
    port = devs[0].ports[0]
    assert (port.port, port.state, port.link_layer, port.active_mtu) == (1, "ACTIVE", "Ethernet", None)
    assert [(g.index, g.gid_type, g.netdev) for g in port.gids] == [
        (0, "RoCEv2", "veth0"),
        (1, "RoCEv2", "veth0"),
        (2, "RoCEv1", "veth0"),
    ]
    assert port.gids[1].ip == ipaddress.IPv4Address("198.18.0.1")
    assert port.gids[0].ip == ipaddress.IPv6Address("fe80::24:13ff:fec5:518f")
    assert devs[0].node_guid == "0024:13ff:fec5:518f"
    assert devs[1].ports[0].state == "DOWN" and devs[1].ports[0].gids[0].netdev is None


def test_gid_for_ip_prefers_active_ports_and_type(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path)
    g = d.gid_for_ip("198.18.0.1", sysfs_root=str(tmp_path))
    assert g is not None and (g.device, g.port, g.index) == ("rxe0", 1, 1)
    g1 = d.gid_for_ip(ipaddress.IPv4Address("198.18.0.1"), gid_type="RoCEv1", sysfs_root=str(tmp_path))
    assert g1 is not None and g1.index == 2
    assert d.gid_for_ip("fe80::24:13ff:fec5:518f", sysfs_root=str(tmp_path)) is not None
    assert d.gid_for_ip("198.18.0.2", sysfs_root=str(tmp_path)) is None


def test_names_and_gid_conversion() -> None:
    assert v.wc_status_name(0) == "IBV_WC_SUCCESS"
    assert v.wc_status_name(5) == "IBV_WC_WR_FLUSH_ERR"
    assert v.wc_status_name(13) == "IBV_WC_RNR_RETRY_EXC_ERR"
    assert v.wc_status_name(99) == "IBV_WC_STATUS_99"
    assert v.event_type_name(1) == "IBV_EVENT_QP_FATAL" and v.event_type_name(99) == "IBV_EVENT_99"
    assert v._gid_bytes("198.18.0.1") == ipaddress.IPv6Address("::ffff:198.18.0.1").packed
    assert v._gid_bytes(b"\x01" * 16) == b"\x01" * 16
    with pytest.raises(ValueError):
        v._gid_bytes(b"short")
    assert v._mtu_enum(1024) == 3
    with pytest.raises(ValueError):
        v._mtu_enum(1500)


def test_work_completion_error_without_device() -> None:
    wc = v.WorkCompletion(7, 13, 0, 0, None, 42, 0, 0x81, 0)
    assert not wc.ok and wc.status_name == "IBV_WC_RNR_RETRY_EXC_ERR" and wc.opcode_name == "SEND"
    err = wc.error()
    assert isinstance(err, RDMAError) and isinstance(err, OSError)
    assert err.errno == errno.EIO and err.wc_status == "IBV_WC_RNR_RETRY_EXC_ERR" and "wr_id=7" in str(err)
    with pytest.raises(RDMAError):
        wc.raise_for_status()
    v.WorkCompletion(1, 0, 128, 10, 5, 1, 0, 0, 2).raise_for_status()


# -- setup.py -------------------------------------------------------------


def _setup_py(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env},
        check=False,
    )


def test_setup_py_honours_no_native() -> None:
    pytest.importorskip("cffi")
    proc = _setup_py({"AIORDMA_NO_NATIVE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "aiordma" in proc.stdout and "AIORDMA_NO_NATIVE is set" in proc.stderr


def test_setup_py_without_a_compiler(tmp_path: Path) -> None:
    """A compiler that does not run: the install goes on without the module (rdma-core's
    headers are not needed: the project carries the declarations), unless
    AIORDMA_REQUIRE_NATIVE is set."""
    pytest.importorskip("cffi")
    env = {"CC": str(tmp_path / "no-such-cc"), "AIORDMA_NO_NATIVE": ""}
    proc = _setup_py(env)
    assert proc.returncode == 0, proc.stderr
    assert "no C compiler" in proc.stderr and "TCP only" in proc.stderr
    proc = _setup_py({**env, "AIORDMA_REQUIRE_NATIVE": "1"})
    assert proc.returncode != 0 and "AIORDMA_REQUIRE_NATIVE" in proc.stderr


def test_import_aiordma_maps_no_libibverbs() -> None:
    """A TCP-only process never loads the native module (it loads when RDMA is first needed)."""
    proc = run_py(
        """
import sys
import aiordma
import aiordma.asyncio, aiordma.testing
print(sorted(m for m in sys.modules if m.startswith("aiordma._verbs") or m == "aiordma._rdma.verbs"))
with open("/proc/self/maps") as f:
    print("libibverbs" in f.read())
"""
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "False"], proc.stdout


def test_the_probe_asks_the_host_only_while_no_device_is_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport probe (each side, each connect) walks sysfs and lists the verbs devices --
    unless a device of the same provider is open in this process, which proves verbs work here.
    A closed device, or one of another provider (the simulated wire), proves nothing."""
    from aiordma._rdma import device as dev
    from aiordma._rdma.config import NativeProvider

    calls: list[int] = []
    answer = d.Probe(False, "no RDMA device (the host's answer)", False, "not loaded")

    def host_probe() -> d.Probe:
        calls.append(1)
        return answer

    monkeypatch.setattr(d, "probe", host_probe)

    class Open:
        def __init__(self, name: str, key: object, closed: bool = False) -> None:
            self.name, self.closed = name, closed
            self.provider = type("P", (), {"key": key})()

    provider = NativeProvider()
    assert provider.probe() is answer and calls == [1]
    for stale in (Open("rxe0", "native", closed=True), Open("sim0", object())):
        monkeypatch.setitem(dev._devices, ("loop", stale.provider.key, stale.name), stale)  # type: ignore[arg-type]
        assert provider.probe() is answer
    assert len(calls) == 3
    monkeypatch.setitem(dev._devices, ("loop", "native", "rxe0"), Open("rxe0", "native"))  # type: ignore[arg-type]
    found = provider.probe()
    assert found.usable and found.native_module and found.devices == ["rxe0"] and len(calls) == 3
