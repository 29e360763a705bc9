"""The Dask comm backend (``aiordma._dask``): distributed's own comm tests on ``rdma://``, and clusters.

The generic checks are adapted from distributed's ``distributed/comm/tests/test_comms.py``
(client/server, implicit and explicit close, connect timeout, many listeners, deserialization
round trips, repr and addresses) and run, through the public ``distributed.comm.connect`` /
``listen``, for each kind of connection:

* ``tcp``: the backend as installed (``transport="auto"``) on 127.0.0.1, where aiordma falls
  back to TCP;
* ``sim``: ``transport="rdma"`` on the simulated RC wire (any host): the RDMA link, rendezvous
  and registered receive buffers, over a real TCP control connection on 127.0.0.1;
* ``rdma``: ``transport="rdma"`` (strict) on a real device, in the Soft-RoCE guest (marked).

Every test runs under distributed's ``gen_test``, which fails on leaked threads, subprocesses
and unclosed comms; pinned memory must be back where it was after each test.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("distributed")
np = pytest.importorskip("numpy")

import dask  # noqa: E402
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster  # noqa: E402
from distributed.comm import (  # noqa: E402
    CommClosedError,
    connect,
    get_address_host,
    get_local_address_for,
    listen,
    parse_address,
    parse_host_port,
    resolve_address,
)
from distributed.comm.core import FatalCommClosedError  # noqa: E402
from distributed.comm.registry import backends, get_backend  # noqa: E402
from distributed.metrics import time  # noqa: E402
from distributed.protocol import Serialized, deserialize, serialize, to_serialize  # noqa: E402
from distributed.protocol.utils_test import get_host_array  # noqa: E402
from distributed.utils import wait_for  # noqa: E402
from distributed.utils_test import gen_test  # noqa: E402

import aiordma  # noqa: E402
from aiordma import RdmaConfig  # noqa: E402
from aiordma._dask import RDMABackend, RDMAComm, decode_head, encode  # noqa: E402
from aiordma.testing import rdma_address, simulated_backend  # noqa: E402

from ._skips import rdma_device_present  # noqa: E402
from ._leaks import pinned_unchanged, verbs_released  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass
class Kind:
    name: str
    host: str
    backend: RDMABackend

    @property
    def transport(self) -> str:
        return "tcp" if self.name == "tcp" else "rdma"

    @property
    def address(self) -> str:
        return f"rdma://{self.host}"


KINDS = [
    pytest.param("tcp", id="tcp"),
    pytest.param("sim", id="sim"),
    # the rendezvous from 256 KiB (an RNIC's setting): frames of a few MiB by RDMA READ into
    # registered buffers
    pytest.param("sim-rndv", id="sim-rndv"),
    pytest.param("rdma", id="rdma", marks=pytest.mark.rdma),
]


def _make_kind(name: str) -> Kind:
    if name == "tcp":
        return Kind(name, "127.0.0.1", RDMABackend())
    if name == "sim":
        return Kind(name, "127.0.0.1", RDMABackend(transport="rdma", rdma_backend=simulated_backend()))
    if name == "sim-rndv":
        backend = simulated_backend(RdmaConfig(rendezvous=256 << 10))
        return Kind(name, "127.0.0.1", RDMABackend(transport="rdma", rdma_backend=backend))
    host = rdma_address()
    assert host is not None, "no RDMA device with an IPv4 RoCEv2 address"
    return Kind(name, host, RDMABackend(transport="rdma"))


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Kind:
    """Installs the kind's backend as the ``rdma`` scheme (restored after the test)."""
    k = _make_kind(str(request.param))
    monkeypatch.setitem(backends, "rdma", k.backend)
    return k


@pytest.fixture
def tcp_kind(monkeypatch: pytest.MonkeyPatch) -> Kind:
    k = _make_kind("tcp")
    monkeypatch.setitem(backends, "rdma", k.backend)
    return k


@pytest.fixture(autouse=True)
def released_everything() -> Iterator[None]:
    with pinned_unchanged():
        yield
    verbs_released()


def dead_port() -> int:
    """A port on 127.0.0.1 where nobody listens (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LogRecords(logging.Handler):
    """Collects the records of ``distributed.comm.rdma`` (``distributed`` does not propagate to
    the root logger, where pytest's caplog listens)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> LogRecords:
        log = logging.getLogger("distributed.comm.rdma")
        self._level = log.level
        log.setLevel(logging.DEBUG)
        log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("distributed.comm.rdma")
        log.removeHandler(self)
        log.setLevel(self._level)


# -- helpers adapted from distributed/comm/tests/test_comms.py ------------------------------


async def get_comm_pair(listen_addr: str, listen_args: Any = None, connect_args: Any = None, **kwargs: Any) -> Any:
    listen_args = listen_args or {}
    connect_args = connect_args or {}
    q: asyncio.Queue[Any] = asyncio.Queue()

    async def handle_comm(comm: Any) -> None:
        await q.put(comm)

    async with listen(listen_addr, handle_comm, **listen_args, **kwargs) as listener:
        comm = await connect(listener.contact_address, **connect_args, **kwargs)

    serv_comm = await q.get()
    return (comm, serv_comm)


def tcp_eq(expected_host: str, expected_port: int | None = None) -> Callable[[str], None]:
    def checker(loc: str) -> None:
        host, port = parse_host_port(loc)
        assert host == expected_host
        if expected_port is not None:
            assert port == expected_port
        else:
            assert 1023 < port < 65536

    return checker


async def check_client_server(
    addr: str, check_listen_addr: Callable[[str], None] | None = None, transport: str | None = None
) -> None:
    async def handle_comm(comm: Any) -> None:
        try:
            scheme, loc = parse_address(comm.peer_address)
            assert scheme == bound_scheme
            msg = await comm.read()
            assert msg["op"] == "ping"
            msg["op"] = "pong"
            await comm.write(msg)
            msg = await comm.read()
            assert msg["op"] == "foobar"
        finally:
            await comm.close()

    # arbitrary connection args are ignored
    listener = await listen(addr, handle_comm, xxx="bar")
    bound_addr = listener.listen_address
    bound_scheme, bound_loc = parse_address(bound_addr)
    assert bound_scheme in backends
    assert bound_scheme == parse_address(addr)[0] == "rdma"
    if check_listen_addr is not None:
        check_listen_addr(bound_loc)
    assert listener.contact_address == bound_addr

    seen = []

    async def client_communicate(key: int, delay: float = 0) -> None:
        comm = await connect(listener.contact_address, xxx="foo")
        try:
            assert comm.peer_address == listener.contact_address
            assert isinstance(comm, RDMAComm)
            if transport is not None:
                assert comm.transport == transport
            await comm.write({"op": "ping", "data": key})
            await comm.write({"op": "foobar"})
            if delay:
                await asyncio.sleep(delay)
            msg = await comm.read()
            assert msg == {"op": "pong", "data": key}
            seen.append(key)
        finally:
            await comm.close()

    await client_communicate(key=1234)
    # many clients at once
    await asyncio.gather(*[client_communicate(key=i, delay=0.05) for i in range(20)])
    assert set(seen) == {1234} | set(range(20))
    listener.stop()


async def check_comm_closed_implicit(addr: str) -> None:
    async def handle_comm(comm: Any) -> None:
        await comm.close()

    async with listen(addr, handle_comm) as listener:
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.write({})
            await comm.read()

        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()


async def check_comm_closed_explicit(addr: str) -> None:
    a, b = await get_comm_pair(addr)
    a_read = a.read()
    b_read = b.read()
    await a.close()
    # in-flight reads abort with CommClosedError
    with pytest.raises(CommClosedError):
        await a_read
    with pytest.raises(CommClosedError):
        await b_read
    # new reads as well
    with pytest.raises(CommClosedError):
        await a.read()
    with pytest.raises(CommClosedError):
        await b.read()
    # and writes
    with pytest.raises(CommClosedError):
        await a.write({})
    with pytest.raises(CommClosedError):
        await b.write({})
    await b.close()


async def check_connect_timeout(addr: str) -> None:
    t1 = time()
    with pytest.raises(IOError):
        await connect(addr, timeout=0.15)
    dt = time() - t1
    assert 1 >= dt >= 0.1


async def check_many_listeners(addr: str, n: int = 100) -> None:
    async def handle_comm(comm: Any) -> None:
        pass

    listeners = [await listen(addr, handle_comm) for _ in range(n)]
    assert len({lst.listen_address for lst in listeners}) == n
    assert len({lst.contact_address for lst in listeners}) == n
    for lst in listeners:
        await lst.stop()


async def check_listener_deserialize(addr: str, deserialize: bool, in_value: Any, check_out: Callable[[Any], None]) -> None:
    q: asyncio.Queue[Any] = asyncio.Queue()

    async def handle_comm(comm: Any) -> None:
        try:
            msg = await comm.read()
        except Exception as exc:
            q.put_nowait(exc)
        else:
            q.put_nowait(msg)
        finally:
            await comm.close()

    async with listen(addr, handle_comm, deserialize=deserialize) as listener:
        comm = await connect(listener.contact_address)

    await comm.write(in_value)
    out_value = await q.get()
    if isinstance(out_value, Exception):
        raise out_value
    check_out(out_value)
    await comm.close()


async def check_connector_deserialize(addr: str, deserialize: bool, in_value: Any, check_out: Callable[[Any], None]) -> None:
    done = asyncio.Event()

    async def handle_comm(comm: Any) -> None:
        try:
            await comm.write(in_value)
            await done.wait()
        finally:
            await comm.close()

    async with listen(addr, handle_comm) as listener:
        comm = await connect(listener.contact_address, deserialize=deserialize)

    try:
        out_value = await comm.read()
        done.set()
    finally:
        await comm.close()
    check_out(out_value)


async def check_deserialize(addr: str) -> None:
    """The ``deserialize`` flag of connect() and listen(), with Serialize and Serialized objects."""
    msg = {"op": "update", "x": b"abc", "to_ser": [to_serialize(123)], "ser": Serialized(*serialize(456))}
    msg_orig = msg.copy()

    def check_out_false(out_value: Any) -> None:
        out_value = out_value.copy()
        to_ser = out_value.pop("to_ser")
        ser = out_value.pop("ser")
        expected_msg = msg_orig.copy()
        del expected_msg["ser"]
        del expected_msg["to_ser"]
        assert out_value == expected_msg
        assert isinstance(ser, Serialized)
        assert deserialize(ser.header, ser.frames) == 456
        assert isinstance(to_ser, (tuple, list)) and len(to_ser) == 1
        (to_ser,) = to_ser
        if isinstance(to_ser, Serialized):
            assert deserialize(to_ser.header, to_ser.frames) == 123
        else:
            assert to_ser == to_serialize(123)

    def check_out_true(out_value: Any) -> None:
        expected_msg = msg.copy()
        expected_msg["ser"] = 456
        expected_msg["to_ser"] = [123]
        assert list(out_value.pop("to_ser")) == expected_msg.pop("to_ser")
        assert out_value == expected_msg

    await check_listener_deserialize(addr, False, msg, check_out_false)
    await check_connector_deserialize(addr, False, msg, check_out_false)
    await check_listener_deserialize(addr, True, msg, check_out_true)
    await check_connector_deserialize(addr, True, msg, check_out_true)

    # long bytestrings, transferred as frames of their own
    uncompressible = os.urandom(1024**2) * 4
    msg = {
        "op": "update",
        "x": uncompressible,
        "to_ser": (to_serialize(uncompressible),),
        "ser": Serialized(*serialize(uncompressible)),
    }
    msg_orig = msg.copy()

    def check_out(deserialize_flag: bool, out_value: Any) -> None:
        assert sorted(out_value) == sorted(msg_orig)
        out_value = out_value.copy()
        to_ser = out_value.pop("to_ser")
        ser = out_value.pop("ser")
        expected_msg = msg_orig.copy()
        del expected_msg["ser"]
        del expected_msg["to_ser"]
        assert out_value == expected_msg
        if deserialize_flag:
            assert isinstance(ser, (bytes, bytearray))
            assert bytes(ser) == uncompressible
        else:
            assert isinstance(ser, Serialized)
            assert deserialize(ser.header, ser.frames) == uncompressible
            assert isinstance(to_ser, tuple) and len(to_ser) == 1
            (to_ser,) = to_ser
            if isinstance(to_ser, Serialized):
                assert deserialize(to_ser.header, to_ser.frames) == uncompressible
            else:
                assert to_ser == to_serialize(uncompressible)

    await check_listener_deserialize(addr, False, msg, partial(check_out, False))
    await check_connector_deserialize(addr, False, msg, partial(check_out, False))
    await check_listener_deserialize(addr, True, msg, partial(check_out, True))
    await check_connector_deserialize(addr, True, msg, partial(check_out, True))


async def check_deserialize_roundtrip(addr: str) -> None:
    """Round trips with ``deserialize`` on and off; each write goes before the peer reads."""
    uncompressible = os.urandom(1024**2) * 4
    msg = {
        "op": "update",
        "x": uncompressible,
        "to_ser": [to_serialize(uncompressible)],
        "ser": Serialized(*serialize(uncompressible)),
    }
    for should_deserialize in (True, False):
        a, b = await get_comm_pair(addr, deserialize=should_deserialize)
        await a.write(msg)
        got = await b.read()
        await b.write(got)
        got = await a.read()
        assert sorted(got) == sorted(msg)
        for k in ("op", "x"):
            assert got[k] == msg[k]
        if should_deserialize:
            assert isinstance(got["to_ser"][0], (bytes, bytearray))
            assert isinstance(got["ser"], (bytes, bytearray))
        else:
            assert isinstance(got["to_ser"][0], (to_serialize, Serialized))
            assert isinstance(got["ser"], Serialized)
        await a.close()
        await b.close()


def _raise_eoferror() -> None:
    raise EOFError


class _EOFRaising:
    def __reduce__(self) -> Any:
        return _raise_eoferror, ()


async def check_repr(a: Any, b: Any) -> None:
    assert "closed" not in repr(a)
    assert "closed" not in repr(b)
    await a.close()
    assert "closed" in repr(a)
    assert a.local_address in repr(a)
    assert b.peer_address in repr(a)
    await b.close()
    assert "closed" in repr(b)
    assert a.local_address in repr(b)
    assert b.peer_address in repr(b)


# -- the generic comm tests ------------------------------------------------------------------


@gen_test()
async def test_client_server(kind: Kind) -> None:
    await check_client_server(kind.address, tcp_eq(kind.host), kind.transport)
    port = dead_port()
    await check_client_server(f"{kind.address}:{port}", tcp_eq(kind.host, port), kind.transport)


@gen_test()
async def test_comm_closed_implicit(kind: Kind) -> None:
    await check_comm_closed_implicit(kind.address)


@gen_test()
async def test_comm_closed_explicit(kind: Kind) -> None:
    await check_comm_closed_explicit(kind.address)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tcp", "sim"])
@gen_test(timeout=120)
async def test_a_worker_that_reads_late_loses_nothing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slow is not dead (issue 31): a worker busy for 8 s (twice the default keepalive's user
    timeout) before it reads a 48 MiB frame; the writer waits, every byte arrives.  Over TCP
    this cost the connection before the window watch (``ETIMEDOUT`` at the writer)."""
    k = _make_kind(name)
    monkeypatch.setitem(backends, "rdma", k.backend)
    reader, writer = await get_comm_pair(k.address)
    payload = np.arange(6 << 20, dtype=np.int64)  # 48 MiB
    msg = {"op": "data", "x": to_serialize(payload)}
    write = asyncio.ensure_future(writer.write(msg))
    await asyncio.sleep(8)
    got = await wait_for(reader.read(), 60)
    await wait_for(write, 60)
    assert np.array_equal(got["x"], payload)
    await reader.close()
    await writer.close()


@gen_test()
async def test_comm_closed_on_read_error(kind: Kind) -> None:
    """A read interrupted (here by a timeout) leaves the comm in an unknown state: it is aborted."""
    reader, writer = await get_comm_pair(kind.address)
    with pytest.raises(asyncio.TimeoutError):
        await wait_for(reader.read(), 0.01)
    assert reader.closed()
    with pytest.raises(CommClosedError):
        await writer.read()
    await reader.close()
    await writer.close()


@gen_test()
async def test_connect_timeout(tcp_kind: Kind) -> None:
    await check_connect_timeout(f"rdma://127.0.0.1:{dead_port()}")


@gen_test()
async def test_many_listeners(kind: Kind) -> None:
    await check_many_listeners(kind.address)


@gen_test()
async def test_deserialize(kind: Kind) -> None:
    await check_deserialize(kind.address)


@gen_test()
async def test_deserialize_roundtrip(kind: Kind) -> None:
    await check_deserialize_roundtrip(kind.address)


@gen_test()
async def test_deserialize_eoferror(kind: Kind) -> None:
    """EOFError when deserializing closes the comm."""

    async def handle_comm(comm: Any) -> None:
        await comm.write({"data": to_serialize(_EOFRaising())})
        with pytest.raises(CommClosedError):
            await comm.read()

    async with listen(kind.address, handle_comm) as listener:
        comm = await connect(listener.contact_address, deserialize=deserialize)
        with pytest.raises(CommClosedError):
            await comm.read()
        await comm.close()


@gen_test()
async def test_repr(kind: Kind) -> None:
    a, b = await get_comm_pair(kind.address)
    assert a.local_address in repr(b)
    assert b.local_address in repr(a)
    await check_repr(a, b)


@gen_test()
async def test_addresses(kind: Kind) -> None:
    a, b = await get_comm_pair(kind.address)
    assert a.peer_address == b.local_address
    assert a.local_address == b.peer_address
    assert a.same_host and b.same_host
    a.abort()
    b.abort()
    await a.close()  # (after abort: waits until the teardown abort started is done)
    await b.close()


def test_address_functions(tcp_kind: Kind) -> None:
    assert get_address_host("rdma://127.0.0.1:8786") == "127.0.0.1"
    assert resolve_address("rdma://localhost:8786") == "rdma://127.0.0.1:8786"
    assert get_local_address_for("rdma://127.0.0.1:8786") == "rdma://127.0.0.1"
    assert backends["rdma"].get_address_host_port("[::1]:8786") == ("::1", 8786)


@pytest.mark.parametrize("list_cls", [list, type("OpaqueList", (list,), {})])
@gen_test()
async def test_do_not_share_buffers(tcp_kind: Kind, list_cls: type) -> None:
    """Two objects with a buffer interface in the same message do not share their buffer upon
    deserialization (as over Dask's TCP comm)."""

    async def handle_comm(comm: Any) -> None:
        msg = await comm.read()
        msg["data"] = to_serialize(list_cls([np.array([1, 2]), np.array([3, 4])]))
        await comm.write(msg)
        await comm.close()

    async with listen(tcp_kind.address, handle_comm) as listener:
        comm = await connect(listener.contact_address)
    await comm.write({"op": "ping"})
    msg = await comm.read()
    await comm.close()
    a, b = msg["data"]
    assert get_host_array(a) is not get_host_array(b)


@pytest.mark.parametrize(
    "nbytes_np,nbytes_other,expect_separate_buffer",
    [
        (1, 0, False),  # <2 kiB (including prologue and msgpack header)
        (1, 1800, False),  # <2 kiB
        (1, 2100, True),  # >2 kiB
        (200_000, 9500, False),  # <5% of numpy array
        (200_000, 10500, True),  # >5% of numpy array
        (350_000, 0, False),  # sharded buffer
    ],
)
@gen_test()
async def test_share_buffer_with_header(
    tcp_kind: Kind, nbytes_np: int, nbytes_other: int, expect_separate_buffer: bool
) -> None:
    """A numpy array shares its buffer with the serialized header when the header is small, as
    over Dask's TCP comm; its shards land in one buffer."""

    async def handle_comm(comm: Any) -> None:
        comm.max_shard_size = 250_000
        msg = await comm.read()
        msg["np"] = to_serialize(np.random.randint(0, 256, nbytes_np, dtype="u1"))
        msg["other"] = np.random.bytes(nbytes_other)
        await comm.write(msg)
        await comm.close()

    async with listen(tcp_kind.address, handle_comm) as listener:
        comm = await connect(listener.contact_address)
    await comm.write({"op": "ping"})
    msg = await comm.read()
    await comm.close()
    a = msg["np"]
    ha = get_host_array(a)
    assert (ha.nbytes == a.nbytes) == expect_separate_buffer


# -- what the rdma:// backend adds ---------------------------------------------------------------


@gen_test()
async def test_large_frames_are_byte_exact(kind: Kind) -> None:
    """A 64 MiB array (larger than the peer's message limit: it travels in pieces), a
    Fortran-ordered float array and a non-contiguous view, both ways, written before the peer
    reads; they arrive equal and writable."""
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, 64 << 20, dtype="u1")
    fortran = np.asfortranarray(rng.random((700, 300)))
    strided = rng.integers(0, 1 << 30, 200_000)[::3]
    staged = aiordma.memory_stats().staged_bytes
    misses = aiordma.memory_stats().cache_misses  # (a READ into a buffer registered for it)
    a, b = await get_comm_pair(kind.address)
    try:
        assert a.transport == b.transport == kind.transport
        for sender, receiver in ((a, b), (b, a)):
            await sender.write({"big": to_serialize(big), "f": to_serialize(fortran), "s": to_serialize(strided)})
            await sender.write({"op": "after"})
            got = await receiver.read()
            assert await receiver.read() == {"op": "after"}
            assert got["big"].dtype == big.dtype and np.array_equal(got["big"], big)
            assert got["f"].flags.f_contiguous and np.array_equal(got["f"], fortran)
            assert np.array_equal(got["s"], strided)
            assert all(got[k].flags.writeable for k in ("big", "f", "s"))
        if kind.transport == "rdma":
            # the 64 MiB frames went by rendezvous into registered buffers: nothing of them staged
            assert aiordma.memory_stats().staged_bytes - staged < 8 << 20
            assert aiordma.memory_stats().cache_misses > misses
    finally:
        await a.close()
        await b.close()


@gen_test()
async def test_over_the_pinned_limit_frames_are_staged(kind: Kind) -> None:
    """A frame that may not be registered (the pinned-memory limit) is received through the
    connection's staging regions instead: slower, still byte-exact."""
    if kind.transport != "rdma":
        pytest.skip("registered receive buffers are for RDMA comms")
    data = np.random.default_rng(3).integers(0, 256, 48 << 20, dtype="u1")
    a, b = await get_comm_pair(kind.address)
    staged = aiordma.memory_stats().staged_bytes
    # room for the sender's rendezvous regions (8 MiB pieces, 16 MiB in flight), not for a
    # registration of the whole 48 MiB frame
    aiordma.set_pinned_limit(aiordma.memory_stats().pinned_bytes + (32 << 20))
    try:
        with LogRecords() as logs:
            await a.write({"x": to_serialize(data)})
            got = await b.read()
    finally:
        aiordma.set_pinned_limit(None)
    assert np.array_equal(got["x"], data)
    assert aiordma.memory_stats().staged_bytes - staged >= data.nbytes
    assert any("staging regions" in r.getMessage() for r in logs.records), [r.getMessage() for r in logs.records]
    await a.close()
    await b.close()


@gen_test()
async def test_write_does_not_wait_for_the_reader(kind: Kind) -> None:
    """As over Dask's TCP comm, writes return before the peer reads; order is kept."""
    a, b = await get_comm_pair(kind.address)
    payload = np.arange(2 << 20, dtype="u1")  # 2 MiB each: more than the socket and link buffer
    for i in range(12):
        await wait_for(a.write({"i": i, "x": to_serialize(payload), "small": b"s" * i}), 5)
    for i in range(12):
        msg = await b.read()
        assert msg["i"] == i and msg["small"] == b"s" * i and np.array_equal(msg["x"], payload)
    await a.close()
    await b.close()


@gen_test()
async def test_abort_is_synchronous(kind: Kind) -> None:
    a, b = await get_comm_pair(kind.address)
    pending = asyncio.ensure_future(a.read())
    await asyncio.sleep(0.01)
    a.abort()
    assert a.closed() and "closed" in repr(a)
    with pytest.raises(CommClosedError):
        await pending
    with pytest.raises(CommClosedError):
        await a.write({"x": 1})
    with pytest.raises(CommClosedError):
        await b.read()
    assert b.closed()  # the peer's end noticed, and released its connection
    a.abort()  # idempotent
    await a.close()
    await b.close()


@gen_test()
async def test_listener_survives_a_client_that_breaks_the_framing(tcp_kind: Kind) -> None:
    """A peer that is aiordma but not an rdma:// comm: its comm fails the handshake with
    CommClosedError and the listener goes on accepting."""
    handled: list[Any] = []

    async def handle_comm(comm: Any) -> None:
        handled.append(comm)
        await comm.close()

    async with listen(tcp_kind.address, handle_comm) as listener:
        host, port = parse_host_port(parse_address(listener.contact_address)[1])
        channel = await aiordma.connect_channel(host, port)
        try:
            await channel.receive()  # the listener's handshake message
            await channel.send(b"definitely not a head message")
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                await wait_for(channel.receive(), 5)  # the listener aborted it
        finally:
            await channel.aclose()
        comm = await connect(listener.contact_address)
        await comm.close()
    assert len(handled) == 1


def test_framing_round_trip() -> None:
    """encode/decode_head: inline frames, frames of their own, empty frames, nosplit."""
    frames = [b"header", b"", memoryview(np.arange(100_000, dtype="u1")), b"tail", bytearray(b"x" * 70_000)]
    head, separate = encode(frames)
    assert [v.nbytes for v in separate] == [100_000, 70_000]
    plan = decode_head(head, register_threshold=0)
    assert [t.nbytes for t, _ in plan.pending] == [100_000, 70_000]
    for (target, reg), data in zip(plan.pending, separate):
        assert not reg
        target[:] = data
    assert [bytes(f) for f in plan.frames] == [bytes(f) for f in frames]
    with pytest.raises(Exception, match="not an rdma:// comm message"):
        decode_head(b"x" * 64, register_threshold=0)
    # over RDMA the frames whose messages go by rendezvous are flagged: the receiver registers
    # the large ones
    head, _ = encode(frames, rendezvous=80_000)
    assert [reg for _, reg in decode_head(head, register_threshold=1).pending] == [True, False]
    assert [reg for _, reg in decode_head(head, register_threshold=200_000).pending] == [False, False]


@gen_test()
async def test_fallback_is_logged_once_per_reason(tcp_kind: Kind) -> None:
    if rdma_device_present():
        pytest.skip("this host has an RDMA device: 127.0.0.1 falls back for another reason")
    with LogRecords() as logs:
        a, b = await get_comm_pair(tcp_kind.address)
        c, d = await get_comm_pair(tcp_kind.address)
    assert a.transport == "tcp" and "no RDMA device" in a.fallback_reason
    assert a.extra_info["fallback_reason"] == a.fallback_reason
    warnings = [r for r in logs.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in logs.records]
    assert "fell back to TCP" in warnings[0].getMessage() and a.fallback_reason in warnings[0].getMessage()
    assert [r.levelno for r in logs.records].count(logging.DEBUG) >= 3  # the other three ends
    for comm in (a, b, c, d):
        await comm.close()


@gen_test()
async def test_transport_from_the_dask_config(tcp_kind: Kind) -> None:
    with dask.config.set({"distributed.comm.rdma.transport": "tcp"}), LogRecords() as logs:
        a, b = await get_comm_pair(tcp_kind.address)
    assert (a.transport, b.transport) == ("tcp", "tcp")
    assert "transport='tcp' was requested" in a.fallback_reason
    assert [r.levelno for r in logs.records if "fell back" in r.getMessage()][0] == logging.INFO
    await a.close()
    await b.close()


@gen_test()
async def test_strict_rdma_without_a_device_is_fatal(tcp_kind: Kind) -> None:
    if rdma_device_present():
        pytest.skip("this host has an RDMA device")

    async def handle_comm(comm: Any) -> None:
        await comm.close()

    async with listen(tcp_kind.address, handle_comm) as listener:
        with dask.config.set({"distributed.comm.rdma.transport": "rdma"}):
            t0 = time()
            with pytest.raises(FatalCommClosedError, match="RDMA"):
                await connect(listener.contact_address, timeout=10)
            assert time() - t0 < 5, "a fatal error is not retried until the timeout"
            with pytest.raises(aiordma.RDMAUnavailableError):
                await listen("rdma://127.0.0.1", handle_comm)


def test_registered_through_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    (ep,) = importlib.metadata.entry_points(group="distributed.comm.backends", name="rdma")
    assert ep.value == "aiordma._dask:RDMABackend"
    monkeypatch.delitem(backends, "rdma", raising=False)
    backend = get_backend("rdma")
    assert isinstance(backend, RDMABackend)
    assert get_backend("rdma") is backend


# -- clusters ----------------------------------------------------------------------------------


def shuffle_job(n: int = 2400) -> Any:
    """Transpose, rechunk across the other axis and a random permutation of the rows: every
    output chunk needs pieces of many input chunks (2.9 MB at n=2400), most of them on the other
    worker.  (The guest, ~20x slower, runs it at n=1200: the same graph, a quarter of the bytes.)"""
    x = da.random.RandomState(42).random((n, n), chunks=(n // 4, n // 4))
    perm = np.random.default_rng(1).permutation(n)
    y = (x + x.T).rechunk((n, n // 12))[perm]
    return y.sum(axis=1), y.std(axis=0)


async def run_on_cluster(protocol: str, host: str, n: int = 2400) -> tuple[Any, Any, dict[str, list[str]]]:
    async with LocalCluster(
        protocol=protocol,
        host=host,
        n_workers=2,
        threads_per_worker=1,
        processes=False,
        asynchronous=True,
        dashboard_address=None,
        worker_dashboard_address=None,
    ) as cluster:
        async with Client(cluster, asynchronous=True) as client:
            assert cluster.scheduler_address.startswith(protocol)
            a, b = await client.gather(client.compute(list(shuffle_job(n))))

            def transports(dask_worker: Any = None) -> list[str]:
                return sorted({c.transport for c in list(RDMAComm._instances) if isinstance(c, RDMAComm)})

            used = await client.run(transports)
    return a, b, used


_TCP_RESULTS: dict[tuple[str, int], tuple[Any, Any]] = {}


@pytest.mark.parametrize("cluster_kind", KINDS)
@gen_test(timeout=600)
async def test_local_cluster_shuffle_matches_tcp(cluster_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    k = _make_kind(cluster_kind)
    monkeypatch.setitem(backends, "rdma", k.backend)
    n = 1200 if cluster_kind == "rdma" else 2400
    key = (k.host, n)
    if key not in _TCP_RESULTS:  # (the job is deterministic: Dask's tcp:// runs it once per host)
        _TCP_RESULTS[key] = (await run_on_cluster("tcp://", k.host, n))[:2]
    ta, tb = _TCP_RESULTS[key]
    ra, rb, used = await run_on_cluster("rdma://", k.host, n)
    assert np.array_equal(ta, ra) and np.array_equal(tb, rb)
    assert len(used) == 2  # (both workers answered)
    assert all(t == [k.transport] for t in used.values()), used


@pytest.mark.slow
@pytest.mark.skipif(not (EXAMPLES / "dask_cluster.py").exists(), reason="no example")
def test_example_with_worker_processes() -> None:
    """examples/dask_cluster.py: a LocalCluster of worker processes (each finds the backend
    through the entry point); the workers' logs say why they fell back."""
    env = {k: v for k, v in os.environ.items() if k not in ("AIORDMA_TRANSPORT",) and not k.startswith("DASK_")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "dask_cluster.py")],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        cwd=EXAMPLES.parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert "result matches numpy: True" in proc.stdout, proc.stdout
    if not rdma_device_present():
        assert "scheduler: tcp" in proc.stdout, proc.stdout
        fallbacks = [line for line in proc.stderr.splitlines() if "distributed.comm.rdma" in line and "fell back" in line]
        # the client's process and each of the two worker processes say it once
        assert len(fallbacks) >= 3, proc.stderr
        assert all("no RDMA device" in line for line in fallbacks)


@pytest.mark.slow
def test_the_dask_command_line_on_rdma() -> None:
    """``dask scheduler --protocol rdma`` and ``dask worker rdma://...``, as a user starts them,
    and a client that computes on them (over the TCP fallback on this host)."""
    import socket
    import threading

    with socket.socket() as s:  # a free port for the scheduler (it prints no port otherwise)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("AIORDMA_TRANSPORT",) and not k.startswith("DASK_")}
    dask_cmd = str(Path(sys.executable).with_name("dask"))
    address = f"rdma://127.0.0.1:{port}"
    procs = [
        subprocess.Popen([dask_cmd, "scheduler", "--protocol", "rdma", "--host", "127.0.0.1", "--port", str(port),
                          "--no-dashboard"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
    ]  # fmt: skip
    logs: list[str] = []
    try:
        procs.append(subprocess.Popen([dask_cmd, "worker", address, "--nthreads", "1", "--no-dashboard"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))  # fmt: skip
        for proc in procs:  # (keep their pipes drained)
            threading.Thread(target=lambda p=proc: logs.extend(p.stderr), daemon=True).start()  # type: ignore[misc]
        code = (
            "import distributed, sys\n"
            f"c = distributed.Client({address!r}, timeout=60)\n"
            "c.wait_for_workers(1, timeout=60)\n"
            "print(c.submit(lambda x: x * 2, 21).result(timeout=60), c.scheduler_info()['address'])\n"
            "c.close()\n"
        )
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["42", address], out.stdout
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert any("Scheduler at:" in line and address in line for line in logs), "".join(logs[-20:])
    if not rdma_device_present():
        assert any("fell back to TCP" in line for line in logs), "".join(logs[-20:])


@gen_test()
async def test_close_right_after_a_write_delivers_it(kind: Kind) -> None:
    """A comm writes large frames and closes at once; the peer starts reading late and still gets
    every message, then the comm's end (tests/test_close.py has the transport's own races)."""
    a, b = await get_comm_pair(kind.address)
    payload = np.arange(9 << 20, dtype="u1")  # 9 MiB: over the default rendezvous threshold too

    async def read_late() -> None:
        await asyncio.sleep(0.2)
        for i in range(3):
            msg = await wait_for(b.read(), 30)
            assert msg["i"] == i and np.array_equal(msg["x"], payload)
        with pytest.raises(CommClosedError):
            await wait_for(b.read(), 10)

    reading = asyncio.ensure_future(read_late())
    for i in range(3):
        await wait_for(a.write({"i": i, "x": to_serialize(payload)}), 30)
    await wait_for(a.close(), 30)  # (it sends what the writes queued, then closes)
    await wait_for(reading, 60)
    await b.close()
