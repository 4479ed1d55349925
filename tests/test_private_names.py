"""No module uses another module's ``_private`` names (issue 14: narrow interfaces).

A module may use its own private names freely (one class reaching into another class of the same
module is one unit of code). Across modules, only public names: an attribute ``x._name`` is allowed
only when ``_name`` is defined in the module doing the access, and ``from m import _name`` is never
allowed. Generated flatc code (``protocol/fbs``, a test oracle) is not checked.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sbpstream"
SKIP_PARTS = {"fbs"}


def _modules() -> list[Path]:
    files = [*sorted(PACKAGE.rglob("*.py")), ROOT / "pyspark_sbpstream.py"]
    return [f for f in files if not SKIP_PARTS.intersection(f.relative_to(ROOT).parts)]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names this module defines: functions, classes, attributes it assigns, slots."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.add(node.value)  # __slots__ entries, getattr(self, "_x") and the like
    return {n for n in out if _is_private(n)}


def _on_self(node: ast.Attribute) -> bool:
    """``self._x`` / ``cls._x``: a member of this class or one it inherits (a base class's
    protected member is its interface to subclasses)."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def _own_package_module(path: Path, node: ast.ImportFrom, name: str) -> bool:
    """``from sbpstream.client import _sync_support`` inside sbpstream/client: a package-private
    module used by its own package (httpcore's sync generator pattern)."""
    if not path.is_relative_to(ROOT):
        return False
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    return node.module == package and any(
        (path.parent / f"{name}{ext}").exists() for ext in (".py", ".pyx"))


def violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    own = _defined_privates(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _is_private(alias.name) and not _own_package_module(path, node, alias.name):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
        elif (isinstance(node, ast.Attribute) and _is_private(node.attr)
              and node.attr not in own and not _on_self(node)):
            found.append(f"{path.name}:{node.lineno} uses .{node.attr} defined elsewhere")
    return found


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_reach_ins(path: Path) -> None:
    assert violations(path) == []


def test_the_check_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from sbpstream.x import _hidden\n\n"
        "def f(c):\n    return c._pm_call()\n\n"
        "class K:\n    def g(self):\n        return self._own()\n")
    assert len(violations(bad)) == 2
