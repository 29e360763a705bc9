"""Tools for testing aiordma and code that uses it.

* :func:`stream_pair` / :func:`channel_pair` -- connected endpoints over an
  in-memory pipe (``"memory"``: the real protocol, no sockets), over TCP on
  127.0.0.1 (``"tcp"``) or over RDMA (``"rdma"``, needs a device).
  ``"sim"`` runs the real RDMA transport over the simulated RC wire (any host).
  Both ends are closed on exit with :func:`aclose_together` (concurrently: a close waits
  until its peer has everything, so one task must not close a sender before its reader).
* :func:`simulated_backend` / :class:`SimFabric` -- the simulated RC wire: verbs
  objects with RC semantics (ordered completions, queue limits, RNR, flushes,
  a completion channel fd that really becomes readable) and fault knobs.
* :class:`Rechunked` and :mod:`aiordma.testing.strategies` (hypothesis) -- a byte stream whose
  receives split and coalesce where a drawn chunking says, message sizes across every threshold,
  delays of a memory pair's wire, and fault schedules (:class:`Fault`: a peer that closes, aborts,
  dies or resets after step k; a lost link, RNR, late ACKs or completions on the simulated wire)
  that the pairs apply at the same step on every run.
* :mod:`aiordma.testing.plugin` -- a pytest plugin (``-p aiordma.testing.plugin``): pair
  fixtures of every kind this host can make, checked for leaks after each test.

The Soft-RoCE test bed (``python -m tools.vm``) and the far end of the two-host tests live in the
checkout's ``tools/``, outside the installed package.
"""

from ._chunking import Rechunked
from ._faults import FAULT_KINDS, Fault, supported_faults
from ._pairs import MemoryByteStream, aclose_together, channel_pair, memory_byte_stream_pair, rdma_address, stream_pair
from ._sim import SimFabric, SimProvider, simulated_backend

__all__ = [
    "MemoryByteStream",
    "memory_byte_stream_pair",
    "stream_pair",
    "channel_pair",
    "rdma_address",
    "aclose_together",
    "Rechunked",
    "Fault",
    "FAULT_KINDS",
    "supported_faults",
    "SimFabric",
    "SimProvider",
    "simulated_backend",
]
