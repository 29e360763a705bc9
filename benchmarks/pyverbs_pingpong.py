"""A plain pyverbs SEND/RECV ping-pong: what a user writing verbs by hand in Python gets.

The reference the issue compares aiordma's RDMA path against: one RC QP per
side, a registered buffer, receives re-posted one at a time, SENDs signaled,
and the CQ polled in a busy loop from Python (``cq.poll()`` until it returns
something) -- no event loop, no credits, no framing.  Prints the median
round trip in microseconds and the bulk rate of 1 MiB SENDs (``--bulk``).

    python benchmarks/pyverbs_pingpong.py --local            # both QPs in this process
    python benchmarks/pyverbs_pingpong.py --serve PORT       # the server of two processes
    python benchmarks/pyverbs_pingpong.py HOST PORT          # the client

Needs Debian's python3-pyverbs (imported from /usr/lib/python3/dist-packages)
and an RDMA device with a RoCEv2 GID on HOST's address.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from typing import Any

sys.path.append("/usr/lib/python3/dist-packages")

import pyverbs.enums as e  # noqa: E402
from pyverbs.addr import AHAttr, GlobalRoute  # noqa: E402
from pyverbs.cq import CQ  # noqa: E402
from pyverbs.device import Context  # noqa: E402
from pyverbs.mr import MR  # noqa: E402
from pyverbs.pd import PD  # noqa: E402
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: E402
from pyverbs.wr import SGE, RecvWR, SendWR  # noqa: E402

PORT = 1
BUF = 1 << 20


def _device_and_gid(ip: str) -> tuple[str, int]:
    from aiordma._rdma.discovery import list_devices

    for dev in list_devices(query_verbs=False):
        for port in dev.ports:
            for entry in port.gids:
                if entry.gid_type == "RoCEv2" and str(entry.gid.ipv4_mapped) == ip:
                    return dev.name, entry.index
    raise SystemExit(f"no RDMA device has a RoCEv2 GID for {ip}")


class End:
    def __init__(self, device: str, gid_index: int) -> None:
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        self.cq = CQ(self.ctx, 64, None, None, 0)
        cap = QPCap(max_send_wr=16, max_recv_wr=16)
        self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap), QPAttr(port_num=PORT))
        self.mr = MR(self.pd, 2 * BUF, e.IBV_ACCESS_LOCAL_WRITE)
        self.gid_index = gid_index
        self.gid = self.ctx.query_gid(PORT, gid_index)

    def info(self) -> dict[str, Any]:
        return {"qp": self.qp.qp_num, "gid": str(self.gid)}

    def connect(self, peer: dict[str, Any]) -> None:
        from pyverbs.addr import GID

        attr = QPAttr(port_num=PORT)
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        attr.dest_qp_num = peer["qp"]
        attr.rq_psn = attr.sq_psn = 0
        gr = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=0)
        self.qp.to_rts(attr)

    def post_recv(self) -> None:
        self.qp.post_recv(RecvWR(wr_id=1, num_sge=1, sg=[SGE(self.mr.buf + BUF, BUF, self.mr.lkey)]), None)

    def send(self, n: int) -> None:
        self.qp.post_send(SendWR(wr_id=2, opcode=e.IBV_WR_SEND, num_sge=1, sg=[SGE(self.mr.buf, n, self.mr.lkey)],
                                 send_flags=e.IBV_SEND_SIGNALED), None)  # fmt: skip

    def wait(self, count: int) -> None:
        """Busy-poll the CQ from Python until ``count`` completions came (a naive loop)."""
        got = 0
        while got < count:
            n, wcs = self.cq.poll(count - got)
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    raise RuntimeError(f"completion failed: status {wc.status}")
            got += n

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.cq, self.pd, self.ctx):
            obj.close()


def _exchange(sock: socket.socket, mine: dict[str, Any]) -> dict[str, Any]:
    sock.sendall(json.dumps(mine).encode() + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise SystemExit("the peer went away")
        data += chunk
    return json.loads(data)  # type: ignore[no-any-return]


def _client_loop(end: End, round_trips: int, size: int, bulk: int) -> dict[str, float]:
    samples = []
    end.post_recv()
    for _ in range(round_trips):
        t0 = time.perf_counter()
        end.send(size)
        end.wait(2)  # our send's completion and the reply
        end.post_recv()
        samples.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(bulk):
        end.send(BUF)
        end.wait(1)
    end.wait(1)  # the server's "done" SEND
    elapsed = time.perf_counter() - t0
    return {"rtt_us": statistics.median(samples) * 1e6, "bulk_mb_s": bulk * BUF / elapsed / 1e6}


def _server_loop(end: End, round_trips: int, size: int, bulk: int) -> None:
    for _ in range(round_trips):
        end.wait(1)
        end.post_recv()
        end.send(size)
        end.wait(1)
    for _ in range(bulk):
        end.wait(1)
        end.post_recv()
    end.send(1)
    end.wait(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("host", nargs="?")
    parser.add_argument("port", nargs="?", type=int)
    parser.add_argument("--serve", type=int, metavar="PORT")
    parser.add_argument("--local", action="store_true")
    parser.add_argument("--ip", default=None, help="the RDMA address (default: the guest's)")
    parser.add_argument("--round-trips", type=int, default=1000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--bulk", type=int, default=64, help="1 MiB SENDs for the bulk rate")
    args = parser.parse_args()
    from aiordma.testing import rdma_address

    ip = args.ip or args.host or rdma_address()
    if ip is None:
        raise SystemExit("no RDMA address")
    device, gid_index = _device_and_gid(ip)
    if args.local:
        a, b = End(device, gid_index), End(device, gid_index)
        a.connect(b.info())
        b.connect(a.info())
        samples = []
        a.post_recv()
        b.post_recv()
        for _ in range(args.round_trips):
            t0 = time.perf_counter()
            a.send(args.size)
            b.wait(1)
            b.post_recv()
            b.send(args.size)
            a.wait(2)  # our SEND's completion and the reply
            b.wait(1)
            a.post_recv()
            samples.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(args.bulk):
            a.send(BUF)
            b.wait(1)
            b.post_recv()
            a.wait(1)
        elapsed = time.perf_counter() - t0
        print(json.dumps({"rtt_us": statistics.median(samples) * 1e6, "bulk_mb_s": args.bulk * BUF / elapsed / 1e6}))
        a.close()
        b.close()
        return
    if args.serve is not None:
        end = End(device, gid_index)
        with socket.create_server((ip, args.serve)) as lst:
            print(lst.getsockname()[1], flush=True)
            conn, _ = lst.accept()
            with conn:
                end.connect(_exchange(conn, end.info()))
                end.post_recv()
                conn.sendall(b"R")  # ready: the first receive is posted
                _server_loop(end, args.round_trips, args.size, args.bulk)
        end.close()
        return
    end = End(device, gid_index)
    with socket.create_connection((args.host, args.port)) as conn:
        end.connect(_exchange(conn, end.info()))
        conn.recv(1)
        result = _client_loop(end, args.round_trips, args.size, args.bulk)
    print(json.dumps(result))
    end.close()


if __name__ == "__main__":
    main()
