"""Remote keys are scoped to one connection, and live only while they are granted.

A peer that drives its QP with raw verbs -- as any hostile peer can -- tries what the
caller-side checks of ``aiordma._proto.onesided`` never let honest code try: it copies another
connection's exposure (addr, rkey) into its own READ or WRITE, READs a rendezvous region after
its RNDV_DONE, or an exposure after it was revoked.  The NIC must refuse each (the simulated wire
enforces PD and memory-window scoping as rxe does): the hostile connection fails with a typed
error, the victim's memory is unread and unchanged, and its connection goes on.

Environments: ``sim`` (memory windows: the shared PD, a type 2 window bound to each grant's
QP), ``sim-own-pd`` (a device without windows, as siw: a protection domain per connection), and
``rxe`` on Soft-RoCE in the guest (windows).  The two-host stage runs the cross-host case.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from anyio import BrokenResourceError

import aiordma
from aiordma import RdmaConfig, RemoteBuffer
from aiordma._rdma.constants import Access, Opcode, SendWR

from ._leaks import no_fd_leak, pinned_unchanged
from ._rdma_env import Env, rdma_env
from ._skips import backend_of, one_loop_on_a_device

pytestmark = pytest.mark.anyio

RNDV = 256 << 10


@pytest.fixture(params=["sim", "sim-own-pd", pytest.param("rxe", marks=pytest.mark.rdma)])
def env(request: pytest.FixtureRequest) -> Any:
    """The simulated wire with memory windows (``sim``: every exposure a window of its own) or
    without (``sim-own-pd``: a PD per connection), or the device."""
    if request.param == "rxe":
        one_loop_on_a_device(True, backend_of(request))
    with pinned_unchanged(), rdma_env(request.param == "rxe", memory_windows=request.param == "sim",
                                      config=RdmaConfig(rendezvous=RNDV)) as e:  # fmt: skip
        if e.kind == "sim":
            e.kind = request.param
        yield e


@asynccontextmanager
async def two_connections(env: Env) -> AsyncIterator[list[tuple[aiordma.Channel, aiordma.Channel]]]:
    """Two connections to one listener (so both server ends share a device): [(client, server)] x 2."""
    send, receive = anyio.create_memory_object_stream[Any](2)
    pairs: list[tuple[aiordma.Channel, aiordma.Channel]] = []
    async with no_fd_leak(), await aiordma.create_channel_listener(
        env.host, 0, transport="rdma", rdma_backend=env.backend(), max_message_size=16 << 20
    ) as listener, send, receive:  # fmt: skip
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, send.send)
            for _ in range(2):
                client = await aiordma.connect_channel(env.host, listener.port, transport="rdma",
                                                       rdma_backend=env.backend(), max_message_size=16 << 20)  # fmt: skip
                pairs.append((client, await receive.receive()))
            tg.cancel_scope.cancel()
        try:
            yield pairs
        finally:
            with anyio.CancelScope(shield=True):
                for client, server in pairs:
                    await client.aclose()
                    await server.aclose()


def raw_rdma(attacker: aiordma.Channel, write: bool, raddr: int, rkey: int, length: int) -> None:
    """Post, behind aiordma's back, an RDMA READ (or WRITE) on the attacker's own QP."""
    link: Any = attacker._core.link
    mr = link.res.send_mr  # (registered, local write: a READ's destination, a WRITE's source)
    link.qp.post_send(SendWR(Opcode.RDMA_WRITE if write else Opcode.RDMA_READ, wr_id=(1 << 63) | 0x77,
                             addr=mr.addr, length=length, lkey=mr.lkey, remote_addr=raddr, rkey=rkey))  # fmt: skip


#: what a NIC answers an access it refuses: rxe NAKs a READ with a bad rkey as an invalid request,
#: a WRITE as an access error; the simulated wire says access error for both
REFUSED = ("REM_ACCESS_ERR", "REM_INV_REQ_ERR", "REM_OP_ERR")


def refused(cause: BaseException) -> bool:
    return any(status in str(cause) for status in REFUSED)


async def the_connection_fails(ch: aiordma.Channel) -> BaseException:
    """Wait (bounded) until ``ch`` reports its connection failed; its cause."""
    with anyio.fail_after(20):
        with pytest.raises(BrokenResourceError) as ei:
            while True:
                await ch.receive()
    cause = ei.value.__cause__
    assert cause is not None
    return cause


@pytest.mark.parametrize("write", [False, True], ids=["READ", "WRITE"])
async def test_an_rkey_granted_on_one_connection_is_refused_on_another(anyio_backend: Any, env: Env, write: bool) -> None:
    async with two_connections(env) as [(a_client, a_server), (b_client, b_server)]:
        secret = os.urandom(8192)
        buf = bytearray(secret)
        async with a_server.expose(buf, read=True, write=True) as remote:
            await a_server.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await a_client.receive())
            assert desc.rkey and desc.addr
            # the hostile peer on connection B uses A's descriptor on its own QP
            landing = b_client._core.link.res.send_mr  # (where B's READ would put A's bytes)
            raw_rdma(b_client, write, desc.addr, desc.rkey, 4096)
            cause = await the_connection_fails(b_client)
            assert landing.read(0, 4096) != secret[:4096], "B read A's memory"
            assert refused(cause), cause
            # B's server end fails too (the responder's QP went to ERROR), and says so
            await the_connection_fails(b_server)
            # A goes on: its memory unread by B (B's buffer holds none of it) and unchanged
            assert bytes(buf) == secret
            got = bytearray(8192)
            await a_client.read(desc, got)
            assert bytes(got) == secret
            await a_client.write(desc, b"still mine", offset=10)
            await a_client.send(b"done")
            assert await a_server.receive() == b"done"
        assert bytes(buf[10:20]) == b"still mine"


async def test_a_rendezvous_rkey_dies_at_rndv_done(anyio_backend: Any, env: Env) -> None:
    async with two_connections(env) as [(a_client, a_server), _other]:
        message = os.urandom(RNDV + 4096)
        await a_server.send(message)  # staged; its descriptor comes in the message's place
        core = a_client._core
        with anyio.fail_after(20):
            while not core.messages:
                await anyio.sleep(0.01)
        rv: Any = core.messages[0]
        assert not isinstance(rv, bytes) and rv.rkey  # (a rendezvous)
        assert await a_client.receive() == message  # READ, then RNDV_DONE
        server_nic: Any = a_server._core.nic
        with anyio.fail_after(20):
            while server_nic.rndv_staged:  # the server took the RNDV_DONE: the grant is gone
                await anyio.sleep(0.01)
        raw_rdma(a_client, False, rv.addr, rv.rkey, 4096)  # the old rkey, the right QP
        cause = await the_connection_fails(a_client)
        assert refused(cause), cause


async def test_a_lent_send_is_reachable_only_by_its_connection_and_only_until_rndv_done(anyio_backend: Any,
                                                                                         env: Env) -> None:  # fmt: skip
    """A send from registered memory is lent (zero copy) through a grant of its own: another
    connection cannot READ it with the announced rkey, its own connection READs it, and after
    the RNDV_DONE the rkey is dead -- the memory stays registered, and is the sender's again."""
    async with two_connections(env) as [(a_client, _a_server), (b_client, b_server)]:
        reg = aiordma.RegisteredBuffer(RNDV + 8192)
        reg[:] = os.urandom(len(reg))
        async with anyio.create_task_group() as tg:
            tg.start_soon(b_server.send, reg)
            with anyio.fail_after(20):
                while not b_client._core.messages:
                    await anyio.sleep(0.01)
            rv: Any = b_client._core.messages[0]
            assert not isinstance(rv, bytes) and rv.rkey and b_server._core.nic.rndv_staged == 0  # lent
            raw_rdma(a_client, False, rv.addr, rv.rkey, 4096)  # the rkey, another connection's QP
            cause = await the_connection_fails(a_client)
            assert refused(cause), cause
            assert await b_client.receive() == bytes(reg)  # its own connection READs it
        raw_rdma(b_client, False, rv.addr, rv.rkey, 4096)  # after the RNDV_DONE: the old rkey, the right QP
        cause = await the_connection_fails(b_client)
        assert refused(cause), cause
        reg.close()  # (the sender's again: not busy, no view of ours alive)


async def test_a_revoked_exposure_is_unreachable_when_the_block_exits(anyio_backend: Any, env: Env) -> None:
    async with two_connections(env) as [(a_client, a_server), _other]:
        buf = bytearray(os.urandom(4096))
        async with a_server.expose(buf, read=True) as remote:
            await a_server.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await a_client.receive())
            got = bytearray(4096)
            await a_client.read(desc, got)
            assert got == buf
        # the block exited: revoked, whatever the peer answers -- its rkey is dead on the NIC
        raw_rdma(a_client, False, desc.addr, desc.rkey, 4096)
        cause = await the_connection_fails(a_client)
        assert refused(cause), cause


async def test_a_read_only_bytes_exposure_works_over_rdma(anyio_backend: Any, env: Env) -> None:
    async with two_connections(env) as [(a_client, a_server), _other]:
        data = bytes(os.urandom(10_000))  # immutable: registered without any write access
        async with a_server.expose(data, read=True) as remote:
            await a_server.send(remote.to_bytes())
            desc = RemoteBuffer.from_bytes(await a_client.receive())
            got = bytearray(10_000)
            await a_client.read(desc, got)
            assert bytes(got) == data
            with pytest.raises(aiordma.RemoteAccessDeniedError):
                await a_client.write(desc, b"x")
            await a_client.send(b"done")
            assert await a_server.receive() == b"done"


async def test_a_qp_lets_its_peer_read_only_once_it_granted_a_read(anyio_backend: Any, env: Env) -> None:
    async with two_connections(env) as [(a_client, a_server), _other]:
        link: Any = a_server._core.link
        assert not link.remote.qp_access & Access.REMOTE_READ  # a fresh connection: no remote READ at all
        if env.fabric is not None:
            assert not link.qp._access & Access.REMOTE_READ
        async with a_server.expose(bytearray(4096), read=True) as remote:
            assert link.remote.qp_access & Access.REMOTE_READ
            await a_server.send(remote.to_bytes())
            await a_client.receive()
        assert (link.scope is link.device) == (env.kind != "sim-own-pd")  # which scoping the device has


@pytest.mark.rdma
def test_aiordma_info_says_how_remote_keys_are_scoped() -> None:
    from aiordma._cli.info import collect_info, format_info

    info = collect_info()
    devices = info["rdma"]["devices"]
    assert devices and all(d["remote_keys"] for d in devices)
    assert devices[0]["remote_keys"].startswith("memory windows (type 2)"), devices[0]  # rxe has them
    assert "remote keys: memory windows" in format_info(info)
