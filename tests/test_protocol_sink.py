"""The DATA sink of the sans-IO protocol (``Connection.data_sink``) and its fast path.

A connection with a sink must decode exactly what one without it decodes:
the same events but ``Data``, the same bytes in the sink as in the ``Data``
events, the same errors at the same input, with the same pending events --
for any input, cut anywhere, fed through ``receive_data`` or through
``get_buffer``/``buffer_updated``.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma import HandshakeError, ProtocolError
from aiordma._proto.protocol import (
    HEADER,
    MIN_FRAME_SIZE,
    Connection,
    ConnectionClosed,
    Data,
    EndOfStream,
    FrameType,
    Mode,
    frame,
)
from aiordma._proto.receiving import StreamBuffer
from aiordma._proto.states import Role

LIMIT = 64 * 1024


def handshake(mode: Mode) -> tuple[bytes, bytes]:
    """The client's bytes for a server: (magic + HELLO, SELECT)."""
    c = Connection(Role.CLIENT, mode, now=0.0, max_message_size=LIMIT)
    s = Connection(Role.SERVER, mode, now=0.0, max_message_size=LIMIT)
    hello = c.send_hello()
    s.receive_data(hello)
    c.receive_data(s.send_hello())
    return hello, c.select("tcp")


def server(mode: Mode, sink: bool) -> Connection:
    """A server that got the client's HELLO and answered: the SELECT opens it."""
    conn = Connection(Role.SERVER, mode, now=0.0, max_message_size=LIMIT, max_frame_size=MIN_FRAME_SIZE)
    if sink:
        conn.data_sink = StreamBuffer()
    conn.receive_data(handshake(mode)[0])
    conn.send_hello()
    return conn


def opening(mode: Mode) -> bytes:
    return handshake(mode)[1]


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def run(conn: Connection, chunks: list[bytes], buffered: bool, eof: bool) -> list[tuple[object, ...]]:
    """Per call: (events but Data, DATA bytes decoded) or ("error", ...)."""
    out: list[tuple[object, ...]] = []
    sink = conn.data_sink
    for chunk in chunks + ([b"<eof>"] if eof else []):
        before = len(sink) if sink is not None else 0
        try:
            if chunk == b"<eof>":
                events = conn.receive_eof()
            elif buffered:
                view = conn.get_buffer(len(chunk))
                view[: len(chunk)] = chunk
                del view
                events = conn.buffer_updated(len(chunk))
            else:
                events = conn.receive_data(chunk)
        except (ProtocolError, HandshakeError) as err:
            pending = err.pending_events
            data = b"".join(e.data for e in pending if isinstance(e, Data))
            if sink is not None:
                assert not data
                data = bytes(sink)[before:]
            others = [e for e in pending if not isinstance(e, Data)]
            out.append(("error", type(err), str(err), others, data))
            break
        data = b"".join(e.data for e in events if isinstance(e, Data))
        if sink is not None:
            assert not data
            data = bytes(sink)[before:]
        out.append(([e for e in events if not isinstance(e, Data)], data))
    return out


def assert_same(mode: Mode, data: bytes, cuts: list[int], eof: bool = True) -> None:
    chunks = pieces(data, cuts)
    reference = run(server(mode, sink=False), chunks, buffered=False, eof=eof)
    assert run(server(mode, sink=True), chunks, buffered=False, eof=eof) == reference
    assert run(server(mode, sink=True), chunks, buffered=True, eof=eof) == reference
    assert run(server(mode, sink=False), chunks, buffered=True, eof=eof) == reference


def data_frame(payload: bytes, flags: int = 0, reserved: int = 0, length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return HEADER.pack(FrameType.DATA, flags, reserved, n) + payload


frames = st.one_of(
    st.binary(max_size=300).map(data_frame),
    st.integers(0, MIN_FRAME_SIZE + 10).map(lambda n: data_frame(bytes(i % 251 for i in range(n)))),
    st.just(data_frame(b"")),
    st.just(frame(FrameType.EOF)),
    st.just(frame(FrameType.CLOSE, b"\x00\x00bye")),
    st.just(frame(FrameType.MESSAGE, b"m")),
    st.just(data_frame(b"x", flags=1)),
    st.just(data_frame(b"x", reserved=1)),
    st.just(data_frame(b"", length=MIN_FRAME_SIZE + 1)),
    st.just(HEADER.pack(0x7F, 0, 0, 0)),
    st.binary(min_size=1, max_size=20),
)


@given(
    body=st.lists(frames, max_size=12),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=12),
    eof=st.booleans(),
)
@settings(max_examples=400)
def test_sink_decodes_what_data_events_decode(body: list[bytes], cuts: list[int], eof: bool) -> None:
    assert_same(Mode.STREAM, opening(Mode.STREAM) + b"".join(body), cuts, eof)


@given(
    body=st.lists(frames, max_size=8),
    mutations=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=4),
    cuts=st.lists(st.integers(0, 1 << 16), max_size=8),
    mode=st.sampled_from(Mode),
)
@settings(max_examples=300)
def test_sink_matches_on_mutated_input(
    body: list[bytes], mutations: list[tuple[int, int]], cuts: list[int], mode: Mode
) -> None:
    data = bytearray(opening(mode) + b"".join(body))
    for pos, value in mutations:
        data[pos % len(data)] = value
    assert_same(mode, bytes(data), cuts)


def test_bytes_decoded_before_an_error_are_in_the_sink() -> None:
    conn = server(Mode.STREAM, sink=True)
    conn.receive_data(opening(Mode.STREAM))
    bad = data_frame(b"abc") + data_frame(b"de") + data_frame(b"x", flags=1)
    try:
        conn.receive_data(bad)
    except ProtocolError as err:
        assert err.pending_events == []
    else:  # pragma: no cover
        raise AssertionError("no error")
    assert bytes(conn.data_sink) == b"abcde"


def test_whole_frames_leave_the_receive_buffer_empty() -> None:
    conn = server(Mode.STREAM, sink=True)
    conn.receive_data(opening(Mode.STREAM))
    view = conn.get_buffer(-1)
    wire = data_frame(b"hello") + data_frame(b" world")[:10]
    view[: len(wire)] = wire
    del view
    assert conn.buffer_updated(len(wire)) == []
    assert bytes(conn.data_sink) == b"hello w"
    assert conn.receive_data(b"orld" + frame(FrameType.EOF) + frame(FrameType.CLOSE, b"\x00\x00")) == [
        EndOfStream(),
        ConnectionClosed(0, ""),
    ]
    assert bytes(conn.data_sink) == b"hello world"


def test_sink_with_a_memoryview_of_another_format() -> None:
    conn = server(Mode.STREAM, sink=True)
    conn.receive_data(opening(Mode.STREAM))
    raw = data_frame(b"12345678")
    assert conn.receive_data(memoryview(raw).cast("H")) == []
    assert bytes(conn.data_sink) == b"12345678"


def test_no_view_of_the_callers_buffer_outlives_receive_data() -> None:
    # the RDMA link feeds views of registered memory and re-posts the buffer
    # right after: nothing may hold on to it, also when the input is bad and
    # the error (with its traceback) is kept, as the Core keeps it
    bodies = [data_frame(b"abc") + data_frame(b"de")[:5], data_frame(b"abc") + data_frame(b"x", flags=1)]
    kept: list[BaseException] = []
    for body, fmt in [(b, f) for b in bodies for f in ("B", "H")]:
        conn = server(Mode.STREAM, sink=True)
        conn.receive_data(opening(Mode.STREAM))
        buf = bytearray(body + bytes(len(body) % 2))
        view = memoryview(buf).cast(fmt)
        try:
            conn.receive_data(view)
        except ProtocolError as exc:
            kept.append(exc)
        view.release()
        buf.extend(b"more")  # raises BufferError if an export is left
        assert conn.data_sink is not None and conn.data_sink.startswith(b"abc")
    assert len(kept) == 2
