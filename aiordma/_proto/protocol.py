"""The aiordma wire protocol, sans I/O.

:class:`Connection` takes bytes (and the time, for the handshake deadline) in
and gives bytes and events out.  It imports nothing that does I/O: the TCP
transport, the RDMA transport and the tests all drive the same object.  The
format is written down in ``docs/protocol.md``; the state machines are the
tables in :mod:`aiordma._proto.states`.

Theory of operation
-------------------
Each side starts with an 8-byte magic, then frames follow.  A frame is an
8-byte header (type, flags, reserved, payload length) and its payload.  Every
field read from the wire is checked before it is used: the length of a frame
is compared with the limit for its type *before* any byte of the payload is
buffered, so a peer can never make us allocate more than
``max(max_message_size, MAX_CONTROL_PAYLOAD) + HEADER.size`` plus the receive
buffer.  DATA payloads are handed out as they arrive (a byte stream has no
boundaries to wait for); MESSAGE payloads are handed out whole.

Ownership: the bytes returned by ``send_*`` are the caller's to write out, in
order, before any bytes returned by a later call.  ``get_buffer`` lends a
writable view into the receive buffer until the matching ``buffer_updated``;
events never refer to that buffer (their payloads are copies).

Speed: this object sits on every byte of a TCP connection, so the receive
path has a fast path for the common case -- whole or continued DATA frames in
an open stream, appended straight to ``data_sink`` (see :class:`Connection`)
-- that skips the state tables only where their answer is known (state
``OPEN``, receive half ``OPEN``, stream mode), and checks every header field
as the general parser does; anything else goes to the general parser.  Hot
enum members and ``HEADER`` methods are bound to module constants: a class
attribute lookup costs several times a global one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable

from .._errors import AuthenticationError, HandshakeError, HandshakeTimeoutError, LocalProtocolError, RemoteProtocolError
from .receiving import (
    LONG_PEEK,
    MIN_RECV_ROOM,
    RECV_BUFFER_SIZE,
    SPARES,
    Landing,
    LongFrame,
    MessageSink,
    ReceiveBuffer,
    SpareBuffers,
    SpareMessage,
    StreamBuffer,
)
from .states import HALF, HANDSHAKE, Half, HalfInput, Input, Role, State

from .framing import (
    AUTH_ANSWER,
    AUTH_CHALLENGE,
    AUTH_NONCE_SIZE,
    AUTH_PROOF_SIZE,
    AuthChallenged,
    Authenticated,
    CAP_PASS_THROUGH,
    CAP_RDMA,
    CLOSE_FIXED,
    COALESCE_LIMIT,
    Chunk,
    CloseCode,
    ConnectionClosed,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_MAX_FRAME_SIZE,
    DEFAULT_MAX_MESSAGE_SIZE,
    Data,
    EndOfStream,
    Event,
    FrameType,
    HEADER,
    Hello,
    HelloReceived,
    MAGIC,
    MAX_CONTROL_PAYLOAD,
    MAX_MESSAGE_SIZE_LIMIT,
    MEMORY_OVERHEAD,
    MIN_FRAME_SIZE,
    MemoryFrame,
    Message,
    Mode,
    SELECT_FIXED,
    Transport,
    TransportSelected,
    VERSION,
    _AUTH_LABELS,
    _CONTROL_LIMITS,
    _DATA_HEADER,
    _DATA_WORD,
    _END_OF_STREAM,
    _HEADER_SIZE,
    _H_OPEN,
    _JOIN,
    _MEMORY_RNDV,
    _MESSAGE_WORD,
    _MODE_NAMES,
    _M_MESSAGES,
    _M_STREAM,
    _READING,
    _S_CLOSE_SENT,
    _S_OPEN,
    _S_PASSED,
    _TRANSPORT_CODES,
    _TRANSPORT_NAMES,
    _T_DATA,
    _T_MESSAGE,
    _byte_view,
    _decode_reason,
    _encode_reason,
    _hmac_key,
    _pack_header,
    _pack_u64,
    _unpack_header,
    _unpack_words,
    decode_hello,
    encode_hello,
    frame,
)

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "FrameType",
    "Mode",
    "CloseCode",
    "CAP_PASS_THROUGH",
    "CAP_RDMA",
    "Hello",
    "HelloReceived",
    "AuthChallenged",
    "Authenticated",
    "TransportSelected",
    "Data",
    "Message",
    "MemoryFrame",
    "EndOfStream",
    "ConnectionClosed",
    "Event",
    "Connection",
    "Role",
    "State",
    "Half",
    # (the wire format's names, from .framing, that the other layers use)
    "CLOSE_FIXED",
    "Chunk",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MAX_CONTROL_PAYLOAD",
    "MessageSink",
    "frame",
]

class Connection:
    """One side of an aiordma connection, without I/O.

    Feed it what the peer sent with :meth:`receive_data` (or
    :meth:`get_buffer`/:meth:`buffer_updated`), and :meth:`receive_eof` when the
    byte transport ends; write out, in order, whatever its ``send_*`` methods
    return.  Methods raise :class:`LocalProtocolError` for calls the protocol
    does not allow in the current state (nothing is sent and the connection
    stays usable), and :class:`RemoteProtocolError` / :class:`HandshakeError`
    when the peer broke the protocol (the connection is then closed: send the
    bytes of :meth:`close` if you can, and drop it).  Such an error carries in
    ``pending_events`` the events decoded from the same input before it:
    deliver those first, and nothing the peer sent correctly is lost.

    Data sink: when ``data_sink`` is a :class:`StreamBuffer` (it is ``None`` by
    default), the payloads of DATA frames are added to it as they are
    decoded instead of being returned as :class:`Data` events -- a read's
    payloads as one chunk, each byte copied once.  Everything else (messages, EOF, CLOSE, the
    handshake) still comes back as events, and the order between the two is
    the wire order within one call: the bytes appended during a call precede
    an :class:`EndOfStream` or :class:`ConnectionClosed` returned by it (a
    peer cannot send DATA after those).  Bytes appended to the sink count as
    delivered, also when the same call then raises: ``pending_events`` holds
    only the events, the sink already holds every DATA byte decoded before the
    error.  The sink is the owner's buffer (the Core's ``rbuf``); this object
    only appends to it.  It may be set or cleared between calls.
    """

    #: where long messages' spare buffers come from (a free list the process shares)
    spares: SpareBuffers = SPARES

    def __init__(
        self,
        role: Role,
        mode: Mode,
        *,
        now: float,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        auth_key: bytes | None = None,
        nonce: Callable[[int], bytes] = os.urandom,
    ) -> None:
        if auth_key is not None and not auth_key:
            raise ValueError("an empty auth key authenticates nothing")
        if not 0 <= max_message_size <= MAX_MESSAGE_SIZE_LIMIT:
            raise ValueError(f"max_message_size must be between 0 and {MAX_MESSAGE_SIZE_LIMIT}")
        if not MIN_FRAME_SIZE <= max_frame_size <= MAX_MESSAGE_SIZE_LIMIT:
            raise ValueError(f"max_frame_size must be between {MIN_FRAME_SIZE} and {MAX_MESSAGE_SIZE_LIMIT}")
        self.role = role
        self.mode = mode
        self.max_message_size = max_message_size
        self.max_frame_size = max_frame_size
        self.state = State.IDLE
        self.send_half = Half.OPEN
        self.recv_half = Half.OPEN
        self.handshake_deadline: float | None = now + handshake_timeout
        self.local_hello: Hello | None = None
        self.peer_hello: Hello | None = None
        self.transport: Transport | None = None
        self.transport_reason = ""
        #: the pre-shared key (None: no authentication); see send_auth_challenge
        self.auth_key = auth_key
        self._nonce = nonce
        self._auth_nonces: tuple[bytes, bytes] | None = None  # (client's, server's)
        self._client_hello = b""  # the client's HELLO payload: what both proofs cover
        self.close_sent = False
        self.close_received: ConnectionClosed | None = None
        self._error: Exception | None = None
        # limits for what we send, from the peer's HELLO
        self._peer_max_message = 0
        self._peer_max_frame = MIN_FRAME_SIZE
        # where received bytes land (see aiordma._proto.receiving); handshake-sized until
        # TCP is chosen for the data (widen_receive_buffer)
        self._rb = ReceiveBuffer()
        #: a view of the receive buffer shared with the other connections of the owner's thread
        #: (see share_receive_buffer)
        self._scratch: memoryview | None = None
        self._long: LongFrame | None = None  # a long MESSAGE read into its own destination
        self._landing: Landing | None = None  # a waiting reader's buffer, for the next message
        #: the last message was long: the next read takes the next header alone
        self.peek = False
        #: the last :meth:`buffer_updated` only moved a long message's payload on (it is not all
        #: in yet): no reader has anything new -- its owner need not wake one
        self.partial = False
        #: ``get_buffer`` may lend small views: exactly a long frame's rest, a header alone.  A link
        #: whose reader drops what does not fit the view it lent last when the connection ends
        #: (asyncio's and uvloop's TLS read once more at EOF, into one view) clears it: views are
        #: then never below MIN_RECV_ROOM (a long frame's last bytes go through the receive buffer)
        self.lend_exact = True
        self._magic_left = len(MAGIC)
        self._magic_sent = False
        self._data_left = 0  # payload bytes left in the current DATA frame
        #: a byte stream's rendezvous is being fetched: bytes after it wait unparsed (see resume)
        self.paused = False
        #: where DATA payloads go instead of Data events (see the class docs)
        self.data_sink: StreamBuffer | None = None
        #: where whole MESSAGE payloads go in message mode (no Message events for them)
        self.message_sink: MessageSink | None = None
        #: counters (aiordma.stats): payload bytes and messages framed to send, messages and their
        #: bytes decoded (a byte stream's received bytes are counted by its ``data_sink``)
        self.sent_bytes = 0
        self.sent_messages = 0
        self.received_messages = 0
        self.received_message_bytes = 0

    # -- state machinery ---------------------------------------------------

    def _step(self, what: Input, remote: bool) -> None:
        new = HANDSHAKE.get((self.role, self.state, what))
        if new is None:
            err_type = RemoteProtocolError if remote else LocalProtocolError
            err = err_type(f"{what.value} is not allowed in state {self.state.value} ({self.role.value})")
            if remote:
                self._fail(err)
            raise err
        self.state = new

    def _half_step(self, half: Half, what: HalfInput, remote: bool) -> Half:
        new = HALF.get((half, what))
        if new is None:
            direction = "receive" if remote else "send"
            if self.state is not State.OPEN:
                text = f"cannot {direction} {what.value} in state {self.state.value}"
            else:
                text = f"cannot {direction} {what.value} after {half.value} in that direction"
            if remote:
                err: Exception = RemoteProtocolError(text)
                self._fail(err)
                raise err
            raise LocalProtocolError(text)
        return new

    def _fail(self, err: Exception) -> None:
        self._error = err
        self._drop_long()
        self._landing = None
        self.state = State.CLOSED
        self.send_half = Half.CLOSED
        self.recv_half = Half.CLOSED

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RemoteProtocolError(f"the connection already failed: {self._error}")

    # -- timers ------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` must be called next (``None``: never)."""
        return self.handshake_deadline

    def handle_timer(self, now: float) -> None:
        """Raise :class:`HandshakeTimeoutError` if the handshake is overdue."""
        if self.handshake_deadline is not None and now >= self.handshake_deadline:
            text = f"the handshake did not complete in time (state {self.state.value})"
            err = HandshakeTimeoutError(text)
            self._fail(err)
            raise err

    # -- handshake ---------------------------------------------------------

    def send_hello(
        self,
        *,
        capabilities: int = 0,
        rdma_params: bytes | None = None,
        no_rdma_reason: str | None = None,
    ) -> bytes:
        """Our magic and HELLO: a client's first bytes, or a server's answer.

        With a key, a client's HELLO carries its nonce, and a server's may only follow the
        client's proof (:class:`Authenticated`)."""
        self._check_alive()
        client = self.role is Role.CLIENT
        if not client and self.auth_key is not None and self.state is not State.AUTHENTICATED:
            raise LocalProtocolError("this server has a key: the client must authenticate before its HELLO")
        hello = Hello(
            mode=self.mode,
            capabilities=capabilities,
            max_message_size=self.max_message_size,
            max_frame_size=self.max_frame_size,
            rdma_params=rdma_params,
            no_rdma_reason=no_rdma_reason,
            auth_nonce=self._nonce(AUTH_NONCE_SIZE) if client and self.auth_key is not None else None,
        )
        if hello.can_rdma != (rdma_params is not None):
            raise LocalProtocolError("offer RDMA exactly when RDMA parameters are given")
        payload = encode_hello(hello)
        self._step(Input.SEND_HELLO, remote=False)
        if client:
            self._client_hello = payload
        self.local_hello = hello
        prefix = b"" if self._magic_sent else MAGIC  # (a server that sent AUTH sent the magic with it)
        self._magic_sent = True
        return prefix + frame(FrameType.HELLO, payload)

    # -- authentication (a pre-shared key: auth=) ----------------------------------------
    #
    # client                                      server (with the key)
    #   HELLO(.., nonce_c)                      ->
    #                                           <-  AUTH(1, nonce_s, proof_s)
    #   AUTH(2, proof_c)                        ->      (checked; only now RDMA resources)
    #                                           <-  HELLO(..)
    # proof_x = HMAC-SHA-256(key, label_x | nonce_c | nonce_s | the client's HELLO payload),
    # labels naming the side (a proof cannot be reflected), compared in constant time.

    def _proof(self, role: Role) -> bytes:
        assert self.auth_key is not None and self._auth_nonces is not None
        nonce_c, nonce_s = self._auth_nonces
        msg = _AUTH_LABELS[role] + nonce_c + nonce_s + self._client_hello
        return hmac.new(_hmac_key(self.auth_key), msg, hashlib.sha256).digest()

    def send_auth_challenge(self) -> bytes:
        """Server with a key, after the client's HELLO: our nonce and our proof of the key."""
        self._check_alive()
        if self.role is not Role.SERVER or self.auth_key is None:
            raise LocalProtocolError("only a server with a key sends an AUTH challenge")
        hello = self.peer_hello
        if hello is None or hello.auth_nonce is None:
            raise LocalProtocolError("the client offered no authentication (no nonce in its HELLO)")
        self._step(Input.SEND_AUTH, remote=False)
        self._auth_nonces = (hello.auth_nonce, self._nonce(AUTH_NONCE_SIZE))
        self._magic_sent = True  # (the server's first bytes: the magic goes first)
        return MAGIC + frame(FrameType.AUTH, bytes([AUTH_CHALLENGE]) + self._auth_nonces[1] + self._proof(Role.SERVER))

    def send_auth_answer(self) -> bytes:
        """Client, after :class:`AuthChallenged`: our proof of the key."""
        self._check_alive()
        self._step(Input.SEND_AUTH, remote=False)
        return frame(FrameType.AUTH, bytes([AUTH_ANSWER]) + self._proof(Role.CLIENT))

    def _receive_auth(self, payload: memoryview) -> Event:
        if self.role is Role.CLIENT:
            if self.auth_key is None or self.local_hello is None or self.local_hello.auth_nonce is None:
                raise RemoteProtocolError("an AUTH challenge, although this side offered no authentication")
            if len(payload) != 1 + AUTH_NONCE_SIZE + AUTH_PROOF_SIZE or payload[0] != AUTH_CHALLENGE:
                raise RemoteProtocolError(f"malformed AUTH challenge ({len(payload)} bytes)")
            self._step(Input.RECV_AUTH, remote=True)
            self._auth_nonces = (self.local_hello.auth_nonce, bytes(payload[1 : 1 + AUTH_NONCE_SIZE]))
            if not hmac.compare_digest(bytes(payload[1 + AUTH_NONCE_SIZE :]), self._proof(Role.SERVER)):
                raise AuthenticationError("authentication failed: the server's proof does not match this side's key")
            return AuthChallenged()
        if len(payload) != 1 + AUTH_PROOF_SIZE or payload[0] != AUTH_ANSWER:
            raise RemoteProtocolError(f"malformed AUTH answer ({len(payload)} bytes)")
        self._step(Input.RECV_AUTH, remote=True)
        if not hmac.compare_digest(bytes(payload[1:]), self._proof(Role.CLIENT)):
            raise AuthenticationError("authentication failed: the client's proof does not match this side's key")
        return Authenticated()

    def select(self, transport: Transport, reason: str = "") -> bytes:
        """Client: choose the transport for the data (after the peer's HELLO)."""
        self._check_alive()
        if transport not in _TRANSPORT_CODES:
            raise LocalProtocolError(f"unknown transport {transport!r}")
        if transport == "rdma" and not (
            self.peer_hello and self.peer_hello.can_rdma and self.local_hello and self.local_hello.can_rdma
        ):
            raise LocalProtocolError("cannot select RDMA: it was not offered by both sides")
        self._step(Input.SEND_SELECT, remote=False)
        self._opened(transport, reason)
        return frame(FrameType.SELECT, SELECT_FIXED.pack(_TRANSPORT_CODES[transport]) + _encode_reason(reason))

    def _opened(self, transport: Transport, reason: str) -> None:
        self.transport = transport
        self.transport_reason = reason
        self.handshake_deadline = None
        if (
            transport == "tcp"
            and self.mode is Mode.STREAM
            and self.local_hello is not None
            and self.local_hello.can_pass_through
            and self.peer_hello is not None
            and self.peer_hello.can_pass_through
        ):
            self._step(Input.PASS_THROUGH, remote=False)

    def share_receive_buffer(self, scratch: bytearray) -> None:
        """Receive into ``scratch``, a buffer shared by the connections of the owner's thread,
        whenever this connection holds no unparsed bytes: what a read leaves unparsed (a cut
        frame) moves to a buffer of its own, from a pool, which goes back once all is parsed.  An
        idle connection then holds no receive buffer (256 KiB each before; issue 23).

        Contract: the owner calls :meth:`get_buffer` and :meth:`buffer_updated` back to back, with
        no read of another connection sharing ``scratch`` in between, and only from one thread
        (asyncio's and uvloop's transports on a plain socket do; a reader that waits between the
        two must not share)."""
        self._scratch = memoryview(scratch)
        rb = self._rb
        if rb.start == rb.end and self._long is None:
            rb.borrow(self._scratch)

    def widen_receive_buffer(self) -> None:
        """The handshake chose TCP for framed data: the receive buffer grows to its working size
        (``RECV_BUFFER_SIZE``; it starts at ``MIN_RECV_ROOM``), keeping what it holds.  The owner
        calls it outside a read (no view of the buffer is lent then); nothing happens in any
        other state (RDMA carries the data, or the connection passed through or ended)."""
        rb = self._rb
        if self._scratch is not None:
            return  # (reads go into the shared buffer, of the working size)
        if self.state is State.OPEN and self.transport == "tcp" and rb.size < RECV_BUFFER_SIZE:
            rb.reserve(RECV_BUFFER_SIZE - (rb.end - rb.start))

    @property
    def passed_through(self) -> bool:
        """Both sides offered it and TCP was selected: the data flows unframed from the byte
        after the SELECT on (the owner hands the TCP connection over, or carries it on unframed;
        see :meth:`take_passed`)."""
        return self.state is State.PASSED_THROUGH

    def take_passed(self) -> bytes:
        """Passed through: the data's first bytes, read after the SELECT and not parsed (and
        nothing more is kept here)."""
        if self.state is not State.PASSED_THROUGH:
            raise LocalProtocolError(f"the connection did not pass through (state {self.state.value})")
        rb = self._rb
        data = bytes(rb.view[rb.start : rb.end])
        # the receive buffer goes (nothing is parsed any more): its memory back to the process
        # at once -- also the allocator's cue that buffers of its size are in use (glibc raises
        # its mmap threshold when a mapped chunk is freed; without it every 256 KiB read buffer
        # of asyncio's transport was mapped and unmapped per read)
        if not rb.borrowed:  # (a shared one stays the loop's)
            rb.view.release()
        self._rb = ReceiveBuffer(0)
        self._scratch = None
        return data

    # -- sending -----------------------------------------------------------

    def send_data(self, data: bytes | bytearray | memoryview) -> list[Chunk]:
        """Frame stream bytes; returns the chunks to write, in order."""
        if self.state is not _S_OPEN or self.send_half is not _H_OPEN or self.mode is not _M_STREAM:
            if self.state is _S_PASSED:
                # unframed: the bytes go as they are (the owner carries the TCP connection on;
                # nothing fails in this state: no frame is parsed)
                if self.send_half is not _H_OPEN:
                    self._half_step(self.send_half, HalfInput.DATA, remote=False)  # (raises)
                chunk = data if type(data) is bytes else _byte_view(data)  # (counted in bytes)
                return [chunk] if len(chunk) else []
            self._check_alive()
            if self.mode is not Mode.STREAM:
                raise LocalProtocolError("send_data on a message connection")
            if self.state is not State.OPEN:
                raise LocalProtocolError(f"cannot send data in state {self.state.value}")
            self._half_step(self.send_half, HalfInput.DATA, remote=False)
        if type(data) is not bytes and type(data) is not bytearray:
            data = _byte_view(data)  # count bytes, not items of a typed view
        n = len(data)
        self.sent_bytes += n
        limit = self._peer_max_frame
        if n <= COALESCE_LIMIT:
            return [_JOIN((_pack_u64(_DATA_HEADER | n), data))] if n else []
        view = memoryview(data).cast("B")
        out: list[Chunk] = []
        for pos in range(0, n, limit):
            piece = view[pos : pos + limit]
            out.append(_pack_header(_T_DATA, 0, 0, len(piece)))
            out.append(piece)
        return out

    def send_message(self, data: bytes | bytearray | memoryview) -> list[Chunk]:
        """Frame one message; raises :class:`LocalProtocolError` if it is larger than the peer accepts."""
        if self.mode is not Mode.MESSAGES:
            raise LocalProtocolError("send_message on a byte-stream connection")
        if self.state is not _S_OPEN or self.send_half is not _H_OPEN:
            self._check_alive()
            if self.state is not State.OPEN:
                raise LocalProtocolError(f"cannot send a message in state {self.state.value}")
            self._half_step(self.send_half, HalfInput.MESSAGE, remote=False)
        if type(data) is not bytes and type(data) is not bytearray:
            data = _byte_view(data)  # count bytes, not items of a typed view
        n = len(data)
        if n > self._peer_max_message:
            raise LocalProtocolError(f"message of {n} bytes exceeds the peer's limit of {self._peer_max_message}")
        self.sent_messages += 1
        self.sent_bytes += n
        if n <= COALESCE_LIMIT:
            return [_JOIN((_pack_header(_T_MESSAGE, 0, 0, n), data))]
        return [_pack_header(_T_MESSAGE, 0, 0, n), data if isinstance(data, bytes) else memoryview(data)]

    def resume(self) -> list[Event]:
        """The stream's rendezvous bytes are in: parse what waited behind it."""
        self.paused = False
        return self._parse()

    def send_memory(self, payload: bytes, *, after_peer_close: bool = False) -> bytes:
        """A MEMORY frame (one-sided memory; see :mod:`aiordma._proto.onesided`).

        ``after_peer_close``: also once the peer's CLOSE came (we have not sent ours) -- an
        RNDV_DONE for a message the peer sent before its CLOSE: the closing peer keeps its region
        staged, and its close waits, until it hears that the region was READ."""
        self._check_alive()
        late = after_peer_close and self.close_received is not None and self.state is State.CLOSED
        if (self.state is not State.OPEN and not late) or self.close_sent:
            raise LocalProtocolError(f"cannot send a MEMORY frame in state {self.state.value}")
        if len(payload) > self._peer_max_frame + MEMORY_OVERHEAD:
            raise LocalProtocolError(f"MEMORY frame of {len(payload)} bytes exceeds the peer's limit")
        return _pack_header(FrameType.MEMORY, 0, 0, len(payload)) + payload

    @property
    def peer_max_frame(self) -> int:
        return self._peer_max_frame

    @property
    def peer_max_message(self) -> int:
        return self._peer_max_message

    def send_eof(self) -> bytes:
        """Half-close: we send no more data; the peer may still send.  Returns the EOF frame, or
        ``b""`` when the connection passed through (the owner ends its TCP half: a FIN)."""
        self._check_alive()
        if self.state is not State.OPEN and self.state is not State.PASSED_THROUGH:
            raise LocalProtocolError(f"cannot send EOF in state {self.state.value}")
        self.send_half = self._half_step(self.send_half, HalfInput.EOF, remote=False)
        return frame(FrameType.EOF) if self.state is State.OPEN else b""

    def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> bytes:
        """The CLOSE frame to send, or ``b""`` if a CLOSE already went either way (or the
        connection passed through: no frame may go any more)."""
        if self.state is State.PASSED_THROUGH:
            return b""
        if self.close_sent or self.close_received is not None:
            self.state = State.CLOSED
            return b""
        if self._error is None:
            self._step(Input.SEND_CLOSE, remote=False)
        self.close_sent = True
        self.send_half = Half.CLOSED
        if self.state is not State.CLOSE_SENT:  # (CLOSE_SENT: what the peer sent meanwhile is still read)
            self.recv_half = Half.CLOSED
        self.handshake_deadline = None
        # a side that refuses before its HELLO still starts with the magic
        prefix = b"" if self._magic_sent else MAGIC
        self._magic_sent = True
        return prefix + frame(FrameType.CLOSE, CLOSE_FIXED.pack(code) + _encode_reason(reason))

    # -- receiving ---------------------------------------------------------

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable view to receive into; pass the count to :meth:`buffer_updated`.

        While a long message is read, the view is the rest of its payload, exactly (its
        destination: a waiting reader's buffer, or a spare one); after one, the next header alone
        (:attr:`peek`).  See :mod:`aiordma._proto.receiving`."""
        long = self._long
        if long is not None:
            if self.lend_exact or long.length - long.got >= MIN_RECV_ROOM:
                return long.view[long.got :]
            long.tail = True  # (the last bytes go through the receive buffer: see lend_exact)
            return self._rb.view  # (empty while a long frame is read)
        rb = self._rb
        if rb.start == rb.end:
            rb.start = rb.end = 0
            if not rb.borrowed and self._scratch is not None:
                rb.borrow(self._scratch)
            if self.peek:
                return rb.view[:_HEADER_SIZE]
            if sizehint <= rb.size:
                # all parsed: the whole buffer (never below MIN_RECV_ROOM) is free
                return rb.view
        elif self.peek and rb.end - rb.start < _HEADER_SIZE:
            rb.reserve(_HEADER_SIZE)
            return rb.view[rb.end : rb.start + _HEADER_SIZE]
        rb.reserve(max(sizehint, MIN_RECV_ROOM))
        return rb.view[rb.end :]

    def peek_lent(self, nbytes: int) -> bytes:
        """The ``nbytes`` written into the buffer :meth:`get_buffer` lent last, without parsing
        them (a link that no longer carries this protocol's frames reads them so)."""
        long = self._long
        if long is not None:
            return bytes(long.view[long.got : long.got + nbytes])
        rb = self._rb
        return bytes(rb.view[rb.end : rb.end + nbytes])

    def offer_landing(self, view: memoryview) -> Landing | None:
        """A reader waits for the next message with ``view`` (a flat, writable byte view): the next
        MESSAGE that fits goes into it (straight from the socket, when it is long) instead of the
        message sink; ``Landing.length`` then says its length.  ``None`` when another landing is
        offered already, or on a byte stream.  The view is this object's to write into until the
        message landed or :meth:`withdraw_landing`."""
        if self._landing is not None or self.mode is not _M_MESSAGES:
            return None
        long = self._long
        if long is not None:
            # the next message is being read into a spare buffer: the reader's buffer takes over
            # (what is in moves once; the rest comes straight), or the reader finds it too small
            if long.landing is not None or long.length > view.nbytes:
                return None
            assert long.spare is not None
            landing = Landing(view)
            dest = view[: long.length]
            dest[: long.got] = long.view[: long.got]
            long.view.release()
            self.spares.give(long.spare)
            long.view, long.spare, long.landing = dest, None, landing
            return landing
        landing = self._landing = Landing(view)
        return landing

    def withdraw_landing(self, landing: Landing) -> bytes | None:
        """The reader of ``landing`` leaves (cancelled, or it found a message in the sink): its
        buffer is its own again.  A message that landed already is returned (put it back first in
        line: nothing is lost); one half read into it goes on in a spare buffer."""
        if self._landing is landing:
            self._landing = None
            return None
        long = self._long
        if long is not None and long.landing is landing:
            spare = self.spares.take(long.length)
            view = memoryview(spare)[: long.length]
            view[: long.got] = long.view[: long.got]
            long.view, long.spare, long.landing = view, spare, None
            return None
        if landing.length >= 0:
            return bytes(landing.view[: landing.length])
        return None

    def buffer_updated(self, nbytes: int) -> list[Event]:
        long = self._long
        if long is not None:
            if long.tail:
                return self._long_tail(long, nbytes)
            got = long.got + nbytes
            if nbytes < 0 or got > long.length:
                raise ValueError("nbytes is larger than the buffer lent by get_buffer")
            long.got = got
            if got < long.length:
                self.partial = True
                return []
            self.partial = False
            return self._long_done(long)
        self.partial = False
        rb = self._rb
        end = rb.end + nbytes
        if nbytes < 0 or end > rb.size:
            raise ValueError("nbytes is larger than the buffer lent by get_buffer")
        rb.end = end
        sink = self.data_sink
        # the fast path (see _sink_frames, inlined here: this runs for every
        # read of a TCP connection); state OPEN implies no error
        if sink is not None and self.state is _S_OPEN and self.recv_half is _H_OPEN and self.mode is _M_STREAM and not self.paused:
            view = rb.view
            pos = rb.start
            if self._data_left:
                pos = self._sink_frames(sink, view, pos, end)
            else:
                limit = self.max_frame_size
                parts: list[memoryview] = []
                while end - pos >= _HEADER_SIZE:
                    word, length = _unpack_words(view, pos)
                    if word != _DATA_WORD or length > limit:
                        break
                    first = pos + _HEADER_SIZE
                    pos = first + length
                    if pos >= end:  # the last frame here: whole, or cut by end
                        if pos > end:
                            self._data_left = pos - end
                            pos = end
                        parts.append(view[first:pos])
                        break
                    parts.append(view[first:pos])
                if parts:
                    sink.add_parts(parts)  # (one chunk for this read's payloads: one copy)
            if pos == end:
                rb.start = rb.end = 0
                if rb.size > RECV_BUFFER_SIZE:
                    rb.shrink()
                return []
            rb.start = pos
        elif (
            self.message_sink is not None
            and self.state is _S_OPEN
            and self.recv_half is _H_OPEN
            and self.mode is _M_MESSAGES
        ):
            pos = rb.start
            if self._landing is not None:
                pos = self._land(rb.view, pos, end)
            pos = self._sink_messages(self.message_sink, rb.view, pos, end)
            if pos == end:
                rb.start = rb.end = 0
                if rb.size > RECV_BUFFER_SIZE:
                    rb.shrink()
                return []
            rb.start = pos
        if rb.borrowed:
            try:
                return self._parse(lent=True)
            finally:
                rb.settle()  # (what is left goes to a buffer of our own: the next read is another's)
        return self._parse(lent=True)

    def _land(self, view: memoryview, pos: int, end: int) -> int:
        """The message fast path with a landing: the first frame, if it is a whole MESSAGE that
        fits, goes into the landing; returns the position after what was taken."""
        landing = self._landing
        assert landing is not None
        if end - pos < _HEADER_SIZE:
            return pos
        word, length = _unpack_words(view, pos)
        first = pos + _HEADER_SIZE
        if word != _MESSAGE_WORD or length > self.max_message_size or end - first < length:
            return pos  # (not a whole MESSAGE: the other paths decide)
        self._landing = None
        if length > landing.view.nbytes:
            return pos  # (too large for it: it goes to the sink, where the reader finds it)
        landing.view[:length] = view[first : first + length]
        landing.length = length
        self.received_messages += 1
        self.received_message_bytes += length
        end_: int = first + length
        return end_

    def _begin_long(self, view: memoryview, first: int, end: int, length: int) -> None:
        """A MESSAGE frame whose payload (``length`` bytes) starts at ``view[first:end]`` and goes
        on: read the rest into its own destination (a landing that fits, else a spare buffer)."""
        landing = self._landing
        spare = None
        self._landing = None  # (the next message is this one: the landing takes it, or nothing)
        if landing is not None and length <= landing.view.nbytes:
            dest = landing.view[:length]
        else:
            landing = None
            spare = self.spares.take(length)
            dest = memoryview(spare)[:length]
        head = end - first
        dest[:head] = view[first:end]
        self._long = LongFrame(dest, head, landing, spare)

    def _long_done(self, long: LongFrame) -> list[Event]:
        """The last byte of a long MESSAGE is in: hand it out (the receive buffer is empty)."""
        self._long = None
        self.peek = self.lend_exact and long.length >= LONG_PEEK
        if self.state is not _S_OPEN or self.recv_half is not _H_OPEN:
            # (state moved meanwhile -- our CLOSE: the tables decide, as for any MESSAGE)
            if self.state not in _READING:
                self._half_step(Half.CLOSED, HalfInput.MESSAGE, remote=True)
            self.recv_half = self._half_step(self.recv_half, HalfInput.MESSAGE, remote=True)
        self.received_messages += 1
        self.received_message_bytes += long.length
        landing = long.landing
        if landing is not None:
            landing.length = long.length
            return []
        assert long.spare is not None
        parked = SpareMessage(long.view, long.spare, self.spares)
        sink = self.message_sink
        if sink is None:
            return [Message(parked.take())]
        sink.append(parked)  # (its reader copies it once, into bytes or into its buffer)
        sink.nbytes += long.length
        return []

    def _long_tail(self, long: LongFrame, nbytes: int) -> list[Event]:
        """The last bytes of a long frame and what follows it, read into the receive buffer (not
        ``lend_exact``): the frame's part moves to its destination, the rest is parsed."""
        rb = self._rb
        if nbytes < 0 or nbytes > rb.size:
            raise ValueError("nbytes is larger than the buffer lent by get_buffer")
        long.tail = False
        take = min(nbytes, long.length - long.got)
        long.view[long.got : long.got + take] = rb.view[:take]
        long.got += take
        if long.got < long.length:
            self.partial = True
            return []
        self.partial = False
        events = self._long_done(long)
        if take == nbytes:
            return events
        rb.start, rb.end = take, nbytes
        return events + self._parse(lent=True)

    def _drop_long(self) -> None:
        long = self._long
        if long is not None:
            self._long = None
            if long.spare is not None:
                long.view.release()
                self.spares.give(long.spare)

    def _sink_messages(self, sink: MessageSink, view: memoryview, pos: int, end: int) -> int:
        """The message fast path: whole MESSAGE frames at ``view[pos:end]`` go to ``sink``.

        Called only with state ``OPEN``, receive half ``OPEN`` and message mode,
        where the tables allow MESSAGE and leave the half as it is.  Every
        header is checked as in :meth:`_parse`; at the first frame that is not
        a whole, valid MESSAGE it stops and returns its position, and the
        general parser takes over (and raises if need be).
        """
        limit = self.max_message_size
        while end - pos >= _HEADER_SIZE:
            word, length = _unpack_words(view, pos)
            if word != _MESSAGE_WORD or length > limit:
                break
            first = pos + _HEADER_SIZE
            if end - first < length:
                break
            pos = first + length
            sink.append(bytes(view[first:pos]))
            sink.nbytes += length
            self.received_messages += 1
            self.received_message_bytes += length
        return pos

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """Feed bytes from the peer; returns the events they complete."""
        if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1):
            with data.cast("B") as flat:  # count bytes, not items; keep no view
                return self.receive_data(flat)
        n = len(data)
        if not n:
            return []
        if self._rb.borrowed:
            self._rb.own()  # (bytes fed, not read into a lent buffer: the shared one is not ours)
        if self._long is not None:
            return self._receive_lending(data)
        sink = self.data_sink
        pos = 0
        msink = self.message_sink
        rb = self._rb
        if (
            msink is not None
            and rb.start == rb.end
            and self.state is _S_OPEN
            and self.recv_half is _H_OPEN
            and self.mode is _M_MESSAGES
            and self._landing is None
        ):
            # nothing buffered: whole MESSAGE frames go straight from the caller's bytes
            view = memoryview(data)
            try:
                # whole MESSAGE frames (the loop of _sink_messages, inlined: it runs per message)
                limit = self.max_message_size
                while n - pos >= _HEADER_SIZE:
                    word, length = _unpack_words(view, pos)
                    if word != _MESSAGE_WORD or length > limit:
                        break
                    first = pos + _HEADER_SIZE
                    if n - first < length:
                        break
                    pos = first + length
                    msink.append(bytes(view[first:pos]))
                    msink.nbytes += length
                    self.received_messages += 1
                    self.received_message_bytes += length
                if pos == n:
                    return []
                rb.reserve(n - pos)
                rb.buf[0 : n - pos] = view[pos:]
            finally:
                view.release()
            rb.start = 0
            rb.end = n - pos
            return self._parse()
        if (
            sink is not None
            and rb.start == rb.end
            and self.state is _S_OPEN
            and self.recv_half is _H_OPEN
            and self.mode is _M_STREAM
            and not self.paused
        ):
            # nothing buffered: decode DATA frames straight from the caller's
            # bytes, and buffer only what is left (a non-DATA frame, a cut header)
            view = memoryview(data)
            try:
                pos = self._sink_frames(sink, view, 0, n)
                if pos == n:
                    return []
                rb.reserve(n - pos)
                rb.buf[0 : n - pos] = view[pos:]
            finally:
                view.release()  # the caller may resize its bytearray again
            rb.start = 0
            rb.end = n - pos
            return self._parse()
        rb.reserve(n)
        rb.buf[rb.end : rb.end + n] = data
        rb.end += n
        return self._parse()

    def _receive_lending(self, data: bytes | bytearray | memoryview) -> list[Event]:
        """``receive_data`` through :meth:`get_buffer`/:meth:`buffer_updated`: a long message's
        payload goes from ``data`` to its destination (one copy), not through the receive buffer."""
        events: list[Event] = []
        with memoryview(data) as src:
            pos, n = 0, src.nbytes
            try:
                while pos < n:
                    dest = self.get_buffer(n - pos)
                    take = min(dest.nbytes, n - pos)
                    dest[:take] = src[pos : pos + take]
                    del dest  # (possibly the receive buffer's own view: dropped, not released)
                    pos += take
                    events += self.buffer_updated(take)
            except (RemoteProtocolError, HandshakeError) as err:
                err.pending_events = events + err.pending_events
                raise
        return events

    def _sink_frames(self, sink: StreamBuffer, view: memoryview, pos: int, end: int) -> int:
        """The fast path: add DATA payloads at ``view[pos:end]`` to ``sink`` (as one chunk).

        Only called with state ``OPEN``, receive half ``OPEN`` and stream mode
        -- where the tables allow DATA; ``OPEN`` implies that the magic is
        behind us and that there was no error (``_fail`` leaves ``CLOSED``,
        for good).  Every header is checked as in :meth:`_parse`; at the
        first frame that is not a valid DATA frame (or an incomplete header)
        it stops and returns its position, and the general parser takes over
        from there and raises if need be.  A DATA frame cut by ``end`` is
        added as far as it goes (``_data_left`` keeps the rest).
        ``buffer_updated`` has a copy of the loop inlined: keep the two alike.
        """
        parts: list[memoryview] = []
        left = self._data_left
        if left:
            if end - pos <= left:
                sink.add_parts([view[pos:end]])
                self._data_left = left - (end - pos)
                return end
            parts.append(view[pos : pos + left])
            pos += left
            self._data_left = 0
        limit = self.max_frame_size
        while end - pos >= _HEADER_SIZE:
            word, length = _unpack_words(view, pos)
            if word != _DATA_WORD or length > limit:
                break
            first = pos + _HEADER_SIZE
            pos = first + length
            if pos >= end:  # the last frame here: whole, or cut by end
                if pos > end:
                    self._data_left = pos - end
                    pos = end
                parts.append(view[first:pos])
                break
            parts.append(view[first:pos])
        if parts:
            sink.add_parts(parts)
        return pos

    def receive_eof(self) -> list[Event]:
        """The byte transport from the peer ended (TCP FIN or connection loss).  Passed through,
        an orderly end (a FIN) is the data's end: the stream's EOF, once (a connection lost
        without one is the owner's to report: nothing here can tell)."""
        if self.state is State.PASSED_THROUGH:
            if self.recv_half is not Half.OPEN:
                return []
            self.recv_half = Half.EOF
            return [_END_OF_STREAM]
        if self.close_received is not None or self.close_sent:
            return []
        self._check_alive()
        long = self._long
        pending = self._rb.end - self._rb.start or (long.length - long.got if long is not None else 0)
        err: Exception
        if self._data_left or pending:
            err = RemoteProtocolError(
                f"the peer closed the connection in the middle of a frame "
                f"({self._data_left or pending} bytes of it outstanding)"
            )
        elif self.state is not State.OPEN:
            err = HandshakeError(f"the peer closed the connection during the handshake (state {self.state.value})")
        else:
            err = RemoteProtocolError("the peer closed the connection without a CLOSE frame")
        self._fail(err)
        raise err

    def _parse(self, lent: bool = False) -> list[Event]:
        """The general parser, over the receive buffer.  ``lent``: the bytes came through
        :meth:`get_buffer` (only then may a long frame be lent to the socket)."""
        self._check_alive()
        events: list[Event] = []
        if self.paused or self.state is State.PASSED_THROUGH:
            return events  # (passed through: the bytes stay, unparsed, for take_passed)
        rb = self._rb
        view = rb.view
        sink = self.data_sink
        pos = rb.start
        end = rb.end
        try:
            if self._magic_left:
                pos = self._parse_magic(pos, end)
                if self._magic_left:
                    return events
            while pos < end:
                if self._data_left:
                    take = min(self._data_left, end - pos)
                    if sink is not None:
                        sink += view[pos : pos + take]
                    else:
                        events.append(Data(bytes(view[pos : pos + take])))
                    self._data_left -= take
                    pos += take
                    continue
                if end - pos < _HEADER_SIZE:
                    break
                ftype, flags, reserved, length = _unpack_header(view, pos)
                if ftype == _T_DATA and self.recv_half is _H_OPEN and self.mode is _M_STREAM:
                    if flags or reserved:
                        self._bad_header(ftype, flags, reserved)
                    if length > self.max_frame_size:
                        raise RemoteProtocolError(f"DATA frame of {length} bytes exceeds the limit {self.max_frame_size}")
                    if self.state is not _S_OPEN and self.state is not _S_CLOSE_SENT:
                        self._half_step(Half.CLOSED, HalfInput.DATA, remote=True)
                    pos += _HEADER_SIZE
                    self._data_left = length
                    continue
                if flags or reserved:
                    self._bad_header(ftype, flags, reserved)
                if ftype == FrameType.DATA:
                    # refused by the fast path: wrong mode or state; raises
                    self._handle_frame(FrameType.DATA, view[0:0])
                limit = self._frame_limit(ftype)
                if length > limit:
                    raise RemoteProtocolError(
                        f"{FrameType(ftype).name} frame of {length} bytes exceeds the limit {limit}"
                    )
                if end - pos < _HEADER_SIZE + length:
                    if (
                        lent
                        and ftype == _T_MESSAGE
                        and self.state is _S_OPEN
                        and self.recv_half is _H_OPEN
                        and self.mode is _M_MESSAGES
                        and (
                            pos + _HEADER_SIZE + length > rb.size
                            or (self._landing is not None and length <= self._landing.view.nbytes)
                        )
                    ):
                        # a long message (or one a reader waits for): the rest of its payload
                        # goes to its own destination, straight from the socket
                        self._begin_long(view, pos + _HEADER_SIZE, end, length)
                        pos = end
                        return events
                    # wait for the rest; make room for it (bounded by the check above)
                    self.peek = False
                    rb.start = pos
                    rb.reserve(_HEADER_SIZE + length - (end - pos))
                    pos = rb.start
                    return events
                payload = view[pos + HEADER.size : pos + HEADER.size + length]
                pos += HEADER.size + length
                event = self._handle_frame(FrameType(ftype), payload)
                if event is not None:
                    events.append(event)
                if self.paused or self.passed_through:
                    break  # (passed through: what follows the SELECT is data, unframed)
        except (RemoteProtocolError, HandshakeError) as err:
            if self._error is None:
                self._fail(err)
            err.pending_events = events
            raise
        finally:
            if self._error is None:
                rb.start = pos
                if pos == rb.end:
                    rb.start = rb.end = 0
                    if rb.size > RECV_BUFFER_SIZE:
                        rb.shrink()
        return events

    def _parse_magic(self, pos: int, end: int) -> int:
        offset = len(MAGIC) - self._magic_left
        take = min(self._magic_left, end - pos)
        got = bytes(self._rb.view[pos : pos + take])
        if got != MAGIC[offset : offset + take]:
            err = HandshakeError(f"the peer does not speak aiordma (it sent {got!r} where {MAGIC!r} was expected)")
            self._fail(err)
            raise err
        self._magic_left -= take
        return pos + take

    def _bad_header(self, ftype: int, flags: int, reserved: int) -> None:
        err = RemoteProtocolError(f"frame type {ftype:#x} has flags {flags:#x} / reserved {reserved:#x}, both must be 0")
        self._fail(err)
        raise err

    def _frame_limit(self, ftype: int) -> int:
        if ftype == FrameType.MESSAGE:
            return self.max_message_size
        if ftype == FrameType.DATA:
            return self.max_frame_size
        if ftype == FrameType.MEMORY:
            return self.max_frame_size + MEMORY_OVERHEAD
        limit = _CONTROL_LIMITS.get(ftype)
        if limit is None:
            err = RemoteProtocolError(f"unknown frame type {ftype:#x}")
            self._fail(err)
            raise err
        return limit

    def _handle_frame(self, ftype: FrameType, payload: memoryview) -> Event | None:
        try:
            return self._dispatch(ftype, payload)
        except (RemoteProtocolError, HandshakeError) as err:
            if self._error is None:
                self._fail(err)
            raise

    def _dispatch(self, ftype: FrameType, payload: memoryview) -> Event | None:
        if ftype is FrameType.MESSAGE:
            if self.mode is not Mode.MESSAGES:
                raise RemoteProtocolError("MESSAGE frame on a byte-stream connection")
            if self.state not in _READING:
                self._half_step(Half.CLOSED, HalfInput.MESSAGE, remote=True)
            self.recv_half = self._half_step(self.recv_half, HalfInput.MESSAGE, remote=True)
            self.received_messages += 1
            self.received_message_bytes += len(payload)
            landing = self._landing
            if landing is not None:  # the next message is the waiting reader's, if it fits
                self._landing = None
                n = len(payload)
                if n <= landing.view.nbytes:
                    landing.view[:n] = payload
                    landing.length = n
                    return None
            return Message(bytes(payload))
        if ftype is FrameType.DATA:
            # only reached when the fast path refused it: wrong mode or state
            if self.mode is not Mode.STREAM:
                raise RemoteProtocolError("DATA frame on a message connection")
            self._half_step(self.recv_half if self.state in _READING else Half.CLOSED, HalfInput.DATA, remote=True)
            raise AssertionError("unreachable")  # pragma: no cover
        if ftype is FrameType.MEMORY:
            if self.state not in _READING:
                raise RemoteProtocolError(f"MEMORY frame in state {self.state.value}")
            if self.mode is Mode.STREAM and len(payload) and payload[0] == _MEMORY_RNDV:
                # a stream's rendezvous: its bytes come before everything after it, so nothing
                # after it is parsed until they are in (resume())
                self.paused = True
            elif len(payload) and payload[0] == _MEMORY_RNDV:
                self._landing = None  # (a rendezvous message comes first: the reader takes it from the sink)
            return MemoryFrame(bytes(payload))
        if ftype is FrameType.EOF:
            if self.state not in _READING:
                self._half_step(Half.CLOSED, HalfInput.EOF, remote=True)
            self.recv_half = self._half_step(self.recv_half, HalfInput.EOF, remote=True)
            return _END_OF_STREAM
        if ftype is FrameType.CLOSE:
            if len(payload) < CLOSE_FIXED.size:
                raise RemoteProtocolError("CLOSE frame shorter than its code")
            (code,) = CLOSE_FIXED.unpack_from(payload, 0)
            reason = _decode_reason(payload[CLOSE_FIXED.size :], "CLOSE")
            self._step(Input.RECV_CLOSE, remote=True)
            self.handshake_deadline = None
            self.send_half = Half.CLOSED
            self.recv_half = Half.CLOSED
            self.close_received = ConnectionClosed(code, reason)
            return self.close_received
        if ftype is FrameType.AUTH:
            return self._receive_auth(payload)
        if ftype is FrameType.HELLO:
            hello = decode_hello(payload)
            if hello.mode is not self.mode:
                raise HandshakeError(
                    f"the peer is a {_MODE_NAMES[hello.mode]} endpoint, this side is a {_MODE_NAMES[self.mode]}"
                )
            if self.role is Role.CLIENT and self.auth_key is not None and self.state is State.AWAIT_HELLO:
                raise AuthenticationError(
                    "authentication failed: the server did not prove it has the key (it has none; this side has one)"
                )
            self._step(Input.RECV_HELLO, remote=True)
            if self.role is Role.SERVER:
                self._client_hello = bytes(payload)
            self.peer_hello = hello
            self._peer_max_message = hello.max_message_size
            self._peer_max_frame = hello.max_frame_size
            return HelloReceived(hello)
        if ftype is FrameType.SELECT:
            if len(payload) < SELECT_FIXED.size:
                raise RemoteProtocolError("SELECT frame is empty")
            (code,) = SELECT_FIXED.unpack_from(payload, 0)
            transport = _TRANSPORT_NAMES.get(code)
            if transport is None:
                raise RemoteProtocolError(f"SELECT names unknown transport {code}")
            reason = _decode_reason(payload[SELECT_FIXED.size :], "SELECT")
            self._step(Input.RECV_SELECT, remote=True)
            if transport == "rdma" and not (
                self.local_hello and self.local_hello.can_rdma and self.peer_hello and self.peer_hello.can_rdma
            ):
                raise RemoteProtocolError("the peer selected RDMA, which was not offered by both sides")
            self._opened(transport, reason)
            return TransportSelected(transport, reason)
        raise RemoteProtocolError(f"unexpected frame {ftype.name}")  # pragma: no cover


