"""Every state machine of the aiordma protocol, as data.

Two tables drive :class:`aiordma._proto.protocol.Connection`:

* ``HANDSHAKE`` -- the connection as a whole, from the first byte to ``OPEN`` and
  ``CLOSED`` (or ``PASSED_THROUGH``: a byte stream over TCP whose two ends offered to carry the
  data unframed).  A client sends HELLO, reads the server's HELLO and then SELECTs
  the transport; a server reads HELLO, answers with its own and waits for the
  client's SELECT.  With a pre-shared key an AUTH exchange (challenge and proof
  each way) comes between the client's HELLO and the server's.
* ``HALF`` -- once open, each direction (what we send, what we receive) is a
  half of its own: ``OPEN`` until an EOF frame passes, ``EOF`` after it, and
  ``CLOSED`` after a CLOSE frame.

A pair (state, input) that is not in a table is a protocol violation: the
connection code turns it into a :class:`~aiordma.LocalProtocolError` when the
input came from this side and a :class:`~aiordma.RemoteProtocolError` when it
came from the wire.
"""

from __future__ import annotations

import enum
from typing import Final


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


class State(enum.Enum):
    """States of the connection as a whole."""

    IDLE = "idle"  # nothing sent or received yet
    AWAIT_HELLO = "await-hello"  # we wait for the peer's HELLO
    AUTH_CHALLENGED = "auth-challenged"  # client: the server proved its key; our proof is due
    AWAIT_HELLO_AUTHED = "await-hello-authed"  # client: proof sent, waiting for the server's HELLO
    AUTH_SENT = "auth-sent"  # server: challenge and proof sent, waiting for the client's proof
    AUTHENTICATED = "authenticated"  # server: the client proved its key; our HELLO is due
    SELECTING = "selecting"  # client: HELLOs exchanged, transport not chosen yet
    HELLO_RECEIVED = "hello-received"  # server: client's HELLO read, ours not sent yet
    AWAIT_SELECT = "await-select"  # server: waits for the client's SELECT
    OPEN = "open"  # data may flow (each direction has its own HALF state)
    #: we sent CLOSE on an open connection: what the peer sent before it saw ours still comes,
    #: and is parsed (and dropped by the Core) until the peer's CLOSE or the end
    CLOSE_SENT = "close-sent"
    CLOSED = "closed"  # a CLOSE frame went one way or the other, or an error
    #: both sides offered to pass the connection through and TCP was selected (a byte stream):
    #: from the byte after the SELECT on, the data flows unframed, each way -- the protocol
    #: parses and frames nothing more (what it read after the SELECT is the data's first bytes)
    PASSED_THROUGH = "passed-through"


class Input(enum.Enum):
    """What can happen to the connection as a whole."""

    SEND_HELLO = "send HELLO"
    RECV_HELLO = "receive HELLO"
    SEND_AUTH = "send AUTH"
    RECV_AUTH = "receive AUTH"
    SEND_SELECT = "send SELECT"
    RECV_SELECT = "receive SELECT"
    SEND_CLOSE = "send CLOSE"
    RECV_CLOSE = "receive CLOSE"
    FAIL = "fail"
    PASS_THROUGH = "pass through"


HANDSHAKE: Final[dict[tuple[Role, State, Input], State]] = {
    # client: HELLO -> (peer HELLO) -> SELECT -> OPEN
    (Role.CLIENT, State.IDLE, Input.SEND_HELLO): State.AWAIT_HELLO,
    (Role.CLIENT, State.AWAIT_HELLO, Input.RECV_HELLO): State.SELECTING,
    (Role.CLIENT, State.SELECTING, Input.SEND_SELECT): State.OPEN,
    # server: (peer HELLO) -> HELLO -> (peer SELECT) -> OPEN
    (Role.SERVER, State.IDLE, Input.RECV_HELLO): State.HELLO_RECEIVED,
    (Role.SERVER, State.HELLO_RECEIVED, Input.SEND_HELLO): State.AWAIT_SELECT,
    (Role.SERVER, State.AWAIT_SELECT, Input.RECV_SELECT): State.OPEN,
    # with a key (auth=): the server answers HELLO with AUTH (its nonce and proof) and sends
    # its own HELLO -- the first point where it creates RDMA resources -- only after the
    # client's AUTH (its proof) checked out
    (Role.CLIENT, State.AWAIT_HELLO, Input.RECV_AUTH): State.AUTH_CHALLENGED,
    (Role.CLIENT, State.AUTH_CHALLENGED, Input.SEND_AUTH): State.AWAIT_HELLO_AUTHED,
    (Role.CLIENT, State.AWAIT_HELLO_AUTHED, Input.RECV_HELLO): State.SELECTING,
    (Role.SERVER, State.HELLO_RECEIVED, Input.SEND_AUTH): State.AUTH_SENT,
    (Role.SERVER, State.AUTH_SENT, Input.RECV_AUTH): State.AUTHENTICATED,
    (Role.SERVER, State.AUTHENTICATED, Input.SEND_HELLO): State.AWAIT_SELECT,
    # right after the SELECT (sent or received) of TCP, when both HELLOs offered it
    (Role.CLIENT, State.OPEN, Input.PASS_THROUGH): State.PASSED_THROUGH,
    (Role.SERVER, State.OPEN, Input.PASS_THROUGH): State.PASSED_THROUGH,
}
# Either side may close (or fail) at any point, including in the middle of the
# handshake: a server that refuses a client sends CLOSE instead of HELLO.
for _role in Role:
    for _state in State:
        if _state is State.PASSED_THROUGH:
            continue  # (no frame comes or goes any more: a CLOSE cannot, and nothing can fail)
        if _state is not State.CLOSED:
            HANDSHAKE[(_role, _state, Input.SEND_CLOSE)] = State.CLOSED
            HANDSHAKE[(_role, _state, Input.RECV_CLOSE)] = State.CLOSED
        HANDSHAKE[(_role, _state, Input.FAIL)] = State.CLOSED
    # closing an open connection: the peer's frames already on their way are still read
    HANDSHAKE[(_role, State.OPEN, Input.SEND_CLOSE)] = State.CLOSE_SENT


class Half(enum.Enum):
    """State of one direction of an open connection."""

    OPEN = "open"
    EOF = "eof"  # EOF passed: no more data this way
    CLOSED = "closed"


class HalfInput(enum.Enum):
    DATA = "data"
    MESSAGE = "message"
    EOF = "EOF"
    CLOSE = "CLOSE"


HALF: Final[dict[tuple[Half, HalfInput], Half]] = {
    (Half.OPEN, HalfInput.DATA): Half.OPEN,
    (Half.OPEN, HalfInput.MESSAGE): Half.OPEN,
    (Half.OPEN, HalfInput.EOF): Half.EOF,
    (Half.OPEN, HalfInput.CLOSE): Half.CLOSED,
    (Half.EOF, HalfInput.CLOSE): Half.CLOSED,
}
