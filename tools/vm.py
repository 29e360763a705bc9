"""Run a command inside a throw-away Soft-RoCE (``rdma_rxe``) guest.

The host needs no RDMA NIC and no InfiniBand in its kernel: the command runs in
a qemu guest booted by virtme-ng from a stock Debian kernel, which sees the
host's file system (read-only, except the project directory and a scratch
directory), loads ``rdma_rxe`` and binds ``rxe0`` to a veth interface with the
address ``198.18.0.1`` (GID index 1 = ``::ffff:198.18.0.1``, RoCEv2).

Command line::

    python -m tools.vm [options] -- CMD [ARG...]
    python -m tools.vm -- python -m pytest -m rdma tests

Python::

    from tools.vm import run_in_vm
    result = run_in_vm(["python", "-m", "pytest", "-m", "rdma", "tests"], timeout=1200)
    result.returncode

Exit status of the command line: the command's own exit status; 124 when the
command timed out; 125 when the guest could not be booted or prepared, or
something it needs is missing; 0 without doing anything when
``AIORDMA_SKIP_VM=1``.

The command's stdout is streamed to stdout.  Its stderr is streamed to stderr
(in the guest it shares the serial console with the kernel, so kernel log
lines are kept out of it and go to the console log instead).  Two one-line
timings (boot + device setup, command) are printed on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Final

from tools import _guest

__all__ = [
    "DEFAULT_BOOT_TIMEOUT",
    "DEFAULT_COMMAND_TIMEOUT",
    "DEFAULT_SETUP_TIMEOUT",
    "DEBIAN_PACKAGES",
    "EXIT_SETUP_FAILED",
    "EXIT_TIMEOUT",
    "MissingDependencies",
    "Requirement",
    "VMBootError",
    "VMError",
    "VMResult",
    "VMTools",
    "check_dependencies",
    "ensure_dependencies",
    "find_kernel",
    "guest_environment",
    "main",
    "project_dir",
    "run_in_vm",
    "run_two_hosts",
    "Wire",
    "HOST_ADDRESSES",
]

#: The two guests' addresses on their wire (``run_two_hosts``): host a, host b.
HOST_ADDRESSES: Final = ("198.18.0.1", "198.18.0.2")


@dataclasses.dataclass(frozen=True)
class Wire:
    """One guest's end of a virtual wire between two guests: a qemu stream netdev on a unix
    socket (no address on the host), the guest's address on it, and a jumbo MTU.
    ``netem``: a ``tc netem`` spec for the guest's NIC (e.g. ``"loss 1%"``), or ''."""

    socket: Path
    listen: bool
    address: str
    mac: str
    mtu: int = 4200
    netem: str = ""
    peer: str = ""

DEFAULT_COMMAND_TIMEOUT: Final = 1200.0
DEFAULT_BOOT_TIMEOUT: Final = 300.0
DEFAULT_SETUP_TIMEOUT: Final = 120.0
APT_UPDATE_TIMEOUT: Final = 600.0
APT_INSTALL_TIMEOUT: Final = 1800.0
PIP_INSTALL_TIMEOUT: Final = 600.0
#: Extra time the host allows beyond the guest's own deadlines (shutdown etc.).
HOST_GRACE: Final = 60.0

EXIT_TIMEOUT: Final = _guest.EXIT_TIMEOUT
EXIT_SETUP_FAILED: Final = _guest.EXIT_SETUP_FAILED

DIST_PACKAGES: Final = "/usr/lib/python3/dist-packages"
KERNEL_GLOB: Final = "vmlinuz-*-amd64"
SBIN_DIRS: Final = ("/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/local/bin", "/usr/bin", "/bin")

#: Every Debian package the runner and the guest stage rely on.
DEBIAN_PACKAGES: Final = (
    "qemu-system-x86",
    "linux-image-amd64",
    "busybox-static",
    "kmod",
    "iproute2",
    "rdma-core",
    "ibverbs-providers",
    "ibverbs-utils",
    "libibverbs-dev",
    "rdmacm-utils",
    "perftest",
    "python3-pyverbs",
)

#: Environment variables passed from the host to the command in the guest
#: (exact names, or prefixes ending in ``_``).
PASSTHROUGH_ENV: Final = (
    "AIORDMA_",
    "PYTEST_",
    "HYPOTHESIS_",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "CI",
    "NO_COLOR",
    "FORCE_COLOR",
    "PY_COLORS",
    "PYTHONHASHSEED",
    "PYTHONFAULTHANDLER",
    "PYTHONWARNINGS",
    "PYTHONDEVMODE",
    "PYTHONASYNCIODEBUG",
    "PYTHONTRACEMALLOC",
)

_KERNEL_LOG_LINE: Final = re.compile(rb"^\s*\[\s*\d+\.\d+\]\s")


class VMError(RuntimeError):
    """The guest could not run the command (missing tools, boot or setup failure)."""


class MissingDependencies(VMError):
    """Something the runner needs is not installed and could not be installed."""

    def __init__(self, message: str, packages: Sequence[str]) -> None:
        super().__init__(message)
        self.packages = tuple(packages)


class VMBootError(VMError):
    """The guest did not boot, or did not get its rxe devices ready, in time."""

    def __init__(self, message: str, console_tail: Sequence[str] = (), scratch: Path | None = None) -> None:
        super().__init__(message)
        self.console_tail = tuple(console_tail)
        self.scratch = scratch


class VMResult(subprocess.CompletedProcess[str]):
    """:class:`subprocess.CompletedProcess` plus timings of the guest run.

    ``returncode`` is the command's exit status (``EXIT_TIMEOUT`` if it timed
    out); ``stdout``/``stderr`` are set only with ``capture_output=True``.
    """

    def __init__(
        self,
        args: list[str],
        returncode: int,
        stdout: str | None,
        stderr: str | None,
        *,
        boot_seconds: float,
        setup_seconds: float,
        command_seconds: float,
        total_seconds: float,
        timed_out: bool,
    ) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.boot_seconds = boot_seconds
        self.setup_seconds = setup_seconds
        self.command_seconds = command_seconds
        self.total_seconds = total_seconds
        self.timed_out = timed_out


# --------------------------------------------------------------------------
# Dependencies
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One thing the runner needs, the Debian package that provides it, and a check."""

    what: str
    package: str
    check: Callable[[], bool]


@dataclasses.dataclass(frozen=True)
class VMTools:
    """Resolved paths of what :func:`run_in_vm` runs."""

    vng: Path
    kernel: Path


def _which(name: str) -> str | None:
    path = os.environ.get("PATH", os.defpath)
    extra = os.pathsep.join(SBIN_DIRS)
    return shutil.which(name, path=f"{path}{os.pathsep}{extra}")


def _is_static_elf(path: str) -> bool:
    """True for an ELF executable without a program interpreter (PT_INTERP)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
                return False
            endian = "<" if head[5] == 1 else ">"
            (phoff,) = struct.unpack_from(endian + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 0x36)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return False
    for i in range(phnum):
        (p_type,) = struct.unpack_from(endian + "I", table, i * phentsize)
        if p_type == 3:  # PT_INTERP
            return False
    return True


def _has_static_busybox() -> bool:
    for name in ("busybox-static", "busybox.static", "busybox"):
        found = _which(name)
        if found and _is_static_elf(found):
            return True
    return False


def _kernel_version(kernel: Path) -> str:
    return kernel.name.removeprefix("vmlinuz-")


def _has_rxe_module(version: str) -> bool:
    moddir = Path("/lib/modules") / version
    if not (moddir / "modules.dep").is_file():
        return False
    return any((moddir / "kernel/drivers/infiniband/sw/rxe").glob("rdma_rxe.ko*"))


def _natural_key(text: str) -> list[tuple[int, int | str]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text)]


def find_kernel(boot: Path = Path("/boot")) -> Path | None:
    """Newest Debian amd64 kernel in *boot* whose modules include ``rdma_rxe``."""
    candidates = [k for k in boot.glob(KERNEL_GLOB) if _has_rxe_module(_kernel_version(k))]
    if not candidates:
        return None
    return max(candidates, key=lambda k: _natural_key(k.name))


def _dist_path(*parts: str) -> Path:
    return Path(DIST_PACKAGES, *parts)


def requirements() -> list[Requirement]:
    """What the runner checks for (see :data:`DEBIAN_PACKAGES`)."""

    def has(*names: str) -> Callable[[], bool]:
        return lambda: all(_which(n) is not None for n in names)

    def exists(*patterns: str) -> Callable[[], bool]:
        return lambda: all(any(Path("/").glob(p.lstrip("/"))) for p in patterns)

    return [
        Requirement("qemu-system-x86_64", "qemu-system-x86", has("qemu-system-x86_64")),
        Requirement(f"/boot/{KERNEL_GLOB} with the rdma_rxe module", "linux-image-amd64", lambda: find_kernel() is not None),
        Requirement("a statically linked busybox (virtme-ng's initramfs)", "busybox-static", _has_static_busybox),
        Requirement("modprobe", "kmod", has("modprobe")),
        Requirement("ip, rdma", "iproute2", has("ip", "rdma")),
        Requirement("rdma-core (rdma-ndd)", "rdma-core", has("rdma-ndd")),
        Requirement(
            "the rxe verbs provider",
            "ibverbs-providers",
            exists("/usr/lib/*/libibverbs/librxe-rdmav*.so", "/etc/libibverbs.d/rxe.driver"),
        ),
        Requirement("ibv_devinfo", "ibverbs-utils", has("ibv_devinfo")),
        Requirement("infiniband/verbs.h", "libibverbs-dev", exists("/usr/include/infiniband/verbs.h")),
        Requirement("rping", "rdmacm-utils", has("rping")),
        Requirement("ib_send_lat, ib_write_bw, ib_read_bw", "perftest", has("ib_send_lat", "ib_write_bw", "ib_read_bw")),
        Requirement(f"{DIST_PACKAGES}/pyverbs", "python3-pyverbs", lambda: _dist_path("pyverbs", "__init__.py").is_file()),
    ]


def find_vng() -> Path | None:
    """``vng`` next to ``sys.executable`` (the venv), else on ``PATH``."""
    beside = Path(sys.executable).parent / "vng"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("vng")
    return Path(found) if found else None


def check_dependencies() -> tuple[list[Requirement], Path | None]:
    """Return (missing Debian requirements, vng path or None)."""
    return [r for r in requirements() if not r.check()], find_vng()


def _log(message: str) -> None:
    print(f"aiordma-vm: {message}", file=sys.stderr, flush=True)


def _run_install(argv: list[str], timeout: float) -> None:
    _log("running " + shlex.join(argv))
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise VMError(f"{shlex.join(argv)} timed out after {timeout:.0f} s") from exc
    except OSError as exc:
        raise VMError(f"{shlex.join(argv)} could not run: {exc}") from exc
    if proc.returncode != 0:
        raise VMError(f"{shlex.join(argv)} failed with exit status {proc.returncode}")


def _can_pip_install() -> bool:
    in_venv = sys.prefix != sys.base_prefix
    return in_venv or os.geteuid() == 0 or os.access(sys.prefix, os.W_OK)


def ensure_dependencies(*, install: bool = True) -> VMTools:
    """Check what the runner needs; install what is missing when allowed.

    Debian packages are installed with apt-get only when running as root (and
    *install* is true); ``virtme-ng`` with ``sys.executable -m pip``.  Raises
    :class:`MissingDependencies` naming the packages otherwise.
    """
    missing, vng = check_dependencies()
    if missing:
        packages = sorted({r.package for r in missing}, key=DEBIAN_PACKAGES.index)
        details = "; ".join(f"{r.what} ({r.package})" for r in missing)
        if install and os.geteuid() == 0 and shutil.which("apt-get"):
            _log(f"missing: {details}; installing {' '.join(packages)}")
            _run_install(["apt-get", "update"], APT_UPDATE_TIMEOUT)
            _run_install(["apt-get", "install", "-y", *packages], APT_INSTALL_TIMEOUT)
            missing, vng = check_dependencies()
        if missing:
            packages = sorted({r.package for r in missing}, key=DEBIAN_PACKAGES.index)
            details = "; ".join(f"{r.what} ({r.package})" for r in missing)
            how = "" if os.geteuid() == 0 else "\n(or run this as root: it installs them itself)"
            raise MissingDependencies(
                f"missing: {details}.\nInstall them with:\n"
                f"  sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y "
                f"{' '.join(packages)}{how}",
                packages,
            )
    if vng is None:
        if install and _can_pip_install():
            _run_install([sys.executable, "-m", "pip", "install", "virtme-ng"], PIP_INSTALL_TIMEOUT)
            vng = find_vng()
        if vng is None:
            raise MissingDependencies(
                f"vng not found next to {sys.executable} or on PATH; install it with:\n"
                f"  {sys.executable} -m pip install virtme-ng",
                ["virtme-ng"],
            )
    kernel = find_kernel()
    assert kernel is not None  # checked above
    if not os.access(kernel, os.R_OK):
        raise VMError(f"{kernel} is not readable by this user; run as root or make it readable")
    return VMTools(vng=vng, kernel=kernel)


# --------------------------------------------------------------------------
# Guest environment
# --------------------------------------------------------------------------


def project_dir() -> Path:
    """The checkout this package lives in (if it is one), else the current directory."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() else Path.cwd().resolve()


#: the project's own source trees: their bytecode is written on the host before a guest boots
SOURCE_TREES: Final = ("aiordma", "tools", "tests", "benchmarks")


def compile_sources(root: Path | None = None) -> None:
    """Write the bytecode of the project's own modules (``__pycache__``, checked against each
    source's mtime as usual).  This host and CI run with ``PYTHONDONTWRITEBYTECODE=1``, so no
    process ever wrote it, and every Python process in a guest compiled aiordma again: under TCG
    that was ~4 s of each process's ~11 s ``import aiordma`` (measured in one boot: 10.5-11.3 s
    without, 6.6-7.5 s with); the guest stages start a process per peer, CLI call and plugin
    run.  The guests keep ``PYTHONDONTWRITEBYTECODE`` (two of them share the tree)."""
    import compileall

    root = project_dir() if root is None else root
    for name in SOURCE_TREES:
        if (root / name).is_dir():
            try:
                compileall.compile_dir(str(root / name), quiet=2, workers=0)
            except OSError as exc:  # (a tree this user cannot write: only slower)
                _log(f"no bytecode written for {root / name}: {exc}")


def _dedupe(entries: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for entry in entries:
        if entry and entry not in seen:
            seen.add(entry)
            out.append(entry)
    return out


def guest_environment(
    devices: int = 1,
    extra: Mapping[str, str] | None = None,
    host_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment the command gets in the guest.

    ``PATH`` starts with the directory of ``sys.executable`` (the venv's bin);
    ``PYTHONPATH`` ends with ``/usr/lib/python3/dist-packages`` so pyverbs
    imports but the venv's packages win; ``AIORDMA_*`` and a few test-related
    variables are passed through; ``AIORDMA_IN_VM=1``,
    ``AIORDMA_VM_DEVICES=rxe0[,rxe1...]`` and ``AIORDMA_VM_ADDRESSES`` (their
    IPv4 addresses) are set.  *extra* overrides everything.
    """
    src = os.environ if host_env is None else host_env
    env: dict[str, str] = {
        "HOME": "/root",
        "USER": "root",
        "LOGNAME": "root",
        "TERM": "dumb",
        "LANG": "C.UTF-8",
    }
    for name, value in src.items():
        if any(name.startswith(p) if p.endswith("_") else name == p for p in PASSTHROUGH_ENV):
            env[name] = value
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(_dedupe([venv_bin, *src.get("PATH", "").split(os.pathsep), *SBIN_DIRS]))
    pythonpath = [p for p in src.get("PYTHONPATH", "").split(os.pathsep) if p and p != DIST_PACKAGES]
    env["PYTHONPATH"] = os.pathsep.join(_dedupe([*pythonpath, DIST_PACKAGES]))
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("AIORDMA_SKIP_VM", None)
    env["AIORDMA_IN_VM"] = "1"
    env["AIORDMA_VM_DEVICES"] = ",".join(_guest.device_name(i) for i in range(devices))
    env["AIORDMA_VM_ADDRESSES"] = ",".join(_guest.ipv4_address(i) for i in range(devices))
    if extra:
        env.update(extra)
    return env


# --------------------------------------------------------------------------
# Running the guest
# --------------------------------------------------------------------------


class _StreamPump:
    """Reads vng's stdout and stderr in threads.

    stdout is copied to our stdout (or captured).  stderr carries the serial
    console: everything goes to the console log until the guest's ready
    marker; afterwards kernel log lines still go there and the rest is the
    command's stderr (copied to our stderr, or captured).
    """

    def __init__(self, proc: subprocess.Popen[bytes], console_log: IO[bytes], *, capture: bool, show_console: bool) -> None:
        self.proc = proc
        self.console_log = console_log
        self.capture = capture
        self.show_console = show_console
        self.booted = threading.Event()
        self.ready = threading.Event()
        self.booted_at = 0.0
        self.ready_at = 0.0
        self.stdout_chunks: list[bytes] = []
        self.stderr_chunks: list[bytes] = []
        self._threads = [
            threading.Thread(target=self._pump_stdout, name="vm-stdout", daemon=True),
            threading.Thread(target=self._pump_stderr, name="vm-stderr", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _pump_stdout(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = sys.stdout.buffer
        while chunk := os.read(fd, 65536):
            if self.capture:
                self.stdout_chunks.append(chunk)
            else:
                out.write(chunk)
                out.flush()

    def _pump_stderr(self) -> None:
        assert self.proc.stderr is not None
        err = sys.stderr.buffer
        booted = _guest.BOOTED_MARKER.encode()
        ready = _guest.READY_MARKER.encode()
        for line in self.proc.stderr:
            stripped = line.strip()
            if stripped == booted:
                self.booted_at = time.monotonic()
                self.booted.set()
                continue
            if stripped == ready:
                self.ready_at = time.monotonic()
                self.ready.set()
                continue
            if not self.ready.is_set() or _KERNEL_LOG_LINE.match(line):
                self.console_log.write(line)
                self.console_log.flush()
                if self.show_console or line.startswith(b"aiordma-vm(guest):"):
                    err.write(line)
                    err.flush()
            elif self.capture:
                self.stderr_chunks.append(line)
            else:
                err.write(line)
                err.flush()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue


def _wait_for(event: threading.Event, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait until *event* is set; False if the process exited or the deadline passed."""
    while not event.wait(0.2):
        if proc.poll() is not None:
            # The marker may still be in the pipe: give the reader a moment.
            return event.wait(2.0)
        if time.monotonic() >= deadline:
            return False
    return True


def _tail(path: Path, lines: int = 40) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


def _boot_diagnosis(tail: Sequence[str]) -> str:
    text = "\n".join(tail)
    if "Probing EDD" in text and "Linux version" not in text:
        return "the kernel hung right after 'Probing EDD' (this is what happens with KVM; the runner uses TCG)"
    if "Kernel panic" in text:
        return "kernel panic"
    if "busybox" in text:
        return "virtme-ng needs a statically linked busybox (apt-get install busybox-static)"
    if not text.strip():
        return "no console output at all (is qemu-system-x86_64 working?)"
    return "see the console log"


def _read_status(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _as_float(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def run_in_vm(
    cmd: Sequence[str],
    *,
    timeout: float = DEFAULT_COMMAND_TIMEOUT,
    devices: int = 1,
    cwd: str | os.PathLike[str] | None = None,
    rwdirs: Sequence[str | os.PathLike[str]] | None = None,
    env: Mapping[str, str] | None = None,
    kernel: str | os.PathLike[str] | None = None,
    cpus: int = 2,
    memory: str = "2G",
    boot_timeout: float = DEFAULT_BOOT_TIMEOUT,
    setup_timeout: float = DEFAULT_SETUP_TIMEOUT,
    install: bool = True,
    capture_output: bool = False,
    stdin: int | IO[bytes] | None = subprocess.DEVNULL,
    show_console: bool = False,
    keep_scratch: bool = False,
    quiet: bool = False,
    wire: Wire | None = None,
    on_start: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> VMResult:
    """Boot a Soft-RoCE guest, set up *devices* rxe devices and run *cmd* in it.

    *cmd* runs in *cwd* (default: the current directory if it is inside the
    project directory, else the project directory) with
    :func:`guest_environment` plus *env*.  *rwdirs* are the host directories
    the guest may write (default: the project directory); everything else is
    read-only, except the guest's own /tmp.  *timeout* bounds the command;
    *boot_timeout* and *setup_timeout* the boot and the device setup.

    Returns a :class:`VMResult` whose ``returncode`` is the command's exit
    status (:data:`EXIT_TIMEOUT` when it timed out).  Raises
    :class:`MissingDependencies`, :class:`VMBootError` or :class:`VMError`
    when the command could not be run to completion for reasons of the guest.
    ``on_start`` gets the vng process (whose process group is the guest's qemu) once started.
    """
    if not cmd:
        raise ValueError("cmd must not be empty")
    if devices < 1:
        raise ValueError("devices must be >= 1")
    if os.environ.get("AIORDMA_IN_VM") == "1":
        raise VMError("already inside the aiordma Soft-RoCE guest (AIORDMA_IN_VM=1); run the command directly")

    tools = ensure_dependencies(install=install)
    kernel_path = Path(kernel) if kernel is not None else tools.kernel
    project = project_dir()
    here = Path.cwd().resolve()
    run_cwd = Path(cwd).resolve() if cwd is not None else (here if here.is_relative_to(project) else project)
    writable = [Path(d).resolve() for d in (rwdirs if rwdirs is not None else [project])]

    scratch = Path(tempfile.mkdtemp(prefix="aiordma-vm-"))
    spec_path = scratch / "spec.json"
    status_path = scratch / "status.json"
    console_path = scratch / "console.log"
    guest_env = guest_environment(devices, env)
    if wire is not None:
        guest_env.update(AIORDMA_VM_DEVICES="rxe0", AIORDMA_VM_ADDRESSES=wire.address,
                         AIORDMA_HOST_ADDRESS=wire.address, AIORDMA_PEER_ADDRESS=wire.peer)  # fmt: skip
    spec: dict[str, object] = {
        "argv": list(cmd),
        "cwd": str(run_cwd),
        "env": guest_env,
        "devices": devices,
        "timeout": timeout,
        "setup_timeout": setup_timeout,
    }
    if wire is not None:
        spec["wire"] = {"address": wire.address, "mtu": wire.mtu, "netem": wire.netem}
    spec_path.write_text(json.dumps(spec, indent=1))

    guest_script = Path(_guest.__file__).resolve()
    guest_cmd = "exec " + shlex.join([sys.executable, "-I", "-B", str(guest_script), str(spec_path)])
    argv = [
        str(tools.vng),
        "--run", str(kernel_path),
        "--disable-kvm",  # a stock Debian kernel hangs after "Probing EDD" with KVM here
        "--force-9p",
        "--user", "root",
        "--cpus", str(cpus),
        "--memory", memory,
        "--verbose",  # the kernel console goes to stderr: kept as the console log
        "--cwd", str(run_cwd),
    ]
    if wire is not None:
        netdev = (f"-netdev stream,id=wire,server={'on' if wire.listen else 'off'},addr.type=unix,"
                  f"addr.path={wire.socket} -device virtio-net-pci,netdev=wire,mac={wire.mac}")  # fmt: skip
        argv += ["--disable-microvm", f"--qemu-opts={netdev}"]  # (with "=": the value starts with "-")
    for d in [*writable, scratch]:
        argv += ["--rwdir", str(d)]
    argv += ["--", guest_cmd]

    # vng runs virtme-run and qemu from PATH: put vng's own directory first.
    vng_env = dict(os.environ)
    vng_env["PATH"] = os.pathsep.join(
        _dedupe([str(tools.vng.parent), *vng_env.get("PATH", "").split(os.pathsep), *SBIN_DIRS])
    )

    t_start = time.monotonic()
    keep = keep_scratch
    raised = False
    console = open(console_path, "wb")
    try:
        console.write(("$ " + shlex.join(argv) + "\n").encode())
        proc = subprocess.Popen(
            argv,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=vng_env,
            cwd=run_cwd,
            start_new_session=True,
        )
        if on_start is not None:
            on_start(proc)
        pump = _StreamPump(proc, console, capture=capture_output, show_console=show_console)
        host_timed_out = False
        try:
            if not _wait_for(pump.booted, proc, t_start + boot_timeout):
                _kill_group(proc)
                pump.join(5)
                keep = True
                tail = _tail(console_path)
                why = "did not boot within %.0f s" % boot_timeout if proc.returncode in (None, -15, -9) else (
                    f"stopped (exit status {proc.returncode}) before it booted"
                )
                raise VMBootError(f"the guest {why}: {_boot_diagnosis(tail)}", tail, scratch)
            if not _wait_for(pump.ready, proc, pump.booted_at + setup_timeout + HOST_GRACE):
                _kill_group(proc)
                pump.join(5)
                keep = True
                status = _read_status(status_path)
                tail = _tail(console_path)
                error = status.get("error") or "no answer from the guest within %.0f s" % (setup_timeout + HOST_GRACE)
                dmesg = status.get("dmesg_tail")
                if isinstance(dmesg, list):
                    tail = [*tail, "--- guest dmesg ---", *(str(x) for x in dmesg)]
                raise VMBootError(f"setting up the rxe devices failed: {error}", tail, scratch)
            try:
                proc.wait(timeout=max(0.0, pump.ready_at + timeout + HOST_GRACE - time.monotonic()))
            except subprocess.TimeoutExpired:
                host_timed_out = True
                _kill_group(proc)
        except BaseException:
            if proc.poll() is None:
                _kill_group(proc)
            raise
        finally:
            pump.join(10)
        t_end = time.monotonic()

        status = _read_status(status_path)
        boot_s = pump.booted_at - t_start
        setup_s = pump.ready_at - pump.booted_at
        if status.get("phase") == "done" and isinstance(status.get("returncode"), int):
            code = int(str(status["returncode"]))
            timed_out = bool(status.get("timed_out"))
            if proc.returncode != code and not quiet:
                _log(f"note: vng exited with {proc.returncode}, the command with {code}; using the latter")
        elif host_timed_out:
            code, timed_out = EXIT_TIMEOUT, True
        else:
            keep = True
            tail = _tail(console_path)
            raise VMBootError(
                f"the guest stopped (vng exit status {proc.returncode}) before the command finished: "
                f"{_boot_diagnosis(tail)}",
                tail,
                scratch,
            )
        command_s = _as_float(status.get("command_seconds")) or (t_end - pump.ready_at)
        if not quiet:
            _log(
                f"guest booted in {boot_s:.1f} s, {devices} rxe device(s) ready {setup_s:.1f} s later "
                f"(boot+setup {boot_s + setup_s:.1f} s)"
            )
            verdict = f"timed out after {timeout:.0f} s" if timed_out else f"exited with {code}"
            _log(f"command {verdict} in {command_s:.1f} s (total {t_end - t_start:.1f} s)")
        return VMResult(
            list(cmd),
            code,
            b"".join(pump.stdout_chunks).decode(errors="replace") if capture_output else None,
            b"".join(pump.stderr_chunks).decode(errors="replace") if capture_output else None,
            boot_seconds=boot_s,
            setup_seconds=setup_s,
            command_seconds=command_s,
            total_seconds=t_end - t_start,
            timed_out=timed_out,
        )
    except VMError:
        raised = True  # the caller reports it, with exc.scratch when kept
        raise
    finally:
        console.close()
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        elif not raised and not quiet:
            _log(f"kept {scratch} (console.log, spec.json, status.json)")


def run_two_hosts(
    cmd_a: Sequence[str],
    cmd_b: Sequence[str],
    *,
    timeout: float = DEFAULT_COMMAND_TIMEOUT,
    netem: tuple[str, str] = ("", ""),
    mtu: int = 4200,
    cpus: int = 1,
    memory: str = "1G",
    boot_timeout: float = DEFAULT_BOOT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    rwdirs: Sequence[str | os.PathLike[str]] | None = None,
    linger: float = 120.0,
    **kwargs: object,
) -> tuple[VMResult, VMResult]:
    """Boot two Soft-RoCE guests joined by one virtual wire and run ``cmd_a`` in the first
    (``198.18.0.1``) and ``cmd_b`` in the second (``198.18.0.2``), at the same time.

    The wire is a relay on the host (:class:`tools.wire.WireRelay`) between two
    qemu stream netdevs on unix sockets in a scratch directory: no address on the host, RoCEv2
    packets between two kernels, and faults on request from the guests (an outage; a guest
    killed, and booted again with its command).  Each guest has ``rxe0`` on its NIC (MTU
    ``mtu``: rxe's path MTU is 4096 with the default 4200), one vCPU and 1 GiB by default (two
    TCG guests on two cores), and gets ``AIORDMA_HOST_ADDRESS``, ``AIORDMA_PEER_ADDRESS`` and
    ``AIORDMA_WIRE_CONTROL`` (the relay's control directory).  ``netem``: ``tc netem`` specs for
    the NICs of a and b (``"loss 1%"``; '' for none).  Other keyword arguments go to
    :func:`run_in_vm` for both.  Host a serves host b: once b's command has ended, a has
    ``linger`` seconds to end too, then it is stopped (a server that was still serving: status
    0).  Returns both results (a, b); a guest killed on request and not booted again gets status
    0 too.  Raises the first guest's error if one could not
    run its command."""
    from tools import wire as _wire

    scratch = Path(tempfile.mkdtemp(prefix="aiordma-wire-"))
    a, b = HOST_ADDRESSES
    procs: dict[int, subprocess.Popen[bytes]] = {}
    killed = [False, False]
    restart = [False, False]
    started = [threading.Event(), threading.Event()]
    results: list[VMResult | None] = [None, None]
    errors: list[BaseException | None] = [None, None]

    def kill(side: str, again: bool) -> None:
        i = "ab".index(side)
        proc = procs.get(i)
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"host {side} is not running")
        started[i].clear()
        killed[i], restart[i] = True, again
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # qemu and all: the guest's kernel sends nothing more
        proc.wait(30)
        _log(f"host {side} killed on request" + (" (booting it again)" if again else ""))

    relay = _wire.WireRelay(scratch, kill=kill)
    wires = (
        Wire(relay.paths["a"], False, a, "52:54:00:00:00:01", mtu, netem[0], peer=b),
        Wire(relay.paths["b"], False, b, "52:54:00:00:00:02", mtu, netem[1], peer=a),
    )
    guest_env = {**(env or {}), _wire.CONTROL_ENV: str(relay.control)}
    writable = [*(rwdirs if rwdirs is not None else [project_dir()]), relay.control]

    def run(i: int, cmd: Sequence[str]) -> None:
        def on_start(proc: subprocess.Popen[bytes]) -> None:
            procs[i] = proc
            started[i].set()

        while True:
            try:
                results[i] = run_in_vm(cmd, timeout=timeout, cpus=cpus, memory=memory, boot_timeout=boot_timeout,
                                       wire=wires[i], env=guest_env, rwdirs=writable, on_start=on_start,
                                       **kwargs)  # type: ignore[arg-type]  # fmt: skip
            except VMBootError as exc:
                if not killed[i]:
                    errors[i] = exc
                    return
                if exc.scratch is not None:
                    shutil.rmtree(exc.scratch, ignore_errors=True)
            except BaseException as exc:  # (reported below, from the caller's thread)
                errors[i] = exc
                return
            if not killed[i]:
                return
            killed[i] = False
            if not restart[i]:
                results[i] = VMResult(list(cmd), 0, None, None, boot_seconds=0.0, setup_seconds=0.0,
                                      command_seconds=0.0, total_seconds=0.0, timed_out=False)  # fmt: skip
                return

    try:
        threads = [threading.Thread(target=run, args=(i, cmd), name=f"aiordma-vm-{'ab'[i]}")
                   for i, cmd in enumerate((cmd_a, cmd_b))]  # fmt: skip
        for t in threads:
            t.start()
        threads[1].join()
        threads[0].join(linger)
        if threads[0].is_alive() and procs.get(0) is not None:
            _log(f"host a still served {linger:.0f} s after host b's command ended: stopping it")
            with contextlib.suppress(RuntimeError):
                kill("a", False)
        threads[0].join()
    except BaseException:
        # interrupted (Ctrl-C, or SIGTERM from a cancelled CI job): no guest outlives the runner
        for proc in list(procs.values()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
        raise
    finally:
        relay.close()
        shutil.rmtree(scratch, ignore_errors=True)
    for error in errors:
        if error is not None:
            raise error
    ra, rb = results
    assert ra is not None and rb is not None
    return ra, rb


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tools.vm",
        usage="%(prog)s [options] -- CMD [ARG...]",
        description=(
            "Run CMD inside a Soft-RoCE (rdma_rxe) qemu guest booted with virtme-ng. "
            "Exit status: CMD's; 124 if it timed out; 125 if the guest could not run it. "
            "AIORDMA_SKIP_VM=1 makes this a no-op that exits 0."
        ),
    )
    p.add_argument("--devices", type=int, default=1, metavar="N", help="number of rxe devices: rxe0..rxeN-1 (default 1)")
    p.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                   help="2: two guests on one virtual wire (198.18.0.1, 198.18.0.2): -- CMD_A -- CMD_B")
    p.add_argument("--netem", action="append", default=[], metavar="SPEC",
                   help="with --hosts 2: tc netem on host a's NIC, then b's (repeat for b), e.g. 'loss 1%%'")  # fmt: skip
    p.add_argument("--timeout", type=float, default=DEFAULT_COMMAND_TIMEOUT, metavar="S", help="command timeout (default %(default).0f s)")
    p.add_argument("--boot-timeout", type=float, default=DEFAULT_BOOT_TIMEOUT, metavar="S", help="boot timeout (default %(default).0f s)")
    p.add_argument("--setup-timeout", type=float, default=DEFAULT_SETUP_TIMEOUT, metavar="S", help="rxe setup timeout (default %(default).0f s)")
    p.add_argument("--kernel", metavar="PATH", help=f"kernel image (default: newest /boot/{KERNEL_GLOB} with rdma_rxe)")
    p.add_argument("--cpus", type=int, default=2, help="guest CPUs (default %(default)s)")
    p.add_argument("--memory", default="2G", help="guest memory (default %(default)s)")
    p.add_argument("--cwd", metavar="DIR", help="where CMD runs (default: the current directory if inside the project, else the project)")
    p.add_argument("--rwdir", action="append", metavar="DIR", help="host directory the guest may write (repeatable; default: the project directory)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="extra environment variable for CMD (repeatable)")
    p.add_argument("--no-install", action="store_true", help="never install missing packages, just report them")
    p.add_argument("--check", action="store_true", help="only check (and install) dependencies, then exit")
    p.add_argument("--show-console", action="store_true", help="also copy the guest's boot console to stderr")
    p.add_argument("--keep-scratch", action="store_true", help="keep the scratch directory (console log, spec, status)")
    p.add_argument("--stdin", action="store_true", help="connect CMD's stdin to ours (default: /dev/null)")
    p.add_argument("-q", "--quiet", action="store_true", help="no timing lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if "--" in args_list:
        split = args_list.index("--")
        opts, cmd = args_list[:split], args_list[split + 1 :]
    else:
        opts, cmd = args_list, []
    parser = _parser()
    args = parser.parse_args(opts)
    if args.check:
        try:
            tools = ensure_dependencies(install=not args.no_install)
        except VMError as exc:
            _log(str(exc))
            return EXIT_SETUP_FAILED
        _log(f"ready: vng {tools.vng}, kernel {tools.kernel}")
        return 0
    if not cmd:
        parser.error("no command: put it after '--', e.g. -- python -m pytest -m rdma tests")
    cmd_b: list[str] = []
    if args.hosts == 2:
        if "--" not in cmd:
            parser.error("--hosts 2 wants two commands: -- CMD_A -- CMD_B")
        split = cmd.index("--")
        cmd, cmd_b = cmd[:split], cmd[split + 1 :]
        if not cmd or not cmd_b:
            parser.error("--hosts 2 wants two commands: -- CMD_A -- CMD_B")
    if os.environ.get("AIORDMA_SKIP_VM") == "1":
        _log(f"AIORDMA_SKIP_VM=1: not booting the Soft-RoCE guest, skipped: {shlex.join(cmd)}")
        return 0
    extra: dict[str, str] = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env wants NAME=VALUE, got {item!r}")
        extra[name] = value
    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # A cancelled CI job gets SIGTERM: stop the guest as for Ctrl-C.
    signal.signal(signal.SIGTERM, _terminate)
    compile_sources()
    try:
        if args.hosts == 2:
            netem = (list(args.netem) + ["", ""])[:2]
            ra, rb = run_two_hosts(
                cmd, cmd_b, timeout=args.timeout, netem=(netem[0], netem[1]), env=extra, kernel=args.kernel,
                setup_timeout=args.setup_timeout, install=not args.no_install, show_console=args.show_console,
                keep_scratch=args.keep_scratch, quiet=args.quiet, boot_timeout=args.boot_timeout,
            )  # fmt: skip
            _log(f"host a exited with {ra.returncode}, host b with {rb.returncode}")
            return ra.returncode or rb.returncode
        result = run_in_vm(
            cmd,
            timeout=args.timeout,
            devices=args.devices,
            cwd=args.cwd,
            rwdirs=args.rwdir,
            env=extra,
            kernel=args.kernel,
            cpus=args.cpus,
            memory=args.memory,
            boot_timeout=args.boot_timeout,
            setup_timeout=args.setup_timeout,
            install=not args.no_install,
            stdin=None if args.stdin else subprocess.DEVNULL,
            show_console=args.show_console,
            keep_scratch=args.keep_scratch,
            quiet=args.quiet,
        )
    except VMBootError as exc:
        _log(str(exc))
        if exc.console_tail:
            _log("console log tail:")
            for line in exc.console_tail:
                print("    " + line, file=sys.stderr)
        if exc.scratch is not None:
            _log(f"full console log: {exc.scratch / 'console.log'}")
        return EXIT_SETUP_FAILED
    except VMError as exc:
        _log(str(exc))
        return EXIT_SETUP_FAILED
    except KeyboardInterrupt:
        _log("interrupted; the guest was stopped")
        return 130
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
