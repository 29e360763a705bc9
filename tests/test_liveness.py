"""The liveness probe's schedule (aiordma/_rdma/liveness.py), sans I/O, with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma._rdma.liveness import ProbePlan, ProbeSchedule

events = st.lists(st.sampled_from(["progress", "timeout"]), max_size=60)


@given(base=st.sampled_from([0.0, 0.01, 0.1, 0.25, 1.0]), steps=events)
def test_the_gap_starts_over_on_progress_and_doubles_up_to_the_cap(base: float, steps: list[str]) -> None:
    s = ProbeSchedule(base, cap=8.0)
    silent = 0  # timeouts since the last progress
    for step in steps:
        if step == "progress":
            s.progressed()
            silent = 0
        else:
            probed = s.timed_out()
            assert probed == (base > 0)  # every silent gap probes; base 0 never does
            silent += 1
        expected = min(base * 2**silent, 8.0) if base else 0.0
        assert s.gap == pytest.approx(expected)
        assert s.gap == 0.0 or base <= s.gap <= 8.0


def test_a_schedule_needs_a_sane_base_and_cap() -> None:
    with pytest.raises(ValueError):
        ProbeSchedule(-1.0)
    with pytest.raises(ValueError):
        ProbeSchedule(10.0, cap=8.0)


# -- the plan: which waiting connections of a device to probe, and when ------------------------

BASE = 0.1

# a connection's story, one step per look of the plan: it made progress, stayed silent, or
# nobody waits on it any more
looks = st.lists(st.sampled_from(["progress", "silent"]), max_size=40)


@given(stories=st.lists(looks, min_size=1, max_size=5), gone=st.lists(st.booleans(), min_size=5, max_size=5))
def test_the_plan_probes_exactly_the_connections_that_went_silent(stories: list[list[str]], gone: list[bool]) -> None:
    """A model of the device's timer: it wakes at ``next_due()`` and ticks.  Each connection
    follows its story, one step per look (then nobody waits: it leaves at that look, or it is
    discarded, as a closing connection is).  Checked at every look: a connection is probed iff
    its mark did not move since the look before, and the next look comes a schedule's gap later
    -- ``base`` after progress, doubling after each probe up to the cap."""
    plan: ProbePlan[int] = ProbePlan()
    now = 0.0
    marks = {key: 0 for key in range(len(stories))}
    step = {key: 0 for key in marks}
    due = {key: plan.add(key, BASE, 0, now) for key in marks}
    gap = {key: BASE for key in marks}
    assert all(d == BASE for d in due.values()) and len(plan) == len(stories)
    looked: list[int] = []

    def look(key: int) -> int | None:
        looked.append(key)
        if step[key] >= len(stories[key]):
            return None
        if stories[key][step[key]] == "progress":
            marks[key] += 1
        step[key] += 1
        return marks[key]

    for _ in range(200):
        nxt = plan.next_due()
        if nxt is None:
            break
        assert nxt == pytest.approx(min(due.values()))
        now = nxt
        before = dict(step)
        looked.clear()
        probed = plan.tick(now, look)
        assert sorted(looked) == sorted(k for k, d in due.items() if d <= now)  # every due key, once
        for key in looked:
            if step[key] == before[key]:  # its story ended: it left the plan, not probed
                assert key not in plan and key not in probed
                del due[key]
                continue
            silent = stories[key][before[key]] == "silent"
            assert (key in probed) == silent
            gap[key] = min(gap[key] * 2, 8.0) if silent else BASE
            due[key] = now + gap[key]
            if gone[key] and step[key] == 3:  # closed meanwhile: discarded, never looked at again
                plan.discard(key)
                del due[key]
        assert set(due) == {k for k in marks if k in plan}
    assert plan.next_due() is None and len(plan) == 0


def test_a_key_added_twice_keeps_its_schedule_and_one_that_never_probes_is_refused() -> None:
    plan: ProbePlan[str] = ProbePlan()
    assert plan.add("a", 0.1, 0, now=5.0) == pytest.approx(5.1)
    assert plan.tick(5.1, lambda key: 0) == ["a"]  # silent: probed; the next gap is 0.2
    assert plan.add("a", 0.1, 7, now=5.15) == pytest.approx(5.3)  # (a second waiter: the same entry)
    assert plan.tick(5.3, lambda key: 1) == []  # it moved
    with pytest.raises(ValueError):
        plan.add("b", 0.0, 0, now=0.0)
