"""The liveness probe's schedule and plan (aiordma/_rdma/liveness.py), sans I/O, with hypothesis."""

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
    due = {key: plan.add(key, key, BASE, 0, now) for key in marks}  # (each its own path)
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
    assert plan.add("a", "p", 0.1, 0, now=5.0) == pytest.approx(5.1)
    assert plan.tick(5.1, lambda key: 0) == ["a"]  # silent: probed; the next gap is 0.2
    assert plan.add("a", "p", 0.1, 7, now=5.15) == pytest.approx(5.3)  # (a second waiter: the same entry)
    assert plan.tick(5.3, lambda key: 1) == []  # it moved
    with pytest.raises(ValueError):
        plan.add("b", "p", 0.0, 0, now=0.0)


# -- paths: one probe per silent path (a peer host through a port), not per connection ---------

CAP = 8.0


@given(data=st.data(), npaths=st.integers(1, 3))
def test_a_silent_path_costs_one_probe_per_gap_and_its_connections_take_turns(
    data: st.DataObject, npaths: int
) -> None:
    """Connections join (a task waits), move or stay silent at each look, leave (nobody waits),
    close or fail, in any order, on up to three paths.  Checked against a model at every look:
    a due path's waiting connections are each looked at once; a path whose marks did not move
    during a whole gap is probed once -- on the connection whose turn it is, so that every
    connection of a path that stays as it is gets probed within as many probes as it has
    connections -- and any move means no probe; the gap starts over at ``base`` on progress or
    a new wait and doubles up to the cap after a probe; a failed connection makes its path
    suspect: looked at now, every silent connection of it probed."""
    plan: ProbePlan[int] = ProbePlan()
    now = 0.0
    path_of: dict[int, int] = {}  # waiting connections
    marks: dict[int, int] = {}
    gap: dict[int, float] = {}  # per path (model)
    due: dict[int, float] = {}
    suspect: set[int] = set()
    since_change: dict[int, set[int]] = {}  # per path: keys probed since its membership changed
    probes_since: dict[int, int] = {}
    next_key = 0

    def changed(path: int) -> None:
        since_change[path] = set()
        probes_since[path] = 0

    for _ in range(60):
        op = data.draw(st.sampled_from(["join", "tick", "tick", "tick", "close", "fail"]))
        if op == "join":
            key, path = next_key, data.draw(st.integers(0, npaths - 1))
            next_key += 1
            marks[key] = 0
            got = plan.add(key, path, BASE, 0, now)
            due[path] = min(due.get(path, now + BASE), now + BASE)
            gap[path] = BASE
            path_of[key] = path
            changed(path)
            assert got == pytest.approx(due[path])
        elif op in ("close", "fail") and path_of:
            key = data.draw(st.sampled_from(sorted(path_of)))
            path = path_of.pop(key)
            plan.discard(key)
            assert key not in plan
            if path in path_of.values():
                changed(path)
                if op == "fail":
                    plan.suspect(path, now)
                    suspect.add(path)
                    due[path] = min(due[path], now)
            else:
                for table in (gap, due, since_change, probes_since):
                    table.pop(path, None)
                suspect.discard(path)
                if op == "fail":
                    plan.suspect(path, now)  # (nothing left to suspect: a no-op)
        elif op == "tick":
            nxt = plan.next_due()
            if not due:
                assert nxt is None
                now += 1.0
                continue
            assert nxt == pytest.approx(min(due.values()))
            assert nxt is not None
            now = max(now, nxt)
            # what each waiting connection does until this look: moves, stays silent, or leaves
            fate = {key: data.draw(st.sampled_from(["move", "silent", "silent", "leave"])) for key in sorted(path_of)}
            looked: list[int] = []

            def look(key: int) -> int | None:
                looked.append(key)
                if fate[key] == "leave":
                    return None
                if fate[key] == "move":
                    marks[key] += 1
                return marks[key]

            probed = plan.tick(now, look)
            assert len(probed) == len(set(probed))
            due_paths = {p for p, d in due.items() if d <= now}  # (the model computes as the plan does)
            assert sorted(looked) == sorted(k for k, p in path_of.items() if p in due_paths)
            for path in sorted(due_paths):
                members = [k for k, p in path_of.items() if p == path]
                staying = [k for k in members if fate[k] != "leave"]
                for k in members:
                    if fate[k] == "leave":
                        del path_of[k]
                        assert k not in plan
                mine = [k for k in probed if k in members]
                if len(staying) < len(members):
                    changed(path)
                if not staying:
                    assert not mine
                    for table in (gap, due, since_change, probes_since):
                        table.pop(path, None)
                    suspect.discard(path)
                    continue
                if any(fate[k] == "move" for k in staying):
                    assert not mine  # a move proves the path alive
                    gap[path] = BASE
                elif path in suspect:
                    assert sorted(mine) == sorted(staying)  # suspect: every silent one
                    gap[path] = min(gap[path] * 2, CAP)
                else:
                    assert len(mine) == 1 and mine[0] in staying  # one probe per gap
                    gap[path] = min(gap[path] * 2, CAP)
                    since_change[path].add(mine[0])
                    probes_since[path] += 1
                    if probes_since[path] >= len(staying):  # they take turns
                        assert since_change[path] == set(staying), (since_change[path], staying)
                suspect.discard(path)
                due[path] = now + gap[path]
            assert not [k for k in probed if path_of.get(k) not in due_paths]
            assert len(plan) == len(path_of)
    for key in list(path_of):
        plan.discard(key)
    assert plan.next_due() is None and len(plan) == 0


def test_a_path_that_is_looked_at_late_is_not_probed_for_each_connection() -> None:
    """Ten waiting connections to one peer host, silent for ten seconds: ~8 probes in all (the
    gap doubles from 0.05 s up to 8 s), where one schedule per connection made ~80."""
    plan: ProbePlan[int] = ProbePlan()
    marks = dict.fromkeys(range(10), 0)
    for key in marks:
        plan.add(key, ("our gid", "their gid"), 0.05, 0, now=0.0)
    probes: list[int] = []
    while (due := plan.next_due()) is not None and due <= 10.0:
        probes += plan.tick(due, marks.__getitem__)
    assert 6 <= len(probes) <= 9, probes
    assert len(set(probes)) == len(probes)  # (each a different connection: they take turns)
