"""The package's layers: each imports only layers below it (or its own), and no module imports
itself back through others.

From the bottom (docs/architecture.md draws it):

0. ``_errors``, ``_attributes`` -- what every layer names;
1. ``_proto/`` (sans-IO: wire protocol, state tables, one-sided rules, admission) and ``_io/``
   (event-loop backends);
2. ``_conn/`` -- the connection core (``Core``, the ``Link`` contract), registered memory,
   one-sided operations over a Core;
3. the transports: ``_rdma/`` (RDMA: session, device, poller, link, verbs) and ``_tcp/`` (the
   TCP links, accepting); neither imports the other;
4. ``_handshake/`` -- opening a connection: the handshake, the transport policy, listener
   limits (where TCP and RDMA meet);
5. the front ends: ``_api`` (anyio streams and channels), ``asyncio`` and ``_transport``,
   ``grpc``, ``_dask/``, ``_perf``;
6. the package itself, its command line and ``testing/``.

Every import counts, also one inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "aiordma"

LAYERS: list[tuple[int, str]] = [
    (0, "aiordma._errors"),
    (0, "aiordma._attributes"),
    (1, "aiordma._proto"),
    (1, "aiordma._io"),
    (2, "aiordma._conn"),
    (3, "aiordma._rdma"),
    (3, "aiordma._verbs_cffi"),
    (3, "aiordma._tcp"),
    (4, "aiordma._handshake"),
    (5, "aiordma._api"),
    (5, "aiordma._transport"),
    (5, "aiordma.asyncio"),
    (5, "aiordma.grpc"),
    (5, "aiordma._dask"),
    (5, "aiordma._perf"),
    (5, "aiordma.metrics"),
    (6, "aiordma._cli"),
    (6, "aiordma.testing"),
    (6, "aiordma.__main__"),
    (6, "aiordma"),
]
#: packages of one layer that must not import each other
SIBLINGS_APART = [("aiordma._rdma", "aiordma._tcp"), ("aiordma._proto", "aiordma._io")]


def layer_of(module: str) -> tuple[int, str]:
    best: tuple[int, str] | None = None
    for layer, prefix in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[1]):
                best = (layer, prefix)
    assert best is not None, f"{module} is in no layer: add it to tests/test_layers.py (and the docs)"
    return best


def module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """The aiordma modules ``path`` imports (every import, lazy ones too), with their lines."""
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "aiordma"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "aiordma":
                continue
            if node.module is None or node.level and not node.module:
                # "from . import x": x may be a module of the package
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    out.append((sub if _exists(sub) else target, node.lineno))
            else:
                out.append((target, node.lineno))
    return out


def _exists(module: str) -> bool:
    rel = Path(*module.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").exists() or (PACKAGE.parent / rel / "__init__.py").exists()


def _modules() -> dict[str, Path]:
    return {module_of(p): p for p in PACKAGE.rglob("*.py")}


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    for module, path in _modules().items():
        mine, my_prefix = layer_of(module)
        for target, line in imports_of(path):
            theirs, their_prefix = layer_of(target)
            if theirs > mine:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} (layer {mine}) imports "
                             f"{target} (layer {theirs})")  # fmt: skip
            if {my_prefix, their_prefix} in [set(pair) for pair in SIBLINGS_APART] and my_prefix != their_prefix:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {my_prefix} imports {their_prefix}")
    assert not wrong, "imports that climb:\n" + "\n".join(wrong)


def test_no_module_imports_itself_back() -> None:
    modules = _modules()
    graph = {m: {t for t, _ in imports_of(p) if t in modules and t != m} for m, p in modules.items()}
    # (a package's __init__ re-exporting its modules, and those importing siblings, is no circle of
    # concern only when the __init__ is not imported back: checked like the rest)
    state: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(stack[stack.index(t) :] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # a package importing its own parent package (``from .. import x``) is the usual Python
    # re-export pattern only at the top: aiordma/__init__.py is imported by nothing inside
    circles = [c for c in circles if "aiordma" not in c]
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
