"""Hypothesis strategies for property tests of code on aiordma (needs ``hypothesis``:
``pip install aiordma[testing]``).

* :func:`chunkings` -- where a byte stream's receives split and coalesce; apply one with
  :class:`aiordma.testing.Rechunked` (the same example replays the same boundaries, and a
  failure shrinks to a minimal chunking).
* :func:`message_sizes` -- message sizes across every threshold of the RDMA transport (inline,
  one slot, rendezvous) and the receiver's limit, with their neighbours.

See docs/testing-your-code.md.
"""

from __future__ import annotations

from hypothesis import strategies as st

from .._proto.protocol import DEFAULT_MAX_MESSAGE_SIZE, HEADER
from .._rdma.config import RdmaConfig

__all__ = ["chunkings", "message_sizes", "thresholds"]


def chunkings(*, max_chunk: int = 4096, max_length: int = 8) -> st.SearchStrategy[tuple[int, ...]]:
    """Receive sizes, used in turn (cycled) by :class:`aiordma.testing.Rechunked`: 1 to
    ``max_chunk`` bytes each, 1 to ``max_length`` of them.  Shrinks towards ``(1,)``."""
    return st.lists(st.integers(1, max_chunk), min_size=1, max_size=max_length).map(tuple)


def thresholds(config: RdmaConfig | None = None, *, limit: int = DEFAULT_MAX_MESSAGE_SIZE) -> list[int]:
    """The payload sizes where the RDMA transport changes how a message travels under
    ``config`` (default: ``RdmaConfig()``) -- sent inline, in one slot, by rendezvous -- and
    ``limit`` (the receiver's ``max_message_size``), each with its neighbours, plus 0 and 1;
    sorted, within 0..``limit``."""
    config = config or RdmaConfig()
    edges = {config.max_inline - HEADER.size, config.buffer_size - HEADER.size, config.rendezvous, limit}
    sizes = {0, 1}
    for edge in edges:
        sizes.update((edge - 1, edge, edge + 1))
    return sorted(size for size in sizes if 0 <= size <= limit)


def message_sizes(config: RdmaConfig | None = None, *, limit: int = DEFAULT_MAX_MESSAGE_SIZE,
                  max_size: int | None = None) -> st.SearchStrategy[int]:  # fmt: skip
    """A message size: one of :func:`thresholds` half the time, else any size up to
    ``max_size`` (default: ``limit``; keep it small where time matters).  Shrinks towards 0."""
    top = limit if max_size is None else min(max_size, limit)
    edges = [size for size in thresholds(config, limit=limit) if size <= top]
    return st.one_of(st.sampled_from(edges), st.integers(0, top))
