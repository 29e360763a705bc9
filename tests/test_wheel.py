"""The wheel: built with a C compiler alone, installed bare, every import declared.

* ``pip wheel .`` with rdma-core's headers hidden from the compiler (a mount namespace puts an
  empty directory over ``/usr/include/infiniband`` and ``/usr/include/rdma``): the native module
  builds against the declarations the project carries (``_native/include``) and does not link
  libibverbs (it links against a stub built on the spot that carries libibverbs' soname and
  symbol versions: the real library is found at run time);
* that wheel in a fresh venv with no extras: ``import aiordma``, a TCP echo under asyncio,
  ``aiordma info`` saying why there is no RDMA here.  The guest stage installs the same wheel and
  runs RDMA with it (``tests/rdma/test_wheel.py``);
* every third-party module the package imports is a declared dependency, or an extra's, imported
  only where that extra is needed and with a message naming it.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: where the wheel goes (the guest stage installs it from here)
WHEEL_DIR = ROOT / "build" / "wheel-test"

#: third-party module -> the requirement that provides it
PROVIDERS = {
    "anyio": "anyio", "cffi": "cffi", "sniffio": "sniffio", "trio": "trio", "uvloop": "uvloop",
    "grpclib": "grpclib", "distributed": "distributed", "dask": "distributed", "rich": "rich",
    "matplotlib": "matplotlib", "prometheus_client": "prometheus_client",
}  # fmt: skip
#: modules of an extra, and the only places that import them (each says which extra it needs)
OPTIONAL_AT = {
    "trio": {"aiordma/_io/backends.py"},  # (only under trio: it is running, so it is installed)
    "uvloop": {"aiordma/_cli/common.py"},
    "grpclib": {"aiordma/grpc.py"},
    "distributed": {"aiordma/_dask/__init__.py", "aiordma/_dask/comm.py", "aiordma/_dask/framing.py",
                    "aiordma/_dask/listener.py"},
    "dask": {"aiordma/_dask/comm.py", "aiordma/_dask/listener.py"},
    "rich": {"aiordma/_perf.py"},
    "matplotlib": {"aiordma/_perf.py"},
    "prometheus_client": {"aiordma/metrics.py"},
}  # fmt: skip


def _requirements() -> tuple[set[str], dict[str, set[str]]]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def name(req: str) -> str:
        return req.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()

    base = {name(r) for r in meta["dependencies"]}
    extras = {extra: {name(r) for r in reqs} for extra, reqs in meta["optional-dependencies"].items()}
    return base, extras


def test_every_import_is_declared() -> None:
    base, extras = _requirements()
    optional = set().union(*extras.values())
    found: dict[str, set[str]] = {}
    for path in (ROOT / "aiordma").rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for n in names:
                top = n.split(".")[0]
                if top not in sys.stdlib_module_names and top != "aiordma":
                    found.setdefault(top, set()).add(rel)
    for module, places in found.items():
        if module.startswith("_"):  # (the native module's own backend, cffi's)
            continue
        if rel_in_testing(places):
            continue
        assert module in PROVIDERS, f"{module} (imported in {sorted(places)}) is not a known dependency"
        req = PROVIDERS[module]
        if req in base:
            continue
        assert req in optional, f"{module} is neither a dependency nor an extra's (imported in {sorted(places)})"
        stray = places - OPTIONAL_AT.get(module, set())
        assert not stray, f"{module} (an extra's) is imported in {sorted(stray)}"
    for path in ("aiordma/grpc.py", "aiordma/_dask/__init__.py", "aiordma/metrics.py"):
        assert "pip install 'aiordma[" in (ROOT / path).read_text(), f"{path} must name its extra"


def rel_in_testing(places: set[str]) -> bool:
    """aiordma.testing is for tests: its imports (hypothesis, pyverbs...) are the test extra's."""
    return all(p.startswith("aiordma/testing/") for p in places)


def _can_hide_headers() -> str:
    if os.geteuid() != 0:
        return "needs root (a mount namespace hides rdma-core's headers)"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    return ""


@pytest.mark.slow
@pytest.mark.skipif(bool(_can_hide_headers()), reason=_can_hide_headers() or "-")
def test_the_wheel_builds_without_rdma_core_and_installs_bare(tmp_path: Path) -> None:
    shutil.rmtree(WHEEL_DIR, ignore_errors=True)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.so", "__pycache__",
                                                             ".hypothesis", ".mypy_cache", ".scratch", "dist"))  # fmt: skip
    hide = " && ".join(f"mount -t tmpfs none {d}" for d in ("/usr/include/infiniband", "/usr/include/rdma")
                       if os.path.isdir(d))  # fmt: skip
    build = (f"{hide} && test ! -e /usr/include/infiniband/verbs.h && "
             f"{sys.executable} -m pip wheel -q --no-deps -w {WHEEL_DIR} {src}")  # fmt: skip
    out = subprocess.run(["unshare", "-m", "sh", "-c", build], capture_output=True, text=True, timeout=900,
                         env={**os.environ, "AIORDMA_REQUIRE_NATIVE": "1"})  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    wheels = list(WHEEL_DIR.glob("aiordma-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    out = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheels[0])], capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    so = next((venv / "lib").rglob("_verbs_cffi*.so"))
    dynamic = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
    # linked against the build's stub: the real library by its soname, found by the loader here
    assert "Shared library: [libibverbs.so.1]" in dynamic and "ibverbs-stub" not in dynamic, dynamic
    verbs = [s for s in _dynamic_symbols(str(so)) if "ibv_" in s]
    assert verbs and all("@IBVERBS_" in s for s in verbs), verbs
    script = r"""
import sys, anyio, aiordma
from aiordma._rdma import verbs
assert verbs._lib is not None, verbs._IMPORT_REASON   # the native module loads (libibverbs1 is here)
async def main():
    async def handler(s):
        async with s:
            await s.send(await s.receive())
    listener = await aiordma.create_listener("127.0.0.1", 0)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, handler)
        async with await aiordma.connect("127.0.0.1", listener.port) as c:
            await c.send(b"bare")
            assert await c.receive() == b"bare"
            print("echo", c.transport)
        tg.cancel_scope.cancel()
anyio.run(main, backend="asyncio")
extras = sorted(m for m in ("trio", "uvloop", "distributed", "grpclib", "rich", "matplotlib", "hypothesis",
                            "prometheus_client")
                if m in sys.modules)
print("extras imported:", extras)
"""
    out = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "echo tcp" in out.stdout and "extras imported: []" in out.stdout, out.stdout
    info = subprocess.run([str(venv / "bin" / "aiordma"), "info"], capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr
    assert "RDMA usable: no" in info.stdout and "auto would use: tcp" in info.stdout, info.stdout


def _dynamic_symbols(path: str) -> list[str]:
    out = subprocess.run(["readelf", "--dyn-syms", "-W", path], capture_output=True, text=True, check=True).stdout
    return [line.split()[7] for line in out.splitlines() if len(line.split()) >= 8 and " UND " in line]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf (binutils)")
def test_the_native_module_asks_for_each_verb_by_its_version() -> None:
    """Each libibverbs function the module calls is a versioned reference, the version the real
    library gives as its default: an unversioned one binds to libibverbs' 1.0 compatibility ABI
    at run time (another ``struct ibv_context``: the fds read from it were garbage on rxe)."""
    try:
        import aiordma._verbs_cffi as mod
    except ImportError as exc:
        pytest.skip(f"the native module is not importable here: {exc}")
    sys.path.insert(0, str(ROOT / "_native"))
    try:
        from build_verbs import SYMBOL_VERSIONS
    finally:
        sys.path.remove(str(ROOT / "_native"))
    wanted = {f"{name}@{version}" for version, names in SYMBOL_VERSIONS.items() for name in names}
    verbs = [s for s in _dynamic_symbols(str(mod.__file__)) if "ibv_" in s]
    assert verbs and all("@IBVERBS_" in s for s in verbs), [s for s in verbs if "@" not in s]
    assert set(verbs) <= wanted, sorted(set(verbs) - wanted)
    real = Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1")
    if real.exists():  # the stub's versions are the real library's defaults
        dump = subprocess.run(["objdump", "-T", str(real)], capture_output=True, text=True, check=True).stdout
        defaults = {f"{f[-1]}@{f[-2]}" for f in (line.split() for line in dump.splitlines())
                    if len(f) >= 7 and f[-2].startswith("IBVERBS_")}  # fmt: skip
        assert set(verbs) <= defaults, sorted(set(verbs) - defaults)
