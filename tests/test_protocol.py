"""The sans-IO protocol core, without any I/O: properties and edge cases."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma import HandshakeError, HandshakeTimeoutError, LocalProtocolError, ProtocolError, RemoteProtocolError
from aiordma._proto.protocol import (
    CAP_RDMA,
    HEADER,
    MAGIC,
    Connection,
    ConnectionClosed,
    Data,
    EndOfStream,
    FrameType,
    Hello,
    HelloReceived,
    Message,
    Mode,
    TransportSelected,
    decode_hello,
    encode_hello,
    frame,
)
from aiordma._proto.states import HALF, HANDSHAKE, Half, Role, State

LIMIT = 64 * 1024


def pair(mode: Mode, limit: int = LIMIT) -> tuple[Connection, Connection]:
    """A client and a server, handshake done (TCP selected)."""
    c = Connection(Role.CLIENT, mode, now=0.0, max_message_size=limit)
    s = Connection(Role.SERVER, mode, now=0.0, max_message_size=limit)
    assert isinstance(s.receive_data(c.send_hello())[0], HelloReceived)
    assert isinstance(c.receive_data(s.send_hello())[0], HelloReceived)
    events = s.receive_data(c.select("tcp", "client: testing"))
    assert events == [TransportSelected("tcp", "client: testing")]
    assert c.state is State.OPEN and s.state is State.OPEN
    return c, s


def wire(chunks: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def feed_in_pieces(conn: Connection, data: bytes, cuts: list[int]) -> list[object]:
    events: list[object] = []
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for a, b in zip(points, points[1:]):
        events += conn.receive_data(data[a:b])
    return events


# -- properties -------------------------------------------------------------------


@given(writes=st.lists(st.binary(max_size=40_000), max_size=10), cuts=st.lists(st.integers(0, 1 << 20), max_size=30))
def test_any_chunking_yields_the_same_bytes_in_order(writes: list[bytes], cuts: list[int]) -> None:
    c, s = pair(Mode.STREAM)
    data = b"".join(wire(c.send_data(w)) for w in writes) + c.send_eof()
    events = feed_in_pieces(s, data, cuts)
    assert events[-1] == EndOfStream()
    assert b"".join(e.data for e in events if isinstance(e, Data)) == b"".join(writes)
    assert all(isinstance(e, Data) for e in events[:-1])


@given(
    sizes=st.lists(st.integers(0, LIMIT), max_size=12),
    cuts=st.lists(st.integers(0, 1 << 20), max_size=30),
    fill=st.integers(0, 255),
)
def test_messages_keep_boundaries_at_any_chunking(sizes: list[int], cuts: list[int], fill: int) -> None:
    c, s = pair(Mode.MESSAGES)
    messages = [bytes([fill ^ (i & 0xFF)]) * n for i, n in enumerate(sizes)]
    data = b"".join(wire(c.send_message(m)) for m in messages)
    events = feed_in_pieces(s, data, cuts)
    assert [e.data for e in events if isinstance(e, Message)] == messages
    assert len(events) == len(messages)


@given(
    mode=st.sampled_from(Mode),
    caps=st.sampled_from([0, CAP_RDMA]),
    max_message=st.integers(0, 1 << 30),
    max_frame=st.integers(4096, 1 << 30),
    params=st.binary(max_size=2048),
    reason=st.none() | st.text(max_size=100),
)
def test_hello_codec_round_trips(
    mode: Mode, caps: int, max_message: int, max_frame: int, params: bytes, reason: str | None
) -> None:
    hello = Hello(
        mode=mode,
        capabilities=caps,
        max_message_size=max_message,
        max_frame_size=max_frame,
        rdma_params=params if caps else None,
        no_rdma_reason=reason or None,
    )
    assert decode_hello(encode_hello(hello)) == hello


def opened_server(mode: Mode) -> tuple[Connection, bytes]:
    """A server plus the client bytes that open it (to prefix fuzz input)."""
    c = Connection(Role.CLIENT, mode, now=0.0, max_message_size=LIMIT)
    s = Connection(Role.SERVER, mode, now=0.0, max_message_size=LIMIT)
    hello = c.send_hello()
    c.receive_data(s.send_hello() if s.receive_data(hello) else b"")
    return Connection(Role.SERVER, mode, now=0.0, max_message_size=LIMIT), hello + c.select("tcp")


def assert_only_protocol_errors(conn: Connection, data: bytes, cuts: list[int]) -> None:
    tracemalloc.start()
    try:
        feed_in_pieces(conn, data, cuts)
        conn.receive_eof()
    except (ProtocolError, HandshakeError):
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    # never buffers beyond the message limit plus the receive buffer and a copy
    assert peak < 3 * (LIMIT + (512 << 10)) + 2 * len(data)


@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 4000), max_size=8), mode=st.sampled_from(Mode))
@settings(max_examples=300)
def test_random_bytes_raise_only_protocol_errors(data: bytes, cuts: list[int], mode: Mode) -> None:
    assert_only_protocol_errors(Connection(Role.SERVER, mode, now=0.0, max_message_size=LIMIT), data, cuts)
    assert_only_protocol_errors(Connection(Role.SERVER, mode, now=0.0), MAGIC + data, cuts)


@given(
    mutations=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=8),
    mode=st.sampled_from(Mode),
)
@settings(max_examples=300)
def test_mutated_streams_raise_only_protocol_errors(
    mutations: list[tuple[int, int]], cuts: list[int], mode: Mode
) -> None:
    server, opening = opened_server(mode)
    c, _ = pair(mode)
    body = (
        wire(c.send_data(b"abc" * 100)) if mode is Mode.STREAM else wire(c.send_message(b"abc" * 100))
    ) + c.send_eof()
    data = bytearray(opening + body + c.close(0, "bye"))
    for pos, value in mutations:
        data[pos % len(data)] = value
    assert_only_protocol_errors(server, bytes(data), cuts)


# -- framing limits are checked before allocation ------------------------------------


def test_oversized_message_header_fails_before_the_payload_arrives() -> None:
    c, s = pair(Mode.MESSAGES)
    with pytest.raises(RemoteProtocolError, match="exceeds the limit"):
        s.receive_data(HEADER.pack(FrameType.MESSAGE, 0, 0, LIMIT + 1))


def test_huge_length_is_refused_without_allocating() -> None:
    c, s = pair(Mode.MESSAGES, limit=1 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError):
            s.receive_data(HEADER.pack(FrameType.MESSAGE, 0, 0, 0xFFFFFFFF))
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "bad",
    [
        HEADER.pack(0x7F, 0, 0, 0),  # unknown type
        HEADER.pack(FrameType.DATA, 1, 0, 0),  # flags
        HEADER.pack(FrameType.MESSAGE, 0, 9, 0),  # reserved
        HEADER.pack(FrameType.EOF, 0, 0, 1) + b"x",  # EOF with payload
        HEADER.pack(FrameType.CLOSE, 0, 0, 1) + b"x",  # CLOSE shorter than its code
        frame(FrameType.CLOSE, struct.pack("!H", 0) + b"\xff\xfe"),  # reason not UTF-8
        frame(FrameType.HELLO, b""),  # HELLO again, after the handshake
        frame(FrameType.SELECT, b"\x00"),  # SELECT to a client
    ],
)
def test_malformed_frames_are_remote_protocol_errors(bad: bytes) -> None:
    c, s = pair(Mode.MESSAGES)
    with pytest.raises((RemoteProtocolError, HandshakeError)) as info:
        c.receive_data(bad)
    assert isinstance(info.value, RemoteProtocolError) or "HELLO" in str(info.value)
    # the connection stays failed, and says so
    with pytest.raises(RemoteProtocolError, match="already failed"):
        c.receive_data(frame(FrameType.EOF))
    # we can still tell the peer why
    assert c.close(1, "bad frame").startswith(HEADER.pack(FrameType.CLOSE, 0, 0, 2 + len("bad frame")))


def test_protocol_errors_name_their_side() -> None:
    assert RemoteProtocolError("x").side == "remote" and "remote protocol error" in str(RemoteProtocolError("x"))
    assert LocalProtocolError("x").side == "local"


def test_wrong_magic_is_detected_early() -> None:
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    with pytest.raises(HandshakeError, match="does not speak aiordma"):
        s.receive_data(b"GET / HTTP/1.1\r\n")


def test_magic_split_byte_by_byte() -> None:
    c = Connection(Role.CLIENT, Mode.STREAM, now=0.0)
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    hello = c.send_hello()
    events = []
    for i in range(len(hello)):
        events += s.receive_data(hello[i : i + 1])
    assert len(events) == 1 and isinstance(events[0], HelloReceived)


# -- handshake -----------------------------------------------------------------------


def test_mode_mismatch_is_a_handshake_error() -> None:
    c = Connection(Role.CLIENT, Mode.MESSAGES, now=0.0)
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    with pytest.raises(HandshakeError, match="message-channel endpoint, this side is a byte-stream"):
        s.receive_data(c.send_hello())


def test_other_major_version_is_a_handshake_error() -> None:
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    payload = bytearray(encode_hello(Hello(mode=Mode.STREAM)))
    payload[0] = 2
    with pytest.raises(HandshakeError, match="protocol 2.0"):
        s.receive_data(MAGIC + frame(FrameType.HELLO, bytes(payload)))


def test_unknown_hello_extensions_are_skipped_but_lengths_checked() -> None:
    base = encode_hello(Hello(mode=Mode.STREAM))
    extended = base + struct.pack("!HH", 999, 3) + b"abc"
    assert decode_hello(extended) == Hello(mode=Mode.STREAM)
    with pytest.raises(RemoteProtocolError, match="claims 300 bytes"):
        decode_hello(base + struct.pack("!HH", 999, 300) + b"abc")
    with pytest.raises(RemoteProtocolError, match="repeats"):
        decode_hello(extended + struct.pack("!HH", 999, 0))


def test_rdma_offer_needs_parameters() -> None:
    hello = encode_hello(Hello(mode=Mode.STREAM))
    caps_offset = 4
    bad = bytearray(hello)
    bad[caps_offset + 3] |= CAP_RDMA
    with pytest.raises(RemoteProtocolError, match="RDMA"):
        decode_hello(bytes(bad))


def test_select_rdma_requires_both_offers() -> None:
    c = Connection(Role.CLIENT, Mode.STREAM, now=0.0)
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    s.receive_data(c.send_hello())
    c.receive_data(s.send_hello(capabilities=CAP_RDMA, rdma_params=b"p"))
    with pytest.raises(LocalProtocolError, match="not offered by both"):
        c.select("rdma")
    with pytest.raises(RemoteProtocolError, match="not offered by both"):
        s.receive_data(frame(FrameType.SELECT, b"\x01"))


def test_handshake_timeout_uses_the_given_clock() -> None:
    c = Connection(Role.CLIENT, Mode.STREAM, now=100.0, handshake_timeout=5.0)
    c.send_hello()
    assert c.next_deadline() == 105.0
    c.handle_timer(104.9)
    with pytest.raises(HandshakeTimeoutError):
        c.handle_timer(105.0)
    # once open there is no deadline
    a, _ = pair(Mode.STREAM)
    assert a.next_deadline() is None
    a.handle_timer(1e12)


def test_data_before_the_handshake_is_refused() -> None:
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    c = Connection(Role.CLIENT, Mode.STREAM, now=0.0)
    with pytest.raises(LocalProtocolError):
        c.send_data(b"early")
    with pytest.raises(RemoteProtocolError):
        s.receive_data(MAGIC + wire([HEADER.pack(FrameType.DATA, 0, 0, 1) + b"x"]))


def test_server_may_refuse_with_close_during_handshake() -> None:
    c = Connection(Role.CLIENT, Mode.STREAM, now=0.0)
    s = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    s.receive_data(c.send_hello())
    events = c.receive_data(s.close(2, "server requires RDMA"))  # starts with the magic
    assert events == [ConnectionClosed(2, "server requires RDMA")]
    assert c.state is State.CLOSED


# -- EOF and half-close -----------------------------------------------------------------


def test_half_close_semantics() -> None:
    c, s = pair(Mode.STREAM)
    assert s.receive_data(c.send_eof()) == [EndOfStream()]
    with pytest.raises(LocalProtocolError, match="after eof"):
        c.send_data(b"late")
    with pytest.raises(LocalProtocolError):
        c.send_eof()
    # the other direction is still open
    assert c.receive_data(wire(s.send_data(b"reply")) + s.send_eof()) == [Data(b"reply"), EndOfStream()]
    assert c.send_half is Half.EOF and c.recv_half is Half.EOF
    # data after the peer's EOF is the peer's protocol error
    c2, s2 = pair(Mode.STREAM)
    with pytest.raises(RemoteProtocolError, match="after eof"):
        s2.receive_data(c2.send_eof() + HEADER.pack(FrameType.DATA, 0, 0, 1) + b"x")


def test_close_after_close_is_empty_and_blocks_sending() -> None:
    c, s = pair(Mode.MESSAGES)
    closing = c.close(0, "done")
    assert s.receive_data(closing) == [ConnectionClosed(0, "done")]
    assert c.close() == b"" and s.close() == b""
    with pytest.raises(LocalProtocolError):
        c.send_message(b"x")
    assert s.receive_eof() == []


def test_eof_in_the_middle_of_a_frame() -> None:
    c, s = pair(Mode.MESSAGES)
    data = wire(c.send_message(b"x" * 100))
    s.receive_data(data[:50])
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        s.receive_eof()


def test_eof_without_close_is_an_error_and_during_handshake_a_handshake_error() -> None:
    _, s = pair(Mode.STREAM)
    with pytest.raises(RemoteProtocolError, match="without a CLOSE"):
        s.receive_eof()
    fresh = Connection(Role.SERVER, Mode.STREAM, now=0.0)
    with pytest.raises(HandshakeError, match="during the handshake"):
        fresh.receive_eof()


def test_send_message_on_stream_and_data_on_channel_are_local_errors() -> None:
    c, _ = pair(Mode.STREAM)
    with pytest.raises(LocalProtocolError):
        c.send_message(b"x")
    m, _ = pair(Mode.MESSAGES)
    with pytest.raises(LocalProtocolError):
        m.send_data(b"x")


def test_large_writes_are_split_at_the_peer_frame_limit_without_copies() -> None:
    c, s = pair(Mode.STREAM)
    payload = bytes(3 * (1 << 20) + 5)
    chunks = c.send_data(payload)
    assert len(chunks) == 8  # 4 frames: header + view each
    assert all(isinstance(chunk, memoryview) for chunk in chunks[1::2])
    events = s.receive_data(wire(chunks))
    assert sum(len(e.data) for e in events if isinstance(e, Data)) == len(payload)


def test_get_buffer_and_buffer_updated_path() -> None:
    c, s = pair(Mode.MESSAGES)
    data = wire(c.send_message(b"hello")) + wire(c.send_message(b""))
    view = s.get_buffer(-1)
    view[: len(data)] = data
    del view
    assert s.buffer_updated(len(data)) == [Message(b"hello"), Message(b"")]
    with pytest.raises(ValueError):
        s.buffer_updated(1 << 30)


# -- the tables ------------------------------------------------------------------------


def test_state_tables_are_consistent() -> None:
    # every handshake path ends OPEN for both roles, and CLOSED is terminal but for FAIL
    for role in Role:
        assert any(new is State.OPEN for (r, _, _), new in HANDSHAKE.items() if r is role)
    assert all(new is State.CLOSED for (_, st_, _), new in HANDSHAKE.items() if st_ is State.CLOSED)
    assert all(old is not Half.CLOSED for old, _ in HALF)


def test_events_before_an_error_are_not_lost() -> None:
    c, s = pair(Mode.MESSAGES)
    data = wire(c.send_message(b"good")) + HEADER.pack(FrameType.MESSAGE, 0, 1, 0)
    with pytest.raises(RemoteProtocolError) as info:
        s.receive_data(data)
    assert info.value.pending_events == [Message(b"good")]
