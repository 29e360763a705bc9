"""Credit-based flow control, simulated without a NIC: never over-sends, never deadlocks."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma._rdma.credits import CreditError, Credits, SendKind, pack_imm, unpack_imm


@dataclass
class Side:
    credits: Credits
    #: data SENDs that arrived and wait for the application to consume them
    unread: int = 0
    delivered: int = 0
    #: data SENDs the application still wants to send
    backlog: int = 0
    #: receive buffers posted at the peer for our SENDs: the NIC's view, kept independently
    posted_at_peer: int = 0
    credit_sends: int = 0
    wire: deque[int] = field(default_factory=deque)


def make(window: int, control: int) -> tuple[Side, Side]:
    a, b = Side(Credits(window, control)), Side(Credits(window, control))
    a.posted_at_peer = b.posted_at_peer = a.credits.buffers
    return a, b


def try_send(me: Side) -> bool:
    if me.backlog and me.credits.can_send_data():
        me.wire.append(pack_imm(SendKind.DATA, *me.credits.on_send_data()))
        me.backlog -= 1
        return True
    if me.credits.should_send_credit():
        me.wire.append(pack_imm(SendKind.CREDIT, *me.credits.on_send_credit()))
        me.credit_sends += 1
        return True
    return False


def deliver(sender: Side, receiver: Side) -> bool:
    if not sender.wire:
        return False
    kind, returned, control = unpack_imm(sender.wire.popleft())
    assert sender.posted_at_peer > 0, "a SEND arrived with no receive buffer posted: RNR"
    sender.posted_at_peer -= 1
    receiver.credits.on_receive(kind, returned, control)
    if kind is SendKind.DATA:
        receiver.unread += 1
    else:  # a credit message's buffer is posted again at once
        receiver.credits.on_repost(SendKind.CREDIT)
        sender.posted_at_peer += 1
    return True


def consume(me: Side, peer: Side) -> bool:
    if not me.unread:
        return False
    me.unread -= 1
    me.delivered += 1
    me.credits.on_repost(SendKind.DATA)
    peer.posted_at_peer += 1
    return True


ACTIONS = st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from(["send", "deliver", "consume", "want"])))


@given(window=st.integers(1, 9), control=st.integers(1, 3), actions=ACTIONS)
@settings(max_examples=500, deadline=None)
def test_never_oversends_and_never_deadlocks(window: int, control: int, actions: list[tuple[str, str]]) -> None:
    a, b = make(window, control)
    sides = {"a": (a, b), "b": (b, a)}
    wanted = {"a": 0, "b": 0}
    for who, action in actions:
        me, peer = sides[who]
        if action == "want":
            me.backlog += 3
            wanted[who] += 3
        elif action == "send":
            try_send(me)
        elif action == "deliver":
            deliver(me, peer)
        else:
            consume(me, peer)
    # both applications now read everything and send what they wanted: all of it must arrive
    steps = 0
    while True:
        progress = False
        for who in "ab":
            me, peer = sides[who]
            progress |= try_send(me)
            progress |= deliver(me, peer)
            progress |= consume(me, peer)
        steps += 1
        assert steps < 10_000, "credit messages ping-pong forever"
        if not progress:
            break
    assert a.backlog == 0 and b.backlog == 0, "deadlock: data left unsent"
    assert b.delivered == wanted["a"] and a.delivered == wanted["b"]
    # credit messages are few: at most about two per window of data
    total = wanted["a"] + wanted["b"]
    assert a.credit_sends + b.credit_sends <= 2 * (total // max(1, window // 2) + 1)
    # at rest nothing is lost (credits not yet returned ride on the next SEND) and each side can send
    assert a.credits.available + b.credits.to_return == window
    assert b.credits.available + a.credits.to_return == window
    assert a.credits.can_send_data() and b.credits.can_send_data()


def test_imm_round_trip_and_range() -> None:
    for kind in SendKind:
        assert unpack_imm(pack_imm(kind, 12345, 7)) == (kind, 12345, 7)
    with pytest.raises(CreditError):
        pack_imm(SendKind.DATA, 1 << 24, 0)


def test_a_peer_sending_without_credit_is_caught() -> None:
    c = Credits(2, 1)
    c.on_receive(SendKind.DATA, 0, 0)
    c.on_receive(SendKind.DATA, 0, 0)
    with pytest.raises(CreditError, match="without a credit"):
        c.on_receive(SendKind.DATA, 0, 0)
    with pytest.raises(CreditError, match="returns nothing"):
        c.on_receive(SendKind.CREDIT, 0, 0)


def test_returning_too_many_credits_is_caught() -> None:
    c = Credits(4)
    with pytest.raises(CreditError, match="more credits than it could owe"):
        c.on_receive(SendKind.DATA, 1, 0)


def test_reposting_more_than_consumed_is_caught() -> None:
    c = Credits(4)
    with pytest.raises(CreditError):
        c.on_repost(SendKind.DATA)


def test_starved_peer_gets_a_credit_message() -> None:
    c = Credits(4, threshold=2)
    for _ in range(4):
        c.on_receive(SendKind.DATA, 0, 0)
    assert c.peer_available == 0
    c.on_repost(SendKind.DATA)
    assert c.should_send_credit()  # only one to return, but the peer is starved
    assert c.on_send_credit() == (1, 0)
    assert not c.should_send_credit()
