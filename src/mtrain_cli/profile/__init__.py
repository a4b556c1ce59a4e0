"""`mtrain profile`: the sparse kernels against dense (kernels.py), the measured crossover (crossover.py), ring
attention over ranks (ring.py) and whole training steps (step.py), each written as a report (report.py).

This is the package's public face; other packages import from here. Names resolve on first use: importing the
face loads neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "KernelProfileSpec": "kernels",
    "kernel_profile_table": "kernels",
    "run_kernel_profile": "kernels",
    "CrossoverSpec": "crossover",
    "crossover_table": "crossover",
    "run_crossover_profile": "crossover",
    "profile_ring_main": "ring",
    "profile_step": "step",
    "step_table": "step",
    "write_report": "report",
}
__all__ = [  # noqa: RUF022 (the order of _EXPORTS: by module)
    "KernelProfileSpec",
    "kernel_profile_table",
    "run_kernel_profile",
    "CrossoverSpec",
    "crossover_table",
    "run_crossover_profile",
    "profile_ring_main",
    "profile_step",
    "step_table",
    "write_report",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


if TYPE_CHECKING:
    from mtrain_cli.profile.crossover import CrossoverSpec, crossover_table, run_crossover_profile
    from mtrain_cli.profile.kernels import KernelProfileSpec, kernel_profile_table, run_kernel_profile
    from mtrain_cli.profile.report import write_report
    from mtrain_cli.profile.ring import profile_ring_main
    from mtrain_cli.profile.step import profile_step, step_table
