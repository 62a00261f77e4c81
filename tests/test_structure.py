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
    """Module -> the ringify modules it imports, at any depth of its code (imports inside
    functions too), with the packages each import runs (``a.b.c`` runs ``a.b``'s
    ``__init__``), a module's own packages left out."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {
            package
            for target in found
            for package in _packages_of(target)
            if package in modules and package != name and not name.startswith(package + ".")
        }
    return graph


def _packages_of(module: str) -> list[str]:
    """``a.b.c`` and the packages importing it runs: ``a.b`` (``a`` is ringify itself)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts) + 1)]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None."""
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
    """Through packages and imports inside functions too."""
    graph = _imports()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


# the runtime's rooms, lowest first: each imports only rooms below it
RUNTIME_ROOMS = ("collectives", "tiling", "masks", "attention")


def test_the_runtime_rooms_import_only_downwards():
    def room(module: str) -> int | None:
        parts = module.split(".")
        inside = parts[:2] == ["ringify", "runtime"] and len(parts) > 2
        return RUNTIME_ROOMS.index(parts[2]) if inside and parts[2] in RUNTIME_ROOMS else None

    upward = {
        (module, target)
        for module, targets in _imports().items()
        for target in targets
        if room(module) is not None and room(target) is not None and room(target) > room(module)
    }
    assert not upward, sorted(upward)


def test_runtime_never_imports_the_passes():
    runtime = {n: ts for n, ts in _imports().items() if n.startswith("ringify.runtime")}
    assert not {n: ts for n, ts in runtime.items() if any("passes" in t for t in ts)}


def test_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 400}
