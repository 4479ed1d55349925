"""Import arrows of the PM and of the layers below it, counting every import statement (module
level, inside functions, under ``TYPE_CHECKING``): the PM's modules form no circle, the
configuration does not reach a backend package, and ``auth`` (below the PM) imports nothing of
the PM, the data node, the Kafka gateway, the SDK or the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import sbpstream

ROOT = Path(sbpstream.__file__).resolve().parent


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str) -> dict[str, Path]:
    root = ROOT.joinpath(*package.split(".")[1:])
    return {_name(p): p for p in sorted(root.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Every sbpstream module (or package) an import statement of ``name`` names."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("sbpstream.")}


def _graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports; importing ``a.b.c`` also runs the
    ``__init__`` of ``a.b``, so a submodule import is an arrow to its packages too (but for a
    package's own modules, whose package is already being imported)."""
    mods = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets: set[str] = set()
        for imp in _imports(name, path):
            parts = imp.split(".")
            targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
        graph[name] = {t for t in targets
                       if t in mods and t != name and not name.startswith(t + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of ``graph`` (module names, first repeated at the end), or []."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for t in sorted(graph[n]):
            if state.get(t) == 1:
                return [*stack[stack.index(t):], t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[n] = 2
        return []

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return []


def test_the_pm_has_no_import_circle() -> None:
    graph = _graph("sbpstream.pm")
    assert "sbpstream.pm.backends" in graph["sbpstream.pm.server"]
    assert _cycle(graph) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check can fail: a graph with a circle is reported."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(g) == ["a", "b", "c", "a"]


def test_config_and_metadata_import_no_backend_package() -> None:
    graph = _graph("sbpstream.pm")
    for below in ("sbpstream.pm.config", "sbpstream.pm.metadata", "sbpstream.pm.rules"):
        assert not {t for t in graph[below] if t.startswith("sbpstream.pm.etcd")}, below
        assert "sbpstream.pm.sqlite_meta" not in graph[below], below


def test_auth_imports_nothing_above_it() -> None:
    above = ("sbpstream.pm", "sbpstream.datanode", "sbpstream.kafka", "sbpstream.client",
             "sbpstream.cli", "sbpstream.cluster", "sbpstream.introspect", "sbpstream.spark")
    bad = {name: sorted(i for i in _imports(name, path) if i.startswith(above))
           for name, path in _modules("sbpstream.auth").items()}
    assert {k: v for k, v in bad.items() if v} == {}
