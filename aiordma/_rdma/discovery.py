"""Which RDMA devices this host has, which one serves an address, and whether
RDMA is usable at all -- the one discovery used by the transport, the probe
and ``aiordma info``.

Everything here reads sysfs (``/sys/class/infiniband``) and never opens a
device, so it is cheap and maps no libibverbs; only ``list_devices(
query_verbs=True)`` (for ``aiordma info``) opens each device briefly to ask
what sysfs does not publish (the MTUs).  The probe never raises: it is what
``transport="auto"`` asks before it offers RDMA to a peer.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from typing import Final

from .._errors import RDMAError, RDMAUnavailableError
from .constants import GidEntry, gid_bytes

__all__ = [
    "Probe",
    "probe",
    "SYSFS_IB",
    "retry_counters",
    "GidEntry",
    "PortInfo",
    "DeviceInfo",
    "list_devices",
    "gid_for_ip",
    "device_names",
    "rdma_address",
    "device_addresses",
]

SYSFS_IB = "/sys/class/infiniband"


def _native_loaded() -> bool:
    """Whether the native module can be imported (imports it: only for callers that need verbs)."""
    from .verbs import native_available

    return native_available()[0]


@dataclass(frozen=True, slots=True)
class PortInfo:
    port: int
    state: str  # "ACTIVE", "DOWN", ...
    link_layer: str  # "Ethernet" (RoCE) or "InfiniBand"
    active_mtu: int | None  # bytes; None when verbs could not be asked
    max_mtu: int | None
    gids: tuple[GidEntry, ...]
    state_text: str | None = None  # as sysfs has it ("4: ACTIVE")
    link_layer_text: str | None = None


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    name: str
    node_guid: str
    ports: tuple[PortInfo, ...]
    node_type: str | None = None  # as sysfs has it ("1: CA")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


#: the device counters that tell of RNR and retries (rxe: rcvd_rnr_err, send_rnr_err,
#: retry_exceeded_err, retry_rnr_exceeded_err, completer_retry_err; mlx5: rnr_nak_retry_err,
#: local_ack_timeout_err, ...): names holding one of these
RETRY_COUNTER_WORDS: Final = ("rnr", "retry", "timeout", "seq_err", "out_of_seq")


def retry_counters(dev: str, *, sysfs_root: str = SYSFS_IB) -> dict[str, int]:
    """The device's RNR and retry counters from sysfs (``hw_counters`` of the device and of each
    port, summed by name), ``{}`` where it has none (the simulated wire; drivers without them).
    They count for the whole device: every process and connection on it."""
    out: dict[str, int] = {}
    base = os.path.join(sysfs_root, dev)
    dirs = [os.path.join(base, "hw_counters")]
    try:
        dirs += [os.path.join(base, "ports", p, "hw_counters") for p in os.listdir(os.path.join(base, "ports"))]
    except OSError:
        pass
    for d in dirs:
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if name == "lifespan" or not any(word in name for word in RETRY_COUNTER_WORDS):
                continue
            raw = _read(os.path.join(d, name))
            if raw is not None and raw.isdigit():
                out[name] = out.get(name, 0) + int(raw)
    return out


def _gid_type(raw: str | None, link_layer: str) -> str:
    if raw is None:
        return "IB" if link_layer == "InfiniBand" else "RoCEv1"
    if "v2" in raw:
        return "RoCEv2"
    return "IB" if link_layer == "InfiniBand" else "RoCEv1"


def _read_gids(sysfs_root: str, dev: str, port: int, link_layer: str) -> tuple[GidEntry, ...]:
    base = os.path.join(sysfs_root, dev, "ports", str(port))
    try:
        names = os.listdir(os.path.join(base, "gids"))
    except OSError:
        return ()
    out = []
    for name in sorted(names, key=lambda s: int(s) if s.isdigit() else -1):
        if not name.isdigit():
            continue
        raw = _read(os.path.join(base, "gids", name))
        if not raw:
            continue
        try:
            gid = ipaddress.IPv6Address(raw)
        except ValueError:
            continue
        if gid.packed == bytes(16):
            continue
        type_text = _read(os.path.join(base, "gid_attrs", "types", name))
        gtype = _gid_type(type_text, link_layer)
        ndev = _read(os.path.join(base, "gid_attrs", "ndevs", name)) or None
        out.append(GidEntry(dev, port, int(name), gid, gtype, ndev, type_text))
    return tuple(out)


def list_devices(*, sysfs_root: str = SYSFS_IB, query_verbs: bool = True) -> list[DeviceInfo]:
    """RDMA devices, their ports (state, link layer, MTU) and GID tables.

    Reads ``/sys/class/infiniband/<dev>/ports/<p>/{state,link_layer,gids,
    gid_attrs/types,gid_attrs/ndevs}``.  With ``query_verbs`` and the native
    module present, each device is opened briefly to ask the active and max
    MTU (sysfs does not publish them; otherwise they are ``None``) and the
    GID table in one ``ibv_query_gid_table`` call, which is much faster than
    walking the (mostly empty) sysfs table.  No device (or no RDMA in the
    kernel) gives an empty list.
    """
    try:
        devs = sorted(os.listdir(sysfs_root))
    except OSError:
        return []
    result = []
    for dev in devs:
        mtus: dict[int, tuple[int | None, int | None]] = {}
        verbs_gids: list[GidEntry] | None = None
        if query_verbs and sysfs_root == SYSFS_IB and _native_loaded():
            from .verbs import Context  # loaded only when asked to query verbs

            try:
                with Context(dev) as ctx:
                    for p in range(1, ctx.query_device().phys_port_cnt + 1):
                        pa = ctx.query_port(p)
                        mtus[p] = (pa.active_mtu, pa.max_mtu)
                    verbs_gids = ctx.query_gid_table()
            except (RDMAError, RDMAUnavailableError, LookupError):
                pass
        ports = []
        try:
            port_names = sorted(int(p) for p in os.listdir(os.path.join(sysfs_root, dev, "ports")) if p.isdigit())
        except OSError:
            port_names = []
        for p in port_names:
            base = os.path.join(sysfs_root, dev, "ports", str(p))
            state_text = _read(os.path.join(base, "state"))
            state = (state_text or "").split(":", 1)[-1].strip() or "UNKNOWN"
            link_layer_text = _read(os.path.join(base, "link_layer"))
            link_layer = link_layer_text or "Unspecified"
            active, maxm = mtus.get(p, (None, None))
            if verbs_gids is not None:
                gids = tuple(g for g in verbs_gids if g.port == p)
            else:
                gids = _read_gids(sysfs_root, dev, p, link_layer)
            ports.append(PortInfo(p, state, link_layer, active, maxm, gids, state_text, link_layer_text))
        node_guid = _read(os.path.join(sysfs_root, dev, "node_guid")) or ""
        result.append(DeviceInfo(dev, node_guid, tuple(ports), _read(os.path.join(sysfs_root, dev, "node_type"))))
    return result


def gid_for_ip(
    ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address,
    *,
    gid_type: str = "RoCEv2",
    sysfs_root: str = SYSFS_IB,
) -> GidEntry | None:
    """The GID entry (device, port, index) whose GID is this local address.

    For RoCEv2 an IPv4 address ``a.b.c.d`` is the GID ``::ffff:a.b.c.d``.
    Ports that are ACTIVE win over others; ``None`` if no device has it.
    """
    want = ipaddress.IPv6Address(gid_bytes(ip if not isinstance(ip, str) else ipaddress.ip_address(ip)))
    best: tuple[int, GidEntry] | None = None
    for dev in list_devices(sysfs_root=sysfs_root, query_verbs=False):
        for port in dev.ports:
            for g in port.gids:
                if g.gid == want and g.gid_type == gid_type:
                    rank = 0 if port.state == "ACTIVE" else 1
                    if best is None or rank < best[0]:
                        best = (rank, g)
    return best[1] if best else None



@dataclass(frozen=True)
class Probe:
    usable: bool
    reason: str  # why not, when not usable; "" otherwise
    native_module: bool
    native_reason: str
    devices: list[str] = field(default_factory=list)


def device_names() -> list[str]:
    """The RDMA devices of this host (a directory listing: cheap)."""
    return _sysfs_devices()


def _sysfs_devices() -> list[str]:
    try:
        return sorted(os.listdir(SYSFS_IB))
    except OSError:
        return []


def probe() -> Probe:
    """Look for the native module and for RDMA devices."""
    devices = _sysfs_devices()
    if not devices:
        # no device: the native module is not even loaded (a TCP-only host maps no libibverbs)
        where = "" if os.path.isdir(SYSFS_IB) else f" ({SYSFS_IB} does not exist: no RDMA support in this kernel)"
        return Probe(False, f"no RDMA device{where}", False, "not loaded (no RDMA device)", devices)
    try:
        from . import verbs as _verbs
    except ImportError as exc:  # pragma: no cover - verbs.py itself imports without the module
        native, native_reason = False, f"native module not available ({exc})"
    else:
        native, native_reason = _verbs.native_available()
    if not native:
        return Probe(False, native_reason, native, native_reason, devices)
    return Probe(True, "", native, native_reason, devices)


def device_addresses() -> list[tuple[str, str]]:
    """(device name, a local IPv4 address it serves) for each RDMA device with one: its first
    ACTIVE port's first RoCEv2 GID of an IPv4 address (sysfs only: no verbs call)."""
    found = []
    for device in list_devices(query_verbs=False):
        address = next(
            (
                str(entry.gid.ipv4_mapped)
                for port in device.ports
                if port.state == "ACTIVE"
                for entry in port.gids
                if entry.gid_type == "RoCEv2" and entry.gid.ipv4_mapped is not None
            ),
            None,
        )
        if address is not None:
            found.append((device.name, address))
    return found


def rdma_address() -> str | None:
    """A local IPv4 address that an RDMA device serves (an ACTIVE port's RoCEv2 GID), or None
    (sysfs only: no verbs call)."""
    found = device_addresses()
    return found[0][1] if found else None
