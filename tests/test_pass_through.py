"""A byte stream on TCP passes through after the handshake when both ends offer it (issue 33, item 2).

Both HELLOs carry ``CAP_PASS_THROUGH`` and the client SELECTs TCP on a byte stream: from the
byte after the SELECT on, the data flows unframed, and the front ends hand the TCP connection
to the user's protocol (asyncio's transport calls it, as ``loop.create_connection`` would).
These tests hold the sans-IO part: when it happens, that it never happens otherwise, and that the
first data bytes read along with the SELECT are kept for the user, not parsed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma import LocalProtocolError
from aiordma._proto.framing import CAP_PASS_THROUGH, CAP_RDMA, FrameType, Hello, encode_hello, frame
from aiordma._proto.protocol import MAGIC, Connection, HelloReceived, Mode, TransportSelected
from aiordma._proto.states import Role, State


def handshake(mode: Mode, client_caps: int, server_caps: int, after_select: bytes = b"",
              transport: str = "tcp") -> tuple[Connection, Connection, bytes]:  # fmt: skip
    """Run the handshake; returns both ends and what the server kept unparsed after the SELECT."""
    c = Connection(Role.CLIENT, mode, now=0.0)
    s = Connection(Role.SERVER, mode, now=0.0)
    params = b"p" * 8
    s.receive_data(c.send_hello(capabilities=client_caps, rdma_params=params if client_caps & CAP_RDMA else None))
    events = c.receive_data(s.send_hello(capabilities=server_caps, rdma_params=params if server_caps & CAP_RDMA else None))
    assert isinstance(events[0], HelloReceived)
    events = s.receive_data(c.select(transport) + after_select)  # type: ignore[arg-type]
    assert events == [TransportSelected(transport, "")]  # type: ignore[arg-type]
    return c, s, s.take_passed() if s.passed_through else b""


@given(after=st.binary(max_size=200))
@settings(max_examples=50, deadline=None)
def test_both_offer_it_on_a_byte_stream_over_tcp_and_the_bytes_after_the_select_are_the_datas(after: bytes) -> None:
    """Whatever follows the SELECT in the same read -- even bytes that look like frames -- is
    the data's start, handed over as it is."""
    c, s, kept = handshake(Mode.STREAM, CAP_PASS_THROUGH, CAP_PASS_THROUGH, after)
    assert c.passed_through and s.passed_through
    assert c.state is s.state is State.PASSED_THROUGH
    assert kept == after
    assert c.take_passed() == b""


def test_data_read_after_passing_through_is_kept_unparsed_until_taken() -> None:
    _, s, _ = handshake(Mode.STREAM, CAP_PASS_THROUGH, CAP_PASS_THROUGH)
    framed_looking = MAGIC + frame(FrameType.CLOSE, b"\x00\x01bye")
    assert s.receive_data(framed_looking) == []
    view = s.get_buffer(-1)
    view[:3] = b"abc"
    del view
    assert s.buffer_updated(3) == []
    assert s.receive_eof() == []  # (the data's end: the owner tells the user)
    assert s.take_passed() == framed_looking + b"abc"
    assert s.take_passed() == b""


def test_nothing_is_framed_once_passed_through() -> None:
    c, s, _ = handshake(Mode.STREAM, CAP_PASS_THROUGH, CAP_PASS_THROUGH)
    for conn in (c, s):
        with pytest.raises(LocalProtocolError):
            conn.send_data(b"x")
        with pytest.raises(LocalProtocolError):
            conn.send_eof()
        assert conn.close() == b""  # (no CLOSE frame into the user's data)
        assert conn.passed_through


@pytest.mark.parametrize(
    "mode, client_caps, server_caps, transport",
    [
        (Mode.STREAM, CAP_PASS_THROUGH, 0, "tcp"),  # the server does not offer it
        (Mode.STREAM, 0, CAP_PASS_THROUGH, "tcp"),  # the client does not
        (Mode.MESSAGES, CAP_PASS_THROUGH, CAP_PASS_THROUGH, "tcp"),  # messages need their frames
        (Mode.STREAM, CAP_PASS_THROUGH | CAP_RDMA, CAP_PASS_THROUGH | CAP_RDMA, "rdma"),  # RDMA
    ],
    ids=["server-does-not-offer", "client-does-not-offer", "messages", "rdma-selected"],
)
def test_otherwise_the_connection_stays_framed(mode: Mode, client_caps: int, server_caps: int, transport: str) -> None:
    c, s, _ = handshake(mode, client_caps, server_caps, transport=transport)
    assert not c.passed_through and not s.passed_through
    assert c.state is s.state is State.OPEN
    with pytest.raises(LocalProtocolError):
        s.take_passed()


def test_a_peer_that_knows_no_such_capability_ignores_the_bit() -> None:
    """An older peer masks capabilities it does not know (so offering it is always safe); an
    unknown bit from a newer one is ignored here the same way."""
    hello = Hello(mode=Mode.STREAM, capabilities=CAP_PASS_THROUGH | (1 << 7))
    payload = encode_hello(hello)
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    (event,) = s.receive_data(MAGIC + frame(FrameType.HELLO, payload))
    assert isinstance(event, HelloReceived)
    assert event.hello.capabilities == CAP_PASS_THROUGH
