"""What a process running aiordma can show of itself: ``aiordma.stats()``, Prometheus, the
stats endpoint that ``aiordma top`` reads.

* :func:`stats` -- the counters now (:class:`~aiordma._conn.stats.Stats`): connections by
  transport, fallbacks by reason, totals, registered memory, and each open RDMA device with its
  RNR and retry counters (sysfs).
* :class:`Collector` -- the same for ``prometheus_client`` (``pip install aiordma[metrics]``):
  ``prometheus_client.REGISTRY.register(aiordma.metrics.Collector())``;
  :func:`prometheus_text` renders it in Prometheus's text format.
* :class:`StatsEndpoint` (:func:`serve_stats`) -- a unix socket, owned by the caller, that
  answers each connection with one snapshot (JSON, or Prometheus text when asked) from a
  thread of its own: it answers also while the event loop is busy, and it only reads.

Wire format of the endpoint: the client may send one line, ``json`` (the default) or
``prometheus``, and reads the answer until the socket closes.  The socket is created ``0600``
in a directory only this user may enter (``default_stats_dir()``), as ``<pid>.sock``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import socket
import tempfile
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any, Final

from ._conn.stats import SUMMED, Stats, stats as _core_stats

__all__ = ["stats", "Collector", "prometheus_text", "StatsEndpoint", "serve_stats", "default_stats_dir",
           "stats_socket_path", "read_stats"]  # fmt: skip

#: how long the endpoint waits for a client's request line
REQUEST_TIMEOUT: Final = 1.0
MAX_REQUEST: Final = 64


def stats(connections: bool = False) -> Stats:
    """The process's counters now (see :class:`aiordma.Stats`); ``connections=True`` adds each
    open connection's :class:`aiordma.ConnectionStats`.  Cheap: nothing is counted per message
    beyond integer additions, and this sums them."""
    from ._rdma.device import open_devices
    from ._rdma.discovery import retry_counters

    devices: dict[str, dict[str, int]] = {}
    for device in open_devices():
        entry = devices.setdefault(device.name, {"connections": 0})
        entry["connections"] += device.refs
        if len(entry) == 1:
            entry.update(retry_counters(device.name))
    return dataclasses.replace(_core_stats(connections), devices=devices)


# -- Prometheus ---------------------------------------------------------------------------------

#: the summed counters' metric names and help
_COUNTERS: Final = {
    "bytes_sent": ("aiordma_sent_bytes", "Payload bytes sent (closed and open connections)"),
    "bytes_received": ("aiordma_received_bytes", "Payload bytes received (closed and open connections)"),
    "messages_sent": ("aiordma_sent_messages", "Messages sent on message channels"),
    "messages_received": ("aiordma_received_messages", "Messages received on message channels"),
    "rendezvous_sent": ("aiordma_rendezvous_sent", "Messages or stream pieces the peer READ from us"),
    "rendezvous_received": ("aiordma_rendezvous_received", "Messages or stream pieces we READ from the peer"),
    "reads": ("aiordma_rdma_reads", "One-sided RDMA READs done (rendezvous included)"),
    "writes": ("aiordma_rdma_writes", "One-sided RDMA WRITEs done"),
    "read_bytes": ("aiordma_rdma_read_bytes", "Bytes moved by one-sided READs"),
    "written_bytes": ("aiordma_rdma_written_bytes", "Bytes moved by one-sided WRITEs"),
    "credit_stalls": ("aiordma_credit_stalls", "Times a sender waited for the peer's credits (RDMA)"),
}
assert set(_COUNTERS) == set(SUMMED)


def _families(snap: Stats) -> Iterator[Any]:
    try:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError("Prometheus metrics need prometheus_client: pip install 'aiordma[metrics]'") from exc
    open_ = GaugeMetricFamily("aiordma_connections_open", "Connections open now", labels=["transport"])
    opened = CounterMetricFamily("aiordma_connections_opened", "Connections that completed their handshake",
                                 labels=["transport"])  # fmt: skip
    for transport in ("tcp", "rdma"):
        open_.add_metric([transport], snap.open.get(transport, 0))
        opened.add_metric([transport], snap.opened.get(transport, 0))
    yield open_
    yield opened
    fallbacks = CounterMetricFamily("aiordma_fallbacks", "Connections that fell back to TCP, by reason", labels=["reason"])
    for reason, n in sorted(snap.fallbacks.items()):
        fallbacks.add_metric([reason], n)
    yield fallbacks
    failures = CounterMetricFamily("aiordma_connection_failures", "Connections that broke, by cause", labels=["cause"])
    for what, n in sorted(snap.failures.items()):
        failures.add_metric([what], n)
    yield failures
    for key, (name, text) in _COUNTERS.items():
        yield CounterMetricFamily(name, text, value=snap.totals.get(key, 0))
    mem = snap.memory
    if mem is not None:
        yield GaugeMetricFamily("aiordma_pinned_bytes", "Registered (pinned) bytes now", value=mem.pinned_bytes)
        yield GaugeMetricFamily("aiordma_registrations", "Memory registrations now", value=mem.registrations)
        yield CounterMetricFamily("aiordma_registration_cache_hits", "Zero-copy calls that found their buffer registered",
                                  value=mem.cache_hits)  # fmt: skip
        yield CounterMetricFamily("aiordma_registration_cache_misses", "Zero-copy calls that registered their buffer",
                                  value=mem.cache_misses)  # fmt: skip
        yield CounterMetricFamily("aiordma_staged_bytes", "Bytes copied through staging regions", value=mem.staged_bytes)
    users = GaugeMetricFamily("aiordma_device_users", "Users of each open RDMA device", labels=["device"])
    hw = CounterMetricFamily("aiordma_device_retry_events", "The device's RNR and retry counters (sysfs; whole device)",
                             labels=["device", "counter"])  # fmt: skip
    for device, counts in sorted(snap.devices.items()):
        for counter, n in sorted(counts.items()):
            if counter == "connections":
                users.add_metric([device], n)
            else:
                hw.add_metric([device, counter], n)
    yield users
    yield hw


class Collector:
    """A ``prometheus_client`` collector of this process's counters::

        prometheus_client.REGISTRY.register(aiordma.metrics.Collector())

    Each scrape takes one :func:`stats` snapshot (no per-connection series: their number grows
    with the peers; ``aiordma top`` shows connections)."""

    def collect(self) -> Iterator[Any]:
        yield from _families(stats())

    def describe(self) -> list[Any]:
        return []  # (unchecked: the families are made at each scrape)


def prometheus_text() -> str:
    """This process's counters in Prometheus's text exposition format (needs ``prometheus_client``)."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
    except ImportError as exc:
        raise ImportError("Prometheus metrics need prometheus_client: pip install 'aiordma[metrics]'") from exc
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry).decode()


# -- the stats endpoint -----------------------------------------------------------------------


def default_stats_dir() -> str:
    """Where stats sockets live: ``$XDG_RUNTIME_DIR/aiordma`` or ``<tmp>/aiordma-<uid>`` (0700)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "aiordma") if runtime else os.path.join(tempfile.gettempdir(), f"aiordma-{os.getuid()}")
    return base


def stats_socket_path(pid: int | None = None) -> str:
    """The default socket path of process ``pid`` (this one when None)."""
    return os.path.join(default_stats_dir(), f"{os.getpid() if pid is None else pid}.sock")


def _snapshot(kind: str) -> bytes:
    if kind == "prometheus":
        try:
            return prometheus_text().encode()
        except ImportError as exc:
            return f"# error: {exc}\n".encode()
    snap = stats(connections=True).as_dict()
    snap["pid"] = os.getpid()
    return json.dumps(snap).encode()


class StatsEndpoint:
    """A unix socket that answers each connection with this process's counters (one snapshot).

    Owned by its creator: :meth:`close` (or the ``with`` block's end) stops the thread, closes
    the socket and removes its file.  It runs in a thread of its own and only reads the
    counters: it answers while the event loop is busy, and never touches a connection."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            directory = default_stats_dir()
            os.makedirs(directory, mode=0o700, exist_ok=True)
            st = os.stat(directory)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"{directory} must belong to this user with mode 0700 (it holds stats sockets)")
            path = stats_socket_path()
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            if os.path.exists(path) and not _answers(path):
                os.unlink(path)  # (a socket left by a process that died)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)
            try:
                sock.bind(path)
            finally:
                os.umask(old)
            sock.listen(8)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._stop_r, self._stop_w = os.pipe()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="aiordma-stats", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        while True:
            ready, _, _ = select.select([sock.fileno(), self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with conn:
                try:
                    conn.settimeout(REQUEST_TIMEOUT)
                    kind = "json"
                    try:
                        request = conn.recv(MAX_REQUEST)
                        kind = request.decode("ascii", "replace").strip().lower() or "json"
                    except (socket.timeout, OSError):
                        pass
                    conn.sendall(_snapshot(kind))
                except OSError:
                    continue  # (the client left: the next one)

    def close(self) -> None:
        """Stop answering, close the socket and remove its file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        os.write(self._stop_w, b"x")
        self._thread.join()
        os.close(self._stop_r)
        os.close(self._stop_w)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> StatsEndpoint:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def serve_stats(path: str | None = None) -> StatsEndpoint:
    """Answer ``aiordma top`` (and anyone who may open ``path``) with this process's counters
    until the returned endpoint is closed; ``path`` defaults to ``stats_socket_path()``."""
    return StatsEndpoint(path)


def _answers(path: str) -> bool:
    try:
        read_stats(path, timeout=0.5)
        return True
    except (OSError, ValueError):
        return False


def read_stats(path: str, *, timeout: float = 2.0) -> dict[str, Any]:
    """One snapshot from the endpoint at ``path`` (what ``aiordma top`` shows)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(b"json\n")
        parts = []
        while True:
            part = sock.recv(1 << 16)
            if not part:
                break
            parts.append(part)
    out: dict[str, Any] = json.loads(b"".join(parts))
    return out
