"""Credit-based flow control for the RDMA transport, as a small object of its own.

Theory of operation
-------------------
On an RC queue pair a SEND consumes one receive work request that the peer
posted in advance.  If none is posted the peer's NIC answers "receiver not
ready" and ours retries ``rnr_retry`` times, then fails the QP.  So a sender
must never have more SENDs on their way than the peer has buffers posted:
each posted receive buffer is a *credit*, granted to the peer when announced.

Each side posts ``window + control`` receive buffers.  Two kinds of SEND use
them, each with its own budget:

* **data** SENDs (DATA, MESSAGE, EOF, CLOSE frames) cost one *data* credit;
  at most ``window`` are outstanding.
* **credit** SENDs carry no payload; they only return credits.  They cost a
  *control* credit; at most ``control`` are outstanding.

Every SEND's immediate data returns the credits of both kinds that its sender
freed (re-posted buffers) since its last SEND.  A credit SEND is due when the
data credits to return reach ``threshold`` (half the window by default), or
when the peer has no data credit left and we have any to return.  Control
credits are never a reason to send: they ride on the next SEND.

Why this cannot deadlock: a credit SEND returns at least one data credit and
is never answered by another credit SEND, so they cannot ping-pong; and with
``threshold`` at most half the window, two credit SENDs return a whole window,
after which the peer cannot be starved until it sends data again -- and that
data returns our control credits.  ``tests/test_credits.py`` checks this by
simulation.

Nothing here does I/O.  The RDMA link asks :meth:`can_send_data` and
:meth:`should_send_credit`, calls ``on_send_*`` when it posts (and puts the
returned pair in the immediate data), :meth:`on_receive` for each arriving
SEND, and :meth:`on_repost` when it posts a consumed buffer again.
"""

from __future__ import annotations

import enum

__all__ = ["Credits", "CreditError", "SendKind", "pack_imm", "unpack_imm"]


class CreditError(RuntimeError):
    """The credit accounting was broken (a misbehaving peer, or a bug)."""


class SendKind(enum.IntEnum):
    DATA = 0
    CREDIT = 1


# Immediate data layout (32 bits): kind (1 bit) | control credits (7 bits) | data credits (24 bits)
_DATA_BITS = 24
_DATA_MASK = (1 << _DATA_BITS) - 1
_CTRL_MASK = 0x7F


def pack_imm(kind: SendKind, data_credits: int, control_credits: int) -> int:
    if not 0 <= data_credits <= _DATA_MASK or not 0 <= control_credits <= _CTRL_MASK:
        raise CreditError("credit counts out of range for the immediate data")
    return (int(kind) << 31) | (control_credits << _DATA_BITS) | data_credits


def unpack_imm(imm: int) -> tuple[SendKind, int, int]:
    return SendKind(imm >> 31 & 1), imm & _DATA_MASK, imm >> _DATA_BITS & _CTRL_MASK


class Credits:
    """The credits of one side of an RDMA connection.

    ``window``/``control`` are the buffers the *peer* posted (what we may send);
    ``local_window``/``local_control`` the buffers *we* post (default: the same).
    """

    def __init__(
        self,
        window: int,
        control: int = 2,
        threshold: int | None = None,
        *,
        local_window: int | None = None,
        local_control: int | None = None,
    ) -> None:
        local_window = window if local_window is None else local_window
        local_control = control if local_control is None else local_control
        for w, c in ((window, control), (local_window, local_control)):
            if w < 1 or not 1 <= c <= _CTRL_MASK:
                raise ValueError("windows must be >= 1 and control between 1 and 127")
        if threshold is None:
            threshold = max(1, local_window // 2)
        if not 1 <= threshold <= max(1, local_window // 2):
            raise ValueError("threshold must be between 1 and half the local window")
        self.window = window
        self.control = control
        self.local_window = local_window
        self.local_control = local_control
        self.threshold = threshold
        #: sends we may post, by kind
        self.available = window
        self.control_available = control
        #: buffers we re-posted and have not announced yet, by kind
        self.to_return = 0
        self.control_to_return = 0
        #: data credits the peer holds on us, as far as we know
        self.peer_available = local_window
        self.peer_control_available = local_control

    @property
    def buffers(self) -> int:
        """How many receive buffers we keep posted."""
        return self.local_window + self.local_control

    def can_send_data(self) -> bool:
        return self.available > 0

    def should_send_credit(self) -> bool:
        """A credit-only SEND is due now (and affordable)."""
        if self.to_return == 0 or self.control_available == 0:
            return False
        return self.to_return >= self.threshold or self.peer_available == 0

    def _returns(self) -> tuple[int, int]:
        returned, control = self.to_return, self.control_to_return
        self.to_return = self.control_to_return = 0
        self.peer_available += returned
        self.peer_control_available += control
        return returned, control

    def on_send_data(self) -> tuple[int, int]:
        """We post a data SEND; returns (data, control) credits for its immediate data."""
        if self.available <= 0:
            raise CreditError("no data credit left for this send")
        self.available -= 1
        return self._returns()

    def on_send_credit(self) -> tuple[int, int]:
        """We post a credit-only SEND; returns the credits it carries."""
        if self.control_available <= 0:
            raise CreditError("no control credit left for a credit message")
        if self.to_return == 0:
            raise CreditError("a credit message must return at least one data credit")
        self.control_available -= 1
        return self._returns()

    def on_receive(self, kind: SendKind, returned: int, control_returned: int) -> None:
        """A SEND of ``kind`` arrived from the peer, returning credits to us."""
        if kind is SendKind.DATA:
            if self.peer_available <= 0:
                raise CreditError("the peer sent data without a credit")
            self.peer_available -= 1
        else:
            if self.peer_control_available <= 0:
                raise CreditError("the peer sent a credit message without a control credit")
            if returned == 0:
                raise CreditError("the peer sent a credit message that returns nothing")
            self.peer_control_available -= 1
        if self.available + returned > self.window or self.control_available + control_returned > self.control:
            raise CreditError("the peer returned more credits than it could owe")
        self.available += returned
        self.control_available += control_returned

    def on_repost(self, kind: SendKind) -> None:
        """We posted again the buffer that a SEND of ``kind`` had consumed."""
        if kind is SendKind.DATA:
            if self.to_return + self.peer_available >= self.local_window:
                raise CreditError("more data buffers re-posted than were consumed")
            self.to_return += 1
        else:
            if self.control_to_return + self.peer_control_available >= self.local_control:
                raise CreditError("more control buffers re-posted than were consumed")
            self.control_to_return += 1
