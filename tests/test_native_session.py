"""The native data path (``_native/aiordma_fast.c``) on the host: its own cases.

Two :class:`NativeSession` objects in record mode (no device: C writes the work requests it would
post into arrays) over the model of the RC wire both sessions share (tests/_rc_model.py, where the
property test of either against itself runs: test_rdma_session.py), with completions processed by
the same C function the poller's wake calls (``aiordma_chan_process`` / ``aiordma_chan_finish``):
hostile completions, inline sends, the close fence, a cid's earlier generation.
"""

from __future__ import annotations

import pytest

from aiordma._errors import RemoteProtocolError
from aiordma._rdma.fastpath import native_lib
from aiordma._rdma.states import LinkState

from ._rc_model import Native, Side, deliver, pair, poll

NATIVE = native_lib()
pytestmark = pytest.mark.skipif(NATIVE is None, reason="the native module is not built here")


def _pair(window: int = 4, control: int = 2, buf: int = 256, max_inline: int = 0) -> tuple[Side, Side, Native]:
    flavor = Native()
    a, b = pair(flavor, window, control, buf, max_inline)
    return a, b, flavor


def _inject(flavor: Native, side: Side, entry: tuple[int, int, int, int, int, int]) -> BaseException | None:
    """Process one completion of the peer's making at ``side``; returns the session's error."""
    side.cq.append(entry)
    try:
        poll(flavor, side, 1)
    except AssertionError:
        pass
    return side.session.error


def test_hostile_completions_are_typed_errors_and_buffers_still_come_back() -> None:
    _ffi, lib = NATIVE  # type: ignore[misc]
    recv, imm_flag = int(lib.IBV_WC_RECV), int(lib.IBV_WC_WITH_IMM)
    cases = [
        # an RDMA WRITE with immediate into our memory
        ((int(lib.IBV_WC_RECV_RDMA_WITH_IMM), 0, 1, imm_flag), "RDMA WRITE with immediate"),
        # a credit-only SEND with a payload
        ((recv, 10, 1 << 31 | 1, imm_flag), "credit-only SEND carried 10 bytes"),
        # a SEND without immediate data
        ((recv, 4, 0, 0), "without immediate data"),
        # a SEND larger than our buffers
        ((recv, 100_000, 0, imm_flag), "exceeds our buffers"),
        # more credits back than could be owed
        ((recv, 4, 50, imm_flag), "more credits"),
    ]
    for (opcode, length, imm, flags), text in cases:
        a, b, flavor = _pair()
        wr_id, _addr, _len = b.rq[0]
        error = _inject(flavor, b, (wr_id, 0, opcode, length, imm, flags))
        assert isinstance(error, RemoteProtocolError), (text, error)
        assert text in str(error), (text, error)
        # the consumed receive is not re-posted once failed: nothing is lost track of
        assert b.session.rq_posted == len(b.rq) - 1
    # a completion naming a buffer that is not posted
    a, b, flavor = _pair()
    wr_id = (2 << 40) | 3
    b.rq.clear()
    b.session.c.rposted[3] = 0
    error = _inject(flavor, b, (wr_id, 0, recv, 4, 0, imm_flag))
    assert error is not None and "nothing outstanding" in str(error)


def test_inline_sends_take_no_slot_and_large_ones_do() -> None:
    a, b, flavor = _pair(max_inline=64)
    a.session.send([b"x" * 10])
    a.session.send([b"y" * 200])
    kinds = [(w.data is not None, w.length) for w in a.wire]
    assert kinds[0][0] and kinds[0][1] == 10
    assert not kinds[1][0] and kinds[1][1] == 200
    assert a.session.c.slots_used == 1
    stats = a.session.stats()
    assert stats["inline_sends"] == 1 and stats["sends"] == 2


def test_close_signals_the_last_send_and_a_fence_follows_an_unsignaled_one() -> None:
    a, b, flavor = _pair()
    a.session.send([b"last"])
    a.session.begin_close()
    assert a.session.state is LinkState.CLOSING
    # the last send went unsignaled (signal_every=4): a signaled zero-length WRITE fences it
    assert a.wire[-1].write and a.wire[-1].signaled and a.wire[-1].length == 0
    while a.wire:
        deliver(flavor, a, b)
    poll(flavor, a)
    assert a.session.close_sent
    assert a.session.state is LinkState.LINGER


def test_a_completion_of_an_earlier_generation_of_the_cid_is_not_taken() -> None:
    """A cid is reused with a new generation: a late completion of the QP that had it before (a
    flushed unsignaled send, after its drain) goes to the caller as foreign, never into the chan."""
    ffi, lib = NATIVE  # type: ignore[misc]
    side = Native().make_side("A", 1, 4, 2, 256, 2, 0, gen=2)
    assert all((wr_id >> 32) & 0xFF == 2 for wr_id, _a, _l in side.rq)
    chans = ffi.new("struct aiordma_chan *[]", 4)
    chans[1] = side.session.c
    wcs = ffi.new("struct aiordma_wc[]", 1)
    stale = (1 << 63) | (1 << 40) | (1 << 32) | 5  # cid 1, generation 1, a send
    wcs[0].wr_id, wcs[0].status = stale, int(lib.IBV_WC_WR_FLUSH_ERR)
    out = ffi.new("struct aiordma_delivery[]", 4)
    others = ffi.new("struct aiordma_wc[]", 4)
    used, n_others = ffi.new("uint64_t *"), ffi.new("int *")
    deliv = bytearray(4096)
    n = lib.aiordma_chan_process(chans, 4, wcs, 1, out, 4, 0, 1, ffi.from_buffer(deliv), len(deliv), used, others, 4,
                                 n_others)  # fmt: skip
    assert n == 0 and n_others[0] == 1 and others[0].wr_id == stale
    assert side.session.c.error == 0 and side.session.rq_posted == 6
