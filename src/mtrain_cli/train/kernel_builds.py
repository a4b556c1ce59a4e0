"""One-time costs that land inside training steps: Triton kernels built and sparse plans captured.

A Triton kernel is built on its first call with new shapes or specializations (compiled, autotuned, or loaded
from Triton's on-disk cache), and the sparse plan's CUDA graph is captured for each new shape of a batch's
documents (attention/sparse/plan_graph.py). Either can make a step seconds slower than the next. Each step's
metrics count both, so a slow step says why, and the run's summary lists the later steps that paid them.

A kernel built again after the first step was built for a new specialization of its arguments (Triton
specializes an integer on being 1 or a multiple of 16, a pointer on its alignment): the summary names each such
kernel and the arguments whose specialization changed, which is where a fix starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class _TritonBuilds:
    installed = False

    def __init__(self) -> None:
        # per build: the kernel, Triton's cache key (its arguments' specialization, then its options) and the
        # kernel's argument names
        self.built: list[tuple[str, str, list[str]]] = []


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
            fn, key = kwargs.get("fn"), str(kwargs.get("key"))
            names = list(getattr(getattr(fn, "jit_function", None), "arg_names", None) or [])
            _BUILDS.built.append((getattr(fn, "name", None) or key, key, names))
            return previous(**kwargs) if previous is not None else None

        knobs.runtime.jit_post_compile_hook = hook
    return len(_BUILDS.built)


def triton_builds_since(count: int) -> list[tuple[str, str, list[str]]]:
    """(kernel, cache key, argument names) of the builds after the first `count` (triton_builds)."""
    return _BUILDS.built[count:]


def _split_key(key: str) -> tuple[list[str], str]:
    """Triton's cache key `[spec of arg 0, spec of arg 1, ...]options` -> (the specs, the options); ([], key) when
    it does not start with a list."""
    if not key.startswith("["):
        return [], key
    specs, depth, begin = [], 0, 1
    for i, char in enumerate(key):
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
            if depth == 0:
                specs.append(key[begin:i].strip())
                return [spec for spec in specs if spec], key[i + 1 :]
        elif char == "," and depth == 1:
            specs.append(key[begin:i].strip())
            begin = i + 1
    return [], key


def changed_arguments(first: str, later: str, arg_names: list[str]) -> list[str]:
    """What differs between two builds' cache keys: 'arg: first spec -> later spec' for each argument (named when
    the names line up), and the options."""
    (specs_a, options_a), (specs_b, options_b) = _split_key(first), _split_key(later)
    if not specs_a or len(specs_a) != len(specs_b):
        return [f"{first} -> {later}"]
    names = arg_names if len(arg_names) == len(specs_a) else [f"argument {i}" for i in range(len(specs_a))]
    changes = [f"{name}: {a} -> {b}" for name, a, b in zip(names, specs_a, specs_b) if a != b]
    return changes + ([] if options_a == options_b else [f"options: {options_a} -> {options_b}"])


class BuildCounter:
    """What each training step built (`start` before the step, `take` after it: validation between steps is not
    counted), the run's totals, the steps after this process's first that built anything, and the kernels those
    built again with what changed."""

    def __init__(
        self,
        count_kernels: Callable[[], int] | None,
        kernels_since: Callable[[int], list[tuple[str, str, list[str]]]] = triton_builds_since,
    ):
        self.count_kernels = count_kernels  # triton_builds on a GPU; None: nothing is built
        self.kernels_since = kernels_since
        self.at_start = (0, 0)
        self.totals = {"kernels_built": 0, "plans_captured": 0}
        self.num_steps = 0
        self.later_steps: list[int] = []
        self.earlier_builds: dict[str, list[str]] = {}  # kernel -> the cache keys of its builds in these steps
        self.rebuilt: list[dict[str, Any]] = []  # later steps' builds of a kernel built before

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
        if built["kernels_built"]:
            # the first step builds a kernel once per specialization it meets (autotuned configs, merge or not);
            # a later build is told against the earlier one it differs from least
            for kernel, key, arg_names in self.kernels_since(self.at_start[0]):
                earlier = self.earlier_builds.setdefault(kernel, [])
                if self.num_steps > 0 and earlier:
                    num_specs = len(_split_key(key)[0])
                    alike = [e for e in earlier if num_specs and len(_split_key(e)[0]) == num_specs] or earlier
                    changed = min((changed_arguments(e, key, arg_names) for e in alike), key=len)
                    self.rebuilt.append({"step": step, "kernel": kernel, "changed": changed})
                earlier.append(key)
        self.num_steps += 1
        if self.num_steps > 1 and any(built.values()):
            self.later_steps.append(step)
        return built

    def summary(self) -> dict[str, Any]:
        return {**self.totals, "later_steps": self.later_steps, "rebuilt": self.rebuilt}
