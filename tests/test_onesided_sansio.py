"""The one-sided state machine on its own (no I/O): two OneSided objects talk through their
payloads; a hostile peer's frames are refused with RemoteProtocolError and change nothing
they must not."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma._errors import RemoteProtocolError
from aiordma._proto.onesided import (
    READ,
    WRITE,
    DescriptorRevokedError,
    Exposure,
    ForeignDescriptorError,
    OneSided,
    RemoteBoundsError,
    RemoteBuffer,
)


def _pair() -> tuple[OneSided, OneSided]:
    return OneSided(1 << 16, 1 << 16), OneSided(1 << 16, 1 << 16)


def _deliver(to: OneSided, payloads: list[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for p in payloads:
        out += to.receive(p)
    return out


def test_a_read_and_a_write_served_over_frames() -> None:
    exposer, caller = _pair()
    memory = bytearray(b"0123456789")
    exp, announce = exposer.expose(memoryview(memory), READ | WRITE)
    _deliver(caller, [announce])
    rec = caller.check(exp.descriptor, 2, 3, READ)
    caller.begin(rec)
    op, req = caller.read_request(rec, 2, 3)
    _deliver(caller, _deliver(exposer, [req]))
    assert caller.take_result(op) == b"234"
    op, req = caller.write_request(rec, 0, b"ab")
    _deliver(caller, _deliver(exposer, [req]))
    assert caller.take_result(op) == b""
    assert memory == bytearray(b"ab23456789") and list(exp.notices) == [(0, 2)]
    assert caller.finish(rec) is None


def test_revocation_fails_waiting_operations_and_confirms_when_idle() -> None:
    exposer, caller = _pair()
    exp, announce = exposer.expose(memoryview(bytearray(100)), READ)
    _deliver(caller, [announce])
    rec = caller.check(exp.descriptor, 0, 10, READ)
    caller.begin(rec)
    op, req = caller.read_request(rec, 0, 10)
    revoke = exposer.revoke(exp)
    assert _deliver(caller, [revoke]) == []  # an operation is in flight: no REVOKED yet
    with pytest.raises(DescriptorRevokedError):
        caller.take_result(op)  # failed at once
    revoked = caller.finish(rec)
    assert revoked is not None
    # the exposer answers the late request REVOKED (it already ended), and takes the late REVOKED
    exposer.end(exp)
    answer = _deliver(exposer, [req])
    assert _deliver(caller, answer) == []  # dropped: nobody waits for it
    assert _deliver(exposer, [revoked]) == []
    with pytest.raises(DescriptorRevokedError):
        caller.check(exp.descriptor, 0, 1, READ)


def test_the_caller_checks_scope_bounds_and_access() -> None:
    exposer, caller = _pair()
    exp, announce = exposer.expose(memoryview(bytearray(100)), READ)
    other, _ = OneSided(1, 1).expose(memoryview(bytearray(100)), READ)
    _deliver(caller, [announce])
    with pytest.raises(ForeignDescriptorError):
        caller.check(other.descriptor, 0, 1, READ)
    with pytest.raises(RemoteBoundsError):
        caller.check(exp.descriptor, 99, 2, READ)
    with pytest.raises(PermissionError):
        caller.check(exp.descriptor, 0, 1, WRITE)
    d = exp.descriptor
    assert RemoteBuffer.from_bytes(d.to_bytes()) == d
    with pytest.raises(ValueError):
        RemoteBuffer.from_bytes(d.to_bytes()[:-1])


def test_hostile_frames_are_protocol_errors() -> None:
    exposer, caller = _pair()
    exp, announce = exposer.expose(memoryview(bytearray(100)), READ | WRITE)
    _deliver(caller, [announce])
    bad = [
        b"",  # empty
        b"\x63",  # unknown op
        bytes([5]) + struct.pack("!IB", 77, 0) + b"x",  # an answer to nothing
        bytes([3]) + struct.pack("!I", exp.id),  # REVOKED of an exposure not being revoked
        bytes([8]) + struct.pack("!IQQ", exp.id, 90, 20),  # WRITTEN outside the exposure
        bytes([4]) + struct.pack("!IIQQI", 1, exp.id, exp.key, 0, 1 << 20),  # READ larger than a frame
    ]
    for payload in bad:
        with pytest.raises(RemoteProtocolError):
            exposer.receive(payload)
    # EXPOSE with another token than the peer's first
    other, announce2 = OneSided(1, 1, token=caller.peer_token ^ 1).expose(memoryview(bytearray(8)), READ)  # type: ignore[operator]
    with pytest.raises(RemoteProtocolError):
        caller.receive(announce2)
    # a READ_DATA of the wrong length for a pending READ
    rec = caller.check(exp.descriptor, 0, 10, READ)
    op, _req = caller.read_request(rec, 0, 10)
    with pytest.raises(RemoteProtocolError):
        caller.receive(bytes([5]) + struct.pack("!IB", op, 0) + b"short")
    assert exp.state == Exposure.LIVE


@given(st.binary(max_size=80))
def test_random_frames_are_refused_cleanly(payload: bytes) -> None:
    exposer, caller = _pair()
    memory = bytearray(64)
    exp, announce = exposer.expose(memoryview(memory), READ)
    _deliver(caller, [announce])
    for side in (exposer, caller):
        try:
            side.receive(payload)
        except RemoteProtocolError:
            pass
    assert memory == bytearray(64)  # read-only exposure: nothing could write into it
