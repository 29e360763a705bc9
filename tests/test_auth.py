"""Handshake authentication (``auth=``, ``AIORDMA_AUTH``): a mutual HMAC-SHA-256 challenge and
response over both sides' nonces, before the server builds anything RDMA for the client.

The sans-IO part drives two :class:`~aiordma._proto.protocol.Connection` objects by hand (right key,
wrong key, a key on one side only, replayed and reflected proofs, malformed AUTH frames, random
keys with hypothesis); the rest runs the real handshake over TCP and over the simulated RC wire
(``rdma`` in the guest) with the anyio and asyncio front ends, and checks that a client without
the right key never made the server open an RDMA endpoint.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aiordma
import aiordma._handshake.negotiate as negotiate
from aiordma import AuthenticationError, RemoteProtocolError
from aiordma._proto.protocol import (
    AUTH_NONCE_SIZE,
    AuthChallenged,
    Authenticated,
    CloseCode,
    Connection,
    ConnectionClosed,
    MAGIC,
    FrameType,
    HelloReceived,
    Mode,
    TransportSelected,
    frame,
)
from aiordma._proto.states import Role, State
from aiordma.testing import SimFabric, SimProvider, rdma_address

from ._leaks import no_fd_leak
from ._skips import one_loop_on_a_device

KEY = b"correct horse battery staple"


def conns(ckey: bytes | None, skey: bytes | None) -> tuple[Connection, Connection]:
    c = Connection(Role.CLIENT, Mode.MESSAGES, now=0.0, auth_key=ckey)
    s = Connection(Role.SERVER, Mode.MESSAGES, now=0.0, auth_key=skey)
    return c, s


def authenticated(c: Connection, s: Connection) -> None:
    """Run the exchange to the server's HELLO and the client's SELECT."""
    (ev,) = s.receive_data(c.send_hello())
    assert isinstance(ev, HelloReceived) and ev.hello.auth_nonce is not None
    assert s.state is State.HELLO_RECEIVED
    (ev,) = c.receive_data(s.send_auth_challenge())
    assert isinstance(ev, AuthChallenged) and c.state is State.AUTH_CHALLENGED
    (ev,) = s.receive_data(c.send_auth_answer())
    assert isinstance(ev, Authenticated) and s.state is State.AUTHENTICATED
    (ev,) = c.receive_data(s.send_hello())
    assert isinstance(ev, HelloReceived)
    assert s.receive_data(c.select("tcp", "client: test")) == [TransportSelected("tcp", "client: test")]
    assert c.state is State.OPEN and s.state is State.OPEN


# -- sans-IO -----------------------------------------------------------------------------------


def test_the_same_key_on_both_sides_opens_the_connection() -> None:
    c, s = conns(KEY, KEY)
    authenticated(c, s)
    # and data flows as usual afterwards
    s.message_sink = None
    (msg,) = s.receive_data(b"".join(bytes(x) for x in c.send_message(b"after auth")))
    assert msg.data == b"after auth"  # type: ignore[union-attr]


def test_a_server_with_a_key_sends_no_hello_before_the_proof() -> None:
    c, s = conns(KEY, KEY)
    s.receive_data(c.send_hello())
    with pytest.raises(aiordma.LocalProtocolError):
        s.send_hello()  # (its HELLO is where RDMA resources would be offered)
    s.send_auth_challenge()
    with pytest.raises(aiordma.LocalProtocolError):
        s.send_hello()


def test_a_wrong_key_fails_on_the_client_first() -> None:
    c, s = conns(b"client key", b"server key")
    s.receive_data(c.send_hello())
    with pytest.raises(AuthenticationError, match="the server's proof does not match"):
        c.receive_data(s.send_auth_challenge())
    assert c.state is State.CLOSED
    # the client's CLOSE tells the server why (code REFUSED)
    closing = c.close(CloseCode.REFUSED, "authentication failed: the server's proof does not match this side's key")
    (ev,) = s.receive_data(closing)
    assert isinstance(ev, ConnectionClosed) and ev.code == CloseCode.REFUSED
    assert s.state is State.CLOSED


def test_a_client_without_the_key_cannot_answer_a_challenge_it_did_not_ask_for() -> None:
    c, s = conns(None, KEY)
    (ev,) = s.receive_data(c.send_hello())
    assert ev.hello.auth_nonce is None  # type: ignore[union-attr]
    with pytest.raises(aiordma.LocalProtocolError):
        s.send_auth_challenge()  # nothing to challenge: the server refuses (see the integration tests)
    # a forged challenge to a keyless client is a protocol error there
    c2, s2 = conns(None, None)
    s2.receive_data(c2.send_hello())
    with pytest.raises(RemoteProtocolError):
        c2.receive_data(MAGIC + frame(FrameType.AUTH, b"\x01" + bytes(64)))


def test_a_client_with_a_key_refuses_a_server_that_skips_the_proof() -> None:
    c, s = conns(KEY, None)
    s.receive_data(c.send_hello())
    with pytest.raises(AuthenticationError, match="the server did not prove it has the key"):
        c.receive_data(s.send_hello())


def test_a_replayed_answer_fails_against_a_fresh_nonce() -> None:
    c1, s1 = conns(KEY, KEY)
    s1.receive_data(c1.send_hello())
    c1.receive_data(s1.send_auth_challenge())
    answer = c1.send_auth_answer()  # recorded by an eavesdropper
    # the eavesdropper replays the same client HELLO and answer to a new server session
    s2 = Connection(Role.SERVER, Mode.MESSAGES, now=0.0, auth_key=KEY)
    s2.receive_data(_hello_bytes_of(c1))
    s2.send_auth_challenge()  # a fresh server nonce
    with pytest.raises(AuthenticationError, match="the client's proof does not match"):
        s2.receive_data(answer)


def _hello_bytes_of(c: Connection) -> bytes:
    return MAGIC + frame(FrameType.HELLO, c._client_hello)


def test_the_servers_proof_reflected_back_is_no_client_proof() -> None:
    c, s = conns(KEY, KEY)
    s.receive_data(c.send_hello())
    challenge = s.send_auth_challenge()
    server_proof = challenge[-32:]
    with pytest.raises(AuthenticationError):
        s.receive_data(frame(FrameType.AUTH, b"\x02" + server_proof))


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x02" + bytes(32), b"\x01" + bytes(10), b"\x01" + bytes(65), b"\x07" + bytes(64)],
)
def test_malformed_challenges_are_protocol_errors(payload: bytes) -> None:
    c, s = conns(KEY, KEY)
    s.receive_data(c.send_hello())
    with pytest.raises(RemoteProtocolError):
        c.receive_data(MAGIC + frame(FrameType.AUTH, payload))


@pytest.mark.parametrize("payload", [b"", b"\x01" + bytes(64), b"\x02" + bytes(31), b"\x02" + bytes(33)])
def test_malformed_answers_are_protocol_errors(payload: bytes) -> None:
    c, s = conns(KEY, KEY)
    s.receive_data(c.send_hello())
    s.send_auth_challenge()
    with pytest.raises(RemoteProtocolError):
        s.receive_data(frame(FrameType.AUTH, payload))


def test_an_auth_frame_out_of_turn_is_a_protocol_error() -> None:
    c, s = conns(KEY, KEY)
    authenticated(c, s)
    with pytest.raises(RemoteProtocolError):
        s.receive_data(frame(FrameType.AUTH, b"\x02" + bytes(32)))


def test_a_bad_nonce_extension_is_a_protocol_error() -> None:
    from aiordma._proto.framing import EXT_AUTH_NONCE, EXTENSION, Hello, decode_hello, encode_hello

    good = encode_hello(Hello(mode=Mode.MESSAGES, auth_nonce=bytes(AUTH_NONCE_SIZE)))
    assert decode_hello(good).auth_nonce == bytes(AUTH_NONCE_SIZE)
    bad = encode_hello(Hello(mode=Mode.MESSAGES)) + EXTENSION.pack(EXT_AUTH_NONCE, 5) + bytes(5)
    with pytest.raises(RemoteProtocolError):
        decode_hello(bad)


@given(st.binary(min_size=1, max_size=64), st.binary(min_size=1, max_size=64))
def test_random_keys_open_exactly_when_equal(ckey: bytes, skey: bytes) -> None:
    c, s = conns(ckey, skey)
    s.receive_data(c.send_hello())
    challenge = s.send_auth_challenge()
    if ckey != skey:
        with pytest.raises(AuthenticationError):
            c.receive_data(challenge)
        return
    c.receive_data(challenge)
    (ev,) = s.receive_data(c.send_auth_answer())
    assert isinstance(ev, Authenticated)


def test_resolve_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIORDMA_AUTH", raising=False)
    assert negotiate.resolve_auth(None) is None
    assert negotiate.resolve_auth("k") == b"k"
    assert negotiate.resolve_auth(b"\x00\x01") == b"\x00\x01"
    with pytest.raises(ValueError):
        negotiate.resolve_auth("")
    with pytest.raises(ValueError):
        negotiate.resolve_auth(True)
    monkeypatch.setenv("AIORDMA_AUTH", "from env")
    assert negotiate.resolve_auth(None) == b"from env"
    assert negotiate.resolve_auth(True) == b"from env"
    assert negotiate.resolve_auth(False) is None
    assert negotiate.resolve_auth("explicit") == b"explicit"
    with pytest.raises(ValueError):
        Connection(Role.CLIENT, Mode.STREAM, now=0.0, auth_key=b"")


# -- the real handshake ---------------------------------------------------------------------------

KINDS = [
    pytest.param("tcp", id="tcp"),
    pytest.param("sim", id="sim"),
    pytest.param("rdma", id="rdma", marks=pytest.mark.rdma),
]


def _one_loop_on_a_device(kind: str, anyio_backend: Any) -> None:
    one_loop_on_a_device(kind == "rdma", anyio_backend)


class Side:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.host = "127.0.0.1"
        self.fabric: SimFabric | None = None
        if kind == "sim":
            self.fabric = SimFabric()
            self.fabric.add_device("sim0", "127.0.0.1")
        elif kind == "rdma":
            self.host = rdma_address() or "no RDMA address"

    def kw(self) -> dict[str, Any]:
        if self.kind == "tcp":
            return {"transport": "tcp"}
        if self.fabric is not None:
            return {"transport": "auto", "rdma_backend": aiordma.RdmaBackend(provider=SimProvider(self.fabric))}
        return {"transport": "auto"}

    @property
    def rdma(self) -> bool:
        return self.kind != "tcp"


@pytest.fixture
def server_endpoints(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sides that opened an RDMA endpoint (QP, CQ, memory) during a handshake."""
    opened: list[str] = []
    real = negotiate._open_endpoint

    def counting(core: Any, backend: Any, side: str) -> Any:
        opened.append(side)
        return real(core, backend, side)

    monkeypatch.setattr(negotiate, "_open_endpoint", counting)
    return opened


pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("kind", KINDS)
async def test_the_right_key_connects_over_every_transport(
    anyio_backend: Any, kind: str, server_endpoints: list[str]
) -> None:
    _one_loop_on_a_device(kind, anyio_backend)
    side = Side(kind)
    async with no_fd_leak():
        async with await aiordma.create_channel_listener(side.host, 0, auth=KEY, **side.kw()) as lst:
            async with anyio.create_task_group() as tg:

                async def handler(ch: aiordma.Channel) -> None:
                    async with ch:
                        await ch.send(await ch.receive())

                tg.start_soon(lst.serve, handler)
                async with await aiordma.connect_channel(side.host, lst.port, auth=KEY, **side.kw()) as ch:
                    await ch.send(b"ping")
                    assert await ch.receive() == b"ping"
                    assert ch.transport == ("rdma" if side.rdma else "tcp")
                tg.cancel_scope.cancel()
    assert server_endpoints.count("server") == (1 if side.rdma else 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("client_key", "server_key", "client_says", "server_says"),
    [
        (b"wrong", KEY, "the server's proof does not match", "the server's proof does not match"),
        (None, KEY, "the server requires a key", "the server requires a key"),
        (KEY, None, "the server did not prove it has the key", "the server did not prove it has the key"),
    ],
    ids=["wrong-key", "client-without-key", "server-without-key"],
)
async def test_a_key_mismatch_is_refused_on_both_sides_with_the_reason(
    anyio_backend: Any, kind: str, client_key: bytes | None, server_key: bytes | None, client_says: str,
    server_says: str, server_endpoints: list[str], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    _one_loop_on_a_device(kind, anyio_backend)
    monkeypatch.delenv("AIORDMA_AUTH", raising=False)
    side = Side(kind)
    caplog.set_level("INFO", logger="aiordma")
    async with no_fd_leak():
        async with await aiordma.create_channel_listener(side.host, 0, auth=server_key, **side.kw()) as lst:
            async with anyio.create_task_group() as tg:
                served: list[int] = []

                async def handler(ch: aiordma.Channel) -> None:
                    served.append(1)
                    await ch.aclose()

                tg.start_soon(lst.serve, handler)
                with anyio.fail_after(10), pytest.raises(AuthenticationError, match=client_says):
                    await aiordma.connect_channel(side.host, lst.port, auth=client_key, **side.kw())
                with anyio.fail_after(10):
                    while not any(server_says in r.getMessage() for r in caplog.records):
                        await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    assert served == []  # the handler never saw the client
    if server_key is not None:
        # a server with a key built nothing RDMA for a client that did not prove it has the key
        assert "server" not in server_endpoints
    if side.fabric is not None:
        assert not any(side.fabric.live_objects().get(k, 0) for k in ("qps", "cqs", "mrs"))


async def test_the_environment_gives_the_key(anyio_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_AUTH", "env key")
    async with no_fd_leak():
        async with await aiordma.create_listener("127.0.0.1", 0, transport="tcp") as lst:
            async with anyio.create_task_group() as tg:

                async def handler(s: aiordma.Stream) -> None:
                    async with s:
                        await s.send(await s.receive())

                tg.start_soon(lst.serve, handler)
                async with await aiordma.connect("127.0.0.1", lst.port, transport="tcp") as s:
                    await s.send(b"x")
                    assert await s.receive() == b"x"
                with pytest.raises(AuthenticationError):
                    await aiordma.connect("127.0.0.1", lst.port, transport="tcp", auth=False)
                with pytest.raises(AuthenticationError):
                    await aiordma.connect("127.0.0.1", lst.port, transport="tcp", auth="another key")
                tg.cancel_scope.cancel()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_front_ends_take_auth(anyio_backend: Any) -> None:
    import asyncio

    import aiordma.asyncio as aa

    async def echo(reader: aa.StreamReader, writer: aa.StreamWriter) -> None:
        writer.write(await reader.read(100))
        await writer.drain()
        writer.close()

    async with no_fd_leak():
        server = await aa.start_server(echo, "127.0.0.1", 0, transport="tcp", auth=KEY)
        async with server:
            port = server.sockets[0].getsockname()[1]
            reader, writer = await aa.open_connection("127.0.0.1", port, transport="tcp", auth=KEY)
            writer.write(b"hi")
            assert await reader.read(100) == b"hi"
            writer.close()
            await writer.wait_closed()
            with pytest.raises((AuthenticationError, ConnectionResetError)):
                await aa.create_connection(asyncio.Protocol, "127.0.0.1", port, transport="tcp", auth=b"nope")
