"""One-time costs that land inside training steps: Triton kernels built and sparse plans captured.

A Triton kernel is built on its first call with new shapes or specializations (compiled, autotuned, or loaded
from Triton's on-disk cache), and the sparse plan's CUDA graph is captured for each new shape of a batch's
documents (attention/sparse/plan_graph.py). Either can make a step seconds slower than the next. Each step's
metrics count both, so a slow step says why, and the run's summary lists the later steps that paid them.
"""

from __future__ import annotations

from typing import Any


class KernelBuilds:
    """Counts this process's Triton builds through Triton's post-compile hook, chained to any hook set before."""

    def __init__(self):
        self.count = 0
        try:
            from triton import knobs
        except ImportError:  # no Triton (CPU installs): nothing is built
            return
        previous = knobs.runtime.jit_post_compile_hook

        def hook(**kwargs: Any) -> Any:
            self.count += 1
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook


class BuildCounter:
    """What each training step built (`start` before the step, `take` after it: validation between steps is not
    counted), the run's totals, and the steps after this process's first that built anything."""

    def __init__(self, kernel_builds: KernelBuilds | None):
        self.kernel_builds = kernel_builds
        self.at_start = (0, 0)
        self.totals = {"kernels_built": 0, "plans_captured": 0}
        self.num_steps = 0
        self.later_steps: list[int] = []

    def _now(self, plan_captures: int) -> tuple[int, int]:
        return (self.kernel_builds.count if self.kernel_builds is not None else 0), plan_captures

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
