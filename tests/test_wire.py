"""The two-host bed's wire relay, on the host: two fake qemu NICs (clients of its unix sockets,
speaking qemu's stream framing) and the guests' fault requests through the control directory."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.wire import WireRelay, request


def nic(relay: WireRelay, side: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(relay.paths[side]))
    s.settimeout(5)
    return s


def send_frame(s: socket.socket, frame: bytes) -> None:
    s.sendall(struct.pack(">I", len(frame)) + frame)


def recv_frame(s: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            assert chunk, "closed"
            buf += chunk
        return buf

    (n,) = struct.unpack(">I", exactly(4))
    return exactly(n)


def connected(relay: WireRelay, *sides: str, times: int = 1) -> None:
    """Wait until each side's NIC has connected ``times`` times."""
    deadline = time.monotonic() + 5
    while not all(relay.log.count(f"{s} connected") >= times for s in sides):
        assert time.monotonic() < deadline, relay.log
        time.sleep(0.01)


@contextlib.contextmanager
def wired(tmp_path: Path, **kwargs: Any) -> Iterator[tuple[WireRelay, socket.socket, socket.socket]]:
    """A relay with both fake NICs connected; closes them and the relay afterwards."""
    with WireRelay(tmp_path, **kwargs) as relay:
        a, b = nic(relay, "a"), nic(relay, "b")
        connected(relay, "a", "b")
        try:
            yield relay, a, b
        finally:
            a.close()
            b.close()


def test_frames_cross_both_ways_whole_and_in_order(tmp_path: Path) -> None:
    with wired(tmp_path) as (relay, a, b):
        frames = [bytes([i]) * (i * 97 % 9000 + 1) for i in range(50)]
        for f in frames:
            send_frame(a, f)
        assert [recv_frame(b) for _ in frames] == frames
        send_frame(b, b"back")
        assert recv_frame(a) == b"back"
        assert relay.forwarded == {"a": 50, "b": 1}


def test_an_outage_drops_frames_then_ends_by_itself(tmp_path: Path) -> None:
    with wired(tmp_path) as (relay, a, b):
        relay.drop(True, seconds=0.3)
        send_frame(a, b"lost")
        send_frame(b, b"lost too")
        time.sleep(0.4)
        send_frame(a, b"after")
        assert recv_frame(b) == b"after"  # (not "lost": it was dropped)
        assert relay.dropped == {"a": 1, "b": 1}


def test_a_guest_asks_for_faults_through_the_control_directory(tmp_path: Path) -> None:
    kills: list[tuple[str, bool]] = []
    killed_at: list[float] = []

    def kill(side: str, again: bool) -> None:
        killed_at.append(time.monotonic())
        kills.append((side, again))

    with wired(tmp_path, kill=kill) as (relay, a, b):
        ctl = str(relay.control)
        t0 = time.monotonic()
        answer = request("drop", seconds=0.2, control=ctl, timeout=10)
        assert answer["ok"] and answer["host_seconds"] >= 0.2 and time.monotonic() - t0 >= 0.2
        request("drop", on=True, control=ctl, timeout=10)
        assert relay.dropping()
        request("drop", on=False, control=ctl, timeout=10)
        assert not relay.dropping()
        asked = time.monotonic()
        answer = request("kill", side="a", restart=True, control=ctl, timeout=10)
        assert kills == [("a", True)]
        # the fault tests measure from sent_at: the request is visible then, and the fault after
        assert asked <= answer["sent_at"] <= killed_at[0] <= time.monotonic()
        with pytest.raises(RuntimeError, match="cannot kill 'c'"):
            request("kill", side="c", control=ctl, timeout=10)
        with pytest.raises(RuntimeError, match="unknown op"):
            request("explode", control=ctl, timeout=10)
        send_frame(a, b"x")
        recv_frame(b)
        assert request("stats", control=ctl, timeout=10)["forwarded"]["a"] == 1


def test_a_guest_booted_again_reconnects_and_a_bad_length_closes_only_that_nic(tmp_path: Path) -> None:
    with wired(tmp_path) as (relay, a, b):
        a.sendall(struct.pack(">I", 1 << 30))  # (no qemu sends this)
        assert a.recv(1) == b""
        a2 = nic(relay, "a")  # the guest's qemu again
        connected(relay, "a", times=2)
        send_frame(b, b"hello again")
        assert recv_frame(a2) == b"hello again"
        a2.close()


def test_outside_the_bed_a_request_says_so() -> None:
    import os

    if os.environ.get("AIORDMA_WIRE_CONTROL"):
        pytest.skip("(inside the bed)")
    with pytest.raises(LookupError, match="two-host bed"):
        request("stats")


def test_closing_the_relay_stops_its_threads(tmp_path: Path) -> None:
    before = threading.active_count()
    relay = WireRelay(tmp_path)
    a = nic(relay, "a")
    connected(relay, "a")
    relay.close()
    assert a.recv(1) == b""
    a.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > before:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.02)


def test_the_wire_nic_gets_a_qdisc_without_aqm_drops_unless_netem_is_asked_for() -> None:
    """rxe's READ responses are a standing queue: fq_codel (the default) would drop from it, and
    NETEM with no spec must put that lossless qdisc back, not the default (docs/testing.md)."""
    from tools._guest import WIRE_QDISC, wire_qdisc_argv

    assert wire_qdisc_argv("eth0") == ["tc", "qdisc", "replace", "dev", "eth0", "root", *WIRE_QDISC]
    assert wire_qdisc_argv("eth0", " ") == wire_qdisc_argv("eth0")
    assert WIRE_QDISC[0] == "fq" and "codel" not in " ".join(WIRE_QDISC)
    assert wire_qdisc_argv("eth0", "loss 1%") == ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "loss", "1%"]
