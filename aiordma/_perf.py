"""``aiordma perf``: latency and bandwidth over a range of message sizes, per transport and poll mode.

In the spirit of ``ib_send_lat`` / ``ib_write_bw`` / ``ucx_perftest``:
``aiordma perf server`` listens; ``aiordma perf client HOST`` measures, and
``aiordma perf client --local`` runs both in this process (one event loop:
the RDMA poll modes then never spin, see ``aiordma/_rdma/poller.py``).

Protocol (over aiordma message channels): the client's first message on a
connection is a small JSON object ``{"test": "lat" | "bw", "size": N,
"count": K}``.  ``lat``: the server echoes K messages of N bytes, one at a
time (ping-pong; the client times each round trip).  ``bw``: the client
sends K messages of N bytes back to back and the server answers with one
8-byte count once it has them all (the client times first send to answer).

The server listens on three consecutive ports, one per RDMA poll mode
(``event``, ``adaptive``, ``busy``), so a client measures each mode with both
ends in that mode; a TCP run goes to the first port.  Every run is bounded
(counts and a timeout); the server stops after ``--max-connections`` if given.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from ._api import Channel, connect_channel, create_channel_listener
from ._conn.memory import RegisteredBuffer
from ._proto.onesided import RemoteBuffer
from ._rdma.config import RdmaBackend, RdmaConfig
from ._rdma.poller import POLL_MODES

__all__ = [
    "PerfResult", "PerfLine", "Progress", "serve", "run_client", "format_table", "to_json", "write_plot",
    "DEFAULT_SIZES", "POLL_MODES",
]  # fmt: skip

DEFAULT_SIZES = [64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
MAX_MESSAGE = (16 << 20) + 4096
_COUNT = struct.Struct("!Q")


@dataclass
class PerfResult:
    """One size on one line: latencies in microseconds, bandwidth in MB/s (10**6 bytes)."""

    size: int
    lat_iterations: int = 0
    lat_p50_us: float = math.nan
    lat_p99_us: float = math.nan
    lat_p999_us: float = math.nan
    lat_mean_us: float = math.nan
    bw_messages: int = 0
    bw_mb_s: float = math.nan


@dataclass
class PerfLine:
    """One transport (and, for RDMA, poll mode)."""

    transport: str
    poll: str
    results: list[PerfResult] = field(default_factory=list)
    note: str = ""
    #: "send" (messages: round trip and stream), or one-sided "read" / "write" against memory the
    #: server exposes (latency: one operation; bandwidth: operations back to back)
    op: str = "send"

    @property
    def label(self) -> str:
        base = f"{self.transport}/{self.poll}" if self.transport == "rdma" else self.transport
        return base if self.op == "send" else f"{base} {self.op}"


def _percentile(values: Sequence[float], fraction: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))
    return ordered[index]


def _backend(poll: str) -> RdmaBackend:
    return RdmaBackend(RdmaConfig(poll=poll))


# -- server -------------------------------------------------------------------------------


async def _serve_one(channel: Channel) -> None:
    async with channel:
        try:
            request = json.loads(await channel.receive())
            test, size, count = request["test"], int(request["size"]), int(request["count"])
            if test == "lat":
                for _ in range(count):
                    await channel.send(await channel.receive())
            elif test == "bw":
                got = 0
                for _ in range(count):
                    got += len(await channel.receive())
                await channel.send(_COUNT.pack(got))
            elif test == "expose":
                with RegisteredBuffer(max(1, size)) as buf:
                    async with channel.expose(buf, read=True, write=True) as remote:
                        await channel.send(remote.to_bytes())
                        await channel.receive()  # the client is done
            else:
                return
        except (anyio.EndOfStream, anyio.BrokenResourceError, ValueError, KeyError):
            return


async def serve(host: str, port: int, *, max_connections: int | None = None,
                on_ready: Callable[[list[int]], None] | None = None) -> None:  # fmt: skip
    """Listen on ``port`` .. ``port + 2`` (one RDMA poll mode each; TCP on any) until cancelled,
    or until ``max_connections`` connections were served."""
    done = anyio.Event()
    served = 0

    async def handle(channel: Channel) -> None:
        nonlocal served
        await _serve_one(channel)
        served += 1
        if max_connections is not None and served >= max_connections:
            done.set()

    listeners: list[Any] = []
    try:
        for attempt in range(20):  # port 0: three consecutive free ports, the first one the system's pick
            try:
                first = port
                for i, mode in enumerate(POLL_MODES):
                    lst = await create_channel_listener(
                        host, first + i if first else 0, transport="auto", max_message_size=MAX_MESSAGE,
                        rdma_backend=_backend(mode),
                    )  # fmt: skip
                    listeners.append(lst)
                    if not first:
                        first = lst.port
                break
            except OSError:
                for lst in listeners:
                    await lst.aclose()
                listeners.clear()
                if port or attempt == 19:
                    raise
        if on_ready is not None:
            on_ready([lst.port for lst in listeners])
        async with anyio.create_task_group() as tg:
            for lst in listeners:
                tg.start_soon(lst.serve, handle)
            await done.wait()
            tg.cancel_scope.cancel()
    finally:
        for lst in listeners:
            await lst.aclose()


# -- client -------------------------------------------------------------------------------


async def _latency(channel: Channel, size: int, count: int, warmup: int) -> list[float]:
    payload = bytes(size)
    await channel.send(json.dumps({"test": "lat", "size": size, "count": count + warmup}).encode())
    samples: list[float] = []
    clock = time.perf_counter
    for i in range(count + warmup):
        start = clock()
        await channel.send(payload)
        reply = await channel.receive()
        elapsed = clock() - start
        if len(reply) != size:
            raise RuntimeError(f"the echo of a {size} B message came back with {len(reply)} B")
        if i >= warmup:
            samples.append(elapsed)
    return samples


async def _bandwidth(channel: Channel, size: int, count: int) -> float:
    payload = bytes(size)
    await channel.send(json.dumps({"test": "bw", "size": size, "count": count}).encode())
    start = time.perf_counter()
    for _ in range(count):
        await channel.send(payload)
    (got,) = _COUNT.unpack(await channel.receive())
    elapsed = time.perf_counter() - start
    if got != size * count:
        raise RuntimeError(f"the server received {got} of {size * count} bytes")
    return size * count / elapsed / 1e6


async def _one_sided(channel: Channel, op: str, size: int, lat_count: int, bw_count: int) -> tuple[list[float], float]:
    """One-sided ``op`` ("read"/"write") of ``size`` bytes against the server's exposed memory,
    between registered buffers: latency samples of single operations, then MB/s back to back."""
    await channel.send(json.dumps({"test": "expose", "size": size, "count": 0}).encode())
    remote = RemoteBuffer.from_bytes(await channel.receive())
    clock = time.perf_counter
    with RegisteredBuffer(size) as local:
        call = channel.read if op == "read" else channel.write
        samples: list[float] = []
        for _ in range(lat_count):
            start = clock()
            await call(remote, local)
            samples.append(clock() - start)
        start = clock()
        for _ in range(bw_count):
            await call(remote, local)
        mb_s = size * bw_count / (clock() - start) / 1e6
    await channel.send(b"done")
    return samples, mb_s


async def run_client(
    host: str,
    ports: Sequence[int],
    *,
    transports: Sequence[str] = ("rdma", "tcp"),
    polls: Sequence[str] = POLL_MODES,
    sizes: Sequence[int] = DEFAULT_SIZES,
    iterations: int = 1000,
    bw_bytes: int = 64 << 20,
    latency_bytes: int = 64 << 20,
    bw_messages: int = 20_000,
    timeout: float = 300.0,
    progress: Callable[[str, int, int], None] | None = None,
    ops: Sequence[str] = ("send",),
) -> list[PerfLine]:
    """Measure every (transport, poll mode, op) line over ``sizes``.  ``progress(label, done,
    total)`` is called after each step."""
    plan: list[tuple[str, str, str]] = []
    for op in ops:
        for transport in transports:
            for poll in polls if transport == "rdma" else ("-",):
                plan.append((transport, poll, op))
    total = len(plan) * len(sizes) * 2
    done = 0
    lines: list[PerfLine] = []
    for transport, poll, op in plan:
        line = PerfLine(transport, poll, op=op)
        lines.append(line)
        port = ports[POLL_MODES.index(poll)] if transport == "rdma" else ports[0]
        backend = _backend(poll if transport == "rdma" else "event")

        async def open_channel() -> Channel:
            return await connect_channel(host, port, transport=transport, max_message_size=MAX_MESSAGE,
                                         rdma_backend=backend)  # fmt: skip

        for size in sizes:
            result = PerfResult(size)
            line.results.append(result)
            lat_count = max(10, min(iterations, latency_bytes // size))
            bw_count = max(4, min(bw_messages, bw_bytes // size))
            if op != "send":
                try:
                    with anyio.fail_after(timeout):
                        async with await open_channel() as channel:
                            samples, mb_s = await _one_sided(channel, op, size, lat_count, bw_count)
                    result.lat_iterations = len(samples)
                    result.lat_p50_us = _percentile(samples, 0.50) * 1e6
                    result.lat_p99_us = _percentile(samples, 0.99) * 1e6
                    result.lat_p999_us = _percentile(samples, 0.999) * 1e6
                    result.lat_mean_us = sum(samples) / len(samples) * 1e6
                    result.bw_mb_s, result.bw_messages = mb_s, bw_count
                except Exception as exc:
                    line.note = f"{type(exc).__name__}: {exc}"
                done += 2
                if progress:
                    progress(line.label, done, total)
                continue
            try:
                with anyio.fail_after(timeout):
                    async with await open_channel() as channel:
                        samples = await _latency(channel, size, lat_count, warmup=min(50, lat_count // 10 + 1))
                result.lat_iterations = len(samples)
                result.lat_p50_us = _percentile(samples, 0.50) * 1e6
                result.lat_p99_us = _percentile(samples, 0.99) * 1e6
                result.lat_p999_us = _percentile(samples, 0.999) * 1e6
                result.lat_mean_us = sum(samples) / len(samples) * 1e6
            except Exception as exc:  # one line failing (e.g. no RDMA) must not lose the others
                line.note = f"{type(exc).__name__}: {exc}"
            done += 1
            if progress:
                progress(line.label, done, total)
            try:
                with anyio.fail_after(timeout):
                    async with await open_channel() as channel:
                        result.bw_mb_s = await _bandwidth(channel, size, bw_count)
                        result.bw_messages = bw_count
            except Exception as exc:
                line.note = f"{type(exc).__name__}: {exc}"
            done += 1
            if progress:
                progress(line.label, done, total)
    return lines


# -- output -------------------------------------------------------------------------------


def _size_text(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def format_table(lines: Sequence[PerfLine]) -> str:
    """A plain-text table: one block per line (transport/mode), one row per size."""
    out: list[str] = []
    header = f"{'size':>9} {'p50 us':>10} {'p99 us':>10} {'p99.9 us':>10} {'MB/s':>10}"

    def cell(v: float, width: int = 10) -> str:
        return f"{'-':>{width}}" if math.isnan(v) else f"{v:>{width}.1f}"

    for line in lines:
        out.append(f"== {line.label}" + (f"  ({line.note})" if line.note else ""))
        out.append(header)
        for r in line.results:
            out.append(f"{_size_text(r.size):>9} {cell(r.lat_p50_us)} {cell(r.lat_p99_us)} {cell(r.lat_p999_us)} "
                       f"{cell(r.bw_mb_s)}")  # fmt: skip
    tcp_of = {line.op: line for line in lines if line.transport == "tcp"}
    if tcp_of:
        out.append("== ratios to tcp (latency p50: lower is better; bandwidth: higher is better)")
        for line in lines:
            tcp = tcp_of.get(line.op)
            if tcp is None or line is tcp:
                continue
            parts = []
            for r, t in zip(line.results, tcp.results):
                lat = r.lat_p50_us / t.lat_p50_us if t.lat_p50_us else math.nan
                bw = r.bw_mb_s / t.bw_mb_s if t.bw_mb_s else math.nan
                parts.append(f"{_size_text(r.size)}: lat {lat:.2f}x bw {bw:.2f}x")
            out.append(f"{line.label:>14}: " + "; ".join(parts))
    return "\n".join(out)


def to_json(lines: Sequence[PerfLine], meta: dict[str, Any]) -> str:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v

    data = {
        "meta": meta,
        "lines": [
            {"transport": ln.transport, "poll": ln.poll, "op": ln.op, "note": ln.note,
             "results": [{k: clean(v) for k, v in asdict(r).items()} for r in ln.results]}
            for ln in lines
        ],
    }  # fmt: skip
    return json.dumps(data, indent=2)


def write_plot(lines: Sequence[PerfLine], path: str, title: str = "aiordma perf") -> None:
    """Latency (p50) and bandwidth against size, one line per transport/mode (needs matplotlib)."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("--plot needs matplotlib: pip install 'aiordma[perf]'") from exc
    fig, (ax_lat, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for line in lines:
        sizes = [r.size for r in line.results]
        ax_lat.plot(sizes, [r.lat_p50_us for r in line.results], marker="o", label=line.label)
        ax_bw.plot(sizes, [r.bw_mb_s for r in line.results], marker="o", label=line.label)
    for ax, ylabel in ((ax_lat, "round trip p50 (us)"), (ax_bw, "bandwidth (MB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_lat.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Progress:
    """A progress bar on stderr: rich's when installed, else one rewritten line."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total = total
        self.enabled = enabled and sys.stderr.isatty()
        self._rich: Any = None
        self._task: Any = None
        if not self.enabled:
            return
        try:
            from rich.progress import Progress as RichProgress  # type: ignore[import-not-found, unused-ignore]

            self._rich = RichProgress(transient=True)
            self._rich.start()
            self._task = self._rich.add_task("aiordma perf", total=total)
        except ImportError:
            self._rich = None

    def update(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=done, description=f"aiordma perf {label}")
            return
        width = 30
        filled = int(width * done / max(1, total))
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<14}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.stop()
        else:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()
