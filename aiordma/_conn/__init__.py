"""The connection core, below every transport: :mod:`.core` (the ``Core`` of one connection
and the ``Link`` contract every transport implements), :mod:`.memory` (registered memory) and
:mod:`.remote` (one-sided operations and rendezvous over a Core, the async glue of
:mod:`aiordma._proto.onesided`).  It knows links only through the ``Link`` contract."""
