"""Opening a connection: the handshake over a TCP link, the transport policy and fallback
reasons (:mod:`.negotiate`), and what a listener may spend on its RDMA clients (:mod:`.limits`).
It is the one layer that brings TCP and RDMA together (the RDMA endpoint is prepared and
switched to here)."""
