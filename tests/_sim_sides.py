"""Two sides of the simulated RC wire, as the sim's tests build them (test_simverbs, test_simsrq)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiordma._rdma.constants import Access
from aiordma.testing._simverbs import (
    SimCompletionChannel,
    SimCompletionQueue,
    SimContext,
    SimFabric,
    SimMemoryRegion,
    SimProtectionDomain,
    SimQueuePair,
    SimWCArray,
)

ALL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
QP_RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


@dataclass
class Side:
    ctx: SimContext
    pd: SimProtectionDomain
    ch: SimCompletionChannel
    cq: SimCompletionQueue
    qp: SimQueuePair
    mr: SimMemoryRegion
    wc: SimWCArray
    extra: list[SimMemoryRegion] = field(default_factory=list)

    def poll(self) -> list[tuple[int, int, int, int, int, int]]:
        """Every queued completion (wr_id, status, opcode, byte_len, imm, qp_num)."""
        out = []
        while n := self.cq.poll_into(self.wc):
            out += self.wc.entries(n)
        return out

    def close(self) -> None:
        for obj in (self.qp, self.cq, self.ch, self.mr, *self.extra, self.pd, self.ctx):
            obj.close()


def side(fab: SimFabric, dev: str, *, cqe: int = 64, mr_access: int = ALL_ACCESS, **qp_kw: int) -> Side:
    ctx = fab.open_context(dev)
    pd = ctx.alloc_pd()
    ch = ctx.create_comp_channel()
    cq = ctx.create_cq(cqe, ch)
    qp = pd.create_qp(cq, **qp_kw)  # type: ignore[arg-type]
    mr = pd.reg_mr(8192, mr_access)
    return Side(ctx, pd, ch, cq, qp, mr, fab.WCArray(16))


def bring_up(fab: SimFabric, a: Side, b: Side, *, access: int = QP_RW) -> None:
    for me, peer in ((a, b), (b, a)):
        gid = fab.gid_for_ip(str(_ip_of(fab, peer.ctx.name)))
        assert gid is not None
        me.qp.to_init(1, access=access)
        me.qp.to_rtr(peer.qp.qp_num, gid.gid, sgid_index=1, path_mtu=4096)
    for me in (a, b):
        me.qp.to_rts(0)


def _ip_of(fab: SimFabric, dev: str) -> str:
    return {"simA": "10.0.0.1", "simB": "10.0.0.2"}[dev]
