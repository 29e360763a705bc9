"""Slow is not dead (issue 31, item 1): the sans-IO :class:`WindowWatch` against a model of
Linux's zero-window probing.

The model: the peer's window closes at 0; the sender's kernel probes it (the first probe after
200 ms, then doubling, up to 120 s apart: ``tcp_send_probe0``); a live peer answers each probe
unless it answered one less than 500 ms before (``tcp_invalid_ratelimit``); a dead one answers
nothing from the moment it dies.  The watch looks every tick, late by a drawn amount, with gaps
where nobody looks (a pull link nobody waits on).  A live peer is never judged dead; a dead one
is judged within two probe intervals after it died, plus the budget and a look; and the user
timeout is always back on once nothing is queued.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma._tcp.window import State, TcpSample, WindowWatch, parse_sample

PROBE_BASE, PROBE_MAX, RATE_LIMIT = 0.2, 120.0, 0.5


class Kernel:
    """The sender's side of one connection whose peer's window is closed from time 0.

    An answer reaches the sender ``latency`` after its probe (a round trip, or a loaded host's
    softirq); the kernel counts the probe when it sends it and forgets the count on the ACK,
    which also restarts the probe timer (``tcp_ack_probe``).  ``rtt`` is what ``tcpi_rtt``
    says, which on a loaded host may be well below the latency."""

    def __init__(self, dies_at: float | None, latency: float = 0.0, rtt: float = 0.0) -> None:
        self.dies_at = dies_at
        self.latency = latency
        self.rtt = rtt
        self.probes = 0  # unanswered, since the last ACK (icsk_probes_out)
        self.backoff = 0
        self.next_probe = PROBE_BASE
        self.last_ack = 0.0
        self.last_answer = -1.0
        self.answers: list[float] = []  # when ACKs on their way arrive
        self.probe_times: list[float] = []

    def run_until(self, now: float) -> None:
        while True:
            ack = self.answers[0] if self.answers else float("inf")
            t = min(ack, self.next_probe)
            if t > now:
                return
            if ack <= self.next_probe:
                self.answers.pop(0)
                self.last_ack = ack
                self.probes = 0
                self.next_probe = ack + min(PROBE_BASE * 2**self.backoff, PROBE_MAX)
                continue
            self.probe_times.append(t)
            self.probes += 1
            self.backoff = min(self.backoff + 1, 15)
            alive = self.dies_at is None or t < self.dies_at
            if alive and t - self.last_answer >= RATE_LIMIT:
                self.last_answer = t
                self.answers.append(t + self.latency)
            self.next_probe = t + min(PROBE_BASE * 2**self.backoff, PROBE_MAX)

    def sample(self, now: float, queued: bool = True) -> TcpSample:
        self.run_until(now)
        return TcpSample(probes=self.probes, backoff=self.backoff, unacked=0, notsent=1 << 20 if queued else 0,
                         window=0, mss=1448, last_ack_ms=int((now - self.last_ack) * 1000),
                         rtt_us=int(self.rtt * 1e6))  # fmt: skip


looks = st.lists(
    st.tuples(st.floats(0, 0.2), st.booleans(), st.floats(0.05, 40)),  # lateness, a gap?, its length
    min_size=1, max_size=60,
)  # fmt: skip


def drive(watch: WindowWatch, kernel: Kernel, plan: list[tuple[float, bool, float]], until: float) -> float | None:
    """Look as ``plan`` says until ``until``; the time the watch judged the peer dead, or None."""
    now = 0.0
    assert watch.wrote()
    ut_on = True
    i = 0
    while now < until:
        late, gap, length = plan[i % len(plan)]
        i += 1
        if gap and watch.state is not State.IDLE:
            step = watch.unattended(kernel.sample(now))
            if step.user_timeout is not None:
                ut_on = step.user_timeout
            now += length
        else:
            now += watch.tick + late
        step = watch.look(kernel.sample(now), now)
        if step.user_timeout is not None:
            ut_on = step.user_timeout
        if step.dead is not None:
            return now
        # the kernel's user timeout never sees a closed window once the watch has looked
        assert not ut_on or now < watch.budget
    return None


#: how late an answer may come, and what tcpi_rtt says meanwhile (up to the answer's lateness)
answers = st.floats(0, 0.24).flatmap(lambda late: st.tuples(st.just(late), st.floats(0, late)))


@settings(max_examples=300, deadline=None)
@given(budget=st.sampled_from([1.0, 2.0, 4.0, 9.0]), plan=looks, until=st.floats(1, 600), answer=answers)
def test_a_live_peer_whose_window_stays_closed_is_never_judged_dead(budget: float, plan: list[tuple[float, bool, float]],
                                                                     until: float, answer: tuple[float, float]) -> None:  # fmt: skip
    """Also when the answers come late: a probe counts as unanswered from the moment it leaves,
    so a live peer that let one pass (the rate limit) has two unanswered while an ACK travels
    (found under load, a budget of 1 s, loopback: the answer came after the look)."""
    latency, rtt = answer
    assert drive(WindowWatch(budget), Kernel(dies_at=None, latency=latency, rtt=rtt), plan, until) is None


def test_the_answer_on_its_way_is_awaited() -> None:
    """The case the suite met, step by step (its samples, a budget of 1 s): a probe answered at
    0; the next, 0.4 s later, goes unanswered (the rate limit); the one at 1.2 s is answered
    0.15 s late.  At 1.25 s two probes count as unanswered and nothing was acknowledged for the
    budget: a verdict then was wrong."""
    kernel = Kernel(dies_at=None, latency=0.15)
    kernel.backoff, kernel.next_probe, kernel.last_answer = 1, 0.4, 0.0
    watch = WindowWatch(1.0)
    watch.wrote()
    assert watch.look(kernel.sample(0.05), 0.05).user_timeout is False
    for now in (0.3, 0.55, 0.8, 1.05, 1.25):
        assert watch.look(kernel.sample(now), now).dead is None
    assert kernel.probes == 2 and kernel.last_ack == 0.0  # (the state a one-look verdict judged)
    step = watch.look(kernel.sample(1.5), 1.5)
    assert step.dead is None and kernel.last_ack == 1.35 and watch.state is State.JUDGING


@settings(max_examples=300, deadline=None)
@given(budget=st.sampled_from([1.0, 2.0, 4.0, 9.0]), plan=looks, dies_at=st.floats(0, 300))
def test_a_peer_that_dies_while_its_window_is_closed_is_found(budget: float, plan: list[tuple[float, bool, float]],
                                                              dies_at: float) -> None:  # fmt: skip
    kernel = Kernel(dies_at=dies_at)
    found = drive(WindowWatch(budget), kernel, plan, until=dies_at + 2000)
    assert found is not None
    after = [t for t in kernel.probe_times if t >= dies_at]
    second = after[1] if len(after) > 1 else after[0]  # (one may do: the probe before went unanswered)
    longest_gap = max(length for _, gap, length in plan) if any(g for _, g, _ in plan) else 0.0
    # (a verdict waits for a second look, a grace after the first)
    bound = max(second, kernel.last_ack + budget) + 2 * (WindowWatch(budget).tick + 0.2 + longest_gap)
    assert dies_at <= found <= bound


@settings(max_examples=200, deadline=None)
@given(
    samples=st.lists(
        st.builds(TcpSample, probes=st.integers(0, 20), backoff=st.integers(0, 15), unacked=st.integers(0, 50),
                  notsent=st.integers(0, 1 << 22), window=st.integers(0, 1 << 20), mss=st.integers(0, 9000),
                  last_ack_ms=st.integers(0, 300_000), rtt_us=st.integers(0, 2_000_000)),  # fmt: skip
        max_size=30,
    ),
    budget=st.floats(0.5, 30),
)
def test_the_user_timeout_is_off_only_while_a_window_is_closed_and_back_once_nothing_is_queued(
    samples: list[TcpSample], budget: float
) -> None:
    watch = WindowWatch(budget)
    ut_on = True
    now = 0.0
    watch.wrote()
    for s in samples:
        now += watch.tick
        step = watch.look(s, now)
        if step.user_timeout is False:
            assert s.window_closed, "the timeout went off with the window open"
        if step.user_timeout is not None:
            ut_on = step.user_timeout
        if step.dead is not None:
            assert s.last_ack_ms >= budget * 1000, "judged dead although the peer acknowledged within the budget"
            return
        if not step.again:
            watch.wrote()
    drained = TcpSample(probes=0, backoff=0, unacked=0, notsent=0, window=65535, mss=1448, last_ack_ms=0, rtt_us=50)
    step = watch.look(drained, now + watch.tick)
    if step.user_timeout is not None:
        ut_on = step.user_timeout
    assert ut_on and watch.state is State.IDLE and not step.again


def test_tcp_info_offsets_match_the_kernel() -> None:
    """The parser against a real socket whose peer does not read: bytes queued, window closed."""
    import socket
    import time

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    client = socket.create_connection(lsock.getsockname())
    server, _ = lsock.accept()
    try:
        client.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 10
        sample = None
        while time.monotonic() < deadline:
            try:
                while True:
                    sent += client.send(b"x" * 65536)
            except BlockingIOError:
                pass
            sample = parse_sample(client.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
            assert sample is not None
            if sample.window_closed:
                break
            time.sleep(0.05)
        assert sample is not None and sample.window_closed and sample.queued
        assert 0 < sample.notsent <= sent and sample.mss > 0 and sample.last_ack_ms < 10_000
        # what is queued, two ways: TCP_INFO's byte counters and SIOCOUTQ (in flight + not sent)
        from aiordma._tcp.common import unacknowledged

        assert abs(sample.in_flight + sample.notsent - unacknowledged(client)) <= sample.mss
        assert 0 < sample.rtt_us < 1_000_000  # (loopback: microseconds)
        server.recv(1 << 20)
        idle = parse_sample(server.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256))
        assert idle is not None and not idle.queued and idle.window > 0
    finally:
        client.close()
        server.close()
        lsock.close()


# -- resting with room: no looks while writes fit in the peer's window --------------------------

MSS = 1448


class Flow:
    """A sender and its peer, for the watch's rest: the application's writes wait in the
    transport's buffer (``pending``) until the kernel's send buffer (``sndbuf``) has room; the
    kernel sends what fits in the window the peer last advertised (``window``, from the last
    ACK); the peer's buffer holds ``capacity`` bytes, an ACK takes in everything in flight and
    advertises what is left; the peer's application reads whenever it likes.  The kernel would
    probe (and its user timeout judge a live peer) when bytes wait and the next segment does not
    fit: :attr:`closed`."""

    def __init__(self, capacity: int, sndbuf: int) -> None:
        self.capacity = capacity
        self.sndbuf = sndbuf
        self.unread = self.in_flight = self.notsent = self.pending = 0
        self.window = capacity

    def _send(self) -> None:
        take = min(self.pending, max(0, self.sndbuf - self.in_flight - self.notsent))
        self.pending -= take
        self.notsent += take
        room = max(0, self.window - self.in_flight)
        n = min(self.notsent, room)
        self.notsent -= n
        self.in_flight += n

    def write(self, n: int) -> None:
        self.pending += n
        self._send()

    def ack(self) -> None:
        self.unread += self.in_flight
        self.in_flight = 0
        self.window = self.capacity - self.unread
        self._send()

    def read(self, n: int) -> None:
        self.unread -= min(n, self.unread)

    @property
    def closed(self) -> bool:
        return self.notsent > 0 and self.window - self.in_flight < min(self.notsent, MSS)

    def sample(self) -> TcpSample:
        return TcpSample(probes=0, backoff=0, unacked=(self.in_flight + MSS - 1) // MSS, notsent=self.notsent,
                         window=self.window, mss=MSS, last_ack_ms=0, rtt_us=50, in_flight=self.in_flight)  # fmt: skip


events = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(1, 1 << 17) | st.integers(1, 256)),
        st.tuples(st.just("ack"), st.just(0)),
        st.tuples(st.just("read"), st.integers(0, 1 << 18)),
        st.tuples(st.just("tick"), st.just(0)),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 1 << 21), sndbuf=st.integers(1 << 12, 1 << 22), plan=events, begin=st.booleans())
def test_the_watch_rests_only_while_the_window_cannot_close(capacity: int, sndbuf: int, plan: list[tuple[str, int]],
                                                            begin: bool) -> None:  # fmt: skip
    """Driven as the asyncio link drives it (a write that fits in the room costs nothing; one
    that does not takes a sample -- with what the transport still holds -- and the watch rests
    again or looks every tick), the watch is never at rest while the kernel would be probing a
    closed window: the one state in which the kernel's user timeout must not judge alone.  (The
    first version left out the transport's buffer: a 48 MiB write rested on the kernel's view,
    and the reader that paused lost its connection to the user timeout.)"""
    flow = Flow(capacity, sndbuf)
    watch = WindowWatch(2.0)
    if begin:
        watch.begin(flow.sample())
    now = 0.0
    for what, n in plan:
        if what == "write":
            flow.write(n)
            if watch.state is State.IDLE:
                if not watch.wrote_within(n):
                    watch.resample(flow.sample(), flow.pending)
        elif what == "ack":
            flow.ack()
        elif what == "read":
            flow.read(n)
        elif watch.state is not State.IDLE:
            now += watch.tick
            watch.look(flow.sample(), now)
        assert not (flow.closed and watch.state is State.IDLE), (what, n, vars(flow), watch.room)


def test_a_round_trip_loop_needs_no_looks() -> None:
    """Small writes answered at once (a request, its answer): after the first sample the watch
    rests, and takes a sample once per half a window written -- no timer in the loop."""
    flow = Flow(65536, 1 << 20)
    watch = WindowWatch(2.0)
    watch.begin(flow.sample())
    samples = 0
    for _ in range(10_000):
        flow.write(64)
        assert watch.state is State.IDLE
        if not watch.wrote_within(64):
            samples += 1
            assert watch.resample(flow.sample(), flow.pending)
        flow.ack()
        flow.read(64)
    assert samples <= 10_000 * 64 // (65536 // 2 - 64) + 1


def test_a_watch_that_cannot_sample_looks() -> None:
    watch = WindowWatch(2.0)
    watch.begin(None)
    assert not watch.wrote_within(1)
    assert not watch.resample(None, 0) and watch.state is State.KERNEL


def test_a_large_write_that_waits_in_the_transport_is_looked_after() -> None:
    """One large write (48 MiB, test_pass_through's paused reader): the kernel takes a send
    buffer of it, the transport keeps the rest and hands it on as ACKs make room -- with no call
    the watch sees.  Its sample must count what the transport holds: the window closes later on
    those bytes, and by then the watch must be looking."""
    flow = Flow(256 << 10, 64 << 10)
    watch = WindowWatch(2.0)
    watch.begin(flow.sample())
    flow.write(48 << 20)
    if not watch.wrote_within(48 << 20):
        watch.resample(flow.sample(), flow.pending)
    for _ in range(100):
        flow.ack()  # (the peer's application never reads)
        if flow.closed:
            break
    assert flow.closed and watch.state is not State.IDLE
