"""Event-loop backends (asyncio, uvloop, trio): fd watchers, parking, checkpoints, timers
(:mod:`.backends`), injectable per loop in the spirit of httpcore's ``_backends``."""
