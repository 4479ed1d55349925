"""The protocol and records layers do no I/O: no module of them imports an I/O module, directly
or through the sbpstream modules it imports (read from their source), and importing all of them
in a fresh interpreter loads no I/O module beyond what their third-party codecs load."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import sbpstream

PURE_PACKAGES = ("sbpstream.protocol", "sbpstream.records")

BUILD_TOOLS = frozenset({"sbpstream.protocol.flatc", "sbpstream.protocol.codegen"})
"""Not runtime code: ``flatc`` runs the schema compiler (a subprocess) to regenerate
``tests/sbp_fbs``; ``codegen`` rewrites ``protocol/generated.py`` and ``Sbp.java``. No runtime
module may import them (checked)."""

IO_MODULES = frozenset({
    "asyncio", "socket", "_socket", "ssl", "selectors", "select", "subprocess", "threading",
    "_thread", "multiprocessing", "concurrent", "mmap", "tempfile", "shutil", "uvloop",
    "sqlite3", "urllib", "http", "signal", "fcntl", "pathlib", "glob", "io",
})
"""Networking, processes, threads, event loops, signals, memory maps, files and paths (top-level
names: ``concurrent`` covers concurrent.futures). The source check also refuses ``os``; the
import check cannot (the interpreter loads ``os`` and ``io`` at start-up)."""

SOURCE_ONLY = frozenset({"os"})

ALLOWED_USES = {"threading": frozenset({"local"}), "os": frozenset({"environ"})}
"""Uses of a refused module that do no I/O: records.compression keeps one zstd context per
thread (``threading.local``), since the contexts are not thread-safe. Nothing else of
``threading`` may be used (no thread is started, no lock taken). records.reader reads one
environment variable at import (``SBPSTREAM_PURE_PYTHON``: use the pure-Python decode loop even
where the compiled one was built); nothing else of ``os``."""

PACKAGE_ROOT = Path(sbpstream.__file__).resolve().parent


def _module_path(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for candidate in (PACKAGE_ROOT / rel.with_suffix(".py"), PACKAGE_ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(name: str) -> Iterator[str]:
    """Every module an import statement of ``name`` names (function-level imports too)."""
    path = _module_path(name)
    assert path is not None, name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield base
            for alias in node.names:  # `from pkg import module`
                if _module_path(f"{base}.{alias.name}") is not None and base.startswith(
                        "sbpstream"):
                    yield f"{base}.{alias.name}"


def _pure_modules() -> list[str]:
    out = []
    for pkg in PURE_PACKAGES:
        root = PACKAGE_ROOT / pkg.split(".")[1]
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if not any(name == t or name.startswith(t + ".") for t in BUILD_TOOLS):
                out.append(name)
    return out


def _closure(roots: list[str]) -> dict[str, set[str]]:
    """Module -> names it imports, over ``roots`` and every sbpstream module they reach."""
    seen: dict[str, set[str]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = set(_imports(name))
        todo += [m for m in seen[name] if m.startswith("sbpstream.") and _module_path(m)]
    return seen


def _only_allowed_uses(name: str, module: str) -> bool:
    """``module`` is imported as a whole by ``name`` and used only as ALLOWED_USES says."""
    allowed = ALLOWED_USES.get(module)
    if allowed is None:
        return False
    path = _module_path(name)
    assert path is not None
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == module:
            return False
    uses = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == module}
    return uses <= allowed


def test_protocol_and_records_source_imports_no_io_module() -> None:
    modules = _pure_modules()
    assert "sbpstream.protocol.messages" in modules and "sbpstream.records.reader" in modules
    graph = _closure(modules)
    bad = {m: sorted(n for n in names if n.split(".")[0] in IO_MODULES | SOURCE_ONLY
                     and not _only_allowed_uses(m, n))
           for m, names in graph.items()}
    assert {m: b for m, b in bad.items() if b} == {}
    reached = set(graph)
    assert not reached & BUILD_TOOLS, "runtime code imports a build tool"
    outside = sorted(m for m in reached if not m.startswith(PURE_PACKAGES))
    assert outside == [] or all(m == "sbpstream" for m in outside), outside


def test_the_source_check_sees_an_io_import() -> None:
    """The same reading of the net layer finds its I/O (the guard can fail)."""
    names = set(_imports("sbpstream.net.client"))
    assert "asyncio" in names


_PROBE = """
import importlib, json, pkgutil, sys
third_party = [m for m in sys.argv[1].split(",") if m]
for m in third_party:
    importlib.import_module(m)
baseline = set(sys.modules)
for name in sys.argv[2:]:
    importlib.import_module(name)
print(json.dumps(sorted(set(sys.modules) - baseline)))
"""


@pytest.mark.integration  # it starts an interpreter; what it checks is pure code
def test_importing_them_loads_no_io_module() -> None:
    modules = _pure_modules()
    third_party = sorted({n.split(".")[0] for names in _closure(modules).values() for n in names
                          if not n.startswith("sbpstream") and n.split(".")[0]
                          not in sys.stdlib_module_names})
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, ",".join(third_party), *modules],
        capture_output=True, text=True, timeout=120, check=True, cwd=PACKAGE_ROOT.parent,
    )
    added = set(json.loads(out.stdout))
    assert "sbpstream.protocol.messages" in added
    assert sorted(m for m in added if m.split(".")[0] in IO_MODULES - ALLOWED_USES.keys()) == []
