"""``aiordma top``: a live table of a process's aiordma connections, from its stats endpoint.

The process must serve its counters (``aiordma.serve_stats()``, a unix socket; see
``aiordma/metrics.py``).  ``aiordma top`` with no target reads the only endpoint in this user's
stats directory (several: it lists them and asks for one); a target is a PID or a socket path.
Every ``--interval`` seconds it takes a snapshot and redraws: the process's totals and rates,
its devices, then one row per connection (busiest first), rates from the previous snapshot.
``--once`` prints one table (the rates over ``--interval``) and exits.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from typing import Any

from ..metrics import default_stats_dir, read_stats, stats_socket_path
from .common import EXIT_FAILED

__all__ = ["cmd_top", "render", "find_endpoint"]


def find_endpoint(target: str | None) -> str:
    """The socket path for ``target`` (a PID, a path, or None: the only endpoint there is)."""
    if target:
        if target.isdigit():
            return stats_socket_path(int(target))
        return target
    found = sorted(glob.glob(os.path.join(default_stats_dir(), "*.sock")))
    if len(found) == 1:
        return found[0]
    if not found:
        raise LookupError(f"no stats endpoint in {default_stats_dir()}: the process must call aiordma.serve_stats()")
    names = ", ".join(os.path.basename(p).removesuffix(".sock") for p in found)
    raise LookupError(f"several processes serve their stats (PIDs {names}): name one")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _rate(now: dict[str, Any], before: dict[str, Any] | None, key: str, dt: float) -> float:
    if before is None or dt <= 0:
        return 0.0
    return max(0.0, float(now.get(key, 0) - before.get(key, 0)) / dt)


def _key(conn: dict[str, Any]) -> Any:
    return conn.get("id")


def render(snap: dict[str, Any], before: dict[str, Any] | None = None, dt: float = 0.0, *, rows: int = 40) -> str:
    """One screen: totals and rates, devices, the busiest connections."""
    totals = snap.get("totals", {})
    prev_totals = before.get("totals") if before else None
    open_ = snap.get("open", {})
    mem = snap.get("memory") or {}
    lines = [
        f"aiordma top -- pid {snap.get('pid', '?')}   open: "
        + (", ".join(f"{n} {t}" for t, n in sorted(open_.items())) or "none")
        + "   opened: " + (", ".join(f"{n} {t}" for t, n in sorted(snap.get("opened", {}).items())) or "none"),
        f"sent {_size(totals.get('bytes_sent', 0))} ({_size(_rate(totals, prev_totals, 'bytes_sent', dt))}/s), "
        f"received {_size(totals.get('bytes_received', 0))} ({_size(_rate(totals, prev_totals, 'bytes_received', dt))}/s); "
        f"messages {totals.get('messages_sent', 0)} out, {totals.get('messages_received', 0)} in; "
        f"rendezvous {totals.get('rendezvous_sent', 0)}/{totals.get('rendezvous_received', 0)}; "
        f"credit stalls {totals.get('credit_stalls', 0)}",
        f"pinned {_size(mem.get('pinned_bytes', 0))} in {mem.get('registrations', 0)} registrations; "
        f"registration cache {mem.get('cache_hits', 0)} hits, {mem.get('cache_misses', 0)} misses; "
        f"staged {_size(mem.get('staged_bytes', 0))}",
    ]
    for reason, n in sorted(snap.get("fallbacks", {}).items(), key=lambda item: -item[1])[:3]:
        lines.append(f"fallback x{n}: {reason}")
    for what, n in sorted(snap.get("failures", {}).items(), key=lambda item: -item[1])[:3]:
        lines.append(f"broken x{n}: {what}")
    for device, counts in sorted(snap.get("devices", {}).items()):
        extra = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "connections" and v)
        lines.append(f"device {device}: {counts.get('connections', 0)} users" + (f"; {extra}" if extra else ""))
    lines.append("")
    header = f"{'peer':<22} {'tr':<4} {'mode':<8} {'role':<6} {'age':>7} {'sent':>10} {'recv':>10} " \
             f"{'out/s':>10} {'in/s':>10} {'msgs out':>9} {'msgs in':>9} {'unread':>9} {'stalls':>6} {'pinned':>9}"  # fmt: skip
    lines.append(header)
    previous = {_key(c): c for c in (before or {}).get("connections", [])}
    conns = snap.get("connections", [])
    table = []
    for conn in conns:
        old = previous.get(_key(conn))
        out_rate = _rate(conn, old, "bytes_sent", dt)
        in_rate = _rate(conn, old, "bytes_received", dt)
        table.append((out_rate + in_rate, conn.get("bytes_sent", 0) + conn.get("bytes_received", 0), conn, out_rate, in_rate))
    table.sort(key=lambda row: (-row[0], -row[1]))
    for _, _, conn, out_rate, in_rate in table[:rows]:
        lines.append(
            f"{str(conn.get('peer') or '?'):<22.22} {conn.get('transport', '?'):<4} {conn.get('mode', '?'):<8} "
            f"{conn.get('role', '?'):<6} {conn.get('age', 0.0):>6.0f}s {_size(conn.get('bytes_sent', 0)):>10} "
            f"{_size(conn.get('bytes_received', 0)):>10} {_size(out_rate):>10} {_size(in_rate):>10} "
            f"{conn.get('messages_sent', 0):>9} {conn.get('messages_received', 0):>9} "
            f"{_size(conn.get('unread_bytes', 0)):>9} {conn.get('credit_stalls', 0):>6} {_size(conn.get('pinned_bytes', 0)):>9}"
        )
    if len(table) > rows:
        lines.append(f"... and {len(table) - rows} more connections")
    if not table:
        lines.append("(no open connections)")
    return "\n".join(lines)


def cmd_top(args: argparse.Namespace) -> int:
    try:
        path = find_endpoint(args.target)
        before = read_stats(path)
    except (LookupError, OSError, ValueError) as exc:
        print(f"aiordma top: {exc}", file=sys.stderr)
        return EXIT_FAILED
    last = time.monotonic()
    tty = sys.stdout.isatty() and not args.once
    try:
        while True:
            time.sleep(args.interval)
            try:
                snap = read_stats(path)
            except (OSError, ValueError) as exc:
                print(f"aiordma top: the process stopped answering ({exc})", file=sys.stderr)
                return EXIT_FAILED
            now = time.monotonic()
            screen = render(snap, before, now - last, rows=args.rows)
            if tty:
                sys.stdout.write("\x1b[H\x1b[2J")
            print(screen, flush=True)
            if args.once:
                return 0
            if not tty:
                print(flush=True)
            before, last = snap, now
    except KeyboardInterrupt:
        return 0
