"""The RDMA transport, one module per concern.

* ``session``  -- sans-IO: credits, queue budgets, signaling, completion decoding
* ``datapath`` -- what the link asks of a session (``DataPath``); ``checked`` (the sans-IO session on its QP) and ``fastpath`` (C) are the two
* ``credits``, ``params``, ``states``, ``liveness``, ``thresholds`` -- sans-IO pieces (flow control, the HELLO codec, the link life cycle, the liveness probe's schedule and plan per path, the rendezvous threshold measured per device and where it is kept)
* ``device``   -- the per-loop device context (context, PD, channel, CQ), reference-counted
* ``poller``   -- the push poller on the completion channel fd, routing by qp_num
* ``link``     -- the thin glue: Core <-> session <-> QP, bring-up, probe and teardown
* ``resources``, ``remote``, ``watch`` -- the link's collaborators: the QP, rings and routing (set-up and teardown); one-sided operations and rendezvous (``Core.nic``); the watch over the peer (TCP after the switch, goodbye, liveness probes)
* ``discovery``-- sysfs discovery and the "is RDMA usable here" probe
* ``verbs``    -- the native binding (loaded only when RDMA is first used); ``constants`` has what needs no native code
* ``config``   -- ``RdmaConfig``, the injectable ``RdmaBackend``, ``RdmaSetupError``

Importing this package loads no native code: ``link`` (and with it
``verbs``) is imported by the handshake only when a connection offers RDMA.
"""

from .config import NativeProvider, RdmaBackend, RdmaConfig, RdmaSetupError

__all__ = ["RdmaBackend", "RdmaConfig", "RdmaSetupError", "NativeProvider"]
