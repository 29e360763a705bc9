"""Build hook for aiordma's optional native verbs module.

All metadata lives in pyproject.toml; this file only decides whether to build
the cffi extension ``aiordma._verbs_cffi`` (``_native/build_verbs.py``).

It is built when the libibverbs development headers are
available (Debian/Ubuntu: ``apt install libibverbs-dev``;
Fedora/RHEL: ``dnf install rdma-core-devel``).  Without them the install still
succeeds; the module is then simply absent and aiordma uses TCP
(``aiordma._verbs.native_available()`` says why).

Environment variables:

* ``AIORDMA_NO_NATIVE=1``: never build the native module (even with headers).
* ``AIORDMA_REQUIRE_NATIVE=1``: fail the build if the headers are missing.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig

from setuptools import setup

HEADERS = ("infiniband/verbs.h",)


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "no", "false")


def _headers_present() -> tuple[bool, str]:
    """Try to preprocess the two headers with the C compiler Python was built with.

    Falls back to looking in /usr/include when no compiler can be run (then the
    build would fail anyway, but the message is clearer from cffi).
    """
    src = "".join(f"#include <{h}>\n" for h in HEADERS)
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    cflags = shlex.split(os.environ.get("CFLAGS", "")) + shlex.split(os.environ.get("CPPFLAGS", ""))
    try:
        proc = subprocess.run(
            [*cc, *cflags, "-E", "-x", "c", "-o", os.devnull, "-"],
            input=src.encode(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        found = all(os.path.exists(os.path.join("/usr/include", h)) for h in HEADERS)
        return found, f"could not run the C compiler ({exc}); looked in /usr/include"
    if proc.returncode == 0:
        return True, "headers found"
    first = proc.stderr.decode(errors="replace").strip().splitlines()[:1]
    return False, first[0] if first else "preprocessing the headers failed"


def _cffi_modules() -> list[str]:
    if _truthy("AIORDMA_NO_NATIVE"):
        print("aiordma: AIORDMA_NO_NATIVE is set, not building the native verbs module", file=sys.stderr)
        return []
    ok, why = _headers_present()
    if not ok:
        msg = (
            "aiordma: libibverbs headers not found "
            f"({why}); installing without the native verbs module (TCP only)"
        )
        if _truthy("AIORDMA_REQUIRE_NATIVE"):
            raise SystemExit(msg.replace("installing without", "AIORDMA_REQUIRE_NATIVE is set, refusing to install without"))
        print(msg, file=sys.stderr)
        return []
    return ["_native/build_verbs.py:ffibuilder"]


setup(cffi_modules=_cffi_modules())
