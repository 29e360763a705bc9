"""``aiordma info``: what this host has (versions, the native verbs module, RDMA devices with their
ports and GIDs from sysfs) and which transport ``transport="auto"`` would use here, and why."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from .common import EXIT_OK, SYSFS_IB, human_bytes

__all__ = ["cmd_info", "collect_info", "format_info", "read_rdma_devices"]

# -- info ----------------------------------------------------------------------


@dataclass
class Gid:
    index: int
    gid: str
    type: str | None
    netdev: str | None


@dataclass
class Port:
    port: int
    state: str | None
    link_layer: str | None
    gids: list[Gid] = field(default_factory=list)


@dataclass
class Device:
    name: str
    node_type: str | None
    ports: list[Port] = field(default_factory=list)
    #: how this device scopes the rkeys a connection grants (None: not asked: no native module)
    remote_keys: str | None = None
    #: from which size messages go by rendezvous here, unless a config says otherwise (None: not
    #: asked), and whence that figure: measured (when, with its table), or the default
    rendezvous_threshold: int | None = None
    rendezvous: str | None = None


def remote_key_scoping(name: str) -> str:
    """How connections on device ``name`` scope the remote keys they grant: the one memory-window
    probe a device makes when it opens (``aiordma._rdma.device``), made here once."""
    from .._rdma.verbs import Context

    with Context(name) as ctx, ctx.alloc_pd() as pd:
        try:
            pd.alloc_mw().close()
        except Exception as exc:  # (RDMAError EOPNOTSUPP: no windows, as on siw)
            return f"a protection domain per connection (no type 2 memory windows: {exc})"
    return "memory windows (type 2): each grant bound to its connection's QP"


def read_rdma_devices(root: str = SYSFS_IB) -> list[Device]:
    """RDMA devices under ``root`` (sysfs), their ports and non-zero GIDs, as sysfs words them.

    The one discovery (``aiordma._rdma.discovery``) reads them; this only keeps sysfs's wording."""
    from .._rdma.discovery import list_devices

    devices = []
    for info in list_devices(sysfs_root=root, query_verbs=False):
        device = Device(info.name, info.node_type)
        for p in info.ports:
            port = Port(p.port, p.state_text, p.link_layer_text)
            port.gids = [Gid(g.index, _readable_gid(str(g.gid)), g.type_text, g.netdev) for g in p.gids]
            device.ports.append(port)
        devices.append(device)
    return devices


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _would_use(policy: str) -> dict[str, Any]:
    """What a client with this transport policy would do on this host."""
    from .._errors import RDMAUnavailableError
    from .._handshake.negotiate import local_offer, resolve_transport

    try:
        choice = resolve_transport(policy)
    except ValueError as exc:
        return {"policy": policy, "transport": None, "reason": str(exc), "error": True}
    try:
        offer = local_offer(choice, "client")
    except RDMAUnavailableError as exc:
        return {"policy": choice, "transport": None, "reason": f"fails with RDMAUnavailableError: {exc}", "error": True}
    if offer.rdma:
        return {"policy": choice, "transport": "rdma", "reason": "if the peer offers RDMA too", "error": False}
    return {"policy": choice, "transport": "tcp", "reason": offer.reason, "error": False}


def _readable_gid(raw: str) -> str:
    """sysfs prints GIDs in full; show them compressed, IPv4-mapped ones with their address
    (``::ffff:198.18.0.1``, the form RoCEv2 uses for an IPv4 address)."""
    import ipaddress

    try:
        address = ipaddress.IPv6Address(raw)
    except ValueError:
        return raw
    if address.ipv4_mapped is not None:
        return f"::ffff:{address.ipv4_mapped}"
    return str(address)


def collect_info(sysfs_root: str = SYSFS_IB) -> dict[str, Any]:
    """Everything ``aiordma info`` prints, as a JSON-ready dict."""
    from .. import __version__
    from .._handshake.negotiate import resolve_transport
    from .._rdma.discovery import probe

    try:
        found = probe()
        probe_result: dict[str, Any] = {
            "usable": found.usable,
            "reason": found.reason,
            "native_module": found.native_module,
            "native_reason": found.native_reason,
            "devices": list(found.devices),
        }
    except Exception as exc:  # the probe promises not to raise; say so if it does
        probe_result = {
            "usable": False,
            "reason": f"the probe failed: {exc!r}",
            "native_module": False,
            "native_reason": f"the probe failed: {exc!r}",
            "devices": [],
        }
    env = os.environ.get("AIORDMA_TRANSPORT")
    try:
        default_policy: str | None = resolve_transport(None)
        env_error = None
    except ValueError as exc:
        default_policy = None
        env_error = str(exc)
    return {
        "aiordma": __version__,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in ("anyio", "trio", "uvloop", "cffi")},
        "native_module": {"available": probe_result["native_module"], "reason": probe_result["native_reason"]},
        "rdma": {
            "usable": probe_result["usable"],
            "reason": probe_result["reason"],
            "sysfs": sysfs_root,
            "sysfs_exists": os.path.isdir(sysfs_root),
            "devices": [asdict(d) for d in _with_scoping(read_rdma_devices(sysfs_root), probe_result["native_module"])],
        },
        "env": {"AIORDMA_TRANSPORT": env},
        "default_policy": default_policy,
        "default_policy_error": env_error,
        "auto": _would_use("auto"),
        "default": _would_use(default_policy) if default_policy is not None else None,
    }


def rendezvous_of(name: str) -> tuple[int, str]:
    """Device ``name``'s rendezvous threshold for connections that leave ``RdmaConfig.rendezvous``
    open, and whence it comes (``aiordma._rdma.thresholds``)."""
    import time

    from .._rdma.thresholds import DEFAULT_RENDEZVOUS, cache_path, load
    from .calibrate import device_key_of

    measured = load(device_key_of(name))
    if measured is None:
        return DEFAULT_RENDEZVOUS, (
            f"{human_bytes(DEFAULT_RENDEZVOUS)} (the default: not measured on this device; "
            "aiordma info --measure-rendezvous measures it)"
        )
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(measured.at))
    rates = ", ".join(f"{human_bytes(size)} {r:g}/{s:g}" for size, (r, s) in sorted(measured.table.items()))
    return measured.threshold, (
        f"{human_bytes(measured.threshold)} (measured {when}, kept in {cache_path()}; "
        f"MB/s by rendezvous/SEND slots: {rates})"
    )


def _with_scoping(devices: list[Device], native: bool) -> list[Device]:
    if native:
        for dev in devices:
            try:
                dev.remote_keys = remote_key_scoping(dev.name)
                dev.rendezvous_threshold, dev.rendezvous = rendezvous_of(dev.name)
            except Exception as exc:  # (the device cannot be opened: say so, do not fail info)
                dev.remote_keys = f"unknown (opening {dev.name} failed: {exc})"
    return devices


def _describe_choice(outcome: dict[str, Any]) -> str:
    if outcome["transport"] is None:
        return str(outcome["reason"])
    return f"{outcome['transport']} \u2014 {outcome['reason']}"


def format_info(info: dict[str, Any]) -> str:
    lines = [f"aiordma {info['aiordma']}"]
    py = info["python"]
    lines.append(f"Python {py['version']} ({py['implementation']}, {py['executable']})")
    lines.append(f"platform: {info['platform']}")
    packages = ", ".join(f"{name} {ver or 'not installed'}" for name, ver in info["packages"].items())
    lines.append(f"packages: {packages}")
    native = info["native_module"]
    lines.append(f"native verbs module: {'available' if native['available'] else 'not available'}")
    if native["reason"]:
        lines.append(f"  {native['reason']}")
    rdma = info["rdma"]
    usable = "yes" if rdma["usable"] else "no"
    lines.append(f"RDMA usable: {usable}" + (f" \u2014 {rdma['reason']}" if rdma["reason"] else ""))
    if not rdma["sysfs_exists"]:
        lines.append(f"RDMA devices: none ({rdma['sysfs']} does not exist)")
    elif not rdma["devices"]:
        lines.append(f"RDMA devices: none (in {rdma['sysfs']})")
    else:
        lines.append("RDMA devices:")
        for dev in rdma["devices"]:
            lines.append(f"  {dev['name']}" + (f" ({dev['node_type']})" if dev["node_type"] else ""))
            if dev.get("remote_keys"):
                lines.append(f"    remote keys: {dev['remote_keys']}")
            if dev.get("rendezvous"):
                lines.append(f"    rendezvous from: {dev['rendezvous']}")
            if not dev["ports"]:
                lines.append("    no ports")
            for port in dev["ports"]:
                lines.append(
                    f"    port {port['port']}: state {port['state'] or '?'}, link layer {port['link_layer'] or '?'}"
                )
                if not port["gids"]:
                    lines.append("      no GIDs")
                for gid in port["gids"]:
                    extra = ", ".join(x for x in (gid["type"], gid["netdev"] and f"netdev {gid['netdev']}") if x)
                    lines.append(f"      gid[{gid['index']}] {gid['gid']}" + (f" ({extra})" if extra else ""))
    env = info["env"]["AIORDMA_TRANSPORT"]
    lines.append(f"AIORDMA_TRANSPORT: {env if env is not None else '(not set)'}")
    if info["default_policy_error"]:
        lines.append(f"  invalid: {info['default_policy_error']}")
    lines.append(f"auto would use: {_describe_choice(info['auto'])}")
    default = info["default"]
    if default is not None and default["policy"] != "auto":
        lines.append(
            f"default policy ({default['policy']}, from AIORDMA_TRANSPORT) would use: {_describe_choice(default)}"
        )
    return "\n".join(lines)


def cmd_info(args: argparse.Namespace) -> int:
    if getattr(args, "measure_rendezvous", False):
        import anyio

        from .calibrate import measure_all

        results = anyio.run(measure_all, args.device)
        if not results:
            print("no RDMA device with an ACTIVE RoCEv2 port and an IPv4 address to measure", file=sys.stderr)
            return 1
        for result in results:
            print(f"{result.device}: rendezvous from {human_bytes(result.threshold)} (kept in {result.path})", file=sys.stderr)
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return EXIT_OK


