"""Tools for testing aiordma and code that uses it.

* :func:`stream_pair` / :func:`channel_pair` -- connected endpoints over an
  in-memory pipe (``"memory"``: the real protocol, no sockets), over TCP on
  127.0.0.1 (``"tcp"``) or over RDMA (``"rdma"``, needs a device).
* :mod:`aiordma.testing.vm` -- boots the Soft-RoCE guest and runs a command in it.
"""

from ._pairs import MemoryByteStream, channel_pair, memory_byte_stream_pair, rdma_address, stream_pair

__all__ = ["MemoryByteStream", "memory_byte_stream_pair", "stream_pair", "channel_pair", "rdma_address"]
