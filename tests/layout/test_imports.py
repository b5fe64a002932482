"""The packages' modules import each other without cycles (issue #22): a module that imports
another at run time, or only for type checking, is an edge; a cycle is a failure naming it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "sokutatsu.monitor": ROOT / "services/monitor/src/sokutatsu/monitor",
    "sokutatsu.broker": ROOT / "services/broker/src/sokutatsu/broker",
    "sokutatsu.sequencer": ROOT / "services/sequencer/src/sokutatsu/sequencer",
    "sokutatsu.queuedb": ROOT / "services/queue-db/src/sokutatsu/queuedb",
}


def _imports(package: str, folder: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, subpackages included (a package is its
    ``__init__``; the generated stubs under ``v1`` left out)."""
    names: dict[Path, str] = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        if parts[0] == "v1":
            continue
        names[path] = ".".join((package, *parts[: -1 if parts[-1] == "__init__" else None]))
    modules = set(names.values())
    edges: dict[str, set[str]] = {}
    for path, name in names.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.module != package and not node.module.startswith(package + "."):
                continue
            for alias in node.names:  # `from p.store import transfer` imports the module p.store.transfer
                target = f"{node.module}.{alias.name}"
                found.add(target if target in modules else node.module)
        edges[name] = (found & modules) - {name}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target in edges and state.get(target) is None and (found := visit(target)):
                return found
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if state.get(module) is None and (found := visit(module)):
            return found
    return None


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_import_cycle(package: str) -> None:
    edges = _imports(package, PACKAGES[package])
    assert edges, f"no modules found for {package}"
    cycle = _cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_check_finds_a_cycle() -> None:
    assert _cycle({"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}) == ["p.a", "p.b", "p.c", "p.a"]
    assert _cycle({"p.a": {"p.b"}, "p.b": set()}) is None
