"""The sans-IO layer: everything that decides without doing I/O.

* :mod:`.protocol` -- the wire protocol (handshake, framing, limits) as an object that takes
  bytes and time and gives bytes and events;
* :mod:`.states` -- its state machines, as tables;
* :mod:`.onesided` -- the rules of one-sided memory (exposures, descriptors, revocation,
  rendezvous descriptors) and the MEMORY frame;
* :mod:`.admission` -- a listener's admission: who gets a handshake, when.

Nothing here imports an event loop, a socket or verbs; it imports only :mod:`aiordma._errors`.
"""
