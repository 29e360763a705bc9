"""The lifetime rule of verbs objects, written once for the native ones (``verbs.py``) and the
simulated ones (``aiordma.testing``'s wire).

A verbs object has parents (a PD has its context; an MR its PD; a QP its PD and CQs):

* it is created only under open parents (else ``RDMAError(EBADF)``);
* a parent refuses to close while a child is open (``RDMAError(EBUSY)``, naming what is open and
  the order: QP, CQ, completion channel, MR, PD, context) -- the kernel would refuse too, or free
  memory the NIC may still touch;
* a closed object refuses every call (``EBADF``) and closing it twice does nothing;
* every open object is counted by kind in its owner's ``live_objects()`` (the native module's, or
  the simulated fabric's): :meth:`Resource._counted` is that counter.
"""

from __future__ import annotations

import errno
import mmap
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Self

from .._errors import RDMAError

__all__ = ["Resource", "RegionBytes", "CLOSE_ORDER", "foreign"]

#: the order a set of verbs objects closes in (children first)
CLOSE_ORDER = "QP, CQ, completion channel, MR, PD, context"


def foreign(obj: object, kind: type, call: str) -> TypeError:
    """The error for an object handed to a provider that is not its own ``kind`` (a simulated CQ
    given to a native QP; verbs refuse objects of another context likewise)."""
    return TypeError(f"{call}: {type(obj).__name__} is not a {kind.__module__}.{kind.__name__} "
                     "(verbs objects of one provider only)")  # fmt: skip


class Resource:
    """A verbs object under the lifetime rule (see the module docs).  A subclass sets ``_kind``
    (its key in ``live_objects()``) and ``_label``, counts itself open once it really is (its
    verbs call succeeded: ``self._counted(self._kind, 1)``), and calls :meth:`_mark_closed` when it
    closed."""

    _kind: str = ""
    _label: str = "object"

    def __init__(self, parents: Sequence[Resource]) -> None:
        for p in parents:
            p._ensure_open()
        self._closed = False
        self._children: set[Resource] = set()
        self._parents = tuple(parents)
        for p in self._parents:
            p._children.add(self)

    def _counted(self, kind: str, delta: int) -> None:
        """Add ``delta`` to the owner's count of ``kind`` (live objects, registered bytes)."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def _ensure_open(self, call: str = "") -> None:
        if self._closed:
            raise RDMAError(errno.EBADF, call or type(self).__name__, f"the {self._label} is closed")

    def _check_children(self, call: str) -> None:
        if self._children:
            kinds: dict[str, int] = {}
            for c in self._children:
                kinds[c._label] = kinds.get(c._label, 0) + 1
            what = ", ".join(f"{n} {k}{'s' if n > 1 else ''}" for k, n in sorted(kinds.items()))
            raise RDMAError(errno.EBUSY, call, f"{what} still open; close them first (order: {CLOSE_ORDER})")

    def _mark_closed(self) -> None:
        self._closed = True
        for p in self._parents:
            p._children.discard(self)
        self._counted(self._kind, -1)

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        self.close()


class RegionBytes(Resource):
    """The bytes of a memory region, native or simulated, seen from this process: a subclass
    sets ``buffer`` (the memory it registered) and ``length``.  A closed region refuses
    (``EBADF``); a view taken before ``close()`` stays valid until it is released."""

    buffer: Any
    length: int
    _mmap: mmap.mmap | None

    def _take_memory(self, length_or_buffer: int | Any) -> int:
        """Set ``buffer``: ``length`` bytes of the region's own (an anonymous shared ``mmap``:
        page-aligned, zero-filled), or the caller's buffer; returns its length in bytes."""
        self._mmap = None
        if isinstance(length_or_buffer, int):
            if length_or_buffer <= 0:
                raise ValueError("a memory region needs a positive length")
            page = mmap.PAGESIZE
            self._mmap = mmap.mmap(-1, (length_or_buffer + page - 1) // page * page)
            self.buffer = self._mmap
            return length_or_buffer
        self.buffer = length_or_buffer
        return memoryview(length_or_buffer).nbytes

    def _give_back_memory(self) -> None:
        """Unmap the memory the region allocated (a view still out keeps the mapping until it is
        released) and forget the buffer."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still out: the mapping goes when it is released
            self._mmap = None
        self.buffer = None

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable memoryview of part of the region; release it when done."""
        if self._closed:
            self._ensure_open("view")
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"[{offset}:{offset + length}] is outside the {self.length}-byte region")
        with memoryview(self.buffer) as mv:
            return mv.cast("B")[offset : offset + length]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        with self.view(offset, len(data)) as v:
            v[:] = data

    def read(self, offset: int = 0, length: int | None = None) -> bytes:
        with self.view(offset, length) as v:
            return bytes(v)
