"""Host-side tests of the memory pool's ownership state machine, with a fake registrar."""

from __future__ import annotations

import errno
import itertools
import mmap
import resource
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma._errors import RDMAError
from ._mempool import (
    MemlockLimitError,
    MemoryPool,
    PoolExhaustedError,
    SlotState,
    SlotStateError,
    memlock_advice,
)


class FakeRegion:
    _keys = itertools.count(0x100)

    def __init__(self, length: int, log: list[str]) -> None:
        self._mm = mmap.mmap(-1, length)
        self.buffer = self._mm
        self.length = length
        self.addr = 0x7F0000000000 + next(self._keys) * 0x100000  # a stand-in device address
        self.lkey = next(self._keys)
        self.rkey = self.lkey + 0x10000
        self.closed = False
        self._log = log
        log.append(f"reg {length}")

    def close(self) -> None:
        assert not self.closed, "region closed twice"
        self.closed = True
        self._mm.close()  # raises BufferError if the pool leaked a view
        self._log.append(f"dereg {self.length}")


class FakeRegistrar:
    def __init__(self, fail_errno: int | None = None) -> None:
        self.log: list[str] = []
        self.regions: list[FakeRegion] = []
        self.fail_errno = fail_errno

    def __call__(self, length: int) -> FakeRegion:
        if self.fail_errno is not None:
            raise RDMAError(self.fail_errno, "ibv_reg_mr", f"{length} bytes")
        r = FakeRegion(length, self.log)
        self.regions.append(r)
        return r


@pytest.fixture
def reg() -> FakeRegistrar:
    return FakeRegistrar()


@pytest.fixture
def pool(reg: FakeRegistrar) -> Iterator[MemoryPool]:
    p = MemoryPool(reg, 1000, slots_per_region=4, max_bytes=3 * 4096, precheck_memlock=False)
    yield p
    if not p.closed:
        for s in p:
            if s.state is SlotState.POSTED:
                s.pool.complete(s.wr_id)
            if s.state in (SlotState.ACQUIRED, SlotState.COMPLETED):
                s.free()
        p.close()
    assert all(r.closed for r in reg.regions)


def test_lazy_registration_and_layout(pool: MemoryPool, reg: FakeRegistrar) -> None:
    assert reg.log == [] and pool.stats().slots == 0
    s = pool.acquire()
    assert reg.log == ["reg 4096"] and pool.region_bytes == 4096
    st_ = pool.stats()
    assert (st_.slots, st_.free, st_.acquired, st_.regions, st_.bytes_registered) == (4, 3, 1, 1, 4096)
    others = [pool.acquire() for _ in range(3)]
    offsets = sorted(x.offset for x in [s, *others])
    assert offsets == [0, 1024, 2048, 3072]  # 1000-byte slots on a 64-byte stride
    region = reg.regions[0]
    assert all(x.addr == region.addr + x.offset and x.lkey == region.lkey for x in [s, *others])
    for x in [s, *others]:
        x.free()


def test_initial_slots_register_up_front(reg: FakeRegistrar) -> None:
    p = MemoryPool(reg, 512, slots_per_region=8, max_bytes=1 << 20, initial_slots=9, precheck_memlock=False)
    assert p.stats().regions == 2 and p.stats().free == 16
    p.close()
    assert reg.log == ["reg 4096", "reg 4096", "dereg 4096", "dereg 4096"]


def test_full_cycle_receive_path(pool: MemoryPool) -> None:
    s = pool.acquire()
    gen = s.generation
    s.mark_posted()
    assert pool.stats().posted == 1
    # the "device" writes 5 bytes
    pool._region_views[s.region][s.offset : s.offset + 5] = b"hello"
    done = pool.complete(s.wr_id, byte_len=5)
    assert done is s and s.state is SlotState.COMPLETED and s.byte_len == 5
    view = s.lend()
    assert s.state is SlotState.LENT and bytes(view.data) == b"hello" and view.nbytes == 5
    view.release()
    assert s.state is SlotState.FREE and pool.stats().free == pool.stats().slots
    view.release()  # idempotent
    with pytest.raises(ValueError):
        _ = view.data
    again = pool.acquire()
    assert again is s and again.generation == gen + 1  # LIFO: warm slot reused, new generation


def test_send_path_fill_and_read(pool: MemoryPool) -> None:
    s = pool.acquire()
    assert s.fill(b"abc", offset=2) == 3
    assert pool.read(s, 5) == b"\0\0abc"
    with pytest.raises(ValueError):
        s.fill(b"x" * 1001)
    s.mark_posted()
    with pytest.raises(SlotStateError):
        s.fill(b"late")
    pool.complete(s.wr_id).free()


def test_double_free_and_recycle_while_posted(pool: MemoryPool) -> None:
    s = pool.acquire()
    s.free()
    with pytest.raises(SlotStateError, match="double free"):
        s.free()
    s = pool.acquire()
    s.mark_posted()
    with pytest.raises(SlotStateError, match="device owns it"):
        s.free()
    with pytest.raises(SlotStateError):
        s.lend()
    with pytest.raises(SlotStateError):
        s.mark_posted()
    pool.complete(s.wr_id)
    with pytest.raises(SlotStateError, match="already handled"):
        pool.complete(s.wr_id)
    v = s.lend()
    with pytest.raises(SlotStateError, match="release the SlotView"):
        s.free()
    v.release()


def test_stale_and_foreign_wr_ids(pool: MemoryPool, reg: FakeRegistrar) -> None:
    s = pool.acquire()
    old = s.wr_id
    s.free()
    s2 = pool.acquire()
    assert s2 is s and s2.wr_id != old
    s2.mark_posted()
    with pytest.raises(SlotStateError, match="earlier use"):
        pool.complete(old)
    with pytest.raises(SlotStateError, match="names no slot"):
        pool.complete(999)
    other = MemoryPool(reg, 100, slots_per_region=4, max_bytes=4096, precheck_memlock=False)
    o = other.acquire()
    with pytest.raises(SlotStateError, match="another pool"):
        pool.free(o)
    o.free()
    other.close()
    pool.complete(s2.wr_id).free()


def test_unpost_after_a_refused_post(pool: MemoryPool) -> None:
    s = pool.acquire()
    s.mark_posted()
    s.unpost()
    assert s.state is SlotState.ACQUIRED
    s.free()


def test_views_must_really_be_released(pool: MemoryPool) -> None:
    s = pool.acquire()
    view = s.lend(16)
    sl = view.data[4:8]
    sl[:] = b"wxyz"
    with pytest.raises(BufferError, match="slice"):
        view.release()
    assert s.state is SlotState.LENT and pool.stats().lent == 1
    # the pool cannot be closed while a view is out
    with pytest.raises(SlotStateError, match="lent 1"):
        pool.close()
    sl.release()
    view.release()
    assert s.state is SlotState.FREE
    # an object built on the view (an export of the view itself) also pins it
    view2 = pool.acquire().lend(8)
    exported = memoryview(view2.data)  # shares the view's buffer
    del exported
    with view2 as mv:
        assert len(mv) == 8
    assert pool.stats().lent == 0


def test_context_manager_releases(pool: MemoryPool) -> None:
    s = pool.acquire()
    s.mark_posted()
    pool.complete(s.wr_id, byte_len=3)
    with s.lend() as mv:
        assert len(mv) == 3
    assert s.state is SlotState.FREE


def test_exhaustion_and_max_bytes(pool: MemoryPool, reg: FakeRegistrar) -> None:
    slots = [pool.acquire() for _ in range(12)]
    assert pool.stats().regions == 3 and len(reg.log) == 3
    assert pool.try_acquire() is None
    with pytest.raises(PoolExhaustedError, match="max_bytes"):
        pool.acquire()
    with pytest.raises(PoolExhaustedError):
        pool.acquire_many(1)
    slots.pop().free()
    assert pool.acquire_many(1)[0].state is SlotState.ACQUIRED
    for s in pool:
        if s.state is SlotState.ACQUIRED:
            s.free()


def test_acquire_many_is_all_or_nothing(pool: MemoryPool) -> None:
    with pytest.raises(PoolExhaustedError):
        pool.acquire_many(13)
    assert pool.stats().acquired == 0


def test_region_bigger_than_max_bytes_is_refused(reg: FakeRegistrar) -> None:
    with pytest.raises(ValueError, match="exceeds max_bytes"):
        MemoryPool(reg, 4096, slots_per_region=8, max_bytes=4096)


def test_close_refuses_busy_slots_and_reclaim_posted(pool: MemoryPool, reg: FakeRegistrar) -> None:
    a, b = pool.acquire(), pool.acquire()
    a.mark_posted()
    b.mark_posted()
    with pytest.raises(SlotStateError, match="posted 2"):
        pool.close()
    # after the QP is destroyed, the device no longer holds them
    assert pool.reclaim_posted() == 2
    pool.close()
    assert pool.closed and reg.log[-1].startswith("dereg")
    with pytest.raises(SlotStateError, match="closed"):
        pool.acquire()


def test_memlock_failure_is_explained(reg: FakeRegistrar) -> None:
    failing = FakeRegistrar(fail_errno=errno.ENOMEM)
    p = MemoryPool(failing, 4096, slots_per_region=16, max_bytes=1 << 20, precheck_memlock=False,
                   memlock_limits=lambda: (32768, 32768))  # fmt: skip
    with pytest.raises(MemlockLimitError) as ei:
        p.acquire()
    text = str(ei.value)
    assert ei.value.errno == errno.ENOMEM and isinstance(ei.value, RDMAError)
    assert "RLIMIT_MEMLOCK" in text and "32.0 KiB (soft)" in text and "ulimit -l" in text
    assert "hard limit is too low" in text
    p.close()


def test_memlock_precheck(reg: FakeRegistrar) -> None:
    p = MemoryPool(reg, 4096, slots_per_region=32, max_bytes=1 << 20, precheck_memlock=True,
                   memlock_limits=lambda: (64 * 1024, resource.RLIM_INFINITY))  # fmt: skip
    with pytest.raises(MemlockLimitError, match="at least 128 KiB"):
        p.acquire()
    assert reg.log == []  # refused before registering anything
    p.close()
    ok = MemoryPool(reg, 4096, slots_per_region=4, max_bytes=1 << 20, precheck_memlock=True,
                    memlock_limits=lambda: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))  # fmt: skip
    ok.acquire().free()
    ok.close()


def test_other_registration_errors_pass_through() -> None:
    p = MemoryPool(FakeRegistrar(fail_errno=errno.EINVAL), 64, slots_per_region=4, precheck_memlock=False)
    with pytest.raises(RDMAError) as ei:
        p.acquire()
    assert not isinstance(ei.value, MemlockLimitError) and ei.value.errno == errno.EINVAL
    p.close()


def test_memlock_advice_is_plain() -> None:
    text = memlock_advice(1 << 20, 0, lambda: (8 << 20, 8 << 20))
    assert "8.0 MiB (soft) / 8.0 MiB (hard)" in text and "LimitMEMLOCK=infinity" in text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("apcflrx"), st.integers(0, 11)), max_size=80))
def test_random_operations_keep_counts_consistent(ops: list[tuple[str, int]]) -> None:
    """Any sequence of (legal or illegal) operations keeps the counters equal to the slots' states."""
    reg = FakeRegistrar()
    p = MemoryPool(reg, 256, slots_per_region=4, max_bytes=3 * 4096, precheck_memlock=False)
    views: dict[int, object] = {}
    for op, i in ops:
        slots = list(p)
        s = slots[i % len(slots)] if slots else None
        try:
            if op == "a":
                p.try_acquire()
            elif s is None:
                continue
            elif op == "p":
                s.mark_posted()
            elif op == "c":
                p.complete(s.wr_id, 1)
            elif op == "f":
                s.free()
            elif op == "l":
                views[s.index] = s.lend()
            elif op == "r" and s.index in views:
                views.pop(s.index).release()  # type: ignore[attr-defined]
            elif op == "x":
                p.unpost(s)
        except (SlotStateError, PoolExhaustedError):
            pass
        st_ = p.stats()
        by_state = {state: sum(1 for x in p if x.state is state) for state in SlotState}
        assert (st_.free, st_.acquired, st_.posted, st_.completed, st_.lent) == (
            by_state[SlotState.FREE], by_state[SlotState.ACQUIRED], by_state[SlotState.POSTED],
            by_state[SlotState.COMPLETED], by_state[SlotState.LENT],
        )  # fmt: skip
        assert len(p._free) == st_.free and all(x.state is SlotState.FREE for x in p._free)
    for sv in views.values():
        sv.release()  # type: ignore[attr-defined]
    p.reclaim_posted()
    for x in p:
        if x.state in (SlotState.ACQUIRED, SlotState.COMPLETED):
            x.free()
    p.close()
    assert all(r.closed for r in reg.regions)


# --------------------------------------------------------------------------
# the receive path's shortcuts: acquire_posted() and consume()
# --------------------------------------------------------------------------


def test_acquire_posted_moves_free_slots_to_posted(pool: MemoryPool) -> None:
    slots = pool.acquire_posted(3)
    assert len({s.index for s in slots}) == 3
    assert all(s.state is SlotState.POSTED and s.generation == 1 for s in slots)
    st = pool.stats()
    assert (st.posted, st.free + st.posted) == (3, st.slots)
    with pytest.raises(SlotStateError):
        pool.free(slots[0])  # the device owns it
    with pytest.raises(SlotStateError):
        pool.fill(slots[0], b"x")
    for s in slots:
        assert pool.complete(s.wr_id, 10) is s
        pool.free(s)
    assert pool.stats().free == pool.stats().slots


def test_acquire_posted_is_all_or_nothing(pool: MemoryPool) -> None:
    # 1000-byte slots, 4 per 4096-byte region, max_bytes three regions: 12 slots at most
    held = pool.acquire_posted(10)
    before = pool.stats()
    with pytest.raises(PoolExhaustedError):
        pool.acquire_posted(3)
    after = pool.stats()
    assert (after.posted, after.free) == (before.posted, before.free) == (10, 2)
    got = pool.acquire_posted(2)
    assert pool.stats().free == 0
    for s in held + got:
        pool.free(pool.complete(s.wr_id))


def test_acquire_posted_refused_slots_go_back(pool: MemoryPool) -> None:
    (slot,) = pool.acquire_posted(1)
    pool.unpost(slot)  # the device refused it
    pool.free(slot)
    assert pool.stats().free == pool.stats().slots


def test_consume_hands_the_bytes_to_the_sink_then_frees(pool: MemoryPool) -> None:
    slot = pool.acquire()
    pool.fill(slot, b"hello world")
    pool.mark_posted(slot)
    pool.complete(slot.wr_id, byte_len=5)
    seen: list[tuple[bytes, SlotState, bool]] = []
    pool.consume(slot, lambda view: seen.append((bytes(view), slot.state, view.readonly)))
    assert seen == [(b"hello", SlotState.LENT, True)]
    assert slot.state is SlotState.FREE and pool.stats().lent == 0


def test_consume_refuses_a_posted_or_free_slot(pool: MemoryPool) -> None:
    slot = pool.acquire()
    pool.mark_posted(slot)
    with pytest.raises(SlotStateError, match="device owns it"):
        pool.consume(slot, lambda view: None)
    assert slot.state is SlotState.POSTED
    pool.complete(slot.wr_id)
    pool.free(slot)
    with pytest.raises(SlotStateError, match="already free"):
        pool.consume(slot, lambda view: None)


def test_consume_frees_the_slot_when_the_sink_raises(pool: MemoryPool) -> None:
    slot = pool.acquire()
    pool.mark_posted(slot)
    pool.complete(slot.wr_id, byte_len=4)

    def sink(view: memoryview) -> None:
        raise ValueError("bad frame")

    with pytest.raises(ValueError, match="bad frame"):
        pool.consume(slot, sink)
    assert slot.state is SlotState.FREE


def test_consume_keeps_a_slot_whose_view_outlived_the_sink(pool: MemoryPool) -> None:
    slot = pool.acquire()
    pool.mark_posted(slot)
    pool.complete(slot.wr_id, byte_len=8)
    kept: list[memoryview] = []
    with pytest.raises(BufferError, match="outlived the sink"):
        pool.consume(slot, lambda view: kept.append(view[2:]))
    assert slot.state is SlotState.LENT  # never recycled under a live view
    assert slot not in pool._free and pool.stats().lent == 1
    kept.clear()
    pool._returned(slot, slot.generation)  # what SlotView.release() would do, for the teardown
