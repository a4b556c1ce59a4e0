"""One-time costs that land inside training steps: Triton kernels built and sparse plans captured.

A Triton kernel is built on its first call with new shapes or specializations (compiled, autotuned, or loaded
from Triton's on-disk cache), and the sparse plan's CUDA graph is captured for each new shape of a batch's
documents (attention/sparse/plan_graph.py). Either can make a step seconds slower than the next. Each step's
metrics count both, so a slow step says why, and the run's summary lists the later steps that paid them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _TritonBuilds:
    count = 0
    installed = False


_BUILDS = _TritonBuilds()


def triton_builds() -> int:
    """Triton builds in this process since the first call, which installs the counting hook (Triton's post-compile
    hook, chained to any hook set before): once a process, however many trainers it makes."""
    if not _BUILDS.installed:
        _BUILDS.installed = True
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU installs): nothing is built
            return 0
        previous = knobs.runtime.jit_post_compile_hook

        def hook(**kwargs: Any) -> Any:
            _BUILDS.count += 1
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
    return _BUILDS.count


class BuildCounter:
    """What each training step built (`start` before the step, `take` after it: validation between steps is not
    counted), the run's totals, and the steps after this process's first that built anything."""

    def __init__(self, count_kernels: Callable[[], int] | None):
        self.count_kernels = count_kernels  # triton_builds on a GPU; None: nothing is built
        self.at_start = (0, 0)
        self.totals = {"kernels_built": 0, "plans_captured": 0}
        self.num_steps = 0
        self.later_steps: list[int] = []

    def _now(self, plan_captures: int) -> tuple[int, int]:
        return (self.count_kernels() if self.count_kernels is not None else 0), plan_captures

    def start(self, plan_captures: int) -> None:
        """plan_captures: the router's captures so far."""
        self.at_start = self._now(plan_captures)

    def take(self, step: int, plan_captures: int) -> dict[str, int]:
        """-> {"kernels_built": in the step, "plans_captured": in the step}."""
        kernels, captures = self._now(plan_captures)
        built = {"kernels_built": kernels - self.at_start[0], "plans_captured": captures - self.at_start[1]}
        for name, count in built.items():
            self.totals[name] += count
        self.num_steps += 1
        if self.num_steps > 1 and any(built.values()):
            self.later_steps.append(step)
        return built

    def summary(self) -> dict[str, Any]:
        return {**self.totals, "later_steps": self.later_steps}
