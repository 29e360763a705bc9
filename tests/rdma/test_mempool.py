"""The registered memory pool on a real device: slots posted as receive and send
buffers, their completions, the views handed out, and the flush after ERROR."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from aiordma._rdma import verbs as v
from .._mempool import MemoryPool, Slot, SlotState, SlotStateError, pd_registrar

pytestmark = pytest.mark.rdma

if not v.native_available()[0]:
    pytest.skip(f"verbs unavailable: {v.native_available()[1]}", allow_module_level=True)

# the fixtures dev (the device under test) and no_leaks (autouse), shared with test_native
from ._native import Dev, Loop, dev, make_loop, no_leaks, wait_wcs  # noqa: E402,F401


@pytest.fixture
def loop(dev: Dev) -> Iterator[Loop]:
    lp = make_loop(dev)
    try:
        yield lp
    finally:
        lp.close()


def post_recv_slots(qp: v.QueuePair, slots: list[Slot]) -> None:
    for s in slots:
        s.mark_posted()
    qp.post_recv_batch([s.addr for s in slots], [s.size for s in slots], slots[0].lkey, [s.wr_id for s in slots])


def test_pool_traffic_and_flush(loop: Loop) -> None:
    a, b = loop.a, loop.b
    slot_size = 2048
    rx = MemoryPool(pd_registrar(loop.pd), slot_size, slots_per_region=16, max_bytes=1 << 20, initial_slots=16)
    tx = MemoryPool(pd_registrar(loop.pd), slot_size, slots_per_region=16, max_bytes=1 << 20)
    try:
        assert v.live_objects()["mrs"] == 2 + 1  # the loop's two MRs + rx's first region
        assert rx.stats().bytes_registered == rx.region_bytes and rx.region_bytes % 4096 == 0
        assert v.live_objects()["registered_bytes"] == 2 * 65536 + rx.region_bytes

        recv_slots = rx.acquire_many(8)
        post_recv_slots(b.qp, recv_slots)
        assert rx.stats().posted == 8
        with pytest.raises(SlotStateError, match="device owns it"):
            recv_slots[0].free()

        msgs = [f"message {i} ".encode() * (i + 1) for i in range(8)]
        send_slots = []
        for m in msgs:
            s = tx.acquire()
            s.fill(m)
            s.mark_posted()
            send_slots.append((s, len(m)))
        a.qp.post_send_batch(
            [v.SendWR(v.Opcode.SEND, wr_id=s.wr_id, addr=s.addr, length=n, lkey=s.lkey) for s, n in send_slots]
        )
        for w in wait_wcs(a.cq, 8):
            w.raise_for_status()
            tx.complete(w.wr_id).free()
        assert tx.stats().free == tx.stats().slots

        got = []
        for w in wait_wcs(b.cq, 8):
            w.raise_for_status()
            slot = rx.complete(w.wr_id, w.byte_len)
            with slot.lend() as view:
                got.append(bytes(view))
                assert rx.stats().lent == 1
            assert slot.state is SlotState.FREE
        assert got == msgs

        # a slice kept alive pins the slot
        s = rx.acquire()
        s.mark_posted()
        b.qp.post_recv(s.addr, s.size, s.lkey, s.wr_id)
        a.qp.post_send(v.SendWR(v.Opcode.SEND, wr_id=1, addr=a.mr.addr, length=100, lkey=a.mr.lkey))
        wait_wcs(a.cq, 1)
        (w,) = wait_wcs(b.cq, 1)
        sv = rx.complete(w.wr_id, w.byte_len).lend()
        part = sv.data[10:20]
        with pytest.raises(BufferError):
            sv.release()
        assert s.state is SlotState.LENT
        part.release()
        sv.release()
        assert s.state is SlotState.FREE

        # flush: posted receives come back with WR_FLUSH_ERR after ERROR
        flushed = rx.acquire_many(5)
        post_recv_slots(b.qp, flushed)
        b.qp.to_error()
        wcs = wait_wcs(b.cq, 5)
        assert {w.status_name for w in wcs} == {"IBV_WC_WR_FLUSH_ERR"}
        for w in wcs:
            rx.complete(w.wr_id, 0, w.status).free()
        st = rx.stats()
        assert (st.posted, st.completed, st.lent, st.acquired) == (0, 0, 0, 0)
    finally:
        rx.close()
        tx.close()
    assert v.live_objects()["registered_bytes"] == 2 * 65536


def test_pool_grows_by_regions_up_to_max_bytes(loop: Loop) -> None:
    pool = MemoryPool(pd_registrar(loop.pd), 4096, slots_per_region=4, max_bytes=3 * 4 * 4096)
    try:
        slots = [pool.acquire() for _ in range(12)]
        assert pool.stats().regions == 3 and len({s.lkey for s in slots}) == 3
        assert pool.try_acquire() is None
        t0 = time.monotonic()
        for s in slots:
            s.free()
        assert time.monotonic() - t0 < 1
    finally:
        pool.close()
