"""The handshake over a link, and the fallback policy.

Every connection starts with HELLOs over its TCP link.  Each side offers RDMA
when its policy allows and its host can; the client then SELECTs the
transport.  The reason for TCP is one sentence naming the side it concerns
("client: no RDMA device ..."); both ends record the same sentence.

``transport`` is a policy:

* ``"tcp"`` -- never offer RDMA;
* ``"auto"`` -- offer RDMA when this host can, fall back to TCP otherwise;
* ``"rdma"`` -- strict: a connection that cannot run on RDMA fails with
  :class:`~aiordma.RDMAUnavailableError` (locally before any connection when
  this host cannot, or at the handshake when the peer cannot).

The default comes from the environment variable ``AIORDMA_TRANSPORT`` (then
``"auto"``); an explicit argument wins over it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, TypeVar

import anyio

from ._core import Core
from ._errors import HandshakeError, RDMAUnavailableError
from ._protocol import CAP_RDMA, CloseCode, Event, HelloReceived, TransportSelected
from ._rdma_probe import probe

__all__ = ["TransportChoice", "resolve_transport", "LocalOffer", "local_offer", "client_handshake", "server_handshake"]

TransportChoice = Literal["auto", "rdma", "tcp"]
_CHOICES: tuple[TransportChoice, ...] = ("auto", "rdma", "tcp")

E = TypeVar("E", HelloReceived, TransportSelected)


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


@dataclass(frozen=True)
class LocalOffer:
    """What this side puts in its HELLO."""

    rdma_params: bytes | None
    reason: str  # why no RDMA ("" when offered)

    @property
    def capabilities(self) -> int:
        return CAP_RDMA if self.rdma_params is not None else 0


def local_offer(choice: TransportChoice, side: str, *, tls: bool = False) -> LocalOffer:
    """Decide what to offer; raises :class:`RDMAUnavailableError` for a strict policy that cannot be met."""
    if choice == "tcp":
        return LocalOffer(None, f"{side}: transport='tcp' was requested")
    if tls:
        reason = f"{side}: TLS was requested, and RDMA data would bypass TLS"
        if choice == "rdma":
            raise RDMAUnavailableError(reason)
        return LocalOffer(None, reason)
    found = probe()
    if not found.usable:
        reason = f"{side}: {found.reason}"
        if choice == "rdma":
            raise RDMAUnavailableError(reason)
        return LocalOffer(None, reason)
    # A usable device: the RDMA transport builds its parameters here.  Until it
    # exists the offer stays TCP, and says so.
    reason = f"{side}: the RDMA transport is not implemented in this version"
    if choice == "rdma":
        raise RDMAUnavailableError(reason)
    return LocalOffer(None, reason)


async def _next_control(core: Core, kind: type[E]) -> E:
    """Wait for the next handshake event, under the protocol's deadline."""
    proto = core.proto
    while True:
        if core.control:
            event: Event = core.control.popleft()
            if isinstance(event, kind):
                return event
            raise HandshakeError(f"unexpected {type(event).__name__} during the handshake")
        if core.peer_close is not None:
            reason = core.peer_close.reason or "no reason given"
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


async def client_handshake(core: Core, choice: TransportChoice, *, tls: bool = False) -> None:
    """Run the client's half of the handshake; on return the connection is open."""
    offer = local_offer(choice, "client", tls=tls)
    proto = core.proto
    await core.link.send(
        [proto.send_hello(capabilities=offer.capabilities, rdma_params=offer.rdma_params, no_rdma_reason=offer.reason)]
    )
    hello = (await _next_control(core, HelloReceived)).hello
    reason = offer.reason
    if not reason and not hello.can_rdma:
        reason = hello.no_rdma_reason or "server: offers no RDMA"
    if choice == "rdma":
        # reaching here means the server cannot (the client could, or local_offer raised)
        await _refuse(core, reason)
        raise RDMAUnavailableError(reason)
    await core.link.send([proto.select("tcp", reason)])
    core.transport = "tcp"
    core.fallback_reason = reason


async def server_handshake(core: Core, choice: TransportChoice, *, tls: bool = False) -> None:
    """Run the server's half of the handshake; on return the connection is open."""
    proto = core.proto
    hello = (await _next_control(core, HelloReceived)).hello
    try:
        offer = local_offer(choice, "server", tls=tls)
    except RDMAUnavailableError as exc:
        await _refuse(core, f"server requires RDMA: {exc.reason}")
        raise
    if choice == "rdma" and not hello.can_rdma:
        reason = f"server requires RDMA; {hello.no_rdma_reason or 'client: offers no RDMA'}"
        await _refuse(core, reason)
        raise RDMAUnavailableError(reason)
    await core.link.send(
        [proto.send_hello(capabilities=offer.capabilities, rdma_params=offer.rdma_params, no_rdma_reason=offer.reason)]
    )
    selected = await _next_control(core, TransportSelected)
    core.transport = selected.transport
    core.fallback_reason = selected.reason
