"""One-time costs inside training steps are counted where they land: Triton kernels built (through Triton's
post-compile hook, chained to any hook set before) and sparse plans captured, per step, with the later steps
that paid them in the summary, and a step line that says so."""

from __future__ import annotations

import io

from rich.console import Console
from triton import knobs

from mtrain_cli.config import load_config
from mtrain_cli.train import kernel_builds
from mtrain_cli.train.kernel_builds import BuildCounter
from mtrain_cli.train.progress import RunLogger


def test_triton_builds_count_tritons_post_compile_calls_and_keep_the_hook_before(monkeypatch):
    earlier = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kwargs: earlier.append(kwargs["key"]))
    monkeypatch.setattr(kernel_builds, "_BUILDS", kernel_builds._TritonBuilds())  # a process that has not counted yet
    assert kernel_builds.triton_builds() == 0
    hook = knobs.runtime.jit_post_compile_hook
    for key in ("a", "b", "c"):  # what Triton calls after building a kernel
        knobs.runtime.jit_post_compile_hook(key=key, repr=key, fn=None, compile={}, is_manual_warmup=False)
    assert kernel_builds.triton_builds() == 3 and earlier == ["a", "b", "c"]
    assert kernel_builds.triton_builds_since(1) == [("b", "b", []), ("c", "c", [])]  # no fn: named by its key
    assert knobs.runtime.jit_post_compile_hook is hook  # installed once, however many trainers ask


def test_a_step_counts_what_it_built_and_the_summary_the_later_steps_that_did():
    class Builds:
        count = 0

    kernels = Builds()
    described = ("k", "[('i32', 'D')]{}", ["a"])  # one build's kernel, cache key, argument names
    counter = BuildCounter(lambda: kernels.count, lambda since: [described] * (kernels.count - since))
    captures, per_step = 0, []
    # per step: kernels built in it, plans captured in it, kernels built by the validation after it
    for step, (built, captured, in_validation) in enumerate([(12, 1, 2), (0, 0, 0), (3, 1, 0), (0, 0, 0)], 1):
        counter.start(plan_captures=captures)
        kernels.count += built
        captures += captured
        per_step.append(counter.take(step, plan_captures=captures))
        kernels.count += in_validation  # between steps: in no step's time
    assert per_step == [
        {"kernels_built": 12, "plans_captured": 1},
        {"kernels_built": 0, "plans_captured": 0},
        {"kernels_built": 3, "plans_captured": 1},
        {"kernels_built": 0, "plans_captured": 0},
    ]
    summary = counter.summary()
    assert summary["kernels_built"] == 15 and summary["plans_captured"] == 2 and summary["later_steps"] == [3]
    assert BuildCounter(None).take(1, 0) == {"kernels_built": 0, "plans_captured": 0}  # no Triton: none built


def test_the_step_line_says_what_a_step_built(tmp_path):
    config = load_config("tiny", ["train.num_steps=2", "train.warmup_steps=0", "logging.every=1"])
    console = Console(file=io.StringIO(), width=300)
    step = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "tflops": 0.0, "peak_mem_gib": 0.1}
    with RunLogger(config, tmp_path, 0, console) as logger:
        logger.log_step({**step, "step": 1, "kernels_built": 7, "plans_captured": 1})
        logger.log_step({**step, "step": 2, "kernels_built": 0, "plans_captured": 0})
    lines = [line for line in console.file.getvalue().splitlines() if line.startswith("step")]
    assert "· built 7 kernels, 1 plans ·" in lines[0] and "built" not in lines[1], lines


def test_a_kernel_built_again_names_the_arguments_whose_specialization_changed():
    """Triton's cache key: each argument's (type, specialization), D for divisible by 16, then the options."""
    names = ["Q", "sdlb", "Sq", "BLOCK"]
    first = "[('*bf16', 'D'), ('i32', 'D'), ('i32', ''), ('constexpr', 64)]{'num_warps': 4}"
    later = "[('*bf16', 'D'), ('i32', ''), ('i32', ''), ('constexpr', 64)]{'num_warps': 4}"
    assert kernel_builds.changed_arguments(first, later, names) == ["sdlb: ('i32', 'D') -> ('i32', '')"]
    assert kernel_builds.changed_arguments(first, first.replace("4}", "8}"), names) == [
        "options: {'num_warps': 4} -> {'num_warps': 8}"
    ]
    assert kernel_builds.changed_arguments(first, later, []) == ["argument 1: ('i32', 'D') -> ('i32', '')"]
    assert kernel_builds.changed_arguments("x", "y", names) == ["x -> y"]  # a key of another form: both whole
    merged = first.replace("64)]", "64), ('constexpr', True)]")  # a second build within the first step
    other = "[('*bf16', 'D'), ('i32', ''), ('i32', 'D'), ('constexpr', 64)]{'num_warps': 8}"
    assert merged != first
    built = iter(
        [
            [("_forward_kernel", first, names), ("_dq_kernel", "[]", []), ("_forward_kernel", merged, names)],
            [("_forward_kernel", other, names), ("_forward_kernel", later, names)],
        ]
    )
    counter = BuildCounter(iter([0, 3, 3, 5]).__next__, lambda since: next(built))  # counts around two steps
    for step in (1, 2):
        counter.start(plan_captures=0)
        counter.take(step, plan_captures=0)
    assert counter.summary()["rebuilt"] == [  # the first step's own builds are no rebuilds
        {
            "step": 2,
            "kernel": "_forward_kernel",
            "changed": [  # against the closest earlier build, `first`
                "sdlb: ('i32', 'D') -> ('i32', '')",
                "Sq: ('i32', '') -> ('i32', 'D')",
                "options: {'num_warps': 4} -> {'num_warps': 8}",
            ],
        },
        {"step": 2, "kernel": "_forward_kernel", "changed": ["sdlb: ('i32', 'D') -> ('i32', '')"]},
    ]
    assert counter.summary()["later_steps"] == [2]
