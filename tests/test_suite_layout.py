"""The suite's own house rules: shared helpers and fixtures live in ``tests/_*.py`` (and
``tests/rdma/_*.py``), never in a test module that others import -- a test module is free to
change, and importing one runs its module-level code (marks, skips) in the importer."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _imported_test_modules(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [module] if module else [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if any(part.startswith("test_") for part in name.split(".")):
                found.append((node.lineno, name))
    return found


def test_no_test_module_imports_another() -> None:
    offenders = [
        f"{path.relative_to(TESTS)}:{line} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in _imported_test_modules(path)
    ]
    assert not offenders, "move what is shared to a tests/_*.py module:\n" + "\n".join(offenders)


def test_the_check_finds_such_an_import(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text("from .test_conformance import KINDS\nimport tests.test_io\nfrom ._kinds import KINDS\n")
    assert [name for _, name in _imported_test_modules(module)] == ["test_conformance", "tests.test_io"]


def test_the_package_does_not_reach_into_the_checkout() -> None:
    """The installed package is lean: the test bed (tools/) and the suite's helpers (tests/) stay
    in the checkout, and nothing in aiordma/ imports them."""
    package = TESTS.parent / "aiordma"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{path.relative_to(package.parent)}:{node.lineno} imports {name}"
                          for name in names if name.split(".")[0] in ("tools", "tests")]
    assert not offenders, "\n".join(offenders)
    assert not (package / "testing" / "vm.py").exists()
