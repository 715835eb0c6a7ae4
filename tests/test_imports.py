"""The package's import graph: no module imports a module that imports it back (at module level or inside a
function: a lazy import is still a dependency a reader must hold in mind), and library code never imports the
CLI module. Read from the source with `ast`; nothing is imported."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "lowvram_grpo"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, `from X import Y` counting as X.Y when that is a module."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    targets.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def test_no_module_imports_one_that_imports_it_back():
    graph = import_graph()
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in _reachable(graph, b)})
    assert not circles, f"import circles (each pair reaches the other): {circles}"


def test_the_walk_sees_lazy_imports_and_relative_imports():
    graph = import_graph()
    assert "lowvram_grpo.training" in graph["lowvram_grpo.pipeline"]          # imported inside a method
    assert "lowvram_grpo.backends.vllm.engine" in graph["lowvram_grpo.backends.vllm.rollouts"]  # `from .engine`
    assert "lowvram_grpo.errors" in graph["lowvram_grpo.backends.vllm.settings"]  # `from ...errors`


def test_only_the_entry_points_import_the_cli_module():
    graph = import_graph()
    users = sorted(m for m, targets in graph.items() if "lowvram_grpo.run" in targets)
    assert users == ["lowvram_grpo.__main__"], users
