"""The package's shape: no import cycles, the runtime never imports the passes, files stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import ringify

ROOT = Path(ringify.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the ringify modules it imports (at any depth of its code)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            found |= {t for t in targets if t in modules and t != name}
        graph[name] = found
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle through modules (not through package ``__init__`` re-exports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = 1, stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node], _ = 2, stack.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle():
    graph = _imports()
    # A package's __init__ re-exports its modules: an edge into a package is not a cycle.
    packages = {n for n in graph if (ROOT.parent / n.replace(".", "/") / "__init__.py").exists()}
    graph = {n: {t for t in ts if t not in packages} for n, ts in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_runtime_never_imports_the_passes():
    runtime = {n: ts for n, ts in _imports().items() if n.startswith("ringify.runtime")}
    assert not {n: ts for n, ts in runtime.items() if any("passes" in t for t in ts)}


def test_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 400}
