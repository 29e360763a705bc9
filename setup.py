"""Build hook for aiordma's native verbs module.

All metadata lives in pyproject.toml; this file only decides whether to build
the cffi extension ``aiordma._verbs_cffi`` (``_native/build_verbs.py``).

It needs a C compiler and nothing else: the verbs declarations are carried in
``_native/include`` (copies of rdma-core's public headers, see its NOTICE) and
the module is linked against a stub ``libibverbs.so.1`` built on the spot (rdma-core's
soname and symbol versions, ``_native/build_verbs.py``): the real one is found at run time.
So ``pip wheel .`` gives one wheel that imports on any Linux host; a host
without libibverbs (or without an RDMA device) runs on TCP and says why
(``aiordma info``).

Environment variables:

* ``AIORDMA_NO_NATIVE=1``: never build the native module.
* ``AIORDMA_REQUIRE_NATIVE=1``: fail the build if no C compiler can build it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig

from setuptools import setup


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "no", "false")


def _compiler_works() -> tuple[bool, str]:
    """Whether the C compiler Python was built with (or ``$CC``) runs at all."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    try:
        proc = subprocess.run([*cc, "-E", "-x", "c", "-o", os.devnull, "-"], input=b"int x;\n",
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60, check=False)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return False, f"could not run the C compiler ({exc})"
    if proc.returncode:
        return False, proc.stderr.decode(errors="replace").strip().splitlines()[0] if proc.stderr else "it failed"
    return True, ""


def _cffi_modules() -> list[str]:
    if _truthy("AIORDMA_NO_NATIVE"):
        print("aiordma: AIORDMA_NO_NATIVE is set, not building the native verbs module", file=sys.stderr)
        return []
    ok, why = _compiler_works()
    if not ok:
        msg = f"aiordma: no C compiler ({why}); installing without the native verbs module (TCP only)"
        if _truthy("AIORDMA_REQUIRE_NATIVE"):
            raise SystemExit(msg.replace("installing without", "AIORDMA_REQUIRE_NATIVE is set, refusing to install without"))
        print(msg, file=sys.stderr)
        return []
    return ["_native/build_verbs.py:ffibuilder"]


setup(cffi_modules=_cffi_modules())
