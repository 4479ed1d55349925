"""No import circle inside the packages listed in ACYCLIC (issue 32).

Every import statement counts: module-level, inside functions and under ``if TYPE_CHECKING``
(a type-only import is still a dependency of the design; a circle hidden behind it is one the
reader must untangle). The graph is read from the source with :mod:`ast`, nothing is imported.
An edge goes to the module an import names (``from a.b import c`` is ``a.b.c`` when that is a
module, else ``a.b``); the implicit import of parent packages is not an edge.

To widen the check, add a package prefix to ACYCLIC (``"sbpstream"`` for the whole package).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sbpstream"

ACYCLIC = ["sbpstream"]
"""Package prefixes whose modules must not import each other in a circle."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))
            if "fbs" not in p.relative_to(ROOT).parts}


@functools.cache
def _extensions() -> frozenset[str]:
    """Compiled modules (``_speedups.pyx`` and the like), by dotted name."""
    return frozenset(_module_name(p.with_suffix(".py")) for p in PACKAGE.rglob("*.pyx"))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The sbpstream modules ``name`` (at ``path``) imports, by any import statement."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in _extensions():
                    continue  # a compiled module (Cython): it imports nothing of ours
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph(prefix: str) -> dict[str, set[str]]:
    """Import edges among the modules named ``prefix`` or ``prefix.*``."""
    modules = _all_modules()
    known = set(modules)

    def inside(m: str) -> bool:
        return m == prefix or m.startswith(prefix + ".")

    return {m: {d for d in imports_of(m, p, known) if inside(d)}
            for m, p in modules.items() if inside(m)}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                return [*path[path.index(d):], d]
            if d not in state and (found := visit(d)) is not None:
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_type_checking_and_function_imports_count(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.a\n"
                   "def f():\n    from x import b\n")
    assert imports_of("x.m", src, {"x", "x.a", "x.b", "x.m"}) == {"x.a", "x.b"}


@pytest.mark.parametrize("prefix", ACYCLIC)
def test_no_import_cycle(prefix: str) -> None:
    edges = graph(prefix)
    assert edges, f"no modules under {prefix}"
    cycle = find_cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


LAYERS: dict[str, int] = {
    "sbpstream": 0, "protocol": 0, "private_files": 0, "console": 0, "records": 1,
    "net": 2, "auth": 3, "quota": 4, "store": 4, "introspect": 5,
    "client": 6, "datanode": 6, "pm": 6, "cluster": 6,
    "kafka": 7, "spark": 7, "tools": 7,
    "cli": 8,
}
"""Each top-level package's layer (docs/architecture.md, "Layers"): a module imports only from
its own package or a lower layer. ``__main__`` modules are entry points (``python -m
sbpstream.pm`` runs the CLI's command), outside the layers."""


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_every_package_has_a_layer() -> None:
    missing = {_top(m) for m in graph("sbpstream")} - set(LAYERS)
    assert not missing, f"give these packages a layer in LAYERS: {sorted(missing)}"


def test_no_import_points_up() -> None:
    up = [f"{m} -> {d} ({_top(m)} layer {LAYERS[_top(m)]}, {_top(d)} layer {LAYERS[_top(d)]})"
          for m, deps in graph("sbpstream").items() if not m.endswith(".__main__")
          for d in sorted(deps)
          if _top(d) != _top(m) and LAYERS.get(_top(d), 99) >= LAYERS.get(_top(m), -1)]
    assert not up, "imports pointing up or sideways:\n" + "\n".join(up)
