"""Smoke tests of the RDMA test environment itself, with pyverbs only.

They check that the Soft-RoCE guest (``python -m tools.vm``) gives
the test suite what it promises -- an rxe device, a RoCEv2 GID, working RC
traffic -- so that a failure of aiordma's own RDMA tests can be told apart
from a broken environment.  They also run unchanged on a host with a real
RNIC (``pytest -m rdma`` there).

Device selection: ``AIORDMA_TEST_DEVICE`` if set, else the first device of
``AIORDMA_VM_DEVICES`` (set by the VM runner), else the first device found.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.rdma

SYS_IB = Path("/sys/class/infiniband")
DIST_PACKAGES = "/usr/lib/python3/dist-packages"
IN_VM = os.environ.get("AIORDMA_IN_VM") == "1"
PORT = 1

# tests/conftest.py skips rdma-marked tests when the host has no device; this
# keeps the module importable (and skipped) even without that hook.
if not (SYS_IB.is_dir() and any(SYS_IB.iterdir())):
    pytest.skip("no RDMA device in /sys/class/infiniband", allow_module_level=True)


def _import_pyverbs() -> Any:
    try:
        import pyverbs.device
    except ImportError:
        # Debian's python3-pyverbs lives outside the venv; add it last so the
        # venv's packages keep precedence (the VM runner does the same).
        if DIST_PACKAGES not in sys.path:
            sys.path.append(DIST_PACKAGES)
        try:
            import pyverbs.device
        except ImportError:
            if IN_VM:
                raise  # the guest always has it: this is a broken environment
            pytest.skip("pyverbs is not installed (apt-get install python3-pyverbs)")
    return pyverbs


pyverbs = _import_pyverbs()

import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ  # noqa: E402
from pyverbs.device import Context, get_device_list  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402


def _vm_devices() -> list[str]:
    return [d for d in os.environ.get("AIORDMA_VM_DEVICES", "").split(",") if d]


def _test_device() -> str:
    if dev := os.environ.get("AIORDMA_TEST_DEVICE"):
        return dev
    if vm := _vm_devices():
        return vm[0]
    return sorted(p.name for p in SYS_IB.iterdir())[0]


def _rocev2_ipv4_gid_index(dev: str) -> int | None:
    """Index of the first RoCEv2 GID holding an IPv4-mapped address, or None
    (InfiniBand link layer, or no such GID)."""
    port = SYS_IB / dev / "ports" / str(PORT)
    if (port / "link_layer").read_text().strip() != "Ethernet":
        return None
    for gid_file in sorted((port / "gids").iterdir(), key=lambda p: int(p.name)):
        try:
            gid = gid_file.read_text().strip()
            gid_type = (port / "gid_attrs" / "types" / gid_file.name).read_text().strip()
        except OSError:  # unpopulated entries cannot be read
            continue
        if gid_type == "RoCE v2" and ipaddress.IPv6Address(gid).ipv4_mapped is not None:
            return int(gid_file.name)
    pytest.fail(f"{dev} has no RoCEv2 GID with an IPv4 address")


def test_pyverbs_lists_the_devices() -> None:
    names = sorted(d.name.decode() for d in get_device_list())
    assert names == sorted(p.name for p in SYS_IB.iterdir())
    for dev in _vm_devices():
        assert dev in names
    if IN_VM:
        assert "rxe0" in names


@pytest.mark.skipif(not IN_VM, reason="the guest's address plan only exists in the Soft-RoCE VM")
def test_guest_rxe0_has_rocev2_gid_1() -> None:
    with Context(name="rxe0") as ctx:
        port = ctx.query_port(PORT)
        assert port.state == e.IBV_PORT_ACTIVE
        gid = ipaddress.IPv6Address(str(ctx.query_gid(PORT, 1)))
    assert gid.ipv4_mapped == ipaddress.IPv4Address("198.18.0.1")
    assert _rocev2_ipv4_gid_index("rxe0") == 1


def _poll(cq: CQ, count: int, timeout: float = 10.0) -> list[Any]:
    wcs: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(wcs) < count:
        n, got = cq.poll(count - len(wcs))
        wcs.extend(got[:n])
        if n == 0:
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {count - len(wcs)} of {count} completions")
            time.sleep(0.0005)
    for wc in wcs:
        assert wc.status == e.IBV_WC_SUCCESS, f"work completion failed: status {wc.status}, wr_id {wc.wr_id}"
    return wcs


def test_pyverbs_rc_send_recv_between_two_qps() -> None:
    """Two RC QPs on one device exchange SEND/RECV messages both ways, over
    the device's loopback (rxe: through the kernel, as RoCEv2 UDP packets)."""
    dev = _test_device()
    gid_index = _rocev2_ipv4_gid_index(dev)
    sizes = [1, 64, 1000, 1024, 1025, 4096, 16384]
    buf_size = max(sizes)
    with Context(name=dev) as ctx:
        port_attr = ctx.query_port(PORT)
        assert port_attr.state == e.IBV_PORT_ACTIVE
        pd = PD(ctx)
        cqs = [CQ(ctx, 32, None, None, 0) for _ in range(2)]
        cap = QPCap(max_send_wr=16, max_recv_wr=16, max_send_sge=1, max_recv_sge=1)
        qps = [
            QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap), QPAttr(port_num=PORT))
            for cq in cqs
        ]
        assert all(qp.qp_state == e.IBV_QPS_INIT for qp in qps)
        psns = [0x1234, 0xABCDE]
        for me, peer in ((0, 1), (1, 0)):
            attr = QPAttr(port_num=PORT)
            attr.path_mtu = e.IBV_MTU_1024
            attr.max_dest_rd_atomic = 1
            attr.max_rd_atomic = 1
            attr.min_rnr_timer = 12
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.dest_qp_num = qps[peer].qp_num
            attr.rq_psn = psns[peer]
            attr.sq_psn = psns[me]
            if gid_index is None:  # InfiniBand: route by LID
                attr.ah_attr = AHAttr(port_num=PORT, dlid=port_attr.lid)
            else:
                gr = GlobalRoute(dgid=ctx.query_gid(PORT, gid_index), sgid_index=gid_index)
                attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=port_attr.lid)
            qps[me].to_rts(attr)
        assert all(qp.qp_state == e.IBV_QPS_RTS for qp in qps)

        mrs = [MR(pd, buf_size, e.IBV_ACCESS_LOCAL_WRITE) for _ in range(2)]
        for n, size in enumerate(sizes):
            src, dst = (0, 1) if n % 2 == 0 else (1, 0)
            payload = bytes((n * 7 + i) % 251 for i in range(size))
            mrs[dst].write(b"\0" * buf_size, buf_size)
            recv = RecvWR(wr_id=100 + n, num_sge=1, sg=[SGE(mrs[dst].buf, buf_size, mrs[dst].lkey)])
            qps[dst].post_recv(recv, None)
            mrs[src].write(payload, size)
            send = SendWR(
                wr_id=200 + n,
                opcode=e.IBV_WR_SEND,
                num_sge=1,
                sg=[SGE(mrs[src].buf, size, mrs[src].lkey)],
                send_flags=e.IBV_SEND_SIGNALED,
            )
            qps[src].post_send(send, None)
            (send_wc,) = _poll(cqs[src], 1)
            (recv_wc,) = _poll(cqs[dst], 1)
            assert (send_wc.wr_id, send_wc.opcode) == (200 + n, e.IBV_WC_SEND)
            assert (recv_wc.wr_id, recv_wc.opcode, recv_wc.byte_len) == (100 + n, e.IBV_WC_RECV, size)
            assert recv_wc.qp_num == qps[dst].qp_num
            assert mrs[dst].read(size, 0) == payload


def test_aiordma_info_reports_the_device_and_rdma() -> None:
    """`aiordma info` sees the device and says `auto` would use RDMA."""
    import json

    # (both at once: each is a process's start-up under TCG, ~10 s)
    runs = [subprocess.Popen([sys.executable, "-m", "aiordma", "info", *extra], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for extra in (["--json"], [])]  # fmt: skip
    try:
        (out, err), (human_out, human_err) = [run.communicate(timeout=120) for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    assert runs[0].returncode == 0, err
    info = json.loads(out)
    text = json.dumps(info)
    assert "rxe0" in text and "::ffff:198.18.0.1" in text
    assert runs[1].returncode == 0 and "rxe0" in human_out, human_err
    assert "auto would use: rdma" in human_out, human_out


def test_aiordma_demo_runs_on_rdma() -> None:
    done = subprocess.run(
        # smaller than the defaults: Python runs ~20x slower in the TCG guest
        [sys.executable, "-m", "aiordma", "demo", "--transport", "rdma", "--host", "198.18.0.1",
         "--messages", "2000", "--round-trips", "200", "--bytes", "8M"],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "transport: rdma" in done.stdout
