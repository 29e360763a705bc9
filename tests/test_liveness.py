"""The liveness probe's schedule (aiordma/_rdma/liveness.py), sans I/O, with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma._rdma.liveness import ProbeSchedule

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
