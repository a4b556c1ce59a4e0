"""The import graph of src/mtrain_cli is layered: no module imports one from a layer above it, there are no
cycles between modules or between packages (function-level imports count: they are deferred, not absent), every
package has a public face that other packages and bench/ import it through, and Triton is imported only where a
kernel runs."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

from import_graph import import_cycles, import_graph, modules

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "mtrain_cli"

# Bottom to top; a module may import its own layer and those below. A module's layer is its longest prefix here.
LAYERS: list[tuple[str, ...]] = [
    (
        "mtrain_cli",
        "mtrain_cli.errors",
        "mtrain_cli.lazy",
        "mtrain_cli.config",
        "mtrain_cli.resources",
        "mtrain_cli.lengths",
        "mtrain_cli.inputs",
        "mtrain_cli.environment",
        "mtrain_cli.cli.launch",
        "mtrain_cli.cli.usage",
        "mtrain_cli.attention.settings",
        "mtrain_cli.parallel.sizes",
    ),  # the recipe's attention section and the ring's size rules: torch-free, read by config
    ("mtrain_cli.parallel",),  # mesh, ring topology, token layouts
    (
        "mtrain_cli.attention.batch_cache",
        "mtrain_cli.attention.documents",
        "mtrain_cli.attention.dense",
        "mtrain_cli.attention.sparse",
        "mtrain_cli.attention.crossover",
    ),
    ("mtrain_cli.attention.ring",),
    (
        "mtrain_cli.attention",  # the package's face
        "mtrain_cli.attention.router",
        "mtrain_cli.attention.records",
        "mtrain_cli.attention.hook",
    ),
    ("mtrain_cli.model", "mtrain_cli.data"),
    ("mtrain_cli.train", "mtrain_cli.eval", "mtrain_cli.profile", "mtrain_cli.dry_run"),
    ("mtrain_cli.cli", "mtrain_cli.cli.profile", "mtrain_cli.demo", "mtrain_cli.__main__"),
]
# Importing these must not import Triton: the kernels load on first sparse or ring use.
TRITON_FREE = (
    "mtrain_cli.attention",
    "mtrain_cli.attention.dense",
    "mtrain_cli.attention.router",
    "mtrain_cli.attention.hook",
    "mtrain_cli.model",
    "mtrain_cli.model.build",
)


def mtrain_modules() -> dict[str, Path]:
    return modules({SRC / PACKAGE: SRC})


def mtrain_graph() -> dict[str, set[str]]:
    return import_graph(mtrain_modules())


def layer_of(module: str) -> int | None:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    return None if best is None else best[0]


def test_every_module_has_a_layer():
    assert [m for m in sorted(mtrain_modules()) if layer_of(m) is None] == []


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        f"{source} (layer {layer_of(source)}) imports {target} (layer {layer_of(target)})"
        for source, targets in sorted(mtrain_graph().items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(source)
    ]
    assert upward == []


def test_no_import_cycles():
    assert import_cycles(mtrain_graph()) == []


def package_of(module: str) -> str:
    """The package directly under mtrain_cli that holds `module`, or the module itself when it sits at the root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (SRC / PACKAGE / parts[1]).is_dir() else module


def test_no_import_cycles_between_packages():
    packages: dict[str, set[str]] = {}
    for source, targets in mtrain_graph().items():
        outside = {package_of(target) for target in targets} - {package_of(source)}
        packages.setdefault(package_of(source), set()).update(outside)
    assert import_cycles(packages) == []


# What other packages (and bench/) may import of each package: its face, its __init__, unless listed here.
FACES = {
    "mtrain_cli.attention": (
        "mtrain_cli.attention",
        "mtrain_cli.attention.sparse",
        "mtrain_cli.attention.ring",
        "mtrain_cli.attention.settings",  # torch-free, read by config
    ),
    "mtrain_cli.eval": ("mtrain_cli.eval", "mtrain_cli.eval.ruler"),
    "mtrain_cli.parallel": ("mtrain_cli.parallel", "mtrain_cli.parallel.sizes"),  # sizes: torch-free, read by config
}


# router.py is being reworked on its own; its import of ContextParallel moves to the parallel face with that work.
def packages() -> list[str]:
    return sorted(f"{PACKAGE}.{path.parent.name}" for path in (SRC / PACKAGE).glob("*/__init__.py"))


def faces_of(package: str) -> tuple[str, ...]:
    return FACES.get(package, (package,))


def exported_names(face: str) -> set[str]:
    """The names a face's `__all__` lists (lazy faces build it, so the face is imported; that costs nothing)."""
    return set(getattr(importlib.import_module(face), "__all__", ()))


def imported_modules(path: Path, known: dict[str, Path]) -> set[str]:
    """What a file imports of `known`: `from face import name` counts as the face even when `name` is also a
    submodule, as long as the face exports it."""
    faces = {face for package in packages() for face in faces_of(package)}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                exported = node.module in faces and alias.name in exported_names(node.module)
                found.add(submodule if submodule in known and not exported else node.module)
    return {module for module in found if module in known}


def test_every_package_has_a_face():
    assert [package for package in packages() if not exported_names(package)] == []


def test_other_packages_and_bench_import_each_package_through_its_faces():
    known = mtrain_modules()
    importers = {name: imported_modules(path, known) for name, path in known.items()}
    for path in (SRC.parent / "bench").rglob("*.py"):
        importers[str(path.relative_to(SRC.parent))] = imported_modules(path, known)
    inside = [
        f"{source} imports {target}"
        for source, targets in sorted(importers.items())
        for target in sorted(targets)
        if package_of(target) != package_of(source)
        and package_of(target) in packages()
        and target not in faces_of(package_of(target))
    ]
    assert inside == []


def test_every_name_of_the_faces_resolves():
    for face in [face for package in packages() for face in faces_of(package)]:
        module = importlib.import_module(face)
        missing = [name for name in exported_names(face) if getattr(module, name, None) is None]
        assert missing == [], f"{face}: {missing}"


def test_dense_attention_the_router_and_the_model_do_not_import_triton():
    code = (
        f"import sys\nimport {', '.join(TRITON_FREE)}\n"
        "loaded = sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.'))\n"
        "assert not loaded, loaded[:5]"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
