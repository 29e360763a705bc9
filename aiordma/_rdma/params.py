"""The RDMA connection parameters carried in a HELLO (extension 1), sans I/O.

Layout (network order), 40 bytes, version 1::

    version u8 (1) | mtu u8 (ibv_mtu: 1=256 .. 5=4096) | flags u16 (bit 0: READS_RENDEZVOUS)
    gid 16 bytes           RoCEv2 GID of the device behind the TCP socket's local address
    qp_num u32             our RC queue pair (24 bits used)
    psn u32                our initial send PSN (24 bits used)
    window u16             receive buffers posted for data SENDs (the peer's data credits)
    control u16            receive buffers posted for credit SENDs
    buffer_size u32        size of each receive buffer: no SEND may carry more

``READS_RENDEZVOUS``: this side READs a rendezvous message (the native path); a sender uses the
rendezvous only towards a peer that set it, so that two configurations never disagree on what
may be sent.  Every field is checked before use: a peer cannot make us post more buffers or
larger sends than our own limits, nor address a QP number or PSN out of range.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Final

from .._errors import RemoteProtocolError

__all__ = ["RdmaParams", "PARAMS"]

PARAMS: Final = struct.Struct("!BBH16sIIHHI")
#: optional trailing fields (a peer that sends none offers one outstanding RDMA READ):
#: responder resources u8 (how many RDMA READs the peer serves at once, 1..255)
PARAMS_EXT: Final = struct.Struct("!B")
VERSION: Final = 1
MAX_WINDOW: Final = 4096
MAX_CONTROL: Final = 127
MIN_BUFFER: Final = 256
MAX_BUFFER: Final = 16 << 20
MTU_BYTES: Final = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
#: flags: this side READs rendezvous messages
READS_RENDEZVOUS: Final = 1 << 0
KNOWN_FLAGS: Final = READS_RENDEZVOUS


@dataclass(frozen=True)
class RdmaParams:
    gid: bytes
    qp_num: int
    psn: int
    mtu: int
    window: int
    control: int
    buffer_size: int
    #: RDMA READs (and atomics) this side serves at once: its QP's max_dest_rd_atomic
    rd_atom: int = 1
    #: this side READs rendezvous messages (a peer may send it some)
    reads_rendezvous: bool = False

    def encode(self) -> bytes:
        return PARAMS.pack(
            VERSION, self.mtu, READS_RENDEZVOUS if self.reads_rendezvous else 0, self.gid, self.qp_num, self.psn, self.window, self.control, self.buffer_size
        ) + PARAMS_EXT.pack(self.rd_atom)

    @property
    def gid_address(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(self.gid)

    @classmethod
    def decode(cls, raw: bytes) -> RdmaParams:
        if len(raw) < PARAMS.size:
            raise RemoteProtocolError(f"RDMA parameters of {len(raw)} bytes are shorter than {PARAMS.size}")
        version, mtu, flags, gid, qp_num, psn, window, control, buffer_size = PARAMS.unpack_from(raw, 0)
        if version != VERSION:
            raise RemoteProtocolError(f"RDMA parameters version {version} is not {VERSION}")
        if flags & ~KNOWN_FLAGS:
            raise RemoteProtocolError(f"RDMA parameters have unknown flags {flags & ~KNOWN_FLAGS:#x}")
        if mtu not in MTU_BYTES:
            raise RemoteProtocolError(f"RDMA path MTU code {mtu} is not one of 1..5")
        if not 0 < qp_num < 1 << 24:
            raise RemoteProtocolError(f"QP number {qp_num:#x} is out of range")
        if psn >= 1 << 24:
            raise RemoteProtocolError(f"PSN {psn:#x} is out of range")
        if not 1 <= window <= MAX_WINDOW:
            raise RemoteProtocolError(f"RDMA window {window} is not between 1 and {MAX_WINDOW}")
        if not 1 <= control <= MAX_CONTROL:
            raise RemoteProtocolError(f"RDMA control buffers {control} is not between 1 and {MAX_CONTROL}")
        if not MIN_BUFFER <= buffer_size <= MAX_BUFFER:
            raise RemoteProtocolError(f"RDMA buffer size {buffer_size} is not between {MIN_BUFFER} and {MAX_BUFFER}")
        if gid == bytes(16):
            raise RemoteProtocolError("the RDMA GID is all zeros")
        rd_atom = 1
        if len(raw) >= PARAMS.size + PARAMS_EXT.size:
            (rd_atom,) = PARAMS_EXT.unpack_from(raw, PARAMS.size)
            if rd_atom < 1:
                raise RemoteProtocolError("RDMA parameters offer no RDMA READ resources (0)")
        return cls(gid, qp_num, psn, mtu, window, control, buffer_size, rd_atom, bool(flags & READS_RENDEZVOUS))
