"""The verbs objects as the RDMA transport uses them: memory regions, memory windows, protection
domains, and the scope a connection's memory lives in.

Two implementations satisfy these interfaces: the native binding (``verbs.py``) and the
simulated wire (``aiordma.testing._simverbs``); mypy holds both to them (the checks at the end
of each module).  Their lifetime rule is ``lifetime.Resource``'s: ``close()`` is idempotent, and
memory a work request names stays the device's until its completion is polled or its QP is
destroyed -- a region is given back (:meth:`Scope.give_region`) or closed only then.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Region", "Window", "Domain", "Scope"]


class Region(Protocol):
    """A registered memory region (``ibv_mr``): ``[addr, addr + length)`` under ``lkey``, and
    ``rkey`` when it grants remote access by itself (a connection's own PD)."""

    addr: int
    length: int
    lkey: int
    rkey: int

    def view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable view of its bytes (release it before the region is closed)."""
        ...

    def close(self) -> None:
        """Deregister (``ibv_dereg_mr``); idempotent."""


class Window(Protocol):
    """A type-2 memory window (``ibv_mw``): a grant bound to one QP; ``close`` kills its rkey."""

    @property
    def rkey(self) -> int: ...

    def close(self) -> None: ...


class Domain(Protocol):
    """A protection domain (``ibv_pd``)."""

    def reg_mr(self, length: int, access: int = ...) -> Region:
        """A fresh registered region of ``length`` bytes."""
        ...

    def reg_buffer(self, buffer: Any, access: int = ...) -> Region:
        """Register the caller's memory (anything with the buffer protocol)."""
        ...

    def alloc_mw(self) -> Window:
        """A type-2 memory window, not bound yet."""
        ...

    def close(self) -> None: ...


class Scope(Protocol):
    """Where one connection's memory lives (``device.py``, "Remote keys"): the device's shared PD,
    where memory windows grant remote access per QP, or the connection's own PD."""

    #: grants are memory windows (else a region's own rkey, in the connection's own PD)
    windows: bool

    @property
    def pd(self) -> Domain: ...

    def take_region(self, length: int) -> Region:
        """A registered, local-only region of ``length`` bytes (recycled when possible)."""
        ...

    def give_region(self, mr: Region) -> None:
        """Give back a region no QP can touch any more."""

    def staging_region(self, length: int) -> Region:
        """A region for a staged rendezvous message."""
        ...

    def register_exposed(self, view: memoryview, access: int) -> Region:
        """Register ``view`` for an exposure (``access``: what its grant will allow)."""
        ...

    def close_scope(self) -> None:
        """A connection's own PD: deregister what is left, deallocate (after its QP is destroyed)."""
