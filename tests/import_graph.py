"""The import graph of a set of Python packages, read from their source (no import runs), for the tests that keep
src/, bench/, data/ and tests/ layered and free of cycles: every import counts, at module level, in functions and
under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path


def modules(roots: dict[Path, Path]) -> dict[str, Path]:
    """Module name -> file, for every .py under each root folder, named relative to that root's base folder."""
    found = {}
    for root, base in roots.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `known` it imports anywhere in its file."""
    graph = {}
    for name, path in known.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{name}: relative import (modules import by absolute name)"
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in known and t != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle found by a depth-first walk, as "a -> b -> a"."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once every edge from it is explored
    cycles = []

    def visit(path: list[str]) -> None:  # path: the imports that led here, this module last
        module = path[-1]
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit([module])
    return cycles
