"""The aiordma wire format, sans I/O: constants and limits, frame types, the HELLO and its codec,
the events a :class:`~aiordma._proto.protocol.Connection` gives out, and the sinks it fills.

``docs/protocol.md`` writes the format down; :mod:`aiordma._proto.protocol` is the state machine
that speaks it.  Hot constants are module globals (``protocol.py`` imports them as such: a class
attribute lookup costs several times a global one).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias, Union

from .._errors import HandshakeError, LocalProtocolError, RemoteProtocolError
from .states import Half, Role, State

MAGIC: Final = b"AIORDMA\n"
VERSION: Final = (1, 0)

#: type u8, flags u8, reserved u16 (zero), payload length u32 -- network order.
HEADER: Final = struct.Struct("!BBHI")
#: version major u8, minor u8, mode u8, pad u8, capabilities u32,
#: max_message_size u32, max_frame_size u32.
HELLO_FIXED: Final = struct.Struct("!BBBxIII")
EXTENSION: Final = struct.Struct("!HH")
SELECT_FIXED: Final = struct.Struct("!B")
CLOSE_FIXED: Final = struct.Struct("!H")

#: Largest payload of a control frame (HELLO, SELECT, CLOSE).
MAX_CONTROL_PAYLOAD: Final = 4096
#: Largest RDMA-parameters extension in a HELLO.
MAX_RDMA_PARAMS: Final = 2048
#: Largest reason text (SELECT, CLOSE, no-RDMA extension), in UTF-8 bytes.
MAX_REASON: Final = 512
#: Smallest DATA frame limit a peer may advertise.
MIN_FRAME_SIZE: Final = 4096
#: Largest message size anyone may configure or advertise (1 GiB).
MAX_MESSAGE_SIZE_LIMIT: Final = 1 << 30

DEFAULT_MAX_MESSAGE_SIZE: Final = 16 << 20
DEFAULT_MAX_FRAME_SIZE: Final = 1 << 20
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0
#: DATA payloads up to this size are copied behind their header into one
#: bytes object; larger ones are returned as a separate chunk (no copy).
COALESCE_LIMIT: Final = 16 << 10

CAP_RDMA: Final = 1 << 0
#: A byte-stream endpoint that can hand the TCP connection over after the handshake: when both
#: offer it and TCP is selected, the data flows unframed (see ``State.PASSED_THROUGH``).
CAP_PASS_THROUGH: Final = 1 << 1
KNOWN_CAPABILITIES: Final = CAP_RDMA | CAP_PASS_THROUGH

EXT_RDMA_PARAMS: Final = 1
EXT_NO_RDMA_REASON: Final = 2
#: the client's authentication nonce (it has a key and asks the server to prove it has too)
EXT_AUTH_NONCE: Final = 3
AUTH_NONCE_SIZE: Final = 32
AUTH_PROOF_SIZE: Final = 32  # HMAC-SHA-256
#: AUTH payload: step u8 (1: the server's nonce and proof, 2: the client's proof) and its fields
AUTH_CHALLENGE: Final = 1
AUTH_ANSWER: Final = 2
_AUTH_LABELS: Final = {Role.SERVER: b"aiordma auth v1 server\0", Role.CLIENT: b"aiordma auth v1 client\0"}


class FrameType(enum.IntEnum):
    HELLO = 0x01
    SELECT = 0x02
    #: mutual authentication with a pre-shared key (between the client's HELLO and the server's)
    AUTH = 0x03
    DATA = 0x10
    MESSAGE = 0x11
    EOF = 0x12
    CLOSE = 0x13
    #: one-sided memory: exposures, their revocation, and READ/WRITE served over TCP
    #: (the payload is :mod:`aiordma._proto.onesided`'s)
    MEMORY = 0x14


class Mode(enum.IntEnum):
    """What the connection carries: a byte stream or messages with boundaries."""

    STREAM = 0
    MESSAGES = 1


class CloseCode(enum.IntEnum):
    NORMAL = 0
    PROTOCOL_ERROR = 1
    REFUSED = 2
    INTERNAL_ERROR = 3


Transport: TypeAlias = Literal["tcp", "rdma"]
_TRANSPORT_CODES: Final[dict[str, int]] = {"tcp": 0, "rdma": 1}
_TRANSPORT_NAMES: Final[dict[int, Transport]] = {0: "tcp", 1: "rdma"}


@dataclass(frozen=True, slots=True)
class Hello:
    """What one side announces about itself."""

    mode: Mode
    capabilities: int = 0
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE
    version: tuple[int, int] = VERSION
    #: Opaque RDMA connection parameters (see the RDMA transport); present
    #: exactly when ``capabilities`` has ``CAP_RDMA``.
    rdma_params: bytes | None = None
    #: Why this side offers no RDMA (readable; may be absent).
    no_rdma_reason: str | None = None
    #: A client with a key: its nonce for the server's proof (absent: no authentication).
    auth_nonce: bytes | None = None

    @property
    def can_rdma(self) -> bool:
        return bool(self.capabilities & CAP_RDMA)

    @property
    def can_pass_through(self) -> bool:
        return bool(self.capabilities & CAP_PASS_THROUGH)


# -- events -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloReceived:
    hello: Hello


@dataclass(frozen=True, slots=True)
class AuthChallenged:
    """Client: the server proved it has the key; :meth:`Connection.send_auth_answer` is due."""


@dataclass(frozen=True, slots=True)
class Authenticated:
    """Server: the client proved it has the key; the server's HELLO may follow."""


@dataclass(frozen=True, slots=True)
class TransportSelected:
    """Server side: the client chose the transport (with its reason for TCP)."""

    transport: Transport
    reason: str


# Data and Message are not frozen: they are made for every payload, and a
# frozen dataclass's __init__ (object.__setattr__) costs twice as much.
@dataclass(slots=True)
class Data:
    data: bytes


@dataclass(slots=True)
class Message:
    data: bytes


@dataclass(slots=True)
class MemoryFrame:
    """A MEMORY frame's payload (for :mod:`aiordma._proto.onesided`)."""

    payload: bytes


@dataclass(frozen=True, slots=True)
class EndOfStream:
    """The peer will send no more data (it may still receive)."""


@dataclass(frozen=True, slots=True)
class ConnectionClosed:
    code: int
    reason: str


Event: TypeAlias = Union[
    HelloReceived, AuthChallenged, Authenticated, TransportSelected, Data, Message, MemoryFrame, EndOfStream,
    ConnectionClosed,
]  # fmt: skip
#: what a MEMORY frame may carry beyond max_frame_size bytes of data (its fixed fields)
MEMORY_OVERHEAD: Final = 64
Chunk: TypeAlias = Union[bytes, memoryview]

_END_OF_STREAM: Final = EndOfStream()

# hot-path constants (module globals are cheaper than enum class attributes)
_S_OPEN: Final = State.OPEN
_S_PASSED: Final = State.PASSED_THROUGH
_S_CLOSE_SENT: Final = State.CLOSE_SENT
#: the states in which the peer's frames are read: open, and after our CLOSE until the peer's
_READING: Final = frozenset({State.OPEN, State.CLOSE_SENT})
_H_OPEN: Final = Half.OPEN
_M_STREAM: Final = Mode.STREAM
_M_MESSAGES: Final = Mode.MESSAGES
_T_DATA: Final = 0x10  # FrameType.DATA, as a plain int
_T_MESSAGE: Final = 0x11  # FrameType.MESSAGE
assert int(FrameType.DATA) == _T_DATA and int(FrameType.MESSAGE) == _T_MESSAGE
_HEADER_SIZE: Final = 8
assert _HEADER_SIZE == HEADER.size
_pack_header: Final = HEADER.pack
_unpack_header: Final = HEADER.unpack_from
#: The header as two words: (type, flags, reserved) and the length.  The first
#: word of a valid DATA header is exactly _DATA_WORD (flags and reserved zero),
#: so the fast path checks three fields with one comparison.
_unpack_words: Final = struct.Struct("!II").unpack_from
_DATA_WORD: Final = _T_DATA << 24
#: A DATA header as one 64-bit number: _DATA_HEADER | length (length < 2**32).
_pack_u64: Final = struct.Struct("!Q").pack
_DATA_HEADER: Final = _DATA_WORD << 32
#: ... and of a valid MESSAGE header
_MESSAGE_WORD: Final = _T_MESSAGE << 24
#: the op byte of a rendezvous MEMORY frame (aiordma._proto.onesided)
_MEMORY_RNDV: Final = 9


def _hmac_key(key: bytes) -> bytes:
    """The HMAC key of a pre-shared key: its SHA-256 with a label.  HMAC pads a short key with
    zero bytes (and hashes a long one), so ``b"k"`` and ``b"k\0"`` would be the same HMAC key;
    hashing first makes every distinct key a distinct one."""
    return hashlib.sha256(b"aiordma auth v1 key\0" + key).digest()


def _decode_reason(raw: bytes | memoryview, what: str) -> str:
    if len(raw) > MAX_REASON:
        raise RemoteProtocolError(f"{what} reason is {len(raw)} bytes, the limit is {MAX_REASON}")
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"{what} reason is not valid UTF-8") from exc


def _encode_reason(reason: str) -> bytes:
    raw = reason.encode("utf-8", "replace")
    if len(raw) > MAX_REASON:
        # cut at a character boundary
        raw = raw[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")
    return raw


def encode_hello(hello: Hello) -> bytes:
    """The payload of a HELLO frame."""
    parts = [
        HELLO_FIXED.pack(
            hello.version[0],
            hello.version[1],
            int(hello.mode),
            hello.capabilities,
            hello.max_message_size,
            hello.max_frame_size,
        )
    ]
    if hello.rdma_params is not None:
        if len(hello.rdma_params) > MAX_RDMA_PARAMS:
            raise LocalProtocolError(f"RDMA parameters of {len(hello.rdma_params)} bytes exceed {MAX_RDMA_PARAMS}")
        parts.append(EXTENSION.pack(EXT_RDMA_PARAMS, len(hello.rdma_params)))
        parts.append(hello.rdma_params)
    if hello.no_rdma_reason:
        raw = _encode_reason(hello.no_rdma_reason)
        parts.append(EXTENSION.pack(EXT_NO_RDMA_REASON, len(raw)))
        parts.append(raw)
    if hello.auth_nonce is not None:
        if len(hello.auth_nonce) != AUTH_NONCE_SIZE:
            raise LocalProtocolError(f"an auth nonce is {AUTH_NONCE_SIZE} bytes")
        parts.append(EXTENSION.pack(EXT_AUTH_NONCE, AUTH_NONCE_SIZE))
        parts.append(hello.auth_nonce)
    return b"".join(parts)


def decode_hello(payload: bytes | memoryview) -> Hello:
    """Parse and check a HELLO payload; raises :class:`RemoteProtocolError`."""
    if len(payload) < HELLO_FIXED.size:
        raise RemoteProtocolError(f"HELLO of {len(payload)} bytes is shorter than {HELLO_FIXED.size}")
    major, minor, mode, caps, max_msg, max_frame = HELLO_FIXED.unpack_from(payload, 0)
    if major != VERSION[0]:
        raise HandshakeError(f"peer speaks aiordma protocol {major}.{minor}, this side speaks {VERSION[0]}.{VERSION[1]}")
    try:
        mode_ = Mode(mode)
    except ValueError:
        raise RemoteProtocolError(f"HELLO has unknown mode {mode}") from None
    if max_msg > MAX_MESSAGE_SIZE_LIMIT:
        raise RemoteProtocolError(f"HELLO max_message_size {max_msg} exceeds {MAX_MESSAGE_SIZE_LIMIT}")
    if max_frame < MIN_FRAME_SIZE:
        raise RemoteProtocolError(f"HELLO max_frame_size {max_frame} is below {MIN_FRAME_SIZE}")
    rdma_params: bytes | None = None
    reason: str | None = None
    nonce: bytes | None = None
    pos = HELLO_FIXED.size
    end = len(payload)
    seen: set[int] = set()
    while pos < end:
        if end - pos < EXTENSION.size:
            raise RemoteProtocolError("HELLO ends inside an extension header")
        ext_type, ext_len = EXTENSION.unpack_from(payload, pos)
        pos += EXTENSION.size
        if ext_len > end - pos:
            raise RemoteProtocolError(f"HELLO extension {ext_type} claims {ext_len} bytes, {end - pos} remain")
        value = payload[pos : pos + ext_len]
        pos += ext_len
        if ext_type in seen:
            raise RemoteProtocolError(f"HELLO repeats extension {ext_type}")
        seen.add(ext_type)
        if ext_type == EXT_RDMA_PARAMS:
            if ext_len > MAX_RDMA_PARAMS:
                raise RemoteProtocolError(f"RDMA parameters of {ext_len} bytes exceed {MAX_RDMA_PARAMS}")
            rdma_params = bytes(value)
        elif ext_type == EXT_NO_RDMA_REASON:
            reason = _decode_reason(value, "no-RDMA")
        elif ext_type == EXT_AUTH_NONCE:
            if ext_len != AUTH_NONCE_SIZE:
                raise RemoteProtocolError(f"HELLO auth nonce of {ext_len} bytes, not {AUTH_NONCE_SIZE}")
            nonce = bytes(value)
        # unknown extensions are skipped: later minor versions may add some
    if bool(caps & CAP_RDMA) != (rdma_params is not None):
        raise RemoteProtocolError("HELLO offers RDMA without parameters, or parameters without RDMA")
    return Hello(
        mode=mode_,
        capabilities=caps & KNOWN_CAPABILITIES,
        max_message_size=max_msg,
        max_frame_size=max_frame,
        version=(major, minor),
        rdma_params=rdma_params,
        no_rdma_reason=reason,
        auth_nonce=nonce,
    )


_JOIN: Final = b"".join  # bytes + memoryview is a TypeError; join takes any buffer


def _byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat view of unsigned bytes of any buffer (``array('I')``, a numpy array, a typed
    memoryview): its ``len`` is the byte count.  A non-contiguous view is copied."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if not view.c_contiguous:
        return memoryview(view.tobytes())
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def frame(ftype: FrameType, payload: bytes = b"") -> bytes:
    """One complete frame (header and payload) as bytes."""
    return HEADER.pack(ftype, 0, 0, len(payload)) + payload


_CONTROL_LIMITS: Final[dict[int, int]] = {
    FrameType.HELLO: MAX_CONTROL_PAYLOAD,
    FrameType.SELECT: SELECT_FIXED.size + MAX_REASON,
    FrameType.AUTH: 1 + AUTH_NONCE_SIZE + AUTH_PROOF_SIZE,
    FrameType.EOF: 0,
    FrameType.CLOSE: CLOSE_FIXED.size + MAX_REASON,
}


_MODE_NAMES: Final = {Mode.STREAM: "byte-stream", Mode.MESSAGES: "message-channel"}
