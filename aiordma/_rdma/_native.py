"""The native module of the verbs binding, loaded once: libibverbs and ``aiordma._verbs_cffi``
(or why not), the count of live objects, and the base of every verbs object.

The binding is :mod:`aiordma._rdma.verbs` (contexts and protection domains) over three modules of
its children: :mod:`._verbs_memory` (regions and windows), :mod:`._verbs_cq` (completions) and
:mod:`._verbs_qp` (queue pairs).  A child names its parent by the base here
(:class:`NativeContext`, :class:`NativeDomain`), so that the binding has no import circle.
"""

from __future__ import annotations

import errno as _errno
import importlib
import os
import threading
from collections.abc import Sequence
from typing import Any, Final

from .._errors import PostError, RDMAError, RDMAUnavailableError
from .constants import MTU_TO_ENUM, Numbered
from .lifetime import Resource

__all__ = ["NativeContext", "NativeDomain", "assert_no_live_objects", "live_objects", "native_available"]

# --------------------------------------------------------------------------
# The native module (optional)
# --------------------------------------------------------------------------

SYSFS_IB: Final = "/sys/class/infiniband"
NOT_BUILT_REASON: Final = "native module not built (it was installed with AIORDMA_NO_NATIVE, or without a C compiler)"
#: the library the native module needs (by soname: it is linked against a stub, _native/build_verbs.py);
#: loaded first here so that its absence is named as such
LIBIBVERBS: Final = "libibverbs.so.1"


def _load_libibverbs() -> str:
    """Whether libibverbs loads (the native module needs it); the reason it cannot, named as such."""
    import ctypes

    try:
        ctypes.CDLL(LIBIBVERBS, mode=os.RTLD_NOW)
    except OSError as exc:
        return (
            f"{LIBIBVERBS} cannot be loaded ({exc}): install libibverbs (Debian/Ubuntu: libibverbs1 and "
            "ibverbs-providers; Fedora: libibverbs) for RDMA"
        )
    return ""


_ffi: Any
_lib: Any
_IMPORT_REASON: str = _load_libibverbs()
try:
    if _IMPORT_REASON:
        raise ImportError(_IMPORT_REASON)
    _mod = importlib.import_module("aiordma._verbs_cffi")
except ModuleNotFoundError as _exc:
    _ffi = _lib = None
    _IMPORT_REASON = (
        NOT_BUILT_REASON if _exc.name == "aiordma._verbs_cffi" else f"native module cannot be loaded: {_exc}"
    )
except ImportError as _exc:  # libibverbs.so.1 missing at run time (said so above), or the module broken
    _ffi = _lib = None
    _IMPORT_REASON = _IMPORT_REASON or f"native module cannot be loaded: {_exc}"
else:
    _ffi, _lib = _mod.ffi, _mod.lib
    _IMPORT_REASON = ""



def native_available() -> tuple[bool, str]:
    """Can verbs be used here?  ``(True, "RDMA devices: rxe0")`` or ``(False, reason)``.

    Reasons: ``"native module not built (no libibverbs headers at install
    time)"``, ``"native module cannot be loaded: ..."``, ``"libibverbs cannot
    list devices: <errno text>"`` (with a hint when the kernel has no RDMA
    support), ``"no RDMA device"``.  Never raises.
    """
    if _lib is None:
        return False, _IMPORT_REASON
    num = _ffi.new("int *")
    lst = _lib.ibv_get_device_list(num)
    if lst == _ffi.NULL:
        err = int(_ffi.errno)
        why = f"libibverbs cannot list devices: {os.strerror(err) if err else 'unknown error'}"
        if not os.path.isdir(SYSFS_IB):
            why += f" ({SYSFS_IB} does not exist: no RDMA support in this kernel)"
        return False, why
    try:
        names = [_ffi.string(_lib.ibv_get_device_name(lst[i])).decode() for i in range(num[0])]
    finally:
        _lib.ibv_free_device_list(lst)
    if not names:
        return False, "no RDMA device"
    return True, "RDMA devices: " + ", ".join(names)


def _require_native(what: str) -> None:
    if _lib is None:
        raise RDMAUnavailableError(f"{_IMPORT_REASON} (while creating {what})")


# --------------------------------------------------------------------------
# Live-object accounting
# --------------------------------------------------------------------------

_LIVE_KEYS: Final = ("contexts", "pds", "mrs", "mws", "cqs", "channels", "qps", "srqs", "registered_bytes")
_live: dict[str, int] = dict.fromkeys(_LIVE_KEYS, 0)
_live_lock = threading.Lock()


def _count(key: str, delta: int) -> None:
    with _live_lock:
        _live[key] += delta


def live_objects() -> dict[str, int]:
    """Open verbs objects per class and bytes currently registered (a copy).

    Keys: contexts, pds, mrs, cqs, channels, qps, registered_bytes.
    """
    with _live_lock:
        return dict(_live)


def assert_no_live_objects() -> None:
    """Raise ``AssertionError`` naming what is still open (for tests)."""
    left = {k: v for k, v in live_objects().items() if v}
    if left:
        raise AssertionError(f"verbs objects still open: {left}")


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def _addr(ptr: Any) -> int:
    return int(_ffi.cast("uintptr_t", ptr))


def _fail(err: int, call: str, detail: str = "") -> RDMAError:
    return RDMAError(err or _errno.EIO, call, detail)


class RecvBatch:
    """The C arrays a batch of receive buffers crosses the boundary in (kept, grown on demand):
    one per QP and per SRQ, both posting through :meth:`post`."""

    def __init__(self, n: int) -> None:
        self._n = 0
        self._grow(max(1, n))
        self._posted: Any = _ffi.new("int *")

    def _grow(self, n: int) -> None:
        self._n = n
        self._addrs: Any = _ffi.new("uint64_t[]", n)
        self._lens: Any = _ffi.new("uint32_t[]", n)
        self._ids: Any = _ffi.new("uint64_t[]", n)

    def post(self, fn: Any, h: Any, addrs: Sequence[int], lens: Sequence[int], lkey: int, wr_ids: Sequence[int],
             call: str) -> None:  # fmt: skip
        """``fn(h, n, addrs, lens, lkey, wr_ids, posted)`` (a C batch poster) on these buffers;
        :class:`PostError` (with ``posted``) if the device refused some."""
        n = len(addrs)
        if not (len(lens) == len(wr_ids) == n):
            raise ValueError("addrs, lens and wr_ids must have the same length")
        if n == 0:
            return
        if n > self._n:
            self._grow(n)
        ra, rl, ri = self._addrs, self._lens, self._ids
        for i in range(n):
            ra[i] = addrs[i]
            rl[i] = lens[i]
            ri[i] = wr_ids[i]
        rc = int(fn(h, n, ra, rl, lkey, ri, self._posted))
        if rc < 0:
            raise PostError(-rc, call, int(self._posted[0]), n)


def _check(rc: int, call: str, detail: str = "") -> int:
    """Helpers return ``-errno`` on failure."""
    if rc < 0:
        raise _fail(-rc, call, detail)
    return rc


def _mtu_enum(path_mtu: int) -> int:
    try:
        return MTU_TO_ENUM[path_mtu]
    except KeyError:
        raise ValueError(f"path_mtu must be one of {sorted(MTU_TO_ENUM)} (bytes), got {path_mtu}") from None


# --------------------------------------------------------------------------
# Resource base
# --------------------------------------------------------------------------


class _Resource(Resource):
    """A native verbs object (the rule: :mod:`aiordma._rdma.lifetime`), counted in :func:`live_objects`."""

    def __init__(self, parents: Sequence[_Resource]) -> None:
        super().__init__(parents)

    def _counted(self, kind: str, delta: int) -> None:
        _count(kind, delta)


class NativeContext(_Resource):
    """What the children of a context (:class:`aiordma._rdma.verbs.Context`) use of it: its
    handle, and the registries its async events name their QP and CQ through (by address)."""

    _h: Any
    _qps: dict[int, Numbered]
    _cqs: dict[int, object]
    _srqs: dict[int, object]


class NativeDomain(_Resource):
    """What the children of a protection domain (:class:`aiordma._rdma.verbs.ProtectionDomain`)
    use of it: its handle and its context."""

    _h: Any
    context: NativeContext

