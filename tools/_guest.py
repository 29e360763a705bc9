"""Guest side of the Soft-RoCE VM runner (see :mod:`tools.vm`).

This file runs *inside* the virtme-ng guest as PID 1's script, started as
``python -I -B _guest.py SPEC.json``.  It must only use the standard library
(``-I`` keeps the environment out, and nothing from the project is imported).

It:

1. prints a "booted" marker on stderr (the host times the boot with it),
2. loads ``rdma_rxe``, brings up ``lo``, creates one veth pair per requested
   rxe device and binds ``rxeN`` to ``veth(2N)`` (address ``198.18.N.1/24``),
3. waits until every device's port 1 is ACTIVE and GID index 1 is the RoCEv2
   GID ``::ffff:198.18.N.1``, cross-checked with ``ibv_devinfo``,
4. lowers the console log level, prints a "ready" marker and runs the command
   with the environment from the spec, under a timeout,
5. writes ``status.json`` next to the spec (the host reads the exit code from
   there, and from the vng exit code) and exits with the command's exit code.

Every step has a timeout.  Exit codes: the command's own; 124 when the command
timed out; 125 when the guest setup failed.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

#: Marker lines written on stderr; the host watches for them.
BOOTED_MARKER: Final = "@@aiordma-vm:booted@@"
READY_MARKER: Final = "@@aiordma-vm:ready@@"

EXIT_TIMEOUT: Final = 124
EXIT_SETUP_FAILED: Final = 125

SYS_IB: Final = Path("/sys/class/infiniband")


class SetupError(RuntimeError):
    """The guest could not be prepared (module, links, rxe devices)."""


def device_name(index: int) -> str:
    return f"rxe{index}"


def netdev_name(index: int) -> str:
    return f"veth{2 * index}"


def peer_name(index: int) -> str:
    return f"veth{2 * index + 1}"


def ipv4_address(index: int) -> str:
    """Address of rxe device *index*'s netdev (all inside 198.18.0.0/15)."""
    return f"198.18.{index}.1"


def rocev2_gid(index: int) -> str:
    """GID index 1 of rxe device *index*, as sysfs prints it."""
    return rocev2_gid_of(ipv4_address(index))


def rocev2_gid_of(address: str) -> str:
    """The RoCEv2 GID of an IPv4 address, as sysfs prints it."""
    a, b, c, d = (int(part) for part in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def log(message: str) -> None:
    print(f"aiordma-vm(guest): {message}", file=sys.stderr, flush=True)


def run(argv: list[str], *, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"{' '.join(argv)!r} timed out after {timeout:.0f} s") from exc
    except OSError as exc:
        raise SetupError(f"{' '.join(argv)!r} could not run: {exc}") from exc
    if check and proc.returncode != 0:
        raise SetupError(
            f"{' '.join(argv)!r} exited with {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).strip()}"
        )
    return proc


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def wait_active(dev: str, want_gid: str, deadline: float) -> None:
    """Wait until ``dev``'s port 1 is ACTIVE with ``want_gid`` at GID index 1."""
    port = SYS_IB / dev / "ports" / "1"
    while True:
        state = _read(port / "state")
        gid = _read(port / "gids" / "1")
        if "ACTIVE" in state and gid == want_gid:
            return
        if time.monotonic() >= deadline:
            raise SetupError(
                f"{dev} not ready: port state {state or '(missing)'!r}, "
                f"GID[1] {gid or '(missing)'!r} (want {want_gid})"
            )
        time.sleep(0.1)


def setup_devices(count: int, deadline: float) -> None:
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SetupError("device setup timed out")
        return left

    run(["modprobe", "rdma_rxe"], timeout=min(60.0, remaining()))
    run(["ip", "link", "set", "lo", "up"], timeout=min(30.0, remaining()))
    for i in range(count):
        dev, veth, peer, addr = device_name(i), netdev_name(i), peer_name(i), ipv4_address(i)
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer], timeout=min(30.0, remaining()))
        run(["ip", "addr", "add", f"{addr}/24", "dev", veth], timeout=min(30.0, remaining()))
        run(["ip", "link", "set", veth, "up"], timeout=min(30.0, remaining()))
        run(["ip", "link", "set", peer, "up"], timeout=min(30.0, remaining()))
        run(["rdma", "link", "add", dev, "type", "rxe", "netdev", veth], timeout=min(60.0, remaining()))

    for i in range(count):
        dev = device_name(i)
        wait_active(dev, rocev2_gid(i), deadline)
        info = run(["ibv_devinfo", "-d", dev], timeout=min(60.0, remaining()))
        if "PORT_ACTIVE" not in info.stdout:
            raise SetupError(f"ibv_devinfo -d {dev} does not show PORT_ACTIVE:\n{info.stdout}")


def wire_nic() -> str:
    """The guest's one real NIC (the virtio-net on the wire between the guests)."""
    names = sorted(n.name for n in Path("/sys/class/net").iterdir() if n.name != "lo" and not n.name.startswith("veth"))
    if len(names) != 1:
        raise SetupError(f"expected one NIC for the wire, found {names or 'none'}")
    return names[0]


#: The wire NIC's queueing discipline when no netem spec is set: per-flow fair queueing without
#: active queue management.  rxe sends RoCEv2 through the kernel's qdisc (a real RNIC does not),
#: and its responder sends a whole RDMA READ's response at once.  The default ``fq_codel`` drops
#: from that standing queue (codel: 5 ms target); RC's go-back-N then loses the READ's rest
#: and retries, and on a busy host seven timeouts in a row end the connection
#: (``RETRY_EXC_ERR``: 6,667 of 15,445 packets dropped in one measured 12 MiB READ).  ``fq``
#: with room for a 16 MiB response keeps the TCP flow's keepalive probes from queueing behind
#: it, and drops nothing: a lossless fabric, as RoCE is deployed.
WIRE_QDISC = ("fq", "limit", "20000", "flow_limit", "10000")


def wire_qdisc_argv(nic: str, netem: str = "") -> list[str]:
    """``tc`` arguments that give ``nic`` its qdisc: ``netem`` with ``netem``'s spec, else
    :data:`WIRE_QDISC`."""
    qdisc = ["netem", *netem.split()] if netem.strip() else list(WIRE_QDISC)
    return ["tc", "qdisc", "replace", "dev", nic, "root", *qdisc]


def setup_wire(wire: dict[str, Any], deadline: float) -> None:
    """Two guests on one wire: rxe0 on the NIC, with this guest's address and a jumbo MTU
    (so that rxe's path MTU is its largest, 4096)."""

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SetupError("wire setup timed out")
        return left

    address, mtu = str(wire["address"]), int(wire.get("mtu", 4200))
    run(["modprobe", "rdma_rxe"], timeout=min(60.0, remaining()))
    run(["ip", "link", "set", "lo", "up"], timeout=min(30.0, remaining()))
    nic = wire_nic()
    run(["ip", "link", "set", nic, "mtu", str(mtu), "up"], timeout=min(30.0, remaining()))
    run(["ip", "addr", "add", f"{address}/24", "dev", nic], timeout=min(30.0, remaining()))
    run(wire_qdisc_argv(nic, str(wire.get("netem") or "")), timeout=min(30.0, remaining()))
    run(["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", nic], timeout=min(60.0, remaining()))
    wait_active("rxe0", rocev2_gid_of(address), deadline)


def quiet_console() -> None:
    """Keep kernel messages off the console once the command runs: the host
    forwards everything on the console stream after the ready marker as the
    command's stderr."""
    try:
        Path("/proc/sys/kernel/printk").write_text("1\n")
    except OSError:
        pass


def raise_memlock() -> None:
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass


def write_status(path: Path, status: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    os.replace(tmp, path)


def run_command(argv: list[str], cwd: str, env: dict[str, str], timeout: float) -> tuple[int, bool]:
    """Run the command in its own process group; return (exit code, timed out)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"command timed out after {timeout:.0f} s; killing it")
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        return EXIT_TIMEOUT, True
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 130, False
    if code < 0:
        code = 128 - code
    return code, False


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    print(BOOTED_MARKER, file=sys.stderr, flush=True)
    spec_path = Path(argv[1])
    spec = json.loads(spec_path.read_text())
    status_path = spec_path.parent / "status.json"
    status: dict[str, Any] = {"phase": "booted"}
    write_status(status_path, status)

    try:
        if spec.get("wire"):
            setup_wire(dict(spec["wire"]), t0 + float(spec["setup_timeout"]))
        else:
            setup_devices(int(spec["devices"]), t0 + float(spec["setup_timeout"]))
    except SetupError as exc:
        log(f"setup failed: {exc}")
        try:
            dmesg = run(["dmesg"], timeout=30, check=False).stdout
        except SetupError:
            dmesg = ""
        status.update(phase="setup-failed", error=str(exc), dmesg_tail=dmesg.splitlines()[-40:])
        write_status(status_path, status)
        return EXIT_SETUP_FAILED
    setup_seconds = time.monotonic() - t0
    status.update(phase="ready", setup_seconds=setup_seconds)
    write_status(status_path, status)

    raise_memlock()
    quiet_console()
    print(READY_MARKER, file=sys.stderr, flush=True)

    t1 = time.monotonic()
    try:
        code, timed_out = run_command(
            list(spec["argv"]), str(spec["cwd"]), dict(spec["env"]), float(spec["timeout"])
        )
    except OSError as exc:
        log(f"cannot run {spec['argv'][0]!r}: {exc}")
        code, timed_out = 127, False
    status.update(
        phase="done",
        returncode=code,
        timed_out=timed_out,
        command_seconds=time.monotonic() - t1,
    )
    write_status(status_path, status)
    # Make sure what the command wrote reaches the host before power-off.
    sys.stdout.flush()
    sys.stderr.flush()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
