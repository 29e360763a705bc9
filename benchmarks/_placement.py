"""Where a two-process benchmark's processes run: pinned, so that a ratio compares work, not luck.

On a small machine (CI's and ours: 2 vCPUs) the scheduler places a client and its server on one
CPU in one run and on two in the next; a round trip between two processes on one CPU costs
about 20 us, between two CPUs (a vCPU woken from idle) 70-120 us.  Left to the scheduler, one
contender of a benchmark got one placement and the other the other: the same asyncio TCP echo
measured 21 us in one run and 65 us in the next, and the ratios swung by 2x.  So each side pins
itself (``AIORDMA_BENCH_PIN``):

* ``split`` (the default): the client on the first CPU, every server on the second -- two
  machines' worth of separation, as a deployment has it;
* ``same``: both on the first CPU (the work per round trip, with no wake-up latency in it);
* ``none``: the scheduler decides (as before).

With one CPU there is nothing to choose.  The benchmark prints the placement it used.
"""

from __future__ import annotations

import os

__all__ = ["pin", "placement"]


def _cpus() -> list[int]:
    """The CPUs this benchmark may use: as the first process found them (its children inherit
    the client's pinning, so it passes the set on)."""
    known = os.environ.get("AIORDMA_BENCH_CPUS")
    if known:
        return [int(c) for c in known.split(",")]
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["AIORDMA_BENCH_CPUS"] = ",".join(map(str, cpus))
    return cpus


def placement() -> str:
    mode = os.environ.get("AIORDMA_BENCH_PIN", "split")
    if mode not in ("split", "same", "none"):
        raise SystemExit(f"AIORDMA_BENCH_PIN={mode!r}: split, same or none")
    if len(_cpus()) < 2 and mode != "none":
        return "one CPU"
    return mode


def pin(role: str) -> None:
    """Pin this process as ``role`` ("client" or "server") says, per :func:`placement`."""
    mode = placement()
    if mode in ("none", "one CPU"):
        if mode == "none" and "AIORDMA_BENCH_CPUS" in os.environ:
            os.sched_setaffinity(0, set(_cpus()))  # (a child of a pinned client: as the machine has it)
        return
    cpus = _cpus()
    cpu = cpus[1] if mode == "split" and role == "server" else cpus[0]
    os.sched_setaffinity(0, {cpu})
