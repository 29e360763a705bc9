"""``aiordma info --measure-rendezvous``: measure where the rendezvous starts to pay on each
RDMA device of this host, and keep it (``aiordma/_rdma/thresholds.py`` has the why).

For each device with an ACTIVE RoCEv2 port, in one process and one event loop: a listener on the
device's address and two client connections to it over RDMA -- one sending every size by
rendezvous (``RdmaConfig(rendezvous=4096)``), one by SEND slots (``rendezvous=0``).  For each size
(64 KiB .. 16 MiB by default) each connection sends the same ``bytes`` messages and the peer takes
each with ``receive()`` (the default path: what a user who sends ``bytes`` gets); the faster of two
rounds counts.  The threshold is the smallest size from which the rendezvous kept up at every
larger size (:func:`aiordma._rdma.thresholds.crossover`).  Connections on that device then use it
unless their ``RdmaConfig.rendezvous`` says otherwise.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio

__all__ = ["Calibration", "measure_device", "measure_all", "DEFAULT_SIZES"]

#: the sizes measured by default (powers of four: 64 KiB .. 16 MiB)
DEFAULT_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
#: bytes each size sends per round and way (at least two messages)
ROUND_BYTES = 32 << 20


@dataclass
class Calibration:
    """What one device measured."""

    device: str
    key: str
    address: str
    threshold: int
    #: size -> (MB/s by rendezvous, MB/s by SEND slots)
    table: dict[int, tuple[float, float]]
    path: str = ""


def device_key_of(name: str) -> str:
    """The key device ``name``'s measurement is kept under (it opens the device once)."""
    from .._rdma.thresholds import device_key
    from .._rdma.verbs import Context

    with Context(name) as ctx:
        return device_key(name, ctx.query_device())


async def _rate(address: str, port: int, rendezvous: int, size: int, rounds: int) -> float:
    """MB/s of ``size``-byte messages over a new connection whose sender uses ``rendezvous``."""
    import aiordma

    backend = aiordma.RdmaBackend(aiordma.RdmaConfig(rendezvous=rendezvous))
    count = max(2, ROUND_BYTES // size)
    payload = os.urandom(size)
    best = 0.0
    async with await aiordma.connect_channel(address, port, transport="rdma", rdma_backend=backend,
                                             max_message_size=max(size, 1 << 20)) as channel:  # fmt: skip
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(count):
                await channel.send(payload)
            await channel.receive()  # (the peer's word that it has them all)
            took = time.perf_counter() - started
            best = max(best, count * size / took / 1e6)
    return best


async def measure_device(name: str, address: str, sizes: Sequence[int] = DEFAULT_SIZES, rounds: int = 2) -> Calibration:
    """Measure device ``name`` (serving ``address``) over a connection to itself."""
    import aiordma

    from .._rdma.thresholds import Measured, crossover, save

    largest = max(sizes)

    async def serve(channel: aiordma.Channel) -> None:
        async with channel:
            while True:
                try:
                    first = await channel.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
                count = max(2, ROUND_BYTES // len(first))
                for _ in range(count - 1):
                    await channel.receive()
                await channel.send(b"ok")

    listener = await aiordma.create_channel_listener(address, 0, transport="rdma",
                                                     max_message_size=max(largest, 1 << 20))  # fmt: skip
    table: dict[int, tuple[float, float]] = {}
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        port = listener.port
        for size in sorted(sizes):
            by_rendezvous = await _rate(address, port, 4096, size, rounds)
            by_slots = await _rate(address, port, 0, size, rounds)
            table[size] = (round(by_rendezvous, 1), round(by_slots, 1))
        tg.cancel_scope.cancel()
    ordered = sorted(table)
    threshold = crossover(ordered, [table[s][0] for s in ordered], [table[s][1] for s in ordered])
    key = device_key_of(name)
    path = save(key, Measured(threshold, time.time(), table))
    return Calibration(name, key, address, threshold, table, str(path))


async def measure_all(only: str | None = None, sizes: Sequence[int] = DEFAULT_SIZES) -> list[Calibration]:
    """Measure every device with an address (or only device ``only``)."""
    from .._rdma.discovery import device_addresses

    results = []
    for name, address in device_addresses():
        if only is None or name == only:
            results.append(await measure_device(name, address, sizes))
    return results
