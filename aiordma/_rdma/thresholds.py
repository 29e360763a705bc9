"""The rendezvous threshold, measured per device: where a message by RDMA READ starts to beat the
SEND slots, and where that measurement is kept.

Theory of operation
-------------------
A message goes by SEND slots (copied into 64 KiB slots that pipeline, credits returned in bulk)
or by rendezvous (announced, then READ by the peer in one piece, then acknowledged: a round trip
more, and no copy on the wire's far side -- none at all when both buffers are registered).  Which
is faster from which size depends on the device: on Soft-RoCE under emulation the round trip is
milliseconds and the copies cost little next to the emulated wire (the crossover was between 4 and
16 MiB); on an RNIC a round trip is microseconds and the copies are the cost (it crosses far lower).
One constant cannot serve both, so the threshold is measured on the device itself
(``aiordma info --measure-rendezvous``: the same messages both ways over a connection of the
device to itself, ``aiordma/_cli/calibrate.py``) and kept in a small JSON file per user, keyed by
what identifies the device (its name, node GUID, vendor, part and firmware).  A connection whose
``RdmaConfig.rendezvous`` is left at None uses its device's measured threshold, else
:data:`DEFAULT_RENDEZVOUS`; a number in the config always wins.  ``aiordma info`` says which.

The file lives in ``$AIORDMA_CACHE_DIR``, else ``$XDG_CACHE_HOME/aiordma``, else
``~/.cache/aiordma``.  A file that cannot be read is ignored (with a warning): the default holds.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from .constants import DeviceAttr

__all__ = [
    "DEFAULT_RENDEZVOUS",
    "Measured",
    "cache_path",
    "crossover",
    "device_key",
    "load",
    "save",
]

log = logging.getLogger("aiordma")

#: the threshold of a device nobody measured: Soft-RoCE's crossover (docs/benchmarks.md, "Where
#: the rendezvous pays")
DEFAULT_RENDEZVOUS: Final = 8 << 20
FILE_NAME: Final = "rendezvous.json"


@dataclass
class Measured:
    """One device's measurement: the threshold, and what it was taken from."""

    threshold: int
    #: when (seconds since the epoch)
    at: float
    #: message size -> (MB/s by rendezvous, MB/s by SEND slots)
    table: dict[int, tuple[float, float]] = field(default_factory=dict)


def device_key(name: str, attr: DeviceAttr) -> str:
    """What identifies a device across runs: another card, or new firmware, is measured anew."""
    return f"{name}/{attr.node_guid:016x}/{attr.vendor_id:x}:{attr.vendor_part_id:x}/{attr.fw_ver}"


def crossover(sizes: Sequence[int], rendezvous: Sequence[float], slots: Sequence[float]) -> int:
    """The threshold from one measurement: the smallest size from which the rendezvous was at
    least as fast as the slots at every larger size measured.  If it never was, twice the largest
    size (beyond what was measured it may pay; a larger buffer received into registered memory
    still saves its copies)."""
    if not sizes or not len(sizes) == len(rendezvous) == len(slots):
        raise ValueError("one rate each way for every size")
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    threshold = 2 * sizes[order[-1]]
    for i in reversed(order):
        if rendezvous[i] < slots[i]:
            break
        threshold = sizes[i]
    return threshold


def cache_path() -> Path:
    """The file the measurements live in (see the module docs)."""
    base = os.environ.get("AIORDMA_CACHE_DIR")
    if base:
        return Path(base) / FILE_NAME
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "aiordma" / FILE_NAME


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("aiordma: ignoring the rendezvous measurements in %s: %s", path, exc)
        return {}
    if not isinstance(data, dict):
        log.warning("aiordma: ignoring the rendezvous measurements in %s: not a JSON object", path)
        return {}
    return data


def load(key: str, path: Path | None = None) -> Measured | None:
    """The measurement of the device ``key``, or None (never measured, or unreadable)."""
    path = path or cache_path()
    entry = _read(path).get(key)
    try:
        if entry is None:
            return None
        threshold = int(entry["threshold"])
        if threshold < 4096:
            raise ValueError(f"threshold {threshold} < 4096")
        table = {int(size): (float(r), float(s)) for size, (r, s) in entry.get("table", {}).items()}
        return Measured(threshold, float(entry.get("at", 0.0)), table)
    except (KeyError, TypeError, ValueError) as exc:
        log.warning("aiordma: ignoring the rendezvous measurement of %s in %s: %s", key, path, exc)
        return None


def save(key: str, measured: Measured, path: Path | None = None) -> Path:
    """Keep ``measured`` for the device ``key`` (the other devices' entries stay); written whole
    to a temporary file and renamed over the old one, so a reader never sees half of it."""
    path = path or cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _read(path)
    entry = asdict(measured)
    entry["table"] = {str(size): list(rates) for size, rates in measured.table.items()}
    entry["at"] = measured.at or time.time()
    data[key] = entry
    fd, tmp = tempfile.mkstemp(prefix=".rendezvous-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
