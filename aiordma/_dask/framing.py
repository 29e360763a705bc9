"""The ``rdma://`` comm's framing, sans I/O: a Dask message (its frames from ``to_frames``) as a
head message and the pieces of its other frames (see :mod:`aiordma._dask`, "Framing")."""


from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from distributed.utils import ensure_memoryview
from distributed.protocol.utils import host_array

#: magic (4 bytes: b"aDk" and the format version), number of frames, nosplit
HEAD = struct.Struct("<4sII")
MAGIC = b"aDk\x01"
#: a frame of at most this many bytes may travel inside the head message ...
INLINE_FRAME_MAX = 64 << 10
#: ... while the inline bytes of one head stay within this
INLINE_MAX = 64 << 10
#: a frame larger than this travels in messages of this size: over TCP ...
TCP_PIECE = 16 << 20
#: ... and over RDMA (at most the peer's ``max_message_size`` either way)
RDMA_PIECE = 8 << 20
#: the smallest ``max-message-size`` accepted (a head with its inline frames must fit)
MIN_MESSAGE_SIZE = 1 << 20


class _FramingError(Exception):
    """The peer's messages do not follow the framing (not an rdma:// comm, or a bug)."""


def _nosplit(frames: Sequence[Any], sizes: Sequence[int]) -> int:
    """How many leading frames share one receive buffer: Dask's TCP rule (the pickled header and
    the first uncompressed buffer with its shards, as long as the header is small)."""
    count = 0
    nosplit_bytes = 0
    first: object = None
    for frame, nb in zip(frames, sizes):
        buffer = frame.obj if isinstance(frame, memoryview) else frame
        if not isinstance(buffer, bytes):  # an uncompressed buffer the deserialized object keeps
            if first is None:
                if nosplit_bytes > max(2048, nb * 0.05):
                    break
                first = buffer
            elif first is not buffer:
                break
        nosplit_bytes += nb
        count += 1
    return count


#: the flag byte of a frame in the head
SEPARATE, INLINE, RENDEZVOUS = 0, 1, 2


def encode(frames: Sequence[Any], rendezvous: int | None = None) -> tuple[bytes, list[memoryview]]:
    """The head message and the frames that follow it, each as a flat byte view.

    ``rendezvous``: over RDMA, the size from which this side's messages go by rendezvous: a
    frame whose first piece does is flagged so, and the receiver may register its buffer."""
    views = [ensure_memoryview(f) if not isinstance(f, bytes) else f for f in frames]
    sizes = [len(v) if isinstance(v, bytes) else v.nbytes for v in views]
    n = len(views)
    flags = bytearray(n)
    inline: list[bytes | memoryview] = []
    separate: list[memoryview] = []
    inline_bytes = 0
    for i, (view, nb) in enumerate(zip(views, sizes)):
        if nb <= INLINE_FRAME_MAX and inline_bytes + nb <= INLINE_MAX:
            flags[i] = INLINE
            inline_bytes += nb
            if nb:
                inline.append(view)
        else:
            flags[i] = RENDEZVOUS if rendezvous is not None and nb >= rendezvous else SEPARATE
            separate.append(view if isinstance(view, memoryview) else memoryview(view))
    head = b"".join([HEAD.pack(MAGIC, n, _nosplit(frames, sizes)), struct.pack(f"<{n}Q", *sizes), flags, *inline])
    return head, separate


@dataclass
class _Plan:
    """What a head announced: the frames (inline ones filled in) and the buffers still to fill."""

    frames: list[Any]
    #: (buffer to receive into, whether to register it) in the order the sender sends them
    pending: list[tuple[memoryview, bool]]


def decode_head(head: bytes, register_threshold: int) -> _Plan:
    """Parse a head message; allocate every frame's buffer and copy the inline frames in."""
    view = memoryview(head)
    if view.nbytes < HEAD.size:
        raise _FramingError(f"a head message of {view.nbytes} bytes is too short")
    magic, n, nosplit = HEAD.unpack_from(view)
    if magic != MAGIC:
        raise _FramingError(f"not an rdma:// comm message (magic {bytes(magic)!r})")
    fixed = HEAD.size + 9 * n
    if view.nbytes < fixed or nosplit > n:
        raise _FramingError("a malformed head message")
    sizes = struct.unpack_from(f"<{n}Q", view, HEAD.size)
    flags = view[HEAD.size + 8 * n : fixed]
    if any(flag > RENDEZVOUS for flag in flags):
        raise _FramingError("a head message with an unknown frame flag")
    inline_end = fixed + sum(nb for nb, flag in zip(sizes, flags) if flag == INLINE)
    if inline_end != view.nbytes:
        raise _FramingError("a head message whose inline frames do not add up")
    frames: list[Any] = []
    pending: list[tuple[memoryview, bool]] = []
    pos = fixed
    # the first `nosplit` frames share one buffer (the header with the first numpy buffer and its
    # shards, as Dask's TCP comm reads them); the others each get their own
    shared_size = sum(sizes[:nosplit])
    shared = host_array(shared_size) if shared_size else None
    shared_pos = 0
    for i, (nb, flag) in enumerate(zip(sizes, flags)):
        if i < nosplit and shared is not None:
            target = shared[shared_pos : shared_pos + nb]
            shared_pos += nb
        else:
            target = host_array(nb)
        if flag == INLINE:
            target[:] = view[pos : pos + nb]
            pos += nb
        elif nb:
            register = flag == RENDEZVOUS and bool(register_threshold) and nb >= register_threshold
            pending.append((target, register))
        frames.append(target)
    return _Plan(frames, pending)

