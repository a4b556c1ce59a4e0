"""Package faces that resolve their names on first use: importing a face costs nothing, and a name loads only
the module it lives in (dense attention never loads Triton; `mtrain --help` never loads torch). A command loads
what it needs of torch, transformers and datasets at once, with the collector paused (import_long_lived)."""

from __future__ import annotations

import atexit
import gc
import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, names_by_module: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any], list[str]]:
    """A face's module `__getattr__` and `__all__`: each name of `names_by_module[m]` comes from `package.m`."""
    module_of = {name: module for module, names in names_by_module.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module_of[name]}"), name)

    return __getattr__, list(module_of)


def import_long_lived(*modules: str) -> None:
    """A command's first imports of torch, transformers and datasets: ~1M objects that live as long as the process.
    The collector pauses while they load (its automatic full passes then, 7 during `mtrain extend`'s, found nothing)
    and leaves them out of later full passes (gc.freeze; a run's end collects). At exit they are handed back, so that
    the interpreter's last collections free them as before: Triton's bindings report what is left as leaks. Where
    torch is loaded already (a program calling the CLI in its process), they are imported as usual."""
    if "torch" in sys.modules:
        for module in modules:
            importlib.import_module(module)
        return
    gc.disable()
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        gc.freeze()
        gc.enable()
        atexit.register(gc.unfreeze)
