"""Bringing one RC queue pair up, and the checks that decide whether it may be.

These are the verbs-facing steps of a connection's set-up, each a named step
of the fallback reasons (``docs/architecture.md``):

* :func:`create_qp` (``resources``): an RC QP on the device's shared CQ, its
  queue depths reserved from the CQ's budget, as the *granted* caps say;
* :func:`to_init` (``init``): access flags -- remote WRITE only, which the
  zero-length path probe needs and which reaches no memory by itself; remote
  READ comes when this side first grants a READ.  What the peer may reach is
  decided per grant: a memory window bound to this QP, or a region of this
  connection's own PD (``device.py``), for as long as it is granted;
* :func:`check_peer` (``params``): the peer's parameters are valid and its
  GID is the TCP peer's address, so a HELLO cannot aim our QP at a third host;
* :func:`rtr`, :func:`rts` (steps ``rtr``, ``rts``): RTR towards the peer, then RTS with
  finite retries (a dead peer surfaces as a failed completion, never a hang).
"""

from __future__ import annotations

import ipaddress

from .._errors import RDMAError
from .config import RdmaConfig, RdmaSetupError
from .constants import Access, GidEntry, gid_bytes
from .device import Device
from .objects import Domain, QueuePair
from .params import MTU_BYTES, RdmaParams

__all__ = ["create_qp", "to_init", "check_peer", "rtr", "rts", "gid_of", "readable_gid", "QP_ACCESS"]

#: what a connection's QP allows its peer at first: remote WRITE, for the zero-length path probe
#: alone (it names no memory; nothing is reachable without a grant).  Remote READ is added when
#: this side first grants a READ (a rendezvous, a read exposure): ``RdmaLink._allow``
QP_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE
#: RDMA READs in flight at once, at most (the device may grant fewer)
MAX_RD_ATOM = 16


def rd_atom_of(device: Device) -> int:
    """How many RDMA READs this side serves at once (its QPs' max_dest_rd_atomic)."""
    return max(1, min(MAX_RD_ATOM, int(getattr(device.attr, "max_qp_rd_atom", 1) or 1)))


def gid_of(ip: str) -> bytes:
    """The RoCEv2 GID of an IP address (``::ffff:a.b.c.d`` for IPv4)."""
    return gid_bytes(ip)


def readable_gid(gid: bytes) -> str:
    address = ipaddress.IPv6Address(gid)
    mapped = address.ipv4_mapped
    return f"::ffff:{mapped}" if mapped is not None else str(address)


def create_qp(device: Device, config: RdmaConfig, pd: Domain | None = None) -> tuple[QueuePair, int]:
    """A QP for ``config`` on the device's CQ, in ``pd`` (default: the device's); returns it and
    the CQ entries reserved for it."""
    buffers = config.window + config.control
    pd = pd if pd is not None else device.pd
    try:
        qp = pd.create_qp(device.cq, max_send_wr=buffers + 4, max_recv_wr=buffers,
                          max_inline_data=config.max_inline)  # fmt: skip
    except (RDMAError, OSError):
        if not config.max_inline:
            raise
        # a device without inline sends (or with less): ask for none; the granted caps decide
        qp = pd.create_qp(device.cq, max_send_wr=buffers + 4, max_recv_wr=buffers)
    reserved = int(qp.caps.max_send_wr) + int(qp.caps.max_recv_wr)
    try:
        device.reserve_cq(reserved)
    except BaseException:
        qp.close()
        raise
    return qp, reserved


def to_init(qp: QueuePair, entry: GidEntry) -> None:
    qp.to_init(entry.port, access=QP_ACCESS)


def check_peer(peer_raw: bytes | None, peer_ip: str | None) -> RdmaParams:
    """Decode the peer's parameters and bind them to its TCP address (step ``params``)."""
    if peer_raw is None:
        raise RdmaSetupError("params", "the peer sent no RDMA parameters")
    peer = RdmaParams.decode(peer_raw)  # RemoteProtocolError on anything out of range
    if peer_ip is None:
        raise RdmaSetupError("params", "the TCP peer has no IP address to check the peer's GID against")
    if peer.gid != gid_of(peer_ip):
        raise RdmaSetupError(
            "params",
            f"the peer's GID {readable_gid(peer.gid)} is not its TCP address {peer_ip} "
            "(a QP is only ever aimed at the host on the other end of the handshake)",
        )
    return peer


def rtr(qp: QueuePair, entry: GidEntry, peer: RdmaParams, mtu: int, rd_atom: int = 1) -> None:
    """RTR; ``rd_atom``: the RDMA READs we serve at once (what our HELLO announced)."""
    qp.to_rtr(peer.qp_num, peer.gid, sgid_index=entry.index, rq_psn=peer.psn,
              path_mtu=min(mtu, MTU_BYTES[peer.mtu]), port_num=entry.port,
              max_dest_rd_atomic=rd_atom)  # fmt: skip


def rts(qp: QueuePair, psn: int, config: RdmaConfig, device: Device | None = None, peer: RdmaParams | None = None) -> None:
    """RTS; RDMA READs in flight: what our device initiates at once and the peer serves, at most."""
    init = 1
    if device is not None and peer is not None:
        init = max(1, min(MAX_RD_ATOM, int(getattr(device.attr, "max_qp_init_rd_atom", 1) or 1), peer.rd_atom))
    qp.to_rts(psn, timeout=config.qp_timeout, retry_cnt=config.retry_cnt, rnr_retry=config.rnr_retry,
              max_rd_atomic=init)  # fmt: skip

