"""The life cycle of one RDMA connection, as a table (in the style of ``aiordma._proto.states``).

::

    SETUP ──activate──▶ OPEN ──close──▶ CLOSING ──close_sent──▶ LINGER ──drain──▶ DRAINING ──drained──▶ CLOSED
      │                  │                 │                       │                  ▲
      └──fail/close/drain┴───fail/drain────┴───────fail/drain──────┴──────────────────┘

* ``SETUP``: the QP is being brought up; receive buffers are posted (a SEND
  that arrives before the switch is kept for the link).
* ``OPEN``: data flows both ways.
* ``CLOSING``: no new sends are taken; the backlog and the CLOSE frame are
  being posted, the last work request signaled, and we wait for its completion.
* ``LINGER``: the CLOSE frame was delivered (its completion came back), but the
  peer may still READ what we staged for it (rendezvous regions): the QP stays
  up, receives and returns credits, and posts nothing else, until the peer
  took everything (or stopped making progress) and the link drains.
* ``DRAINING``: the QP is in ERROR (or about to be): every posted work request
  comes back (flushed), then the QP can be destroyed and its buffers reused.
* ``CLOSED``: QP destroyed, buffers returned, device reference released.

``fail`` (a failed completion, a broken peer, a lost TCP connection, a fatal
async event) goes straight to ``DRAINING`` from anywhere before it: nothing
more is posted except what teardown needs.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["LinkState", "LinkInput", "LIFECYCLE", "next_state"]


class LinkState(enum.Enum):
    SETUP = "setup"
    OPEN = "open"
    CLOSING = "closing"
    LINGER = "linger"
    DRAINING = "draining"
    CLOSED = "closed"


class LinkInput(enum.Enum):
    ACTIVATE = "activate"  # the transport was selected: the link takes over from TCP
    CLOSE = "close"  # the user closes (orderly)
    CLOSE_SENT = "close_sent"  # the last SEND before closing completed (or could not)
    FAIL = "fail"  # the connection broke
    DRAIN = "drain"  # teardown: the QP goes to ERROR now
    DRAINED = "drained"  # every posted work request came back; the QP is destroyed


_S, _I = LinkState, LinkInput

LIFECYCLE: Final[dict[tuple[LinkState, LinkInput], LinkState]] = {
    (_S.SETUP, _I.ACTIVATE): _S.OPEN,
    (_S.SETUP, _I.CLOSE): _S.DRAINING,  # a setup that is abandoned (fallback, error)
    (_S.SETUP, _I.FAIL): _S.DRAINING,
    (_S.OPEN, _I.CLOSE): _S.CLOSING,
    (_S.OPEN, _I.FAIL): _S.DRAINING,
    (_S.CLOSING, _I.CLOSE): _S.CLOSING,
    (_S.CLOSING, _I.CLOSE_SENT): _S.LINGER,
    (_S.CLOSING, _I.FAIL): _S.DRAINING,
    (_S.LINGER, _I.CLOSE): _S.LINGER,
    (_S.LINGER, _I.CLOSE_SENT): _S.LINGER,
    (_S.LINGER, _I.FAIL): _S.DRAINING,
    (_S.LINGER, _I.DRAIN): _S.DRAINING,
    (_S.DRAINING, _I.CLOSE): _S.DRAINING,
    (_S.DRAINING, _I.FAIL): _S.DRAINING,
    (_S.DRAINING, _I.CLOSE_SENT): _S.DRAINING,
    (_S.SETUP, _I.DRAIN): _S.DRAINING,
    (_S.OPEN, _I.DRAIN): _S.DRAINING,
    (_S.CLOSING, _I.DRAIN): _S.DRAINING,
    (_S.DRAINING, _I.DRAIN): _S.DRAINING,
    (_S.DRAINING, _I.DRAINED): _S.CLOSED,
    (_S.CLOSED, _I.CLOSE): _S.CLOSED,
    (_S.CLOSED, _I.FAIL): _S.CLOSED,
    (_S.CLOSED, _I.CLOSE_SENT): _S.CLOSED,
}


def next_state(state: LinkState, event: LinkInput) -> LinkState:
    """The state after ``event``; a pair missing from the table is a bug (``RuntimeError``)."""
    try:
        return LIFECYCLE[(state, event)]
    except KeyError:
        raise RuntimeError(f"RDMA link: {event.value!r} is not allowed in state {state.value!r}") from None
