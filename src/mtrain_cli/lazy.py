"""Package faces that resolve their names on first use: importing a face costs nothing, and a name loads only
the module it lives in (dense attention never loads Triton; `mtrain --help` never loads torch)."""

from __future__ import annotations

import importlib
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
