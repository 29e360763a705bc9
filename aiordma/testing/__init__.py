"""Tools for testing aiordma: the Soft-RoCE VM runner lives in :mod:`aiordma.testing.vm`."""
