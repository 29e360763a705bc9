"""A listener's limits: admission (who gets a handshake, when), RDMA connections and their
pinned ring bytes.

The budget and the admission alone (hypothesis: any sequence of events keeps their bounds; a
client that spoke is never kept out by a silent one), then real listeners under asyncio,
uvloop and trio: 1000 clients at once are all served; 300 silent sockets opened again and
again never delay a real client past 1 s; a silent connection goes after ``hello_timeout``;
one peer address holds at most its share of the handshakes; an RDMA connection over the limit
gets TCP with the limit in its reason (or a refusal under ``transport="rdma"``), and the budget
comes back when a connection's teardown is done.
"""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aiordma
from aiordma._proto.admission import Admission, first_frame_size
from aiordma._handshake.limits import ListenerBudget, ring_bytes
from aiordma.testing import SimFabric, SimProvider

from ._leaks import no_fd_leak

pytestmark = pytest.mark.anyio


@given(
    st.one_of(st.none(), st.integers(0, 3)),
    st.one_of(st.none(), st.integers(0, 10)),
    st.lists(st.tuples(st.sampled_from(["rdma", "free"]), st.integers(1, 4)), max_size=60),
)
def test_the_budget_never_exceeds_its_limits(conns: int | None, pinned: int | None, ops: list[tuple[str, int]]) -> None:
    b = ListenerBudget(conns, pinned if pinned is not None else 10)
    releases: list[Any] = []
    for op, n in ops:
        if op == "rdma":
            got = b.reserve_rdma(n)
            if isinstance(got, str):
                assert "max_rdma_connections" in got or "max_pinned_bytes" in got
            else:
                releases.append(got)
        elif op == "free" and releases:
            release = releases.pop(0)
            release()
            release()  # idempotent
        assert conns is None or b.rdma_connections <= conns
        assert b.pinned_bytes <= (pinned if pinned is not None else 10)
        assert b.rdma_connections == len(releases)
    for release in releases:
        release()
    assert b.rdma_connections == 0 and b.pinned_bytes == 0


def test_bad_limits() -> None:
    with pytest.raises(ValueError):
        ListenerBudget(-1)
    with pytest.raises(ValueError):
        ListenerBudget(None, -1)
    with pytest.raises(ValueError):
        Admission(0, 1, 1)


def test_the_rdma_limits_are_finite_by_default_and_follow_the_pinned_limit() -> None:
    ring = ring_bytes(aiordma.RdmaConfig())
    before = aiordma.memory_stats().limit
    try:
        aiordma.set_pinned_limit(100 * ring)
        assert ListenerBudget().limits(ring) == (50, 50 * ring)  # half of what the process may pin
        b = ListenerBudget()
        releases = [b.reserve_rdma(ring) for _ in range(50)]
        assert all(callable(r) for r in releases)
        refusal = b.reserve_rdma(ring)
        assert isinstance(refusal, str) and "max_pinned_bytes=" in refusal
        for release in releases:
            release()  # type: ignore[operator]
    finally:
        aiordma.set_pinned_limit(before)


# -- admission, sans I/O ---------------------------------------------------------------------------


@given(
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 6),
    st.lists(st.tuples(st.sampled_from(["accept", "speak", "whole", "stall", "move", "tick", "finish"]),
                       st.integers(0, 30), st.sampled_from(["a", "b", "c"])), max_size=80),
)  # fmt: skip
def test_admission_keeps_its_bounds_and_never_drops_a_client_that_moves(
    limit: int, per_address: int, pending: int, ops: list[tuple[str, int, str]]
) -> None:
    """Any sequence of events: the bounds hold; only a silent connection is dropped as silent,
    only a stalled handshake as stalled, never one that is speaking or ready; and after a look
    (``reschedule``), a ready connection waits only while every slot it could take is held by
    a handshake that moves."""
    adm = Admission(limit, per_address, pending, stall_after=1.0)
    idle: dict[int, float] = {}
    alive: set[int] = set()
    next_key = 0

    def apply(decision: Any, before: dict[int, str | None]) -> None:
        for key, why in decision.drop:
            assert key in alive
            if why == "silent":
                assert before[key] == "waiting", (key, before[key])
            else:
                assert why == "stalled" and before[key] == "handshaking" and idle[key] >= 1.0, (key, before[key])
            alive.discard(key)
        for key in decision.start:
            assert key in alive and adm.state(key) == "handshaking"

    for op, pick, address in ops:
        live = sorted(alive)
        before = {k: adm.state(k) for k in alive}
        if op == "accept":
            if not adm.may_accept():
                continue  # (the kernel's backlog queues it)
            key, next_key = next_key, next_key + 1
            alive.add(key)
            idle[key] = 0.0
            apply(adm.accepted(key, address, lambda key=key: idle[key]), before)
        elif op == "tick":
            apply(adm.reschedule(), before)
        elif live:
            key = live[pick % len(live)]
            if op == "speak":
                adm.speaking(key)
            elif op == "whole":
                apply(adm.spoke(key), before)
            elif op == "stall":
                idle[key] = 1.5
            elif op == "move":
                idle[key] = 0.0
            elif op == "finish":
                alive.discard(key)
                apply(adm.finished(key), before)
        states = {k: adm.state(k) for k in alive}
        running = [k for k, v in states.items() if v == "handshaking"]
        assert len(running) == adm.handshaking <= limit
        assert adm.waiting == len(alive) - len(running) <= pending
        assert adm.ready == sum(1 for v in states.values() if v == "ready")
        for addr in "abc":
            assert sum(1 for k in running if adm._entries[k].address == addr) <= per_address
        for k, v in states.items():
            if v == "ready":
                addr = adm._entries[k].address
                same = [r for r in running if adm._entries[r].address == addr]
                full = len(same) >= per_address or len(running) >= limit
                assert full, f"{k} waits with a free slot"
                if op == "tick":  # after a look: it waits only while every slot it could take moves
                    blocking = same if len(same) >= per_address else running
                    assert all(idle[r] < 1.0 for r in blocking), "a stalled handshake keeps a ready client out"


@pytest.mark.parametrize(
    ("head", "tls", "size"),
    [
        (b"", False, 16), (b"AIORDMA\n", False, 16), (b"AIORDMA\n\x01\x00\x00\x00\x00\x00\x00\x20", False, 48),
        (b"AIORDMA\n\x01\x00\x00\x00\xff\xff\xff\xff", False, 5 + (16 << 10) + 2048),
        (b"GET / HTTP/1.1", False, 14), (b"AIX", False, 3),
        (b"", True, 5), (b"\x16\x03\x01\x02\x00", True, 5 + 512), (b"GET /", True, 5),
    ],
)  # fmt: skip
def test_the_first_frame_size_is_read_from_its_first_bytes(head: bytes, tls: bool, size: int) -> None:
    assert first_frame_size(head, tls) == size


# -- admission, real listeners ----------------------------------------------------------------------


async def echo_server(**kw: Any) -> Any:
    return await aiordma.create_channel_listener("127.0.0.1", 0, transport="tcp", **kw)


async def serve_echo(lst: Any, tg: Any) -> None:
    async def handler(ch: aiordma.Channel) -> None:
        async with ch:
            try:
                while True:
                    await ch.send(await ch.receive())
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass

    tg.start_soon(lst.serve, handler)


async def one_echo(port: int) -> None:
    ch = await aiordma.connect_channel("127.0.0.1", port, transport="tcp")
    async with ch:
        await ch.send(b"hi")
        assert await ch.receive() == b"hi"


@pytest.mark.slow
async def test_a_thousand_clients_at_once_are_all_served(anyio_backend: Any) -> None:
    """A default listener; 1000 clients connect at the same moment: none is refused."""
    errors: list[BaseException] = []
    async with no_fd_leak(settle=5):
        async with await echo_server() as lst, anyio.create_task_group() as tg:
            await serve_echo(lst, tg)

            async def client() -> None:
                try:
                    await one_echo(lst.port)
                except Exception as exc:  # noqa: BLE001 - counted below
                    errors.append(exc)

            with anyio.fail_after(120):
                async with anyio.create_task_group() as clients:
                    for _ in range(1000):
                        clients.start_soon(client)
            tg.cancel_scope.cancel()
    assert not errors, f"{len(errors)} of 1000 failed, e.g. {errors[0]!r}"


@pytest.mark.slow
@pytest.mark.alone  # (its 1 s bound is the listener's, not the CI host's parallel workers')
async def test_silent_sockets_never_keep_a_real_client_out(anyio_backend: Any) -> None:
    """300 sockets that never speak, closed and opened again every 2 s for 20 s; meanwhile a real
    client's connect, handshake and one echo take under 1 s, every time."""
    async with no_fd_leak(settle=5):
        async with await echo_server() as lst, anyio.create_task_group() as tg:
            await serve_echo(lst, tg)
            worst = 0.0
            silent: list[socket.socket] = []
            stop = anyio.current_time() + 20
            try:
                while anyio.current_time() < stop:
                    for sock in silent:
                        sock.close()
                    silent = []
                    for _ in range(300):
                        sock = socket.socket()
                        sock.setblocking(False)
                        try:
                            sock.connect(("127.0.0.1", lst.port))
                        except BlockingIOError:
                            pass
                        silent.append(sock)
                    round_end = anyio.current_time() + 2
                    while anyio.current_time() < round_end:
                        started = anyio.current_time()
                        with anyio.fail_after(5):
                            await one_echo(lst.port)
                        worst = max(worst, anyio.current_time() - started)
                        await anyio.sleep(0.25)
            finally:
                for sock in silent:
                    sock.close()
            tg.cancel_scope.cancel()
    assert worst < 1.0, f"a real client took {worst:.2f} s"


@pytest.mark.paced
async def test_a_silent_connection_is_dropped_after_the_hello_timeout(anyio_backend: Any) -> None:
    """Not one byte within ``hello_timeout``: dropped as silent.  A few bytes of the magic, then
    nothing: not silent -- it has until ``handshake_timeout``, and no slot meanwhile."""
    async with no_fd_leak():
        async with await echo_server(hello_timeout=0.3, handshake_timeout=1.2) as lst, \
                anyio.create_task_group() as tg:  # fmt: skip
            await serve_echo(lst, tg)
            for first, bounds in ((b"", (0.2, 0.9)), (b"AIO", (1.0, 2.5))):
                with socket.create_connection(("127.0.0.1", lst.port)) as sock:
                    if first:
                        sock.sendall(first)
                    started = anyio.current_time()
                    # the server closes it: EOF (or a reset) on our side
                    got = await anyio.to_thread.run_sync(_recv_until_closed, sock)
                    took = anyio.current_time() - started
                    assert bounds[0] < took < bounds[1], f"{first!r}: the connection stayed {took:.2f} s"
                    assert got == b"", got  # (no protocol object was made for either)
            await one_echo(lst.port)
            assert lst._acceptor.admission.dropped_silent == 1  # (the one that never spoke)
            assert lst._acceptor.admission.handshaking == 0
            tg.cancel_scope.cancel()


def _recv_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    sock.settimeout(10)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:
        pass
    return got


async def test_one_address_cannot_take_every_handshake_slot(anyio_backend: Any) -> None:
    """Clients from 127.0.0.2 that complete their HELLO and then stall (the listener has a key;
    they never answer its challenge) hold at most that address's share of the handshakes; a
    client from another address gets in at once."""
    from aiordma._proto.protocol import Connection, Mode, Role

    async with no_fd_leak(settle=5):
        async with await aiordma.create_channel_listener(
            "127.0.0.1", 0, transport="tcp", auth=b"k", max_handshakes=4, max_handshakes_per_address=2
        ) as lst, anyio.create_task_group() as tg:  # fmt: skip
            await serve_echo(lst, tg)
            stallers = []
            try:
                for _ in range(6):
                    sock = socket.socket()
                    sock.bind(("127.0.0.2", 0))
                    sock.connect(("127.0.0.1", lst.port))
                    sock.sendall(Connection(Role.CLIENT, Mode.MESSAGES, now=0.0, auth_key=b"k").send_hello())
                    stallers.append(sock)
                adm = lst._acceptor.admission
                with anyio.fail_after(5):
                    while adm.handshaking < 2:
                        await anyio.sleep(0.01)
                await anyio.sleep(0.2)
                assert adm.handshaking == 2  # 127.0.0.2's share; its other four wait, not refused
                started = anyio.current_time()
                with anyio.fail_after(5):
                    async with await aiordma.connect_channel("127.0.0.1", lst.port, transport="tcp", auth=b"k") as ch:
                        await ch.send(b"hi")
                        assert await ch.receive() == b"hi"
                assert anyio.current_time() - started < 1
            finally:
                for sock in stallers:
                    sock.close()
            tg.cancel_scope.cancel()


@pytest.mark.paced
async def test_a_tls_handshake_that_stalls_gives_its_slot_to_a_ready_client(anyio_backend: Any) -> None:
    """``max_handshakes=1``.  A TLS client sends one byte of its ClientHello and stops: it gets
    no slot (its first record is not whole).  Another sends a whole ClientHello and never answers
    the server's: it holds the slot until nothing moved for ``stall_after`` (half of
    ``handshake_timeout``: 1.5 s), then a real TLS
    client takes the slot and echoes; both stallers are closed, each logged with its reason."""
    trustme = pytest.importorskip("trustme")
    import logging
    import ssl

    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    # a whole ClientHello, made without a socket
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    client_hello = outgoing.read()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("aiordma").addHandler(handler)
    logging.getLogger("aiordma").setLevel(logging.INFO)
    try:
        async with no_fd_leak(settle=5):
            async with await aiordma.create_channel_listener(
                "127.0.0.1", 0, ssl=server_ctx, max_handshakes=1, handshake_timeout=3
            ) as lst, anyio.create_task_group() as tg:  # fmt: skip
                await serve_echo(lst, tg)
                with socket.create_connection(("127.0.0.1", lst.port)) as one_byte, \
                        socket.create_connection(("127.0.0.1", lst.port)) as staller:  # fmt: skip
                    one_byte.sendall(client_hello[:1])
                    staller.sendall(client_hello)
                    adm = lst._acceptor.admission
                    with anyio.fail_after(5):
                        while adm.handshaking < 1:
                            await anyio.sleep(0.01)
                    started = anyio.current_time()
                    with anyio.fail_after(5):
                        async with await aiordma.connect_channel("127.0.0.1", lst.port, ssl=client_ctx) as ch:
                            await ch.send(b"hi")
                            assert await ch.receive() == b"hi"
                    took = anyio.current_time() - started
                    assert 1.4 < took < 3.5, f"the ready client waited {took:.2f} s (stall_after is 1.5 s)"
                    assert adm.dropped_stalled == 1
                    for sock in (one_byte, staller):  # (closed: the one-byte one at handshake_timeout)
                        await anyio.to_thread.run_sync(_recv_until_closed, sock)
                tg.cancel_scope.cancel()
    finally:
        logging.getLogger("aiordma").removeHandler(handler)
    assert any("its handshake stalled" in r for r in records), records
    assert any("its first frame did not come whole within handshake_timeout" in r for r in records), records


def _sim() -> tuple[SimFabric, Any]:
    fabric = SimFabric()
    fabric.add_device("sim0", "127.0.0.1")
    return fabric, lambda: aiordma.RdmaBackend(provider=SimProvider(fabric))


async def test_rdma_connections_over_the_limit_get_tcp_and_say_why(anyio_backend: Any) -> None:
    fabric, backend = _sim()
    async with no_fd_leak():
        lst = await aiordma.create_channel_listener("127.0.0.1", 0, rdma_backend=backend(), max_rdma_connections=1)
        async with lst, anyio.create_task_group() as tg:

            async def handler(ch: aiordma.Channel) -> None:
                async with ch:
                    try:
                        while True:
                            await ch.send(await ch.receive())
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        pass

            tg.start_soon(lst.serve, handler)
            first = await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend())
            assert first.transport == "rdma"
            second = await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend())
            assert second.transport == "tcp"
            assert "max_rdma_connections=1" in second.fallback_reason
            with pytest.raises(aiordma.RDMAUnavailableError, match="max_rdma_connections=1"):
                await aiordma.connect_channel("127.0.0.1", lst.port, transport="rdma", rdma_backend=backend())
            for ch in (first, second):
                await ch.send(b"still fine")
                assert await ch.receive() == b"still fine"
                await ch.aclose()
            # once the first one's teardown is done, RDMA is there again
            with anyio.fail_after(10):
                while True:
                    third = await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend())
                    if third.transport == "rdma":
                        break
                    await third.aclose()
                    await anyio.sleep(0.05)
            await third.aclose()
            tg.cancel_scope.cancel()
    with anyio.fail_after(10):
        while fabric.live_objects().get("qps", 0):
            await anyio.sleep(0.01)


async def test_pinned_bytes_over_the_limit_get_tcp(anyio_backend: Any) -> None:
    fabric, backend = _sim()
    one = ring_bytes(aiordma.RdmaConfig())
    async with no_fd_leak():
        lst = await aiordma.create_channel_listener("127.0.0.1", 0, rdma_backend=backend(), max_pinned_bytes=one - 1)
        async with lst, anyio.create_task_group() as tg:

            async def handler(ch: aiordma.Channel) -> None:
                await ch.aclose()

            tg.start_soon(lst.serve, handler)
            async with await aiordma.connect_channel("127.0.0.1", lst.port, rdma_backend=backend()) as ch:
                assert ch.transport == "tcp"
                assert f"max_pinned_bytes={one - 1}" in ch.fallback_reason
            tg.cancel_scope.cancel()
