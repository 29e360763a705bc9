"""What the ``aiordma`` command's subcommands share: exit codes, sysfs, sizes on the command line."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "SYSFS_IB", "ZERO_GID", "MiB", "parse_size", "parse_positive", "human_bytes", "loop_of"]

SYSFS_IB = "/sys/class/infiniband"
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
MiB = 1 << 20

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def parse_size(text: str) -> int:
    """A byte count: ``65536``, ``64K``, ``64M``, ``1G`` (binary units)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    raw = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = 1
    if raw and raw[-1] in units:
        factor = units[raw[-1]]
        raw = raw[:-1]
    try:
        value = int(raw) * factor
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 65536, 64K, 64M)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte: {text!r}")
    return value


def parse_positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def human_bytes(n: int) -> str:
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    if n % 1024 == 0:
        return f"{n // 1024} KiB"
    return f"{n} B"


def loop_of(name: str, prog: str) -> tuple[str, dict[str, Any]] | None:
    """The anyio backend and its options for ``--backend`` (asyncio, uvloop, trio); None, said on
    stderr, when uvloop is asked for and not installed."""
    if name == "trio":
        return "trio", {}
    if name == "uvloop":
        try:
            import uvloop
        except ImportError:
            print(f"{prog}: error: --backend uvloop needs uvloop (pip install 'aiordma[uvloop]')", file=sys.stderr)
            return None
        return "asyncio", {"loop_factory": uvloop.new_event_loop}
    return "asyncio", {}
