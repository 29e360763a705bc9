"""One-sided remote memory, sans I/O: exposures, descriptors, their scope, and the TCP service.

Theory of operation
-------------------
An *exposure* makes part of one side's memory reachable by the peer on one
connection, for as long as an ``async with channel.expose(buf)`` block runs.
The exposer announces it with an EXPOSE frame (id, access, a random key and,
over RDMA, the address and rkey of the region registered for it alone), in
order on the connection: the peer knows an exposure before any message that
could carry its descriptor (:class:`RemoteBuffer`) arrives.

The *caller* checks every operation against that announcement before
anything is posted or sent: the descriptor must name an exposure announced
on this very connection (same connection token, id and key), still live,
granting the access, and ``offset + length`` must fit.  Anything else raises
a typed :class:`RemoteMemoryError` and touches nothing.  This matters on
RDMA: a READ or WRITE the peer's NIC refuses (a bad rkey, a range outside the
region) completes in error, and on RC an error completion ends the queue
pair -- the whole connection.

Revocation is a handshake, so that no honest operation is ever refused by
the NIC: the exposer's block exits by sending REVOKE; the caller stops
starting operations on it at once and answers REVOKED when its operations in
flight have completed; then the exposer deregisters the region.  A caller
that does not answer within the exposer's timeout is not waited for: the
region is deregistered anyway and a late operation of that peer fails (on
RDMA it breaks that connection only).

Over TCP the same frames carry the operations themselves (READ with its
READ_DATA answer, WRITE with WRITE_DONE), and the exposer's side serves them
with the same checks; a served WRITE is also a *write notice*.  Over RDMA a
``write(..., notify=True)`` sends a WRITTEN notice after the WRITE completed.
The exposer reads notices with ``await remote.written()``.

Wire format of a MEMORY frame's payload: ``op u8`` then, per op (network
order): EXPOSE ``id u32, access u8, token u64, key u64, length u64, addr
u64, rkey u32``; REVOKE / REVOKED ``id u32``; READ ``op u32, id u32, key
u64, offset u64, length u32``; READ_DATA ``op u32, status u8`` + bytes;
WRITE ``op u32, id u32, key u64, offset u64`` + bytes; WRITE_DONE ``op u32,
status u8``; WRITTEN ``id u32, offset u64, length u64``.  Every field is
checked before use; a frame that breaks the rules is a protocol error.
"""

from __future__ import annotations

import enum
import os
import struct
from collections import deque
from dataclasses import dataclass
from typing import Final

from .._errors import AiordmaError, RemoteProtocolError

__all__ = [
    "READ",
    "WRITE",
    "RemoteBuffer",
    "RemoteMemoryError",
    "DescriptorRevokedError",
    "ForeignDescriptorError",
    "RemoteBoundsError",
    "RemoteAccessDeniedError",
    "OneSided",
    "Exposure",
    "Rendezvous",
]

#: The largest piece of a byte stream one rendezvous carries (a larger write is split).
STREAM_RENDEZVOUS_MAX = 64 << 20

READ: Final = 1
WRITE: Final = 2


class RemoteMemoryError(AiordmaError):
    """A one-sided operation was refused (nothing was read or written)."""


class DescriptorRevokedError(RemoteMemoryError):
    """The exposure this descriptor names has ended (or is ending)."""


class ForeignDescriptorError(RemoteMemoryError):
    """The descriptor was not exposed on this connection (another connection's, or forged)."""


class RemoteBoundsError(RemoteMemoryError, IndexError):
    """``offset`` and ``length`` do not fit in the exposed memory."""


class RemoteAccessDeniedError(RemoteMemoryError, PermissionError):
    """The exposer did not grant this access (read or write)."""


class _Op(enum.IntEnum):
    EXPOSE = 1
    REVOKE = 2
    REVOKED = 3
    READ = 4
    READ_DATA = 5
    WRITE = 6
    WRITE_DONE = 7
    WRITTEN = 8
    RNDV = 9
    RNDV_DONE = 10


class Status(enum.IntEnum):
    OK = 0
    REVOKED = 1
    FOREIGN = 2
    BOUNDS = 3
    DENIED = 4


_ERRORS: Final[dict[int, type[RemoteMemoryError]]] = {
    Status.REVOKED: DescriptorRevokedError,
    Status.FOREIGN: ForeignDescriptorError,
    Status.BOUNDS: RemoteBoundsError,
    Status.DENIED: RemoteAccessDeniedError,
}

_STATUSES: Final = frozenset(int(s) for s in Status)
_U8: Final = struct.Struct("!B")
_EXPOSE: Final = struct.Struct("!IBQQQQI")
_ID: Final = struct.Struct("!I")
_READ: Final = struct.Struct("!IIQQI")
_STATUS: Final = struct.Struct("!IB")
_WRITE: Final = struct.Struct("!IIQQ")
_WRITTEN: Final = struct.Struct("!IQQ")
_RNDV: Final = struct.Struct("!IQQI")
_DESCRIPTOR: Final = struct.Struct("!4sBIQQQQI")
_MAGIC: Final = b"ARB1"
_MAX_LENGTH: Final = 1 << 62


@dataclass(frozen=True, slots=True)
class RemoteBuffer:
    """A descriptor of memory a peer exposed (``to_bytes`` / ``from_bytes`` to pass it on).

    It is a capability for one connection: it works only there, and only while the exposer's
    ``async with channel.expose(...)`` block runs.  ``addr``/``rkey`` are 0 over TCP."""

    token: int
    id: int
    key: int
    length: int
    access: int
    addr: int = 0
    rkey: int = 0

    @property
    def readable(self) -> bool:
        return bool(self.access & READ)

    @property
    def writable(self) -> bool:
        return bool(self.access & WRITE)

    def to_bytes(self) -> bytes:
        return _DESCRIPTOR.pack(_MAGIC, self.access, self.id, self.token, self.key, self.length, self.addr, self.rkey)

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> RemoteBuffer:
        """Parse a descriptor; raises :class:`ValueError` on anything that is not one."""
        if len(raw) != _DESCRIPTOR.size:
            raise ValueError(f"a RemoteBuffer descriptor has {_DESCRIPTOR.size} bytes, not {len(raw)}")
        magic, access, id_, token, key, length, addr, rkey = _DESCRIPTOR.unpack(bytes(raw))
        if magic != _MAGIC:
            raise ValueError("not a RemoteBuffer descriptor")
        if access & ~(READ | WRITE) or not access:
            raise ValueError(f"descriptor has invalid access bits {access:#x}")
        if length > _MAX_LENGTH:
            raise ValueError("descriptor length out of range")
        return cls(token, id_, key, length, access, addr, rkey)

    def __repr__(self) -> str:
        acc = ("r" if self.readable else "") + ("w" if self.writable else "")
        return f"<aiordma.RemoteBuffer #{self.id} {self.length} bytes {acc}>"


class Exposure:
    """The exposer's side of one exposure (state for :class:`OneSided`)."""

    __slots__ = ("id", "view", "access", "key", "descriptor", "state", "notices", "region")

    LIVE: Final = "live"
    REVOKING: Final = "revoking"
    ENDED: Final = "ended"

    def __init__(self, id_: int, view: memoryview, access: int, key: int, descriptor: RemoteBuffer) -> None:
        self.id = id_
        self.view = view
        self.access = access
        self.key = key
        self.descriptor = descriptor
        self.state = Exposure.LIVE
        self.notices: deque[tuple[int, int]] = deque()  # (offset, length) of writes that landed
        self.region: object = None  # the RDMA registration made for it (the link's)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """A message the peer staged for us to READ (it sits in the Core's message queue in its place)."""

    mid: int
    length: int
    addr: int
    rkey: int


class _Remote:
    """The caller's record of an exposure the peer announced."""

    __slots__ = ("desc", "inflight", "revoking")

    def __init__(self, desc: RemoteBuffer) -> None:
        self.desc = desc
        self.inflight = 0
        self.revoking = False


class OneSided:
    """One connection's one-sided memory state (see the module docs).

    ``max_out``: the most data bytes one frame to the peer may carry (its ``max_frame_size``);
    ``max_in``: the most we accept in one (ours).  Methods that return ``bytes`` return MEMORY
    frame *payloads* for the caller to frame and send, in order."""

    def __init__(self, max_out: int, max_in: int, token: int | None = None) -> None:
        self.token = int.from_bytes(os.urandom(8), "big") if token is None else token
        self.max_out = max_out
        self.max_in = max_in
        self.peer_token: int | None = None
        self.exposures: dict[int, Exposure] = {}
        self.remotes: dict[int, _Remote] = {}
        self._revoked: set[int] = set()  # ids the peer revoked (for a clear error)
        self._next_id = 1
        self._next_op = 1
        #: TCP operations in flight: op id -> None (waiting) or (status, data)
        self.results: dict[int, tuple[int, bytes] | None] = {}
        self._expect: dict[int, int] = {}  # op id -> bytes a READ_DATA must carry (-1: a WRITE, -2: dropped)
        self._op_exposure: dict[int, int] = {}  # TCP op waiting -> the exposure it targets
        self._ended: set[int] = set()  # our exposures that ended before the peer's REVOKED came
        self.ops_served = 0
        self.bytes_served = 0
        #: rendezvous: messages we staged for the peer (mid -> length), and what came back or in
        self.max_message = 1 << 30
        self.rndv_out: dict[int, int] = {}
        self.rndv_done: list[int] = []
        self.rndv_arrived: list[Rendezvous] = []
        self._rndv_in: set[int] = set()
        self._next_mid = 1

    # -- the exposer -------------------------------------------------------------------------

    def expose(self, view: memoryview, access: int, addr: int = 0, rkey: int = 0) -> tuple[Exposure, bytes]:
        if not access or access & ~(READ | WRITE):
            raise ValueError("expose() needs read=True, write=True or both")
        if access & WRITE and view.readonly:
            raise TypeError("exposing for writes needs a writable buffer")
        id_ = self._next_id
        self._next_id += 1
        key = int.from_bytes(os.urandom(8), "big")
        desc = RemoteBuffer(self.token, id_, key, view.nbytes, access, addr, rkey)
        exp = Exposure(id_, view, access, key, desc)
        self.exposures[id_] = exp
        payload = _U8.pack(_Op.EXPOSE) + _EXPOSE.pack(id_, access, self.token, key, view.nbytes, addr, rkey)
        return exp, payload

    def revoke(self, exp: Exposure) -> bytes:
        """Start ending an exposure: the REVOKE to send (then wait until ``exp.state`` is ENDED)."""
        exp.state = Exposure.REVOKING
        return _U8.pack(_Op.REVOKE) + _ID.pack(exp.id)

    def end(self, exp: Exposure) -> None:
        """The exposure is over (REVOKED came, or we did not wait for it): forget it.  Requests
        for it that still come are answered REVOKED; a late REVOKED is accepted."""
        if exp.state == Exposure.REVOKING:
            self._ended.add(exp.id)
        exp.state = Exposure.ENDED
        self.exposures.pop(exp.id, None)

    # -- the caller --------------------------------------------------------------------------

    def check(self, remote: RemoteBuffer, offset: int, length: int, access: int) -> _Remote:
        """The peer's record of ``remote`` if ``[offset, offset + length)`` with ``access`` is allowed;
        else a typed error."""
        if not isinstance(remote, RemoteBuffer):
            raise TypeError(f"expected an aiordma.RemoteBuffer, got {type(remote).__name__}")
        if remote.token != self.peer_token:
            raise ForeignDescriptorError("this descriptor was not exposed on this connection")
        rec = self.remotes.get(remote.id)
        if rec is None or rec.desc.key != remote.key:
            if remote.id in self._revoked:
                raise DescriptorRevokedError(f"exposure #{remote.id} has ended")
            raise ForeignDescriptorError("this descriptor names no exposure of this connection")
        if rec.revoking:
            raise DescriptorRevokedError(f"exposure #{remote.id} is ending")
        desc = rec.desc
        if not desc.access & access:
            what = "reads" if access == READ else "writes"
            raise RemoteAccessDeniedError(f"exposure #{remote.id} does not allow {what}")
        if offset < 0 or length < 0 or offset + length > desc.length:
            raise RemoteBoundsError(
                f"offset {offset} + length {length} is outside exposure #{remote.id} of {desc.length} bytes"
            )
        return rec

    def begin(self, rec: _Remote) -> None:
        rec.inflight += 1

    def finish(self, rec: _Remote) -> bytes | None:
        """An operation on ``rec`` ended; returns the REVOKED to send if it was the last of a revoked one."""
        rec.inflight -= 1
        if rec.revoking and rec.inflight == 0:
            return self._revoked_now(rec)
        return None

    def _revoked_now(self, rec: _Remote) -> bytes:
        self.remotes.pop(rec.desc.id, None)
        self._revoked.add(rec.desc.id)
        return _U8.pack(_Op.REVOKED) + _ID.pack(rec.desc.id)

    def read_request(self, rec: _Remote, offset: int, length: int) -> tuple[int, bytes]:
        """TCP: a READ of at most ``max_in`` bytes; returns its op id and payload."""
        assert 0 < length <= self.max_in
        op = self._op()
        self._expect[op] = length
        self._op_exposure[op] = rec.desc.id
        return op, _U8.pack(_Op.READ) + _READ.pack(op, rec.desc.id, rec.desc.key, offset, length)

    def write_request(self, rec: _Remote, offset: int, data: bytes | memoryview) -> tuple[int, bytes]:
        """TCP: a WRITE of at most ``max_out`` bytes."""
        assert len(data) <= self.max_out
        op = self._op()
        self._expect[op] = -1
        self._op_exposure[op] = rec.desc.id
        return op, b"".join((_U8.pack(_Op.WRITE), _WRITE.pack(op, rec.desc.id, rec.desc.key, offset), data))

    def notice(self, rec: _Remote, offset: int, length: int) -> bytes:
        """RDMA: tell the exposer a WRITE landed."""
        return _U8.pack(_Op.WRITTEN) + _WRITTEN.pack(rec.desc.id, offset, length)

    def take_result(self, op: int) -> bytes:
        """The data of a completed TCP operation, or its typed error."""
        result = self.results.pop(op)
        self._op_exposure.pop(op, None)
        if self._expect.get(op) != -2:  # (-2: failed early; its answer is still to come and dropped)
            self._expect.pop(op, None)
        assert result is not None
        status, data = result
        if status != Status.OK:
            raise _ERRORS.get(status, RemoteMemoryError)(f"the peer refused the operation ({Status(status).name})")
        return data

    def abandon(self, op: int) -> None:
        """A TCP operation's caller went away (cancelled): its answer, when it comes, is dropped."""
        self.results.pop(op, None)
        self._op_exposure.pop(op, None)
        if op in self._expect:
            self._expect[op] = -2

    def _op(self) -> int:
        op = self._next_op
        self._next_op = op + 1 if op < 0xFFFFFFFF else 1
        self.results[op] = None
        return op

    # -- rendezvous (large messages, RDMA) ----------------------------------------------------

    def rendezvous(self, length: int, addr: int, rkey: int) -> tuple[int, bytes]:
        """Announce a staged message of ``length`` bytes at ``[addr, rkey]``; the region stays the
        peer's to READ until its RNDV_DONE."""
        mid = self._next_mid
        self._next_mid = mid + 1 if mid < 0xFFFFFFFF else 1
        self.rndv_out[mid] = length
        return mid, _U8.pack(_Op.RNDV) + _RNDV.pack(mid, length, addr, rkey)

    def rendezvous_done(self, rv: Rendezvous) -> bytes:
        """We READ the message (or gave up on it): the sender may reuse its region."""
        self._rndv_in.discard(rv.mid)
        return _U8.pack(_Op.RNDV_DONE) + _ID.pack(rv.mid)

    # -- input -------------------------------------------------------------------------------

    def receive(self, payload: bytes) -> list[bytes]:
        """One MEMORY frame from the peer; returns the payloads to send back."""
        if not payload:
            raise RemoteProtocolError("empty MEMORY frame")
        op = payload[0]
        body = memoryview(payload)[1:]
        if op == _Op.READ:
            return [self._serve_read(body)]
        if op == _Op.WRITE:
            return [self._serve_write(body)]
        if op == _Op.READ_DATA or op == _Op.WRITE_DONE:
            self._result(op, body)
            return []
        if op == _Op.EXPOSE:
            self._on_expose(body)
            return []
        if op == _Op.REVOKE:
            (id_,) = self._fixed(_ID, body, "REVOKE")
            rec = self.remotes.get(id_)
            if rec is None:
                raise RemoteProtocolError(f"REVOKE of exposure #{id_}, which was never announced")
            if rec.revoking:
                raise RemoteProtocolError(f"REVOKE of exposure #{id_} twice")
            rec.revoking = True
            # TCP operations on it still waiting fail now (the exposer applies none after its
            # REVOKE; their answers, when they come, are dropped)
            for op, target in list(self._op_exposure.items()):
                if target == id_ and self.results.get(op, False) is None:
                    self.results[op] = (Status.REVOKED, b"")
                    self._expect[op] = -2
                    del self._op_exposure[op]
            return [self._revoked_now(rec)] if rec.inflight == 0 else []
        if op == _Op.REVOKED:
            (id_,) = self._fixed(_ID, body, "REVOKED")
            if id_ in self._ended:
                self._ended.discard(id_)
                return []
            exp = self.exposures.get(id_)
            if exp is None or exp.state != Exposure.REVOKING:
                raise RemoteProtocolError(f"REVOKED for exposure #{id_}, which is not being revoked")
            self.end(exp)
            self._ended.discard(id_)
            return []
        if op == _Op.RNDV:
            mid, length, addr, rkey = self._fixed(_RNDV, body, "RNDV")
            if length > self.max_message:
                raise RemoteProtocolError(f"rendezvous message of {length} bytes exceeds the limit {self.max_message}")
            if mid in self._rndv_in:
                raise RemoteProtocolError(f"rendezvous message {mid} announced twice")
            self._rndv_in.add(mid)
            self.rndv_arrived.append(Rendezvous(mid, length, addr, rkey))
            return []
        if op == _Op.RNDV_DONE:
            (mid,) = self._fixed(_ID, body, "RNDV_DONE")
            if self.rndv_out.pop(mid, None) is None:
                raise RemoteProtocolError(f"RNDV_DONE for message {mid}, which is not staged")
            self.rndv_done.append(mid)
            return []
        if op == _Op.WRITTEN:
            id_, offset, length = self._fixed(_WRITTEN, body, "WRITTEN")
            exp = self.exposures.get(id_)
            if exp is None:
                return []  # (ended meanwhile: nobody waits for its notices)
            if not exp.access & WRITE or offset + length > exp.view.nbytes:
                raise RemoteProtocolError(f"WRITTEN notice outside exposure #{id_} or its access")
            exp.notices.append((offset, length))
            return []
        raise RemoteProtocolError(f"unknown MEMORY operation {op}")

    @staticmethod
    def _fixed(st: struct.Struct, body: memoryview, what: str) -> tuple[int, ...]:
        if len(body) != st.size:
            raise RemoteProtocolError(f"{what} frame of {len(body)} bytes, expected {st.size}")
        return st.unpack(body)

    def _on_expose(self, body: memoryview) -> None:
        id_, access, token, key, length, addr, rkey = self._fixed(_EXPOSE, body, "EXPOSE")
        if self.peer_token is None:
            self.peer_token = token
        elif token != self.peer_token:
            raise RemoteProtocolError("EXPOSE with another connection token")
        if not access or access & ~(READ | WRITE) or length > _MAX_LENGTH:
            raise RemoteProtocolError("EXPOSE with invalid access or length")
        if id_ in self.remotes or id_ in self._revoked:
            raise RemoteProtocolError(f"EXPOSE of exposure #{id_} twice")
        self.remotes[id_] = _Remote(RemoteBuffer(token, id_, key, length, access, addr, rkey))

    def _serve_check(self, id_: int, key: int, offset: int, length: int, access: int) -> tuple[int, Exposure | None]:
        exp = self.exposures.get(id_)
        if exp is None or exp.key != key:
            return (Status.REVOKED if 0 < id_ < self._next_id else Status.FOREIGN), None
        if exp.state == Exposure.ENDED:
            return Status.REVOKED, None
        if not exp.access & access:
            return Status.DENIED, None
        if offset + length > exp.view.nbytes:
            return Status.BOUNDS, None
        return Status.OK, exp

    def _serve_read(self, body: memoryview) -> bytes:
        op, id_, key, offset, length = self._fixed(_READ, body, "READ")
        if length > self.max_out:
            raise RemoteProtocolError(f"READ of {length} bytes, more than one frame to the peer holds")
        status, exp = self._serve_check(id_, key, offset, length, READ)
        head = _U8.pack(_Op.READ_DATA) + _STATUS.pack(op, status)
        if exp is None:
            return head
        self.ops_served += 1
        self.bytes_served += length
        return head + bytes(exp.view[offset : offset + length])

    def _serve_write(self, body: memoryview) -> bytes:
        if len(body) < _WRITE.size:
            raise RemoteProtocolError("WRITE frame shorter than its fields")
        op, id_, key, offset = _WRITE.unpack_from(body, 0)
        data = body[_WRITE.size :]
        status, exp = self._serve_check(id_, key, offset, len(data), WRITE)
        if exp is not None:
            exp.view[offset : offset + len(data)] = data
            exp.notices.append((offset, len(data)))
            self.ops_served += 1
            self.bytes_served += len(data)
        return _U8.pack(_Op.WRITE_DONE) + _STATUS.pack(op, status)

    def _result(self, kind: int, body: memoryview) -> None:
        if len(body) < _STATUS.size:
            raise RemoteProtocolError("answer frame shorter than its fields")
        op, status = _STATUS.unpack_from(body, 0)
        expect = self._expect.get(op)
        if expect is None or (expect != -2 and self.results.get(op, False) is not None):
            raise RemoteProtocolError(f"answer to operation {op}, which is not waiting")
        if status not in _STATUSES:
            raise RemoteProtocolError(f"answer with unknown status {status}")
        data = bytes(body[_STATUS.size :])
        if kind == _Op.WRITE_DONE:
            if expect >= 0 or data:
                raise RemoteProtocolError("WRITE_DONE that answers no WRITE, or with data")
        elif expect == -1 or (expect >= 0 and len(data) != (expect if status == Status.OK else 0)):
            raise RemoteProtocolError(f"READ_DATA of {len(data)} bytes does not answer its READ")
        if expect == -2:  # abandoned, or failed early: nobody waits for it
            del self._expect[op]
            return
        self.results[op] = (status, data)
