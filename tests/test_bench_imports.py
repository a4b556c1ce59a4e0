"""bench/, data/ and tests/ import each other as packages from the repository root, as `python -m bench...` and
pytest's `pythonpath` give them: no module edits the import path, and there are no import cycles (function-level
and TYPE_CHECKING imports count, as in test_import_layers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Each root and the folder its module names are relative to: bench.extension.job, data.code_packages, tiny_setup
ROOTS = {"bench": REPO, "data": REPO, "tests": REPO / "tests"}


def modules() -> dict[str, Path]:
    found = {}
    for root, base in ROOTS.items():
        for path in (REPO / root).rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of these roots it imports anywhere in its file."""
    known = modules()
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


def test_no_module_edits_the_import_path():
    edits = []
    for root in ("bench", "data", "tests", "src"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Attribute)
                    and node.attr == "path"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"
                ):
                    edits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert edits == []


def test_bench_and_data_import_as_packages():
    graph = import_graph()
    assert "bench.extension.job" in graph["bench.extension.evals"]
    assert "data.code_packages" in graph["data.make_code_corpus"]
    assert "bench.gpu_e2e.flows.train" in graph["bench.gpu_e2e.flows"]


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, str] = {}  # "open" while on the path, "done" once every edge from it is explored
    cycles = []

    def visit(path: list[str]) -> None:
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
    assert cycles == []
