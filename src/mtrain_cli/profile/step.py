"""`mtrain profile step`: where a training step's time goes, per phase, from torch.profiler.

Builds the trainer for a recipe (under torchrun for several ranks: FSDP2 × context parallelism as in
`mtrain extend`), warms up, profiles --steps steps and sums, per step and rank, the device time of every CUDA
kernel (on CPU: every op's own CPU time) into phases. The warm-up's last --steps steps read the very batches
then profiled: a batch of new shapes builds Triton kernels and captures a sparse plan (train/builds.py), one-time
costs that would otherwise make the profile a picture of start-up, not of training. The phases:
- plan: a sparse layer's plan (`mtrain.plan`: probe, pattern estimate, layout; a ring's plan too), the cost
  that sparse attention adds to a step;
- attention: the rest of what runs inside the attention hook (`mtrain.attention`: kernels, ring transfers
  issued there) or an attention kernel by name (our Triton kernels, flash/cuDNN SDPA) or an attention autograd
  node (the backward of the sparse and ring functions);
- communication: collectives (NCCL kernels, gloo/c10d ops): FSDP all-gathers and reduce-scatters, ring hops;
- optimizer: gradient clipping and AdamW (`mtrain.optimizer`);
- matmul: the remaining GEMMs (projections, MLP, LM head), in forward, recompute and backward;
- other: everything else (norms, RoPE, elementwise, loss, casts).
Phases are sums of kernel time: communication runs on its own streams and may overlap the rest, so the
phases can add up to more than the step (overlap) or less (idle gaps); both are reported. On a GPU the idle
time (no kernel on any stream) is charged to the phase of the kernel that ended each gap: the phase whose
host side the GPU waited for. The profiler's own host overhead inflates it; compare steps profiled alike. On
CPU the plain torch reference attention has no marked backward, so its backward counts as matmul/other.
"""

from __future__ import annotations

import io
import json
import os
import platform
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from rich.console import Console
from torch.profiler import ProfilerActivity, profile

from mtrain_cli.attention import PLAN_RANGE
from mtrain_cli.config import Config

if TYPE_CHECKING:
    from mtrain_cli.parallel.context import ParallelContext

PHASES = ("attention", "plan", "matmul", "communication", "optimizer", "other")
ATTENTION_RANGE = "mtrain.attention"
OPTIMIZER_RANGE = "mtrain.optimizer"
ATTENTION_KERNEL_PREFIXES = (
    "_forward_kernel",
    "_dq_kernel",
    "_dkdv_kernel",
    "_vertical_kernel",
    "_fold_kernel",
    "_delta_kernel",
    "_probe_",
)  # ours
ATTENTION_KERNEL_WORDS = ("flash", "fmha", "cudnn", "attention")  # SDPA backends
ATTENTION_NODES = ("AttentionFunctionBackward", "ScaledDotProduct")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm", "aten::matmul", "aten::linear")
COMM_NAMES = ("nccl", "gloo", "c10d::", "record_param_comms")
TOP_KERNELS = 5  # per phase, in the report
TOP_HOST_OPS = 8
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _range_phase(names_innermost_first) -> str | None:
    """The phase of the innermost marked range or attention autograd node among these enclosing names: a plan
    runs inside the attention range."""
    for name in names_innermost_first:
        if name == PLAN_RANGE:
            return "plan"
        if name == ATTENTION_RANGE or any(n in name for n in ATTENTION_NODES):
            return "attention"
        if name == OPTIMIZER_RANGE:
            return "optimizer"
    return None


def _ancestor_phase(event) -> str | None:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return _range_phase(names)


def classify(op_name: str, time_name: str, ancestor: str | None) -> str:
    """Phase of one unit of time: `time_name` is the kernel's name (GPU) or the op's (CPU), `op_name` the op
    that launched it, `ancestor` the phase of the marked range or autograd node around it."""
    lowered = time_name.lower()
    if any(n in lowered for n in COMM_NAMES) or any(n in op_name for n in COMM_NAMES):
        return "communication"
    if ancestor is not None:
        return ancestor
    if time_name.startswith(ATTENTION_KERNEL_PREFIXES) or any(n in lowered for n in ATTENTION_KERNEL_WORDS):
        return "attention"
    if op_name in GEMM_OPS or any(n in lowered for n in ("gemm", "xmma", "cutlass", "nvjet", "wgmma")):
        return "matmul"
    return "other"


def kernel_times(
    prof, device: torch.device, num_steps: int, trace: Path | None = None
) -> tuple[dict[tuple[str, str], float], dict[str, float]]:
    """(milliseconds per step of each (phase, kernel name), GPU idle per step by the phase it waited for): kernel
    time on CUDA, own CPU time of each op on CPU (no idle). `trace`: keep the chrome trace there."""
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    if device.type == "cuda":
        with tempfile.TemporaryDirectory(prefix="mtrain-trace-") as tmp:
            if trace is None:
                trace = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(trace))
            kernels = trace_kernels(json.loads(trace.read_text())["traceEvents"])
        return kernel_totals(kernels, num_steps), idle_before(kernels, num_steps)
    totals: dict[tuple[str, str], float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if event.name not in (ATTENTION_RANGE, PLAN_RANGE, OPTIMIZER_RANGE):
            key = (classify(event.name, event.name, _ancestor_phase(event)), event.name)
            totals[key] = totals.get(key, 0.0) + event.self_cpu_time_total / 1e3 / num_steps
    return totals, {}


def trace_kernels(events: list[dict]) -> list[tuple[float, float, str, str]]:
    """(start µs, duration µs, phase, name) of every kernel, memcpy and memset of a chrome trace. A kernel belongs
    to the CPU ranges that enclose its launch on the launching thread. By time, not by the profiler's op tree: a
    CUDA graph's replay (a sparse plan's) is launched by no op of its own, and the tree files its kernels under
    an outer compiled region."""
    launches: dict[Any, list[tuple[float, Any]]] = {}  # thread -> (launch time, correlation id)
    ranges: dict[Any, list[tuple[float, float, str, bool]]] = {}  # thread -> (start, end, name, is an op)
    for e in events:
        if e.get("ph") != "X":
            continue
        category = e.get("cat")
        if category in ("cuda_runtime", "cuda_driver"):
            launches.setdefault(e["tid"], []).append((e["ts"], e["args"].get("correlation")))
        elif category in ("cpu_op", "user_annotation"):
            ranges.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"], category == "cpu_op"))
    owners = {}  # correlation id -> the ranges enclosing its launch, innermost first
    for tid, mine in launches.items():
        owners.update(_enclosing(ranges.get(tid, []), sorted(mine, key=lambda launch: launch[0])))
    kernels = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        enclosing = owners.get(e["args"].get("correlation"), [])
        op_name = next((name for name, is_op in enclosing if is_op), "")
        phase = classify(op_name, e["name"], _range_phase(name for name, _is_op in enclosing))
        kernels.append((e["ts"], e["dur"], phase, e["name"]))
    return kernels


def kernel_totals(kernels: list[tuple[float, float, str, str]], num_steps: int) -> dict[tuple[str, str], float]:
    """Milliseconds per step of each (phase, kernel name)."""
    totals: dict[tuple[str, str], float] = {}
    for _start, duration, phase, name in kernels:
        totals[(phase, name)] = totals.get((phase, name), 0.0) + duration / 1e3 / num_steps
    return totals


def idle_before(kernels: list[tuple[float, float, str, str]], num_steps: int) -> dict[str, float]:
    """Milliseconds per step the GPU ran nothing (no stream) between the window's first kernel and its last, each
    gap charged to the phase of the kernel that ended it: the host was still launching that phase (or reading
    a result back), so this is where a step is bound by the host, not the GPU."""
    idle: dict[str, float] = {}
    busy_until = None
    for start, duration, phase, _name in sorted(kernels):
        if busy_until is not None and start > busy_until:
            idle[phase] = idle.get(phase, 0.0) + (start - busy_until) / 1e3 / num_steps
        busy_until = start + duration if busy_until is None else max(busy_until, start + duration)
    return idle


def _enclosing(spans: list[tuple[float, float, str, bool]], launches: list[tuple[float, Any]]) -> dict[Any, list]:
    """One thread's nested spans (start, end, name, is an op) against its launches (time, id), both by time:
    id -> [(name, is an op)] of the spans open at that time, innermost first. One sweep with a stack."""
    spans = sorted(spans, key=lambda span: (span[0], -span[1]))
    found, stack, i = {}, [], 0
    for at, key in launches:
        while i < len(spans) and spans[i][0] <= at:
            while stack and stack[-1][1] < spans[i][0]:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1][1] < at:
            stack.pop()
        found[key] = [(name, is_op) for _start, _end, name, is_op in reversed(stack)]
    return found


def phase_times(by_kernel: dict[tuple[str, str], float]) -> dict[str, float]:
    totals = dict.fromkeys(PHASES, 0.0)
    for (phase, _name), ms in by_kernel.items():
        totals[phase] += ms
    return totals


def top_kernels(by_kernel: dict[tuple[str, str], float], count: int = TOP_KERNELS) -> dict[str, list[list]]:
    """phase -> its `count` largest [kernel name, ms per step]: what a phase's time is made of."""
    top: dict[str, list[list]] = {}
    for (phase, name), ms in sorted(by_kernel.items(), key=lambda item: -item[1]):
        if len(top.setdefault(phase, [])) < count:
            top[phase].append([name, ms])
    return {phase: top[phase] for phase in PHASES if phase in top}


def host_ops(prof, num_steps: int, count: int = TOP_HOST_OPS) -> dict[str, Any]:
    """Where the host's time goes, per step: kernel launches (ours go through the driver's cuLaunchKernel*, torch's
    through the runtime's), and the `count` ops, ranges and runtime calls with the most own CPU time, as [name,
    ms, calls]. What these leave of a host-bound step is Python between the ops."""
    averages = [a for a in prof.key_averages() if a.device_type == torch.autograd.DeviceType.CPU]
    launches = sum(a.count for a in averages if a.key in LAUNCHES)
    top = sorted(averages, key=lambda a: -a.self_cpu_time_total)[:count]
    return {
        "launches": launches / num_steps,
        "top_ops": [[a.key, a.self_cpu_time_total / 1e3 / num_steps, a.count / num_steps] for a in top],
    }


@contextmanager
def _without_kineto_markers():
    """The profiler's C++ side (kineto) writes `USDT: ... profiler_start` / `profiler_stop` markers to stderr at a
    log level that also carries its errors: hold stderr (fd 2) in a file meanwhile and pass on all but those."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            for line in held.read().decode(errors="replace").splitlines(keepends=True):
                if not line.startswith("USDT:"):
                    sys.stderr.write(line)
            sys.stderr.flush()


def profile_step(
    config: Config, warmup: int, steps: int, console: Console, trace_dir: Path | None = None
) -> dict[str, Any]:
    """Every rank profiles its steps; rank 0 gets the per-rank phases, the mean, and the trainer's metrics.
    `trace_dir`: each rank keeps its chrome trace there as rank<N>.json (chrome://tracing, Perfetto)."""
    from mtrain_cli.parallel.context import end_parallel, init_parallel

    pc = init_parallel(config)
    trace = trace_dir / f"rank{pc.rank}.json" if trace_dir is not None else None
    try:
        result = _profile(config, warmup, steps, console if pc.is_main else Console(file=io.StringIO()), pc, trace)
    except BaseException as exc:
        end_parallel(pc, exc)
        raise
    end_parallel(pc)  # the trainer is out of scope here
    return result


def _profile(
    config: Config, warmup: int, steps: int, quiet: Console, pc: ParallelContext, trace: Path | None
) -> dict[str, Any]:
    from mtrain_cli.train.loop import build_trainer

    with tempfile.TemporaryDirectory(prefix="mtrain-profile-") as run_dir:
        trainer = build_trainer(config, Path(run_dir), quiet, pc)
        for _ in range(warmup - steps):  # --warmup beyond --steps: earlier batches
            trainer.train_step()
        # the profiled batches last: bounded caches (PlanGraph keeps 8 shapes) hold theirs when the profile starts
        with trainer.rewinding_data():
            for _ in range(steps):
                trainer.train_step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pc.device.type == "cuda" else [])
        with _without_kineto_markers(), profile(activities=activities) as prof:
            results = [trainer.train_step() for _ in range(steps)]
        metrics = [trainer.meter(result) for result in results]
        by_kernel, idle = kernel_times(prof, pc.device, steps, trace)
        host = host_ops(prof, steps)
    phases = phase_times(by_kernel)
    step_ms = 1e3 * sum(m["step_s"] for m in metrics) / steps
    mine = {"rank": pc.rank, "step_ms": step_ms, **phases, "idle_ms": sum(idle.values()), "idle_before": idle}
    ranks = [None] * pc.world
    if pc.distributed:
        dist.all_gather_object(ranks, mine)
    else:
        ranks = [mine]
    last = metrics[-1]
    mean = {key: sum(r[key] for r in ranks) / len(ranks) for key in ("step_ms", *PHASES, "idle_ms")}
    mean["idle_before"] = {
        phase: sum(r["idle_before"].get(phase, 0.0) for r in ranks) / len(ranks)
        for phase in PHASES
        if any(phase in r["idle_before"] for r in ranks)
    }
    return {
        "device": (
            torch.cuda.get_device_name(pc.device)
            if pc.device.type == "cuda"
            else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
        ),
        "device_type": pc.device.type,
        "torch": torch.__version__,
        "world": pc.world,
        "dp": pc.dp,
        "cp": pc.cp,
        "seq_len": config.data.seq_len,
        "attention": config.attention.mode,
        "warmup": max(warmup, steps),
        "steps": steps,
        "model": {
            "layers": trainer.model.config.num_hidden_layers,
            "hidden": trainer.model.config.hidden_size,
            "parameters": trainer.num_params,
        },
        "tokens_per_s_per_rank": last["tokens_per_s"],
        "tflops_per_rank": last["tflops"],
        "mfu": last.get("mfu"),
        "peak_mem_gib": last["peak_mem_gib"],
        "sparse_recall": last.get("sparse_recall"),
        "sparse_density": last.get("sparse_density"),
        "ring_imbalance": last.get("ring_imbalance"),
        "layers": last.get("layers"),
        # one-time costs inside the profiled steps (train/builds.py), 0 unless the warm-up missed some
        "builds": {key: sum(m.get(key, 0) for m in metrics) for key in ("kernels_built", "plans_captured")},
        "mean": mean,
        "ranks": ranks,
        "top_kernels": top_kernels(by_kernel),  # this rank's (rank 0's in the report)
        "host": host,  # this rank's
        "traces": str(trace.parent) if trace is not None else None,
    }


def markdown_table(result: dict[str, Any]) -> str:
    mean = result["mean"]
    unit = "kernel time" if result["device_type"] == "cuda" else "CPU time"
    lines = [
        f"{result['device']} · torch {result['torch']} · {result['world']} rank(s) (dp {result['dp']} × cp "
        f"{result['cp']}) · {result['seq_len']:,} tokens per sequence · attention {result['attention']} · "
        f"{result['model']['parameters'] / 1e6:,.1f}M parameters · mean over ranks of {result['steps']} "
        f"step(s), ms per step ({unit})",
        "",
        "| phase | ms / step | share of step |",
        "|---|---|---|",
    ]
    for phase in PHASES:
        lines.append(f"| {phase} | {mean[phase]:.1f} | {mean[phase] / mean['step_ms']:.1%} |")
    total = sum(mean[p] for p in PHASES)
    lines.append(f"| sum of phases | {total:.1f} | {total / mean['step_ms']:.1%} |")
    lines.append(f"| step (wall) | {mean['step_ms']:.1f} | 100% |")
    if result["device_type"] == "cuda":
        lines.append(f"| GPU idle | {mean['idle_ms']:.1f} | {mean['idle_ms'] / mean['step_ms']:.1%} |")
        waits = ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in mean["idle_before"].items())
        lines += [
            "",
            f"GPU idle, by the phase the GPU waited for (its host side was slower than the GPU): {waits or 'none'}",
        ]
    builds = result.get("builds") or {}
    if any(builds.values()):
        lines += [
            "",
            f"**The profiled steps built {builds['kernels_built']} Triton kernels and captured "
            f"{builds['plans_captured']} plans** (rank 0) although the warm-up read the same batches: their times "
            "include those one-time costs.",
        ]
    mfu = f" · MFU {result['mfu']:.1%}" if result.get("mfu") else ""
    lines += [
        "",
        f"tokens/s per rank {result['tokens_per_s_per_rank']:,.0f} · {result['tflops_per_rank']:.2f} TFLOP/s "
        f"per rank{mfu} · peak memory {result['peak_mem_gib']:.1f} GiB",
        "",
        f"Largest {'kernels' if result['device_type'] == 'cuda' else 'ops'} of each phase (rank 0):",
        "",
        "| phase | name | ms / step |",
        "|---|---|---|",
    ]
    for phase, kernels in result["top_kernels"].items():
        lines += [f"| {phase} | `{shorten(name)}` | {ms:.2f} |" for name, ms in kernels]
    host = result["host"]
    ops = "; ".join(f"`{shorten(name, 60)}` {ms:.1f} ms ({calls:,.0f} calls)" for name, ms, calls in host["top_ops"])
    lines += ["", f"Host, rank 0, per step: {host['launches']:,.0f} kernel launches; most own CPU time: {ops}"]
    if result.get("traces"):
        lines += ["", f"Profiler traces: {result['traces']}/rank<N>.json (chrome://tracing, Perfetto)"]
    return "\n".join(lines)


def shorten(name: str, width: int = 90) -> str:
    """A kernel's name for a table cell: templated CUDA names run to hundreds of characters."""
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 1] + "…"
