"""The two-host bed's wire: a relay between the two guests' NICs, with faults on command.

Theory of operation
-------------------
Each guest's qemu has one ``-netdev stream`` NIC connected, as a client, to a unix socket of
this relay (no address on the host).  qemu's stream backend frames every Ethernet frame as a
4-byte big-endian length and the frame; the relay reads whole frames from one side and writes
them to the other.  Because the relay sits *between* the NICs, a fault here is what a switch
between two hosts would do: the guests' carriers stay up, the packets just stop.

* **outage** (``drop``): frames are read and thrown away in both directions, for a given time
  (or until ``drop`` off).  Nothing tells either guest; RC retries and TCP retransmissions see
  silence.
* **kill**: a guest's qemu is killed with SIGKILL (its kernel sends nothing more, not even a
  FIN); optionally the guest is booted again with the same command.  The relay accepts the
  new qemu's connection on the same socket.

The guests ask for faults through a **control directory** (shared writable with both guests,
``$AIORDMA_WIRE_CONTROL``): a request is a JSON file ``req-<id>.json`` (written under a
temporary name, then renamed); the host answers with ``done-<id>.json`` once the fault is in
place (for an outage with ``seconds``: once it is over).  :func:`request` is the guest's side.
Packet loss and reordering are not here: they are ``tc netem`` on a guest's own NIC.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

__all__ = ["WireRelay", "request", "CONTROL_ENV"]

#: The environment variable naming the control directory inside the guests.
CONTROL_ENV: Final = "AIORDMA_WIRE_CONTROL"
_HEADER = struct.Struct(">I")
#: qemu never sends a frame larger than this (64 KiB plus headers); a larger length is a bug.
_MAX_FRAME = 1 << 17
_POLL = 0.02

Killer = Callable[[str, bool], None]


class WireRelay:
    """Forwards frames between sides ``"a"`` and ``"b"`` (unix sockets ``a.sock``, ``b.sock``
    in ``directory``) and serves fault requests from ``directory / "control"``.

    ``kill(side, restart)`` is called for a ``kill`` request (the runner owns the guests).
    Use as a context manager; :meth:`close` stops every thread and closes every socket."""

    def __init__(self, directory: Path, kill: Killer | None = None) -> None:
        self.directory = directory
        self.control = directory / "control"
        self.control.mkdir(parents=True, exist_ok=True)
        self.control.chmod(0o777)
        self.paths = {side: directory / f"{side}.sock" for side in "ab"}
        self._kill = kill
        self._lock = threading.Lock()
        self._conns: dict[str, socket.socket] = {}
        self._drop_until = 0.0
        self._dropping = False
        self._closed = threading.Event()
        #: frames forwarded / dropped, per direction ("a" = from a to b)
        self.forwarded = {"a": 0, "b": 0}
        self.dropped = {"a": 0, "b": 0}
        self.log: list[str] = []
        self._listeners: dict[str, socket.socket] = {}
        for side, path in self.paths.items():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(path))
            s.listen(2)
            s.settimeout(_POLL * 5)
            self._listeners[side] = s
        self._threads = [threading.Thread(target=self._accept, args=(side,), daemon=True, name=f"wire-accept-{side}")
                         for side in "ab"]  # fmt: skip
        self._threads.append(threading.Thread(target=self._serve_control, daemon=True, name="wire-control"))
        for t in self._threads:
            t.start()

    # -- faults ------------------------------------------------------------

    def drop(self, on: bool, seconds: float | None = None) -> None:
        """Start (``on``) or end an outage; with ``seconds``, it ends by itself."""
        with self._lock:
            self._dropping = on and seconds is None
            self._drop_until = time.monotonic() + seconds if on and seconds is not None else 0.0

    def dropping(self) -> bool:
        with self._lock:
            return self._dropping or time.monotonic() < self._drop_until

    # -- frames ------------------------------------------------------------

    def _accept(self, side: str) -> None:
        listener = self._listeners[side]
        while not self._closed.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            with self._lock:
                old = self._conns.pop(side, None)
                self._conns[side] = conn
            if old is not None:
                old.close()
            self.log.append(f"{side} connected")
            threading.Thread(target=self._forward, args=(side, conn), daemon=True, name=f"wire-{side}").start()

    def _forward(self, side: str, conn: socket.socket) -> None:
        other = "b" if side == "a" else "a"
        try:
            while True:
                header = _recv_exactly(conn, 4)
                if header is None:
                    break
                (n,) = _HEADER.unpack(header)
                if n > _MAX_FRAME:
                    self.log.append(f"{side}: frame of {n} bytes: closed")
                    break
                frame = _recv_exactly(conn, n)
                if frame is None:
                    break
                if self.dropping():
                    self.dropped[side] += 1
                    continue
                with self._lock:
                    dst = self._conns.get(other)
                if dst is None:
                    self.dropped[side] += 1
                    continue
                # counted before it leaves: whoever receives it may ask for the count at once
                self.forwarded[side] += 1
                try:
                    dst.sendall(header + frame)
                except OSError:
                    self.forwarded[side] -= 1
                    self.dropped[side] += 1  # the other side's qemu went away
        except OSError:
            pass
        finally:
            with self._lock:
                if self._conns.get(side) is conn:
                    del self._conns[side]
            conn.close()
            self.log.append(f"{side} disconnected")

    # -- control -----------------------------------------------------------

    def _serve_control(self) -> None:
        while not self._closed.wait(_POLL):
            for req in sorted(self.control.glob("req-*.json")):
                try:
                    spec = json.loads(req.read_text())
                    req.unlink()
                except (OSError, ValueError):
                    continue  # (not complete yet: renamed into place, so only a race on unlink)
                rid = req.name[len("req-") : -len(".json")]
                threading.Thread(target=self._handle, args=(rid, spec), daemon=True, name="wire-req").start()

    def _handle(self, rid: str, spec: dict[str, Any]) -> None:
        t0 = time.monotonic()
        answer: dict[str, Any] = {"ok": True}
        try:
            op = spec.get("op")
            if op == "drop":
                seconds = spec.get("seconds")
                self.drop(bool(spec.get("on", True)), None if seconds is None else float(seconds))
                if seconds is not None:
                    time.sleep(float(seconds))
            elif op == "kill":
                side = str(spec.get("side"))
                if side not in ("a", "b") or self._kill is None:
                    raise ValueError(f"cannot kill {side!r}")
                self._kill(side, bool(spec.get("restart", False)))
            elif op == "stats":
                answer.update(forwarded=dict(self.forwarded), dropped=dict(self.dropped))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # (answered to the guest that asked)
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        answer["host_seconds"] = time.monotonic() - t0
        self.log.append(f"request {spec}: {answer}")
        _write_atomically(self.control / f"done-{rid}.json", json.dumps(answer))

    def close(self) -> None:
        self._closed.set()
        for s in self._listeners.values():
            s.close()
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()
        for t in self._threads:
            t.join(2)

    def __enter__(self) -> WireRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def request(op: str, *, timeout: float = 300.0, control: str | None = None, **args: Any) -> dict[str, Any]:
    """From inside a guest of the bed: ask the host's relay for ``op`` (``"drop"`` with ``on``
    or ``seconds``; ``"kill"`` with ``side`` and ``restart``; ``"stats"``) and wait for its answer.
    The answer's ``"sent_at"`` is this guest's ``time.monotonic()`` once the request was in the
    control directory: the fault cannot have started before it (the host only then can see the
    request), so a delay measured from it is an upper bound -- unlike one from the answer,
    which comes back through the guest's slow shared directory.
    Raises ``RuntimeError`` if it failed, ``TimeoutError`` without an answer in ``timeout`` s,
    ``LookupError`` outside the bed."""
    where = control or os.environ.get(CONTROL_ENV)
    if not where:
        raise LookupError(f"not in the two-host bed (${CONTROL_ENV} is not set)")
    directory = Path(where)
    rid = uuid.uuid4().hex
    _write_atomically(directory / f"req-{rid}.json", json.dumps({"op": op, **args}))
    sent_at = time.monotonic()  # (the rename returned: 9p renames on the host before it answers)
    done = directory / f"done-{rid}.json"
    deadline = time.monotonic() + timeout
    while True:
        try:
            answer: dict[str, Any] = json.loads(done.read_text())
            done.unlink()
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the wire's host did not answer {op!r} in {timeout:.0f} s") from None
            time.sleep(_POLL / 2)
    if not answer.get("ok"):
        raise RuntimeError(f"the wire's host refused {op!r}: {answer.get('error')}")
    answer["sent_at"] = sent_at
    return answer
