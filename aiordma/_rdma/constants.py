"""Verbs constants, plain records and name tables, with no native code.

Everything here imports without libibverbs: the sans-IO session, the
simulated wire (:mod:`aiordma.testing`) and the native binding
(:mod:`aiordma._rdma.verbs`) share these values.  They are the values of
``<infiniband/verbs.h>`` (the native module checks the ones it passes).
"""

from __future__ import annotations

import enum
import functools
import ipaddress
from dataclasses import dataclass, field
from typing import Final, Protocol

__all__ = [
    "Access",
    "SendFlags",
    "Opcode",
    "WCOpcode",
    "WCStatus",
    "QPState",
    "SendWR",
    "QPCaps",
    "GidEntry",
    "DeviceAttr",
    "PortAttr",
    "AsyncEvent",
    "wc_status_name",
    "event_type_name",
    "gid_bytes",
    "MTU_TO_ENUM",
    "ENUM_TO_MTU",
]

class Access(enum.IntFlag):
    """``ibv_access_flags`` for memory regions and QP access."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    #: memory windows may be bound to the region (each window then grants its own remote access)
    MW_BIND = 16


#: Least privilege: memory is local-only unless a caller grants more; a QP
#: allows remote WRITE only so that the zero-length path probe is answered
#: (with no remote-access MR in the PD, a WRITE of any length is refused).
DEFAULT_MR_ACCESS: Final = Access.LOCAL_WRITE
DEFAULT_QP_ACCESS: Final = Access.LOCAL_WRITE | Access.REMOTE_WRITE


class SendFlags(enum.IntFlag):
    FENCE = 1
    SIGNALED = 2
    SOLICITED = 4
    INLINE = 8


# the same values as plain ints, for the posting loops
FENCE: Final = 1
SIGNALED: Final = 2
SOLICITED: Final = 4
INLINE: Final = 8


class Opcode(enum.IntEnum):
    """Send work request opcodes (``ibv_wr_opcode``) supported by the batch poster."""

    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4


class WCOpcode(enum.IntEnum):
    """``ibv_wc_opcode`` (what a completion completed)."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    BIND_MW = 5
    LOCAL_INV = 6
    TSO = 7
    ATOMIC_WRITE = 9
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class WCStatus(enum.IntEnum):
    """``ibv_wc_status``."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21
    TM_ERR = 22
    TM_RNDV_INCOMPLETE = 23


class QPState(enum.IntEnum):
    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6
    UNKNOWN = 7


EVENT_NAMES: Final = (
    "IBV_EVENT_CQ_ERR",
    "IBV_EVENT_QP_FATAL",
    "IBV_EVENT_QP_REQ_ERR",
    "IBV_EVENT_QP_ACCESS_ERR",
    "IBV_EVENT_COMM_EST",
    "IBV_EVENT_SQ_DRAINED",
    "IBV_EVENT_PATH_MIG",
    "IBV_EVENT_PATH_MIG_ERR",
    "IBV_EVENT_DEVICE_FATAL",
    "IBV_EVENT_PORT_ACTIVE",
    "IBV_EVENT_PORT_ERR",
    "IBV_EVENT_LID_CHANGE",
    "IBV_EVENT_PKEY_CHANGE",
    "IBV_EVENT_SM_CHANGE",
    "IBV_EVENT_SRQ_ERR",
    "IBV_EVENT_SRQ_LIMIT_REACHED",
    "IBV_EVENT_QP_LAST_WQE_REACHED",
    "IBV_EVENT_CLIENT_REREGISTER",
    "IBV_EVENT_GID_CHANGE",
    "IBV_EVENT_WQ_FATAL",
)

PORT_STATE_NAMES: Final = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
MTU_TO_ENUM: Final = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}
ENUM_TO_MTU: Final = {v: k for k, v in MTU_TO_ENUM.items()}
LINK_LAYERS: Final = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
WC_WITH_IMM: Final = 2


def wc_status_name(status: int) -> str:
    """``IBV_WC_RNR_RETRY_EXC_ERR`` style name of a completion status."""
    try:
        return "IBV_WC_" + WCStatus(status).name
    except ValueError:
        return f"IBV_WC_STATUS_{status}"


def event_type_name(event_type: int) -> str:
    if 0 <= event_type < len(EVENT_NAMES):
        return EVENT_NAMES[event_type]
    return f"IBV_EVENT_{event_type}"



def gid_bytes(gid: str | bytes | ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    """A 16-byte GID from an IPv6/GID string, an IPv4 address (mapped) or bytes."""
    if isinstance(gid, bytes):
        if len(gid) != 16:
            raise ValueError(f"a GID is 16 bytes, got {len(gid)}")
        return gid
    if isinstance(gid, str):
        return _gid_of_text(gid)
    if isinstance(gid, ipaddress.IPv4Address):
        return _V4_MAPPED + gid.packed
    return gid.packed


#: the first 12 bytes of an IPv4-mapped IPv6 address (a RoCEv2 GID of an IPv4 address)
_V4_MAPPED = bytes(10) + b"\xff\xff"


@functools.lru_cache(maxsize=256)
def _gid_of_text(text: str) -> bytes:
    """(Each connect asks for its addresses' GIDs: parsed once per address, ~1.5 ms in the guest.)"""
    addr = ipaddress.ip_address(text)
    if isinstance(addr, ipaddress.IPv4Address):
        return _V4_MAPPED + addr.packed
    return addr.packed



@dataclass(slots=True)
class SendWR:
    """One send-queue work request (one scatter/gather entry).

    ``opcode`` SEND / SEND_WITH_IMM / RDMA_WRITE / RDMA_WRITE_WITH_IMM /
    RDMA_READ; ``remote_addr``/``rkey`` for the RDMA ones; ``imm_data`` (host
    order) for the *_WITH_IMM ones.  ``length`` 0 posts no sge.
    """

    opcode: Opcode = Opcode.SEND
    wr_id: int = 0
    addr: int = 0
    length: int = 0
    lkey: int = 0
    remote_addr: int = 0
    rkey: int = 0
    imm_data: int | None = None
    signaled: bool = True
    inline: bool = False
    solicited: bool = False
    fence: bool = False


@dataclass(frozen=True, slots=True)
class QPCaps:
    max_send_wr: int
    max_recv_wr: int
    max_send_sge: int
    max_recv_sge: int
    max_inline_data: int


@dataclass(frozen=True, slots=True)
class GidEntry:
    """One non-empty GID table entry.

    ``gid_type`` is ``"RoCEv2"``, ``"RoCEv1"`` or ``"IB"``; ``netdev`` the
    network interface the GID belongs to (RoCE), ``ip`` the address the GID
    encodes (an IPv4 address for ``::ffff:a.b.c.d`` GIDs).
    """

    device: str
    port: int
    index: int
    gid: ipaddress.IPv6Address
    gid_type: str
    netdev: str | None
    #: as sysfs has it ("RoCE v2"), when read from sysfs (not compared: verbs does not give it)
    type_text: str | None = field(default=None, compare=False)

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        mapped = self.gid.ipv4_mapped
        return mapped if mapped is not None else self.gid




@dataclass(frozen=True, slots=True)
class DeviceAttr:
    node_guid: int
    max_mr_size: int
    vendor_id: int
    vendor_part_id: int
    max_qp: int
    max_qp_wr: int
    max_sge: int
    max_cq: int
    max_cqe: int
    max_mr: int
    max_pd: int
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    phys_port_cnt: int
    fw_ver: str


@dataclass(frozen=True, slots=True)
class PortAttr:
    port: int
    state: int
    state_name: str  # "ACTIVE", ...
    active_mtu: int  # bytes
    max_mtu: int  # bytes
    gid_tbl_len: int
    lid: int
    link_layer: str
    max_msg_sz: int


class Numbered(Protocol):
    """What an asynchronous event says of its QP (``objects.QueuePair`` has it)."""

    qp_num: int


@dataclass(frozen=True, slots=True)
class AsyncEvent:
    """An acknowledged asynchronous event and the object it concerns.

    ``qp``/``cq`` is the aiordma object when it is one of this context's
    (``None`` if it was already closed); ``port`` is set for port events.
    """

    event_type: int
    name: str  # "IBV_EVENT_QP_FATAL"
    description: str  # ibv_event_type_str()
    element_kind: str  # "qp", "cq", "srq", "wq", "port", "device", "none"
    qp: Numbered | None = None  # the QueuePair object, if it is one of this context's
    cq: object = None  # likewise the CompletionQueue
    srq: object = None  # likewise the shared receive queue (IBV_EVENT_SRQ_*)
    port: int | None = None
