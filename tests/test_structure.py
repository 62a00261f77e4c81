"""The package's shape: no import cycles, the runtime never imports the passes, files stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


def _rooms(package: str) -> dict[str, set[str]]:
    """The package's rooms (its direct modules and subpackages, each with all it holds) and
    the rooms each imports."""
    depth = len(package.split("."))

    def room(module: str) -> str | None:
        inside = module.startswith(package + ".")
        return ".".join(module.split(".")[: depth + 1]) if inside else None

    rooms: dict[str, set[str]] = {}
    for module, targets in _imports().items():
        if (here := room(module)) is not None:
            found = {room(t) for t in targets} - {None, here}
            rooms.setdefault(here, set()).update(found)
    for targets in list(rooms.values()):
        for target in targets:
            rooms.setdefault(target, set())
    return rooms


def test_no_cycle_between_the_rooms_of_any_package():
    """Two modules of two rooms may import each other with no module cycle; the rooms of
    every package still form a DAG."""
    packages = {_module_name(p.parent / "__init__.py") for p in ROOT.rglob("__init__.py")}
    cycles = {p: _cycle(_rooms(p)) for p in sorted(packages)}
    assert not {p: c for p, c in cycles.items() if c}, cycles


# the rooms of a layered package, lowest first: each imports only rooms below it (its other
# modules, not listed, sit above them all: the pipeline, what runs around the ring)
LAYERS = {
    "ringify.runtime": ("collectives", "tiling", "masks", "attention"),
    "ringify.passes": ("graph", "folds", "sharding"),
}


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_the_layers_import_only_downwards(package):
    layers = [f"{package}.{name}" for name in LAYERS[package]]
    rank = lambda room: layers.index(room) if room in layers else len(layers)
    upward = {
        (room, target)
        for room, targets in _rooms(package).items()
        for target in targets
        if rank(target) > rank(room)
    }
    assert not upward, sorted(upward)


def test_runtime_never_imports_the_passes():
    runtime = {n: ts for n, ts in _imports().items() if n.startswith("ringify.runtime")}
    assert not {n: ts for n, ts in runtime.items() if any("passes" in t for t in ts)}


def test_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert not {p: n for p, n in sizes.items() if n > 400}


def test_every_module_is_on_the_map():
    """CONTRIBUTING's map names every module of ``ringify/`` in its folder's row."""
    text = (ROOT.parent / "CONTRIBUTING.md").read_text()
    rows = {
        cells[1].strip().strip("`"): cells[2]
        for line in text.splitlines()
        if line.startswith("| `ringify/") and len(cells := line.split("|")) > 2
    }
    missing = [
        str(path.relative_to(ROOT.parent))
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "__init__.py"
        and f"`{path.name}`" not in rows.get(f"{path.parent.relative_to(ROOT.parent)}/", "")
    ]
    assert not missing, f"modules missing from CONTRIBUTING.md's map: {missing}"


def test_no_file_name_is_used_twice():
    """One name, one meaning: a module's file name says which it is anywhere it is named."""
    names: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}


def test_the_top_floor_holds_the_entry_alone():
    """``ringify/`` holds the entry (the call, its configuration, the check) beside its
    folders; the trace and the other stacks' integrations live in folders of their own."""
    loose = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert loose == ["check.py", "config.py", "module.py"], loose


def test_each_kind_of_op_is_named_once():
    """A set of two or more aten ops is written in ``passes/graph/vocabulary.py`` alone:
    every fold, rule and walk reads its kinds from there (a table of ops to what each does
    is not a set: ``op_dims.py``'s, the rules')."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "vocabulary.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Set | ast.Tuple | ast.List):
                ops = [e for e in node.elts if ast.unparse(e).startswith("aten.")]
                if len(ops) >= 2 and len(ops) == len(node.elts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
