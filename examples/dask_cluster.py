"""A Dask cluster on rdma:// (needs ``pip install 'aiordma[dask]'``).

Starts a LocalCluster of two worker processes whose comms are aiordma message channels, computes
a transpose-and-permute job with dask.array (the workers exchange most chunks), checks it
against numpy, and prints the transport every comm used.  On a host without RDMA (or over
127.0.0.1) the comms fall back to TCP, and each process logs why once (logger
``distributed.comm.rdma``, on stderr).

    python examples/dask_cluster.py [HOST]     # HOST: an address an RDMA device serves

``DASK_DISTRIBUTED__COMM__RDMA__TRANSPORT=rdma`` makes RDMA mandatory (``tcp``: never).
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import dask.array as da
import numpy as np
from distributed import Client, LocalCluster


def comm_transports(dask_worker: Any = None, dask_scheduler: Any = None) -> dict[str, int]:
    """How many rdma:// comms of this process run over each transport."""
    from distributed.comm.core import Comm

    from aiordma._dask import RDMAComm

    return dict(Counter(c.transport for c in list(Comm._instances) if isinstance(c, RDMAComm)))


def fallback_reasons() -> list[str]:
    from distributed.comm.core import Comm

    from aiordma._dask import RDMAComm

    return sorted({c.fallback_reason for c in list(Comm._instances) if isinstance(c, RDMAComm) and c.fallback_reason})


def main() -> None:
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    n = 1200
    perm = np.random.default_rng(1).permutation(n)
    with LocalCluster(
        protocol="rdma://",
        host=host,
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        dashboard_address=None,
        worker_dashboard_address=None,
    ) as cluster, Client(cluster) as client:
        print(f"scheduler at {cluster.scheduler_address}")
        x = da.random.RandomState(0).random((n, n), chunks=300)
        y = (x + x.T).rechunk((n, 100))[perm]
        result = client.compute(y.sum(axis=1)).result()
        x_np = client.compute(x).result()  # (64 chunks of 720 KB come back over rdma://)
        expected = (x_np + x_np.T)[perm].sum(axis=1)
        print(f"result matches numpy: {bool(np.allclose(result, expected))}")
        for where, counts in sorted(client.run(comm_transports).items()):
            print(f"worker {where}: " + ", ".join(f"{t}: {k} comms" for t, k in sorted(counts.items())))
        counts = client.run_on_scheduler(comm_transports)
        print("scheduler: " + ", ".join(f"{t}: {k} comms" for t, k in sorted(counts.items())))
        for reason in fallback_reasons():  # of this (the client's) process
            print(f"fallback reason: {reason}")


if __name__ == "__main__":
    main()
