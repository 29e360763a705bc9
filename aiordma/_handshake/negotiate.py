"""The handshake over a link, and the fallback policy.

Every connection starts with HELLOs over its TCP link.  Each side offers RDMA
when its policy allows and its host can (then its HELLO carries the
parameters of a queue pair it prepared); the client brings its QP up, proves
the path, and SELECTs the transport.  The reason for TCP is one sentence
naming the side it concerns ("client: no RDMA device ...",
"server: RDMA setup failed at rtr: ..."); both ends record the same sentence.

``transport`` is a policy over the RDMA backend:

* ``"tcp"`` -- never offer RDMA;
* ``"auto"`` -- offer RDMA when this host can, fall back to TCP on any
  failure (no device, native module missing, peer without RDMA, unreachable
  GID, a QP transition failing, the setup timing out);
* ``"rdma"`` -- strict: a connection that cannot run on RDMA fails with
  :class:`~aiordma.RDMAUnavailableError` (locally before any connection when
  this host cannot, at the handshake otherwise).

The default comes from the environment variable ``AIORDMA_TRANSPORT`` (then
``"auto"``); an explicit argument wins over it.
"""

from __future__ import annotations

import logging
import os
import ssl as _ssl
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal, TypeVar, cast

import anyio

from collections.abc import Callable

from .._conn.core import ControlLink, Core
from .._conn.nowait import PassThroughLink
from .._conn.stats import opened
from .limits import ListenerBudget, ring_bytes
from .._errors import AuthenticationError, HandshakeError, ProtocolError, RDMAUnavailableError
from .._proto.protocol import (
    CAP_PASS_THROUGH, CAP_RDMA, DEFAULT_HANDSHAKE_TIMEOUT, DEFAULT_MAX_MESSAGE_SIZE, AuthChallenged, Authenticated, CloseCode,
    Connection, Event, HelloReceived, Mode, Role, TransportSelected,
)  # fmt: skip
from .._rdma.device import DeviceHold
from .._tcp.links import DEFAULT_KEEPALIVE, open_tcp_link, set_keepalive
from .._rdma.config import RdmaBackend, RdmaSetupError

if TYPE_CHECKING:  # pragma: no cover
    from .._rdma.link import RdmaLink

__all__ = [
    "Options",
    "make_options",
    "open_client",
    "accept_handshake",
    "TransportChoice",
    "resolve_transport",
    "resolve_auth",
    "LocalOffer",
    "local_offer",
    "client_handshake",
    "server_handshake",
]

TransportChoice = Literal["auto", "rdma", "tcp"]
_CHOICES: tuple[TransportChoice, ...] = ("auto", "rdma", "tcp")

E = TypeVar("E", HelloReceived, AuthChallenged, Authenticated, TransportSelected)

log = logging.getLogger("aiordma")


def resolve_transport(transport: str | None) -> TransportChoice:
    """The effective policy: the argument, else ``$AIORDMA_TRANSPORT``, else ``"auto"``."""
    source = "transport="
    if transport is None:
        transport = os.environ.get("AIORDMA_TRANSPORT", "").strip().lower() or "auto"
        source = "AIORDMA_TRANSPORT="
    for choice in _CHOICES:
        if transport == choice:
            return choice
    raise ValueError(f"{source}{transport!r} is not one of 'auto', 'rdma', 'tcp'")


def resolve_auth(auth: str | bytes | bool | None) -> bytes | None:
    """The pre-shared key: the argument (``False``: none, even if the environment has one),
    else ``$AIORDMA_AUTH``, else none.  A ``str`` is taken as UTF-8."""
    if auth is False:
        return None
    if auth is None or auth is True:
        env = os.environ.get("AIORDMA_AUTH", "")
        if not env:
            if auth is True:
                raise ValueError("auth=True needs a key in AIORDMA_AUTH")
            return None
        auth = env
    key = auth.encode("utf-8") if isinstance(auth, str) else bytes(auth)
    if not key:
        raise ValueError("an empty auth key authenticates nothing (auth=False turns authentication off)")
    return key


@dataclass(frozen=True)
class LocalOffer:
    """Whether this side may offer RDMA, and why not."""

    rdma: bool
    reason: str  # why no RDMA ("" when offered)

    @property
    def capabilities(self) -> int:
        return CAP_RDMA if self.rdma else 0


def local_offer(
    choice: TransportChoice, side: str, *, tls: bool = False, backend: RdmaBackend | None = None
) -> LocalOffer:
    """Decide what to offer; raises :class:`RDMAUnavailableError` for a strict policy that cannot be met."""
    if choice == "tcp":
        return LocalOffer(False, f"{side}: transport='tcp' was requested")
    if tls:
        reason = f"{side}: TLS was requested, and RDMA data would bypass TLS"
        if choice == "rdma":
            raise RDMAUnavailableError(reason)
        return LocalOffer(False, reason)
    found = (backend or RdmaBackend()).probe()
    if not found.usable:
        reason = f"{side}: {found.reason}"
        if choice == "rdma":
            raise RDMAUnavailableError(reason)
        return LocalOffer(False, reason)
    return LocalOffer(True, "")


async def _next_control(core: Core, kind: type[E]) -> E:
    """Wait for the next handshake event, under the protocol's deadline."""
    proto = core.proto
    while True:
        # Events in the order they came, except that one we would have to answer (a HELLO, an
        # AUTH step) cannot be answered once the peer closed or broke the protocol after it: a
        # HELLO that came in one segment with a CLOSE (what a client whose connect is cancelled
        # writes) ends the handshake here.  A SELECT needs no answer: the connection opens, and
        # what came after it is the connection's (its handler sees the close or the error).
        if core.control and (
            isinstance(core.control[0], TransportSelected) or (core.peer_close is None and core.error is None)
        ):
            event: Event = core.control.popleft()
            if isinstance(event, kind):
                return event
            raise HandshakeError(f"unexpected {type(event).__name__} during the handshake")
        if core.peer_close is not None:
            reason = core.peer_close.reason or "no reason given"
            if core.peer_close.code == CloseCode.REFUSED and reason.startswith("authentication failed"):
                raise AuthenticationError(f"the peer refused the connection: {reason}")
            if core.peer_close.code == CloseCode.REFUSED and "RDMA" in reason:
                raise RDMAUnavailableError(f"the peer refused the connection: {reason}")
            raise HandshakeError(f"the peer closed the connection during the handshake: {reason}")
        if core.error is not None:
            if isinstance(core.error, HandshakeError):
                raise core.error
            raise HandshakeError(f"the handshake failed: {core.error}") from core.error
        if core.peer_eof or core.closed:
            raise HandshakeError("the connection ended during the handshake")
        deadline = proto.next_deadline()
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time()) if deadline is not None else None):
            await core.link.wait_incoming()
        proto.handle_timer(anyio.current_time())  # raises HandshakeTimeoutError when overdue


async def _refuse(core: Core, reason: str) -> None:
    core.closed = True
    await core.link.aclose(core.proto.close(CloseCode.REFUSED, reason))


def _open_endpoint(core: Core, backend: RdmaBackend | None, side: str) -> tuple[RdmaLink | None, str]:
    """Prepare an RDMA link behind the TCP link's local address, or say why not."""
    from .._rdma.link import RdmaLink, local_ip_of  # the native module loads only when RDMA is offered

    try:
        return RdmaLink.prepare(backend or RdmaBackend(), local_ip_of(core.link)), ""
    except RdmaSetupError as exc:
        return None, f"{side}: {exc}"


def _pass_through_cap(core: Core, pass_through: bool) -> int:
    """``CAP_PASS_THROUGH`` when this side's front end asked for it and can take it: a byte
    stream on a link that can hand its TCP connection over (see ``State.PASSED_THROUGH``)."""
    link = core.link
    ok = pass_through and core.proto.mode is Mode.STREAM and isinstance(link, PassThroughLink) and link.can_pass_through
    return CAP_PASS_THROUGH if ok else 0


def _peer_ip(core: Core) -> str | None:
    from .._rdma.link import peer_ip_of

    return peer_ip_of(core.link)


async def client_handshake(
    core: Core,
    choice: TransportChoice,
    *,
    tls: bool = False,
    backend: RdmaBackend | None = None,
    offer: LocalOffer | None = None,
    pass_through: bool = False,
) -> None:
    """Run the client's half of the handshake; on return the connection is open.

    ``offer`` is what :func:`local_offer` decided before connecting (computed here if not given).
    ``pass_through``: offer to carry a byte stream unframed if TCP is selected (the front end
    then hands the TCP connection over: ``Nowait.pass_through``).
    """
    if offer is None:
        offer = local_offer(choice, "client", tls=tls, backend=backend)
    proto = core.proto
    endpoint: RdmaLink | None = None
    reason = offer.reason
    if offer.rdma:
        endpoint, reason = _open_endpoint(core, backend, "client")
    try:
        params = endpoint.params.encode() if endpoint is not None else None
        await core.link.send(
            [
                proto.send_hello(
                    capabilities=(CAP_RDMA if params is not None else 0) | _pass_through_cap(core, pass_through),
                    rdma_params=params, no_rdma_reason=reason,
                )  # fmt: skip
            ]
        )
        if proto.auth_key is not None:
            await _next_control(core, AuthChallenged)  # (the protocol checked the server's proof)
            await core.link.send([proto.send_auth_answer()])
        hello = (await _next_control(core, HelloReceived)).hello
        if endpoint is not None and not hello.can_rdma:
            reason = hello.no_rdma_reason or "server: offers no RDMA"
        elif endpoint is not None:
            try:
                endpoint.connect(hello.rdma_params, _peer_ip(core))
                await endpoint.probe()
            except RdmaSetupError as exc:
                reason = f"client: {exc}"
        if reason:
            if endpoint is not None:
                await endpoint.discard()
                endpoint = None
            if choice == "rdma":
                await _refuse(core, reason)
                raise RDMAUnavailableError(reason)
            await core.link.send([proto.select("tcp", reason)])
            core.transport = "tcp"
            core.fallback_reason = reason
            proto.widen_receive_buffer()  # (TCP carries the data: the buffer's working size)
            opened(core)
            return
        assert endpoint is not None
        await core.link.send([proto.select("rdma", "")])
        endpoint.activate(core, _control(core))
        endpoint = None  # owned by the Core now
        opened(core)
    finally:
        if endpoint is not None:
            await endpoint.discard()


async def server_handshake(
    core: Core, choice: TransportChoice, *, tls: bool = False, backend: RdmaBackend | None = None,
    budget: ListenerBudget | None = None, pass_through: bool = False,
) -> None:
    """Run the server's half of the handshake; on return the connection is open.

    ``budget``: the listener's limits; an RDMA connection over them gets TCP (or, strict, a
    refusal) with the limit in the reason."""  # fmt: skip
    proto = core.proto
    hello = (await _next_control(core, HelloReceived)).hello
    if proto.auth_key is not None:
        # before anything is built for the client (RDMA resources come with our HELLO)
        if hello.auth_nonce is None:
            reason = "authentication failed: the server requires a key (auth= or AIORDMA_AUTH), the client sent none"
            await _refuse(core, reason)
            raise AuthenticationError(reason)
        await core.link.send([proto.send_auth_challenge()])
        await _next_control(core, Authenticated)  # (the protocol checked the client's proof)
    try:
        offer = local_offer(choice, "server", tls=tls, backend=backend)
    except RDMAUnavailableError as exc:
        await _refuse(core, f"server requires RDMA: {exc.reason}")
        raise
    endpoint: RdmaLink | None = None
    release: Callable[[], None] | None = None  # the listener's budget, while not handed to the link
    reason = offer.reason
    try:
        if offer.rdma and not hello.can_rdma:
            reason = hello.no_rdma_reason or "client: offers no RDMA"
        elif offer.rdma:
            reserved = budget.reserve_rdma(ring_bytes((backend or RdmaBackend()).config)) if budget else None
            if isinstance(reserved, str):
                reason = reserved  # over the listener's limits: nothing is built
            else:
                release = reserved
                endpoint, reason = _open_endpoint(core, backend, "server")
                if endpoint is not None:
                    try:
                        endpoint.connect(hello.rdma_params, _peer_ip(core))
                    except RdmaSetupError as exc:
                        reason = f"server: {exc}"
                        await endpoint.discard()
                        endpoint = None
        if choice == "rdma" and endpoint is None:
            reason = f"server requires RDMA; {reason}"
            await _refuse(core, reason)
            raise RDMAUnavailableError(reason)
        params = endpoint.params.encode() if endpoint is not None else None
        await core.link.send(
            [
                proto.send_hello(
                    capabilities=(CAP_RDMA if params is not None else 0) | _pass_through_cap(core, pass_through),
                    rdma_params=params, no_rdma_reason=reason,
                )  # fmt: skip
            ]
        )
        selected = await _next_control(core, TransportSelected)
        if selected.transport == "rdma":
            assert endpoint is not None  # the protocol checked that both offered it
            endpoint.activate(core, _control(core))
            if release is not None:
                endpoint.on_destroyed.append(release)  # (counted until its teardown ends)
                release = None
            endpoint = None
        else:
            core.transport = "tcp"
            core.fallback_reason = selected.reason
            proto.widen_receive_buffer()  # (TCP carries the data: the buffer's working size)
        opened(core)
    finally:
        if endpoint is not None:
            await endpoint.discard()
        if release is not None:
            release()


# -- the options of a connection or listener, and opening a client connection ------------------------


@dataclass(frozen=True)
class Options:
    transport: TransportChoice
    ssl: _ssl.SSLContext | None = None
    server_hostname: str | None = None
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    #: the RDMA backend (``aiordma.RdmaBackend``); None: the default one
    backend: RdmaBackend | None = None
    #: the pre-shared key of the handshake's authentication (None: none)
    auth: bytes | None = None
    #: a listener's limits and counters (None on clients)
    budget: ListenerBudget | None = None
    #: the bound on noticing a dead peer host (seconds; None: the OS's TCP defaults)
    keepalive: float | None = DEFAULT_KEEPALIVE
    #: offer to carry a byte stream on TCP unframed after the handshake (the asyncio front ends
    #: that can hand the connection to the user's protocol: ``State.PASSED_THROUGH``)
    pass_through: bool = False

    def protocol(self, role: Role, mode: Mode, now: float) -> Connection:
        return Connection(
            role, mode, now=now, max_message_size=self.max_message_size, handshake_timeout=self.handshake_timeout,
            auth_key=self.auth,
        )  # fmt: skip


def make_options(
    transport: str | None,
    ssl: _ssl.SSLContext | bool | None,
    server_hostname: str | None,
    max_message_size: int,
    handshake_timeout: float,
    *,
    server: bool,
    backend: RdmaBackend | None = None,
    auth: str | bytes | bool | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE,
    budget: ListenerBudget | None = None,
) -> Options:
    choice = resolve_transport(transport)
    key = resolve_auth(auth)
    context: _ssl.SSLContext | None
    if ssl is True:
        if server:
            raise ValueError("a server needs an ssl.SSLContext with its certificate, not ssl=True")
        context = _ssl.create_default_context()
    elif ssl is False or ssl is None:
        context = None
    else:
        context = ssl
    if server_hostname is not None and context is None:
        raise ValueError("server_hostname is only meaningful with ssl")
    if keepalive is not None and keepalive <= 0:
        raise ValueError("keepalive must be a positive number of seconds, or None")
    return Options(choice, context, server_hostname, max_message_size, handshake_timeout, backend, key, budget,
                   keepalive)  # fmt: skip


#: link classes found to be ControlLinks (an isinstance against a runtime-checkable Protocol walks
#: its members each time: ~1 ms of an RDMA connect in the Soft-RoCE guest)
_CONTROL_KINDS: set[type] = set()


def _control(core: Core) -> ControlLink:
    """The TCP link an RDMA link takes the Core over from (the handshake runs on one)."""
    link = core.link
    if type(link) not in _CONTROL_KINDS:
        if not isinstance(link, ControlLink):  # pragma: no cover - the handshake runs on a TCP link
            raise TypeError(f"cannot take the connection over from {type(link).__name__}")
        _CONTROL_KINDS.add(type(link))
    return cast(ControlLink, link)


async def _discard(core: Core) -> None:
    """Release a connection whose setup failed (also under cancellation).  What closing it
    meets (the peer reset it meanwhile) is not raised: the caller raises why the setup failed."""
    with anyio.CancelScope(shield=True):
        try:
            await core.aclose()
        except (anyio.BrokenResourceError, OSError) as exc:
            log.debug("aiordma: closing a connection whose setup failed: %r", exc)


async def accept_handshake(core: Core, opts: Options, hold: DeviceHold | None = None) -> None:
    """Run a server's handshake.  Whatever ends it early is raised to the listener, which logs
    it with the client's address and drops that client alone (:class:`~aiordma._tcp.accept.Acceptor`);
    a protocol or handshake error is first recorded on the Core, so that its CLOSE tells the
    client why (a timeout, a mismatch, bytes out of order).

    ``hold`` keeps the RDMA device of the connection open for the listener's lifetime."""
    try:
        set_keepalive(core.link, opts.keepalive)
        await server_handshake(core, opts.transport, tls=opts.ssl is not None, backend=opts.backend,
                               budget=opts.budget, pass_through=opts.pass_through)  # fmt: skip
    except (HandshakeError, ProtocolError) as exc:
        core.on_error(exc)
        raise
    if hold is not None and core.transport == "rdma":
        hold.keep(core.link)


async def open_client(host: str, port: int, mode: Mode, opts: Options) -> Core:
    """Connect to an aiordma listener and run the client's handshake: the open connection's Core
    (the strict policy fails before connecting when this host cannot do RDMA)."""
    tls = opts.ssl is not None
    offer = local_offer(opts.transport, "client", tls=tls, backend=opts.backend)
    link = await open_tcp_link(host, port, partial(opts.protocol, Role.CLIENT, mode), ssl=opts.ssl,
                               server_hostname=opts.server_hostname, keepalive=opts.keepalive)  # fmt: skip
    core = link.core
    try:
        await client_handshake(core, opts.transport, tls=tls, backend=opts.backend, offer=offer,
                               pass_through=opts.pass_through)  # fmt: skip
    except BaseException:
        await _discard(core)
        raise
    return core
