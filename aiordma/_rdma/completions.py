"""Work completions decoded, written once for the native verbs (``verbs.py``) and the simulated
wire (``aiordma.testing``).

A CQ is polled into an array (``verbs.WCArray``: a C array of ``struct aiordma_wc``; the
simulated wire's: a list of its queued completions).  The data path reads an array with
``entries(count)``: one tuple per completion, in one pass (:data:`objects.Completion`).
Everything else -- tests, tools, the verbs API -- reads :class:`WorkCompletion` objects, which
both arrays decode alike (:class:`CompletionArray`).
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

from .._errors import RDMAError
from .constants import WCOpcode, wc_status_name
from .objects import Completion

__all__ = ["WorkCompletion", "CompletionArray"]


@dataclass(frozen=True, slots=True)
class WorkCompletion:
    """A decoded ``ibv_wc``.  ``imm_data`` is host order, ``None`` without immediate."""

    wr_id: int
    status: int
    opcode: int
    byte_len: int
    imm_data: int | None
    qp_num: int
    src_qp: int = 0
    vendor_err: int = 0
    wc_flags: int = 0

    @property
    def ok(self) -> bool:
        return self.status == 0

    @property
    def status_name(self) -> str:
        """``"IBV_WC_SUCCESS"``, ``"IBV_WC_WR_FLUSH_ERR"``, ..."""
        return wc_status_name(self.status)

    @property
    def status_str(self) -> str:
        """A description of the status (the native binding's is ``ibv_wc_status_str()``'s)."""
        return self.status_name

    @property
    def opcode_name(self) -> str:
        try:
            return WCOpcode(self.opcode).name
        except ValueError:
            return str(self.opcode)

    @property
    def is_recv(self) -> bool:
        return bool(self.opcode & 128)

    def error(self, call: str = "ibv_poll_cq") -> RDMAError:
        """The :class:`RDMAError` describing a failed completion (errno EIO)."""
        vendor = f" vendor_err=0x{self.vendor_err:x}" if self.vendor_err else ""
        return RDMAError(errno.EIO, call, f"wr_id={self.wr_id} qp={self.qp_num} {self.status_str}{vendor}",
                         wc_status=self.status_name)  # fmt: skip

    def raise_for_status(self) -> None:
        if self.status != 0:
            raise self.error()


class CompletionArray:
    """What both completion arrays share: a fixed size, entries decoded one by one
    (``arr[i]``, :meth:`decode`) or in one pass (:meth:`entries`, the data path's), and field
    accessors.  A subclass sets ``n`` and implements ``__getitem__`` and ``entries``."""

    n: int

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> WorkCompletion:
        raise NotImplementedError

    def entries(self, count: int) -> list[Completion]:
        """``(wr_id, status, opcode, byte_len, imm, qp_num)`` of the first ``count`` entries; ``imm``
        is the immediate data (host order) or -1 when the completion carries none."""
        raise NotImplementedError

    def decode(self, count: int) -> list[WorkCompletion]:
        return [self[i] for i in range(count)]

    def wr_id(self, i: int) -> int:
        return self[i].wr_id

    def status(self, i: int) -> int:
        return self[i].status

    def byte_len(self, i: int) -> int:
        return self[i].byte_len

    def opcode(self, i: int) -> int:
        return self[i].opcode

    def imm_data(self, i: int) -> int | None:
        return self[i].imm_data
