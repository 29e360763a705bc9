"""aiordma's development tools, outside the installed package: the Soft-RoCE test bed
(``python -m tools.vm``: a qemu guest with rdma_rxe, one or two hosts on one wire; ``_guest.py``
is its side inside the guest) and the far end of the two-host tests (``tools.peer``,
``tools.remote_end``).  ``scripts/test`` and ``scripts/twohost`` use them from the checkout."""
