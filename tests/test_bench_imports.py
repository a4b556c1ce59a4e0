"""bench/, data/ and tests/ import each other as packages from the repository root, as `python -m bench...` and
pytest's `pythonpath` give them: no module edits the import path, and there are no import cycles (function-level
and TYPE_CHECKING imports count, as in test_import_layers.py)."""

from __future__ import annotations

import ast
from pathlib import Path

from import_graph import import_cycles, import_graph, modules

REPO = Path(__file__).resolve().parents[1]
# Each root and the folder its module names are relative to: bench.extension.job, data.code_packages, tiny_setup
ROOTS = {"bench": REPO, "data": REPO, "tests": REPO / "tests"}


def bench_graph() -> dict[str, set[str]]:
    return import_graph(modules({REPO / root: base for root, base in ROOTS.items()}))


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
    graph = bench_graph()
    assert "bench.extension.job" in graph["bench.extension.evals"]
    assert "data.code_packages" in graph["data.make_code_corpus"]
    assert "bench.gpu_e2e.flows.train" in graph["bench.gpu_e2e.flows"]


def test_no_import_cycles():
    assert import_cycles(bench_graph()) == []
