"""The checked sans-IO RDMA session against itself (hypothesis), and the native one beside it.

Both data paths' sessions run over one model of the RC wire (tests/_rc_model.py): each side's
receive queue is a FIFO of posted buffers, a SEND consumes the head (none posted: the test fails --
that is an RNR on a real NIC), its bytes are read from the sender's memory *when it is delivered*
(so a slot reused too early shows up as corrupted bytes), a send-queue entry is retired only when
a signaled completion at or after it is polled.  Random sizes, any legal pair of window/buffer
configurations, random interleavings of delivery, polling, writing and reading, and a reader that
stalls.  The checked session's own cases follow (hostile completions, close, a small send queue);
the native one's are in test_native_session.py.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiordma._errors import RemoteProtocolError
from aiordma._rdma.constants import WCOpcode, WCStatus
from aiordma._rdma.session import detach_views, queue_views
from aiordma._rdma.states import LinkState

from ._rc_model import FLAVORS, Checked, Flavor, Side, deliver, exchange, pair, poll

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
RECV = int(WCOpcode.RECV)
FLUSH = int(WCStatus.WR_FLUSH_ERR)


configs = st.tuples(
    st.integers(1, 8),  # window
    st.integers(1, 3),  # control
    st.sampled_from([256, 512, 4096]),  # buffer size
    st.integers(0, 6),  # extra send-queue entries
    st.sampled_from([0, 64, 256]),  # granted inline size (the native path's)
)


@pytest.mark.parametrize("flavor", FLAVORS)
@SETTINGS
@given(a_cfg=configs, b_cfg=configs, sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=6),
       seed=st.integers(0, 2**32), stall=st.booleans(), high_water=st.sampled_from([512, 4096, 1 << 20]))  # fmt: skip
def test_two_sessions_move_every_byte_once_in_order(
    flavor: type[Flavor],
    a_cfg: tuple[int, int, int, int, int],
    b_cfg: tuple[int, int, int, int, int],
    sizes: list[int],
    seed: int,
    stall: bool,
    high_water: int,
) -> None:
    """Either data path's session against itself on the model of the RC wire (tests/_rc_model.py)."""
    exchange(flavor(), a_cfg, b_cfg, sizes, seed, stall, high_water)


CHECKED = Checked()


def _pair(window: int = 4, control: int = 2, buf: int = 256) -> tuple[Side, Side]:
    return pair(CHECKED, window, control, buf)


def test_a_write_with_immediate_is_refused_and_the_batch_still_accounted() -> None:
    a, b = _pair()
    r0, r1 = b.rq.popleft(), b.rq.popleft()
    entries = [(r0[0], 0, int(WCOpcode.RECV_RDMA_WITH_IMM), 10, 0, b.ident), (r1[0], FLUSH, RECV, 0, -1, b.ident)]
    views, reposts = b.session.on_completions(entries, 0)
    assert isinstance(b.session.error, RemoteProtocolError)
    assert "RDMA WRITE" in str(b.session.error)
    assert views == [] and reposts == []
    # both buffers were accounted, although the first one was bad
    assert b.session.rq_posted == b.session.window + b.session.control - 2


def test_a_credit_send_with_payload_is_refused() -> None:
    a, b = _pair()
    r0 = b.rq.popleft()
    b.session.on_completions([(r0[0], 0, RECV, 5, 1 << 31 | 1, b.ident)], 0)
    assert isinstance(b.session.error, RemoteProtocolError)
    assert "credit-only SEND carried 5 bytes" in str(b.session.error)


def test_over_returned_credits_fail_cleanly_and_buffers_still_come_back() -> None:
    a, b = _pair()
    r0 = b.rq.popleft()
    # a DATA SEND that returns 5 credits nobody owed
    b.session.on_completions([(r0[0], 0, RECV, 3, 5, b.ident)], 0)
    assert isinstance(b.session.error, RemoteProtocolError)
    assert b.session.state is LinkState.DRAINING
    b.session.begin_drain()
    b.session.on_completions([(w[0], FLUSH, RECV, 0, -1, b.ident) for w in b.rq], 0)
    assert b.session.drained
    b.session.reclaim()


def test_a_send_without_immediate_and_an_unknown_wr_id_are_errors() -> None:
    a, b = _pair()
    r0 = b.rq.popleft()
    b.session.on_completions([(r0[0], 0, RECV, 3, -1, b.ident)], 0)
    assert "without immediate" in str(b.session.error)
    a.session.on_completions([(999, 0, RECV, 3, 0, a.ident)], 0)
    assert "not posted" in str(a.session.error)


def test_close_signals_the_last_send_and_waits_for_it() -> None:
    a, b = _pair()
    a.session.queue([b"x" * 10])
    CHECKED.post(a)  # unsignaled (signal_every=4)
    assert a.sq and not a.sq[-1][1]
    a.session.begin_close()
    CHECKED.post(a)  # the last one went unsignaled: a signaled zero-length WRITE follows
    assert a.sq[-1][1]
    assert not a.session.close_sent
    while a.wire:
        deliver(CHECKED, a, b)
    poll(CHECKED, a)
    assert a.session.close_sent
    assert a.session.state is LinkState.LINGER


def test_send_queue_never_overruns_with_a_small_granted_depth() -> None:
    """B2: the send queue is bounded by the granted depth, not by the peer's window."""
    a = CHECKED.make_side("A", 1, 2, 1, 4096, 0)
    b = CHECKED.make_side("B", 2, 64, 2, 256, 0)
    a.sq_depth = 3  # what a small grant would give
    CHECKED.start(a, b, 1 << 20)
    CHECKED.start(b, a, 1 << 20)
    a.session.queue([b"y" * 10_000])
    CHECKED.post(a)
    assert len(a.sq) <= 3
    while a.session.backlog or a.wire or a.cq or b.cq:
        if a.wire:
            deliver(CHECKED, a, b)
        if b.cq:
            poll(CHECKED, b)
        if a.cq:
            poll(CHECKED, a)
        if b.wire:
            deliver(CHECKED, b, a)
    assert b.received == b"y" * 10_000


@given(st.lists(st.tuples(st.lists(st.integers(1, 40), min_size=1, max_size=3), st.booleans()), min_size=1, max_size=30),
       st.integers(0, 2000))  # fmt: skip
def test_detach_copies_only_the_calls_own_unposted_views(calls: list[tuple[list[int], bool]], posted: int) -> None:
    """Each write detaches its own views (and only those) from the caller's buffers: the bytes
    sent are what was written even if the caller reuses its buffer, and a write behind a long
    backlog does not walk (or copy again) what earlier writes queued."""
    class Counting(deque):  # type: ignore[type-arg]
        reads = 0

        def __getitem__(self, index: Any) -> Any:
            Counting.reads += 1
            return super().__getitem__(index)

    backlog: deque[memoryview] = Counting()
    enqueued = 0
    expected = bytearray()
    sources: list[bytearray] = []
    for sizes, mutable in calls:
        chunks: list[bytes | bytearray] = []
        for size in sizes:
            data = bytes(random.randrange(256) for _ in range(size))
            expected += data
            if mutable:
                buf = bytearray(data)
                sources.append(buf)
                chunks.append(buf)
            else:
                chunks.append(data)
        before_ids = [id(v) for v in backlog]
        added = queue_views(backlog, chunks)
        end = enqueued + added
        enqueued = end
        mark = min(posted, enqueued - added)  # (nothing this call queued is posted yet)
        Counting.reads = 0
        detach_views(backlog, enqueued, mark, end, added)
        assert Counting.reads <= len(sizes)  # its own views only: linear in the writes, not the backlog
        assert [id(v) for v in list(backlog)[: len(before_ids)]] == before_ids  # earlier views untouched
        for view in list(backlog)[len(before_ids) :]:
            assert isinstance(view.obj, bytes)  # this call's views no longer point at its buffers
    for buf in sources:
        buf[:] = b"\0" * len(buf)  # the callers reuse their buffers
    assert b"".join(bytes(v) for v in backlog) == bytes(expected)
