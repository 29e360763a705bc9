"""The receive side's memory, sans I/O: where the peer's bytes land before they are handed out.

:class:`~aiordma._proto.protocol.Connection` reads through three kinds of memory:

* its :class:`ReceiveBuffer` -- headers, control frames, DATA, and every message that fits;
* a :class:`LongFrame` -- the payload of a MESSAGE frame too long for that buffer, read into a
  destination of its own (the socket writes it there straight, once the header is parsed);
* a :class:`Landing` -- the buffer of a reader that waits in ``receive_into``, offered for the next
  message: that message goes into it and nowhere else.

A byte stream's DATA goes to a :class:`StreamBuffer`: the payloads one read brought, copied once
out of the receive buffer into one ``bytes``, handed out whole when a reader takes all of it.

A long message that completes with no reader waiting stays in its spare buffer, in the message
sink, as a :class:`SpareMessage`: the reader that comes for it copies it once, into ``bytes``
(``receive()``) or into its buffer (``receive_into``), and the spare goes back.

Theory of operation: copies
---------------------------
The kernel's copy (socket to user space) is the only one a byte needs when its destination is
known before it is read.  So a long message's payload is lent to the socket *exactly*
(``get_buffer`` returns the rest of the frame, no more): the kernel writes it into the waiting
reader's buffer (zero copies after the kernel's) or into a spare buffer from which ``receive()``
makes its ``bytes`` (one copy, the one a ``bytes`` result needs).  The read that ends a long frame
ends at its last byte, so the next frame starts at the beginning of the receive buffer; and after
a long frame the next read takes the header alone (:attr:`Connection.peek`), so the next long
message's payload is not read ahead into the receive buffer only to be copied out again.  Messages
that fit in the receive buffer are copied once from it (into ``bytes``, or into the landing).

Spare buffers are taken from a bounded free list (:class:`SpareBuffers`) and given back once the
message is handed out: a connection between long messages holds none, and a stream of long
messages allocates nothing after the first (issue 33; issue 23's bound on idle memory).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Final, Union, cast

__all__ = [
    "ReceiveBuffer",
    "Landing",
    "LongFrame",
    "SpareMessage",
    "MessageSink",
    "StreamBuffer",
    "STREAM_CHUNK",
    "SpareBuffers",
    "SPARES",
    "ROOMS",
    "RECV_BUFFER_SIZE",
    "MIN_RECV_ROOM",
    "LONG_PEEK",
]

#: Receive buffer: its working size once TCP carries the data (and the size it goes back to), and
#: the least free room ``get_buffer`` offers -- also its size during the handshake: a connection
#: starts with the smaller one, and only one that stays on TCP (framed) widens it
#: (:meth:`~aiordma._proto.protocol.Connection.widen_receive_buffer`).  A connection that moves to
#: RDMA or passes through never needs the working size: not allocating it saves a fresh mapping
#: of 256 KiB, zeroed, per connect (in the Soft-RoCE guest ~2 ms of an RDMA connect's ~40).
RECV_BUFFER_SIZE: Final = 256 << 10
MIN_RECV_ROOM: Final = 64 << 10

#: After a MESSAGE of at least this many bytes came as a long frame, the next read takes the next
#: header alone (see the module docs): one system call more per long message, no read-ahead copy.
LONG_PEEK: Final = 64 << 10
#: A byte stream's received bytes are kept in chunks of at most this many (a reader that asks
#: for this many, as anyio's ``receive()`` does by default, gets each chunk whole: no copy).
STREAM_CHUNK: Final = 64 << 10
#: Spare buffers come in powers of two from this size up.
_SPARE_MIN: Final = 128 << 10


class ReceiveBuffer:
    """Bytes ``[start:end]`` of ``buf`` are received and not parsed yet.

    Never resized in place (a view lent by ``get_buffer`` may still be alive): only replaced.
    ``size`` is ``len(buf)``, kept with it (the hot paths read it).

    ``borrowed``: ``buf`` is a buffer shared by the connections of one thread (see
    ``Connection.share_receive_buffer``), lent for reads while this one holds nothing; what a read
    leaves unparsed moves to a buffer of its own (:meth:`settle`, from :data:`ROOMS`), which goes
    back to the pool once all is parsed (:meth:`borrow`).  An idle connection holds none."""

    __slots__ = ("buf", "view", "size", "start", "end", "borrowed")

    def __init__(self, size: int = MIN_RECV_ROOM) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.size = size
        self.start = 0
        self.end = 0
        self.borrowed = False

    def borrow(self, view: memoryview) -> None:
        """Nothing is held (``start == end``): reads go into the shared buffer ``view`` shows,
        and the own buffer, if any, goes back to :data:`ROOMS`."""
        own = self.buf
        if not self.borrowed:
            size = len(own)
            if size >= _SPARE_MIN and not size & (size - 1):  # (the pool's sizes: powers of two)
                ROOMS.give(own)
        self.buf, self.view, self.size = cast(bytearray, view.obj), view, view.nbytes
        self.start = self.end = 0
        self.borrowed = True

    def settle(self) -> None:
        """After a read into the shared buffer: what is left unparsed moves to a buffer of this
        connection's own (the next connection's read overwrites the shared one)."""
        if self.borrowed and self.start != self.end:
            pending = self.end - self.start
            own = ROOMS.take(max(pending, MIN_RECV_ROOM))
            own[0:pending] = self.buf[self.start : self.end]
            self.buf, self.view, self.size = own, memoryview(own), len(own)
            self.start, self.end = 0, pending
            self.borrowed = False

    def own(self) -> None:
        """Leave the shared buffer (it holds nothing of ours then): an empty buffer of one's own."""
        if self.borrowed:
            self.settle()
            if self.borrowed:
                self.buf = bytearray(0)
                self.view = memoryview(self.buf)
                self.size = 0
                self.start = self.end = 0
                self.borrowed = False

    def reserve(self, room: int) -> None:
        """Make ``room`` bytes free after ``end`` (compacting, or a larger buffer)."""
        if self.start == self.end:
            self.start = self.end = 0
        if self.size - self.end >= room:
            return
        pending = self.end - self.start
        if self.start and self.size - pending >= room:
            # compact in place: same size, so allowed with views outstanding
            self.buf[0:pending] = self.buf[self.start : self.end]
        else:
            new = bytearray(max(self.size, pending + room))
            new[0:pending] = self.buf[self.start : self.end]
            self.buf = new
            self.view = memoryview(new)
            self.size = len(new)
            self.borrowed = False  # (its own now)
        self.start = 0
        self.end = pending

    def shrink(self) -> None:
        """Back to the normal size, once everything is parsed (after a large control frame)."""
        if self.size > RECV_BUFFER_SIZE and self.start == self.end:
            self.buf = bytearray(RECV_BUFFER_SIZE)
            self.view = memoryview(self.buf)
            self.size = RECV_BUFFER_SIZE
            self.start = self.end = 0
            self.borrowed = False


class Landing:
    """A waiting reader's buffer, offered for the next message (``Connection.offer_landing``).

    ``length`` is -1 until a message landed in ``view`` (then its length, and the connection no
    longer holds the landing).  The reader's buffer is the connection's, to write the next message
    into, from the offer until the message landed or the reader withdrew it
    (``Connection.withdraw_landing``)."""

    __slots__ = ("view", "length")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.length = -1


class LongFrame:
    """A MESSAGE payload read into its own destination: ``view`` (exactly ``length`` bytes, of
    a landing or of ``spare``), of which ``got`` bytes are in."""

    __slots__ = ("view", "got", "length", "landing", "spare", "tail")

    def __init__(self, view: memoryview, got: int, landing: Landing | None, spare: bytearray | None) -> None:
        self.view = view
        self.got = got
        self.length = view.nbytes
        self.landing = landing
        self.spare = spare
        #: the receive buffer was lent for the frame's last bytes (``Connection.lend_exact`` off)
        self.tail = False


class SpareMessage:
    """A long message parked in its spare buffer (in the message sink, in its place) until a reader
    takes it: :meth:`take` (its ``bytes``) or :meth:`copy_into`; either gives the spare back."""

    __slots__ = ("view", "spare", "pool")

    def __init__(self, view: memoryview, spare: bytearray, pool: SpareBuffers) -> None:
        self.view = view
        self.spare = spare
        self.pool = pool

    def __len__(self) -> int:
        return self.view.nbytes

    def take(self) -> bytes:
        data = bytes(self.view)  # the one copy a bytes result needs
        self.release()
        return data

    def copy_into(self, dest: memoryview) -> int:
        n = self.view.nbytes
        dest[:n] = self.view
        self.release()
        return n

    def release(self) -> None:
        self.view.release()
        self.pool.give(self.spare)


class MessageSink(deque[Union[bytes, SpareMessage]]):
    """Where whole MESSAGE payloads go without an event (the message twin of
    ``data_sink``); ``nbytes`` counts the bytes it holds (the reader subtracts
    what it takes).  A long message that found no reader waiting is a :class:`SpareMessage`."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0


class StreamBuffer:
    """A byte stream's received bytes, not read yet: the chunks they arrived in, in order.

    The protocol adds each read's DATA payloads as one chunk (``+=``: a ``bytes`` is kept as it
    is, anything else copied once into ``bytes``), and readers take from the front.  A reader
    that takes a whole chunk gets that very ``bytes`` object: a byte that came in a read and is
    taken whole is copied once after the kernel's (into its chunk), where a ``bytearray`` in
    between cost two (into it, then out of it).  Taking part of a chunk copies that part.
    ``len()`` is the count of bytes held (kept, not summed); ``received`` counts every byte ever
    added (aiordma.stats)."""

    __slots__ = ("_chunks", "_head", "nbytes", "received")

    def __init__(self) -> None:
        self._chunks: deque[bytes | bytearray] = deque()
        #: bytes of the first chunk already taken
        self._head = 0
        self.nbytes = 0
        self.received = 0

    def __len__(self) -> int:
        return self.nbytes

    def __bool__(self) -> bool:
        return self.nbytes != 0

    def __iadd__(self, data: bytes | bytearray | memoryview) -> StreamBuffer:
        """Add ``data`` (a flat byte view) after what is held: kept if it is ``bytes``, else copied
        once (in chunks of at most :data:`STREAM_CHUNK`)."""
        n = len(data)
        if not n:
            return self
        if data.__class__ is bytes:
            self._chunks.append(data)  # (bytes: checked above)
            self.nbytes += n
            self.received += n
        else:
            with memoryview(data) as view:
                self.add_parts([view])
        return self

    def add_parts(self, parts: list[memoryview]) -> None:
        """Add ``parts`` (flat byte views, one read's DATA payloads): each byte copied once, into
        chunks of :data:`STREAM_CHUNK` bytes at most -- small payloads together, a large one cut."""
        if len(parts) == 1:
            n = parts[0].nbytes
            if n <= STREAM_CHUNK:  # (one frame's payload: the common case)
                if n:
                    self._chunks.append(parts[0].tobytes())
                    self.nbytes += n
                    self.received += n
                return
        chunks = self._chunks
        pending: list[memoryview] = []
        size = 0
        for part in parts:
            n = part.nbytes
            pos = 0
            while pos < n:
                take = min(n - pos, STREAM_CHUNK - size)
                pending.append(part[pos : pos + take] if pos or take < n else part)
                size += take
                pos += take
                if size == STREAM_CHUNK:
                    chunks.append(pending[0].tobytes() if len(pending) == 1 else b"".join(pending))
                    self.nbytes += size
                    self.received += size
                    pending, size = [], 0
        if size:
            chunks.append(pending[0].tobytes() if len(pending) == 1 else b"".join(pending))
            self.nbytes += size
            self.received += size

    def __bytes__(self) -> bytes:
        """All that is held, without taking it (a copy)."""
        chunks = self._chunks
        if not chunks:
            return b""
        with memoryview(chunks[0]) as first:
            return b"".join([first[self._head :], *list(chunks)[1:]])

    def clear(self) -> None:
        self._chunks.clear()
        self._head = 0
        self.nbytes = 0

    def take(self, n: int, some: bool = False) -> bytes:
        """Up to ``n`` bytes from the front (all there are, if fewer), as ``bytes``.  The first
        chunk whole, when that is what is asked for, is handed out as it is (no copy).
        ``some``: fewer will do (a stream's ``receive``): a full first chunk comes alone, whole,
        rather than copied together with what follows it."""
        chunks = self._chunks
        if n <= 0 or not chunks:
            return b""
        first = chunks[0]
        head = self._head
        avail = len(first) - head
        if n >= avail and (len(chunks) == 1 or n == avail):
            if head == 0 and first.__class__ is bytes:  # (take_chunk's common case, inline)
                chunks.popleft()
                self.nbytes -= avail
                return first  # (bytes: checked above)
            return self.take_chunk()
        if n < avail:
            self._head = head + n
            self.nbytes -= n
            with memoryview(first) as view:
                return view[head : head + n].tobytes()
        if some and head == 0 and avail >= STREAM_CHUNK and first.__class__ is bytes:
            return self.take_chunk()  # a full chunk: whole, as it is (a stream's receive may return less)
        # more than the first chunk: gather up to n, one copy of each byte
        parts: list[memoryview] = []
        want = min(n, self.nbytes)
        got = 0
        while got < want:
            chunk = chunks[0]
            view = memoryview(chunk)[head:]
            size = view.nbytes
            if got + size <= want:
                parts.append(view)
                got += size
                chunks.popleft()
                head = 0
            else:
                part = want - got
                parts.append(view[:part])
                got = want
                head += part
        self._head = head
        self.nbytes -= got
        data = b"".join(parts)
        for view in parts:
            view.release()
        return data

    def take_chunk(self) -> bytes:
        """The rest of the first chunk (whole, as it is, if none of it was taken): what one read
        brought, for a reader that takes whatever there is (a Protocol's ``data_received``)."""
        chunks = self._chunks
        if not chunks:
            return b""
        first = chunks.popleft()
        head = self._head
        self._head = 0
        self.nbytes -= len(first) - head
        if head == 0 and first.__class__ is bytes:
            return first  # (bytes: checked above)
        with memoryview(first) as view:
            return view[head:].tobytes()

    def copy_into(self, out: memoryview) -> int:
        """Move up to ``len(out)`` bytes from the front into ``out`` (a flat writable byte view):
        one copy.  Returns the count."""
        chunks = self._chunks
        room = out.nbytes
        got = 0
        head = self._head
        while chunks and got < room:
            chunk = chunks[0]
            size = len(chunk) - head
            part = min(size, room - got)
            with memoryview(chunk) as view:
                out[got : got + part] = view[head : head + part]
            got += part
            if part == size:
                chunks.popleft()
                head = 0
            else:
                head += part
        self._head = head
        self.nbytes -= got
        return got

    def drop(self, n: int) -> None:
        """Discard ``n`` bytes from the front (at most all)."""
        chunks = self._chunks
        n = min(n, self.nbytes)
        self.nbytes -= n
        head = self._head
        while n:
            size = len(chunks[0]) - head
            if n < size:
                head += n
                break
            n -= size
            chunks.popleft()
            head = 0
        self._head = head

    def _joined(self) -> bytearray:
        """The held bytes as one chunk, the first (a ``bytearray`` of ours, grown in place as
        more come, so that a reader that searches as bytes arrive copies each byte once)."""
        chunks = self._chunks
        first = chunks[0]
        if first.__class__ is not bytearray or self._head:
            with memoryview(first) as view:
                first = bytearray(view[self._head :])
            chunks[0] = first
            self._head = 0
        while len(chunks) > 1:
            first += chunks[1]
            del chunks[1]
        return first  # (made a bytearray above)

    def find(self, sub: bytes, start: int = 0) -> int:
        """The position of ``sub`` in what is held, from ``start``; -1 if it is not there."""
        if self.nbytes < len(sub) + start:
            return -1
        return self._joined().find(sub, start)

    def startswith(self, prefix: bytes, start: int = 0) -> bool:
        if self.nbytes < len(prefix) + start:
            return False
        return self._joined().startswith(prefix, start)


class SpareBuffers:
    """A bounded free list of large buffers (powers of two), shared by connections.

    It is a cache, nothing more: ``take`` returns a buffer of at least ``n`` bytes, from the list
    or new; ``give`` puts one back unless the list would then hold more than ``limit`` bytes (then
    it is freed).  A buffer never handed back is simply collected.  Thread-safe (connections of
    several loops may share it)."""

    def __init__(self, limit: int = 64 << 20) -> None:
        self.limit = limit
        self.held = 0
        self._free: dict[int, list[bytearray]] = {}
        self._lock = threading.Lock()
        #: buffers made because none was free (what a test of allocations counts)
        self.made = 0

    def take(self, n: int) -> bytearray:
        size = max(_SPARE_MIN, 1 << (n - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self.held -= size
                return free.pop()
            self.made += 1
        return bytearray(size)

    def give(self, buf: bytearray) -> None:
        size = len(buf)
        with self._lock:
            if self.held + size > self.limit:
                return
            self.held += size
            self._free.setdefault(size, []).append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self.held = 0


#: The process's spare buffers (a free list, like the interpreter's own; ``Connection.spares``).
SPARES: Final = SpareBuffers()
#: Receive buffers of connections that share one (``ReceiveBuffer.settle``): held only while
#: a connection has bytes it cannot parse yet (a cut frame), pooled in between.
ROOMS: Final = SpareBuffers(limit=16 << 20)
