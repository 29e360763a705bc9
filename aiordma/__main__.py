"""``python -m aiordma``: the ``aiordma`` command (see :mod:`aiordma._cli`)."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
