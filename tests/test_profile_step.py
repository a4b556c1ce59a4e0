"""`mtrain profile step`: phases of a training step from torch.profiler; kernel names and marked ranges go to
the right phase; one process and a 2-rank context-parallel launch (gloo) both report every phase."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console
from spawned_ranks import run_cli_ranks
from tiny_setup import SMALL_MODEL, run_cli, set_args, small_run

from mtrain_cli.attention import PLAN_RANGE
from mtrain_cli.config import load_config
from mtrain_cli.profile.step import phase_times, profile_step, step_table, top_kernels
from mtrain_cli.profile.trace import (
    PHASES,
    Kernel,
    classify,
    host_waits,
    idle_before,
    idle_causes,
    kernel_totals,
    trace_kernels,
)


def test_kernels_and_ops_land_in_their_phase():
    assert classify("aten::mm", "ncclDevKernel_AllGather_RING_LL", None) == "communication"
    assert classify("c10d::allgather_", "c10d::allgather_", None) == "communication"
    assert classify("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32", "attention") == "attention"  # plan matmul
    assert classify("aten::empty", "_dkdv_kernel", None) == "attention"
    assert classify("aten::_flash_attention_backward", "flash_bwd_dq_dk_dv_loop_kernel", None) == "attention"
    assert classify("aten::mm", "sm90_xmma_gemm_bf16bf16_bf16f32", None) == "matmul"
    assert classify("aten::addmm", "aten::addmm", None) == "matmul"
    assert classify("aten::mul_", "vectorized_elementwise_kernel", "optimizer") == "optimizer"
    assert classify("aten::add", "vectorized_elementwise_kernel", None) == "other"
    assert classify("aten::topk", "gatherTopK", "plan") == "plan"


def test_top_kernels_are_each_phases_largest():
    by_kernel = {("matmul", "gemm_a"): 3.0, ("matmul", "gemm_b"): 5.0, ("other", "add"): 1.0, ("matmul", "gemm_c"): 1.0}
    assert phase_times(by_kernel) == {**dict.fromkeys(PHASES, 0.0), "matmul": 9.0, "other": 1.0}
    assert top_kernels(by_kernel, count=2) == {"matmul": [["gemm_b", 5.0], ["gemm_a", 3.0]], "other": [["add", 1.0]]}


def _check(report: dict, world: int) -> None:
    assert report["world"] == world and len(report["ranks"]) == world
    mean = report["mean"]
    assert all(mean[p] >= 0 for p in PHASES)
    assert mean["attention"] > 0 and mean["matmul"] > 0 and mean["optimizer"] > 0 and mean["other"] > 0
    # CPU time of one process cannot exceed its wall time by much (threads aside). One process is busy for most of
    # its step; a rank of a launch also waits for its peers on shared cores (88 ms steps with 42 ms of ops seen in
    # CI), time that no op of its own holds
    phases_ms = sum(mean[p] for p in PHASES)
    assert phases_ms < 4 * mean["step_ms"]
    if world == 1:
        assert phases_ms > 0.5 * mean["step_ms"]


def test_profile_step_one_process(tmp_path):
    out = tmp_path / "step.json"
    result = run_cli(
        "profile",
        "step",
        "--recipe",
        "tiny",
        "--steps",
        "1",
        "--out",
        str(out),
        *set_args(
            [
                *SMALL_MODEL,
                "attention.mode=sparse",
                "attention.block_size=16",
                "attention.dense_below=0",
                f"run.output_dir={tmp_path}",
            ]
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    _check(report, 1)
    assert report["mean"]["communication"] == 0.0 and report["sparse_recall"] is not None
    assert report["mean"]["plan"] > 0  # every layer plans: dense_below=0
    md = (tmp_path / "step.md").read_text()
    assert "| attention |" in md and "Largest ops of each phase (rank 0):" in md
    for phase, ops in report["top_kernels"].items():  # the largest ops make up part of their phase's time
        times = [ms for _name, ms in ops]
        assert 0 < len(ops) <= 5 and times == sorted(times, reverse=True)
        assert sum(times) <= report["mean"][phase] + 1e-6
        assert f"| {phase} | `{ops[0][0]}` |" in md
    assert {"attention", "plan", "matmul"} <= set(report["top_kernels"])
    host = report["host"]  # on CPU no kernel is launched; the ops with the most own time, largest first
    assert host["launches"] == 0 and len(host["top_ops"]) == 8
    own = [ms for _name, ms, _calls in host["top_ops"]]
    assert own == sorted(own, reverse=True) and own[0] > 0 and all(calls > 0 for *_, calls in host["top_ops"])
    assert f"`{host['top_ops'][0][0]}` {own[0]:.1f} ms" in md
    assert report["builds"] == {"kernels_built": 0, "plans_captured": 0} and "Triton kernels" not in md  # CPU
    report["builds"] = {"kernels_built": 3, "plans_captured": 1}  # as a GPU's first profiled rows of a shape
    assert "The profiled steps built 3 Triton kernels and captured 1 plans" in step_table(report)
    report.update(device_type="cuda", idle_causes=[["after cudaStreamSynchronize in aten::item", 1.5, 3.0]])
    report["mean"].update(idle_ms=2.0, idle_before={"plan": 2.0})  # as a GPU's profile reports them
    assert "after cudaStreamSynchronize in aten::item 1.5 ms (3 gaps)" in step_table(report)


def test_profile_step_warms_up_on_the_batches_it_profiles(tmp_path, monkeypatch):
    """The warm-up's last --steps steps read the batches that the profiled steps then read, the first of them
    fetched ahead as in training (a --warmup beyond --steps reads earlier batches first); the report's builds are
    the profiled steps' alone."""
    from mtrain_cli.train.loop import Trainer

    seen, fetched_ahead, launch_step = [], [], Trainer.launch_step

    def spy(trainer: Trainer):
        fetched_ahead.append(trainer._next is not None)
        launched = launch_step(trainer)
        seen.append(torch.cat([row["input_ids"] for row in launched.rows]))
        launched.builds = {"kernels_built": len(seen), "plans_captured": 1}  # every step builds, told apart by count
        return launched

    monkeypatch.setattr(Trainer, "launch_step", spy)
    config = load_config("tiny", small_run(20, tmp_path, "train.grad_accum=2"))
    result = profile_step(config, warmup=3, steps=2, console=Console(file=io.StringIO()))
    assert len(seen) == 5 and result["warmup"] == 3
    warmup, profiled = seen[:3], seen[3:]
    assert all(torch.equal(a, b) for a, b in zip(warmup[1:], profiled)) and not torch.equal(warmup[0], profiled[0])
    assert fetched_ahead[3:] == [True, True]
    assert result["builds"] == {"kernels_built": 4 + 5, "plans_captured": 2}


def test_profile_step_context_parallel_under_torchrun(tmp_path):
    out = tmp_path / "step.json"
    args = [
        "profile",
        "step",
        "--recipe",
        "tiny",
        "--steps",
        "1",
        "--out",
        str(out),
        "--trace-dir",
        str(tmp_path / "traces"),
        *set_args(
            [
                *SMALL_MODEL,
                "parallel.cp=2",
                "attention.mode=sparse",
                "attention.block_size=16",
                "attention.dense_below=0",
                f"run.output_dir={tmp_path}",
            ]
        ),
    ]
    result = run_cli_ranks(2, *args)  # the ranks torchrun starts, forked
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    _check(report, 2)
    assert report["cp"] == 2 and all(r["communication"] > 0 for r in report["ranks"])  # FSDP and ring traffic
    assert report["ring_imbalance"] >= 1.0 and all(r["plan"] > 0 for r in report["ranks"])
    for rank in (0, 1):  # each rank's own trace, with the marked plan ranges
        events = json.loads((tmp_path / "traces" / f"rank{rank}.json").read_text())["traceEvents"]
        assert any(event.get("name") == PLAN_RANGE for event in events)
    assert f"Profiler traces: {tmp_path / 'traces'}/rank<N>.json" in (tmp_path / "step.md").read_text()


def test_profilers_name_every_sparse_kernel():
    """Both profilers find our kernels by name: each Triton kernel of the sparse package is counted as attention
    by the step profile, and `profile kernels` records every autotuned one (a renamed or moved kernel fails here,
    not at the end of a GPU run)."""
    import triton

    from mtrain_cli.attention.sparse import autotuned_kernels, kernels_bwd, kernels_fwd, kernels_vertical, probe_kernels
    from mtrain_cli.profile.trace import ATTENTION_KERNEL_PREFIXES

    kernels = [
        name
        for module in (kernels_fwd, kernels_bwd, kernels_vertical, probe_kernels)
        for name in vars(module)
        if name.startswith("_") and name.endswith("_kernel")
    ]
    assert len(kernels) >= 8
    assert all(name.startswith(ATTENTION_KERNEL_PREFIXES) for name in kernels), kernels
    tuned = autotuned_kernels()
    assert set(tuned) == {"forward", "dq", "dkdv", "vertical"}
    assert all(isinstance(k, triton.runtime.autotuner.Autotuner) for k in tuned.values())


def test_trace_kernel_times_attribute_kernels_by_their_launch():
    """Kernels belong to the ranges open at their launch on the launching thread: a CUDA graph replayed inside
    the plan range (no op of its own, inside a compiled region) is plan time; an attention backward node on the
    autograd thread is attention; a GEMM under aten::mm is matmul; a kernel outside every range is other."""

    def span(tid, ts, dur, name, cat="cpu_op"):
        return {"ph": "X", "cat": cat, "tid": tid, "ts": ts, "dur": dur, "name": name}

    def launch(tid, ts, correlation):
        return {
            "ph": "X",
            "cat": "cuda_runtime",
            "tid": tid,
            "ts": ts,
            "dur": 1,
            "name": "cudaLaunchKernel",
            "args": {"correlation": correlation},
        }

    def kernel(name, dur, correlation, cat="kernel"):
        return {
            "ph": "X",
            "cat": cat,
            "tid": 7,
            "ts": 0,
            "dur": dur,
            "name": name,
            "args": {"correlation": correlation},
        }

    events = [
        span(1, 0, 100, "Torch-Compiled Region: 1/0"),
        span(1, 10, 50, "mtrain.attention", "user_annotation"),
        span(1, 12, 20, "mtrain.plan", "user_annotation"),
        launch(1, 15, 1),  # cudaGraphLaunch inside the plan, no op around it but the compiled region
        span(1, 40, 10, "aten::mm"),
        launch(1, 41, 2),  # inside attention, outside the plan
        span(1, 70, 5, "aten::mm"),
        launch(1, 71, 3),
        launch(1, 90, 4),
        span(2, 200, 50, "autograd::engine::evaluate_function: SparseAttentionFunctionBackward"),
        span(2, 201, 40, "SparseAttentionFunctionBackward"),
        launch(2, 210, 5),
        kernel("radixSortKernel", 2000, 1),
        kernel("Memset (Device)", 1000, 1, "gpu_memset"),
        kernel("nvjet_gemm", 3000, 2),
        kernel("nvjet_gemm", 4000, 3),
        kernel("vectorized_elementwise_kernel", 500, 4),
        kernel("_dq_kernel", 8000, 5),
    ]
    times = kernel_totals(trace_kernels(events), num_steps=2)
    assert times == {
        ("plan", "radixSortKernel"): 1.0,
        ("plan", "Memset (Device)"): 0.5,
        ("attention", "nvjet_gemm"): 1.5,
        ("matmul", "nvjet_gemm"): 2.0,
        ("other", "vectorized_elementwise_kernel"): 0.25,
        ("attention", "_dq_kernel"): 4.0,
    }


def test_idle_is_charged_to_the_phase_that_ended_each_gap():
    """Gaps in the union of all streams' kernels, between the window's first kernel and its last: overlapping
    kernels (another stream) leave no gap; each gap belongs to the phase of the kernel that ends it."""
    kernels = [
        Kernel(0.0, 100.0, "matmul", "gemm"),
        Kernel(50.0, 100.0, "communication", "nccl"),  # overlaps: busy until 150
        Kernel(400.0, 100.0, "plan", "radixSort"),  # 250 µs idle before the plan
        Kernel(500.0, 200.0, "attention", "_forward_kernel"),  # back to back: no gap
        Kernel(1000.0, 50.0, "plan", "radixSort"),  # 300 µs more before the plan
        Kernel(1200.0, 10.0, "other", "fill"),  # 150 µs before other
    ]
    assert idle_before(kernels[::-1], num_steps=2) == pytest.approx({"plan": 0.275, "other": 0.075})
    assert idle_before(kernels[:2], num_steps=1) == {}


def test_idle_causes_name_a_cpu_collective_the_longest_wait_and_the_mtrain_range_beyond_the_innermost_ops():
    """Between steps the host waits in a gloo all-reduce (on gloo's thread) for the slowest rank, then reads a
    scalar: the gap goes to the wait that covered most of it. A launch deep in aten ops still names the mtrain
    range it ran in."""
    events = [
        {"ph": "X", "cat": "user_annotation", "tid": 9, "ts": 50, "dur": 1450, "name": "gloo:all_reduce"},
        {"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 1510, "dur": 20, "name": "cudaEventSynchronize", "args": {}},
        {"ph": "X", "cat": "user_annotation", "tid": 1, "ts": 2000, "dur": 900, "name": "mtrain.plan"},
        {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 2100, "dur": 400, "name": "aten::to"},
        {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 2110, "dur": 380, "name": "aten::_to_copy"},
        {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 2120, "dur": 360, "name": "aten::copy_"},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "tid": 1,
            "ts": 2470,
            "dur": 5,
            "name": "cudaMemcpyAsync",
            "args": {"correlation": 7},
        },
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "tid": 7,
            "ts": 2480,
            "dur": 10,
            "name": "Memcpy HtoD (Pageable -> Device)",
            "args": {"correlation": 7},
        },
    ]
    waits = host_waits(events)
    assert [name for _start, _end, name in waits] == ["gloo:all_reduce", "cudaEventSynchronize"]
    (copy,) = trace_kernels(events)
    assert copy.launched_in == "aten::copy_ < aten::_to_copy < aten::to < … < mtrain.plan"
    kernels = [Kernel(0.0, 100.0, "optimizer", "adam"), Kernel(1600.0, 100.0, "other", "embedding"), copy]
    causes = idle_causes(kernels, waits, num_steps=1, count=2)
    assert causes == [
        ["after gloo:all_reduce", pytest.approx(1.5), 1.0],
        ["launching aten::copy_ < aten::_to_copy < aten::to < … < mtrain.plan", pytest.approx(0.78), 1.0],
    ]


def test_idle_causes_name_the_host_wait_that_drained_the_gpu_or_the_launches_that_ended_it():
    """A gap in which a host wait returned is charged to that wait and the ranges around it; a gap without one to
    the ranges open at the launch of the kernel that ended it; largest first, per step."""
    events = [
        {"ph": "X", "cat": "user_annotation", "tid": 1, "ts": 0, "dur": 2000, "name": "mtrain.attention"},
        {"ph": "X", "cat": "cpu_op", "tid": 1, "ts": 100, "dur": 200, "name": "aten::item"},
        {"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 110, "dur": 170, "name": "cudaStreamSynchronize"},
        {"ph": "X", "cat": "cuda_runtime", "tid": 1, "ts": 900, "dur": 1, "name": "cudaLaunchKernel"},  # no wait
        {"ph": "X", "cat": "cuda_runtime", "tid": 2, "ts": 1000, "dur": 50, "name": "cudaEventSynchronize"},
    ]
    waits = host_waits(events)
    assert waits == [
        (110, 280, "cudaStreamSynchronize in aten::item < mtrain.attention"),
        (1000, 1050, "cudaEventSynchronize"),
    ]
    kernels = [
        Kernel(0.0, 270.0, "attention", "_forward_kernel", "mtrain.attention"),
        Kernel(400.0, 100.0, "other", "fill", "aten::fill_ < mtrain.attention"),  # gap 270-400: the wait at 280
        Kernel(600.0, 100.0, "plan", "sort", "mtrain.plan < mtrain.attention"),  # gap 500-600: no wait inside
        Kernel(1000.0, 10.0, "plan", "sort", "mtrain.plan < mtrain.attention"),  # gap 700-1000: none either
        Kernel(1100.0, 10.0, "other", "copy"),  # gap 1010-1100: the other thread's wait at 1050
    ]
    causes = idle_causes(kernels, waits, num_steps=2, count=3)
    assert [cause for cause, _ms, _gaps in causes] == [
        "launching mtrain.plan < mtrain.attention",
        "after cudaStreamSynchronize in aten::item < mtrain.attention",
        "after cudaEventSynchronize",
    ]
    assert [x for _cause, ms, gaps in causes for x in (ms, gaps)] == pytest.approx([0.2, 1.0, 0.065, 0.5, 0.045, 0.5])
    assert idle_causes(kernels, waits, num_steps=2, count=1) == causes[:1]
