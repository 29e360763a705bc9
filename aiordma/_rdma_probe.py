"""Is RDMA usable on this host?  Answers with a readable reason when not.

The probe never raises: it is what ``transport="auto"`` asks before it offers
RDMA to a peer, and what ``aiordma info`` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["Probe", "probe"]

SYSFS_IB = "/sys/class/infiniband"


@dataclass(frozen=True)
class Probe:
    usable: bool
    reason: str  # why not, when not usable; "" otherwise
    native_module: bool
    native_reason: str
    devices: list[str] = field(default_factory=list)


def _sysfs_devices() -> list[str]:
    try:
        return sorted(os.listdir(SYSFS_IB))
    except OSError:
        return []


def probe() -> Probe:
    """Look for the native module and for RDMA devices."""
    devices = _sysfs_devices()
    try:
        from . import _verbs  # noqa: F401  (built by the RDMA transport)
    except ImportError as exc:
        native, native_reason = False, f"native module not available ({exc})"
    else:
        ok, why = _verbs.native_available()
        native, native_reason = ok, why
    if not devices:
        where = "" if os.path.isdir(SYSFS_IB) else f" ({SYSFS_IB} does not exist: no RDMA support in this kernel)"
        return Probe(False, f"no RDMA device{where}", native, native_reason, devices)
    if not native:
        return Probe(False, native_reason, native, native_reason, devices)
    return Probe(True, "", native, native_reason, devices)
