"""Hypothesis strategies for property tests of code on aiordma (needs ``hypothesis``:
``pip install aiordma[testing]``).

* :func:`chunkings` -- where a byte stream's receives split and coalesce; apply one with
  :class:`aiordma.testing.Rechunked` (the same example replays the same boundaries, and a
  failure shrinks to a minimal chunking).
* :func:`message_sizes` -- message sizes across every threshold of the RDMA transport (inline,
  one slot, rendezvous) and the receiver's limit, with their neighbours.
* :func:`faults` -- fault schedules (a peer that closes, aborts, dies or resets after step k;
  on the simulated wire also a lost link, RNR, late ACKs and completions) for
  ``stream_pair(kind, faults=...)`` / ``channel_pair``; they fire at the same step on every run.
* :func:`delays` -- how many turns of the event loop each chunk of a memory pair's wire waits
  (``stream_pair("memory", delays=...)``): every interleaving of the two sides, replayable.

See docs/testing-your-code.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from .._proto.protocol import DEFAULT_MAX_MESSAGE_SIZE, HEADER
from .._rdma.config import RdmaConfig
from .._rdma.thresholds import DEFAULT_RENDEZVOUS
from ._faults import FAULT_KINDS, Fault, supported_faults

__all__ = ["chunkings", "message_sizes", "thresholds", "faults", "delays"]


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
    rendezvous = config.rendezvous if config.rendezvous is not None else DEFAULT_RENDEZVOUS
    edges = {config.max_inline - HEADER.size, config.buffer_size - HEADER.size, rendezvous, limit}
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


def faults(kind: str = "memory", *, kinds: Sequence[str] | None = None, max_after: int = 8,
           max_faults: int = 1, sides: Sequence[str] = ("client", "server")) -> st.SearchStrategy[tuple[Fault, ...]]:  # fmt: skip
    """A fault schedule for a pair of ``kind``: 0 to ``max_faults`` :class:`~aiordma.testing.Fault`
    of ``kinds`` (default: every kind that pair can apply, see
    :func:`aiordma.testing.supported_faults`), each on one of ``sides`` after 0 to ``max_after``
    of that side's steps.  Shrinks towards no fault, then the simplest kind (a close) and the
    earliest step -- so a failure that needs a fault names the plainest one that does it."""
    have = supported_faults(kind)
    chosen = list(have) if kinds is None else list(kinds)
    for name in chosen:
        if name not in FAULT_KINDS:
            raise ValueError(f"no fault kind {name!r} (have: {', '.join(FAULT_KINDS)})")
        if name not in have:
            raise ValueError(f"a {kind!r} pair cannot apply {name!r} (it can: {', '.join(have)})")
    ordered = [name for name in FAULT_KINDS if name in chosen]  # (simplest first: what shrinks to)
    one = st.builds(Fault, kind=st.sampled_from(ordered), side=st.sampled_from(list(sides)),
                    after=st.integers(0, max_after))  # fmt: skip
    return st.lists(one, max_size=max_faults).map(tuple)


def delays(*, max_turns: int = 4, max_length: int = 8) -> st.SearchStrategy[tuple[int, ...]]:
    """Turns of the event loop before each chunk a memory pair's wire delivers (cycled; both
    ways): 0 to ``max_turns`` each, 1 to ``max_length`` of them.  Shrinks towards ``(0,)``, a
    wire without delay."""
    return st.lists(st.integers(0, max_turns), min_size=1, max_size=max_length).map(tuple)
