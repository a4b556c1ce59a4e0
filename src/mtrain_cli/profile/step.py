"""`mtrain profile step`: where a training step's time goes, per phase, from torch.profiler.

Builds the trainer for a recipe (under torchrun for several ranks: FSDP2 × context parallelism as in
`mtrain extend`), warms up, profiles --steps steps (each launched before the previous one is read, as training
runs them) and sums, per step and rank, the device time of every CUDA
kernel (on CPU: every op's own CPU time) into phases. The warm-up's last --steps steps read the very batches
then profiled: a batch of new shapes builds Triton kernels and captures a sparse plan (train/kernel_builds.py), one-time
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
from mtrain_cli.profile.trace import (
    ATTENTION_RANGE,
    OPTIMIZER_RANGE,
    PHASES,
    classify,
    host_waits,
    idle_before,
    idle_causes,
    kernel_totals,
    range_phase,
    trace_kernels,
)

if TYPE_CHECKING:
    from mtrain_cli.parallel import ParallelContext

TOP_KERNELS = 5  # per phase, in the report
TOP_HOST_OPS = 8
TOP_IDLE_CAUSES = 6
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _ancestor_phase(event) -> str | None:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return range_phase(names)


def kernel_times(
    prof, device: torch.device, num_steps: int, trace: Path | None = None
) -> tuple[dict[tuple[str, str], float], dict[str, float], list[list]]:
    """(milliseconds per step of each (phase, kernel name), GPU idle per step by the phase it waited for, the
    idle's largest causes (profile.trace.idle_causes)): kernel time on CUDA, own CPU time of each op on CPU (no
    idle). `trace`: keep the chrome trace there."""
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    if device.type == "cuda":
        with tempfile.TemporaryDirectory(prefix="mtrain-trace-") as tmp:
            if trace is None:
                trace = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(trace))
            events = json.loads(trace.read_text())["traceEvents"]
        kernels = trace_kernels(events)
        causes = idle_causes(kernels, host_waits(events), num_steps, TOP_IDLE_CAUSES)
        return kernel_totals(kernels, num_steps), idle_before(kernels, num_steps), causes
    totals: dict[tuple[str, str], float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if event.name not in (ATTENTION_RANGE, PLAN_RANGE, OPTIMIZER_RANGE):
            key = (classify(event.name, event.name, _ancestor_phase(event)), event.name)
            totals[key] = totals.get(key, 0.0) + event.self_cpu_time_total / 1e3 / num_steps
    return totals, {}, []


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
    from mtrain_cli.train import parallel_scope

    with parallel_scope(config) as pc:  # the groups go once the trainer, made inside, is out of scope
        trace = trace_dir / f"rank{pc.rank}.json" if trace_dir is not None else None
        return _profile(config, warmup, steps, console if pc.is_main else Console(file=io.StringIO()), pc, trace)


def _profile(
    config: Config, warmup: int, steps: int, quiet: Console, pc: ParallelContext, trace: Path | None
) -> dict[str, Any]:
    from mtrain_cli.train import build_trainer

    with tempfile.TemporaryDirectory(prefix="mtrain-profile-") as run_dir:
        trainer = build_trainer(config, Path(run_dir), quiet, pc)
        trainer.run_steps(max(0, warmup - steps))  # --warmup beyond --steps: earlier batches
        # the profiled batches last: bounded caches (PlanGraph keeps 8 shapes) hold theirs when the profile starts
        with trainer.rewinding_data():
            trainer.run_steps(steps)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if pc.device.type == "cuda" else [])
        with _without_kineto_markers(), profile(activities=activities) as prof:
            results = trainer.run_steps(steps)  # one launched ahead of the other's reading, as in training
        metrics = [trainer.meter(result) for result in results]
        by_kernel, idle, causes = kernel_times(prof, pc.device, steps, trace)
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
        # one-time costs inside the profiled steps (train/kernel_builds.py), 0 unless the warm-up missed some
        "builds": {key: sum(m.get(key, 0) for m in metrics) for key in ("kernels_built", "plans_captured")},
        "mean": mean,
        "ranks": ranks,
        "top_kernels": top_kernels(by_kernel),  # this rank's (rank 0's in the report)
        "host": host,  # this rank's
        "idle_causes": causes,  # this rank's
        "traces": str(trace.parent) if trace is not None else None,
    }


def step_table(result: dict[str, Any]) -> str:
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
        if result.get("idle_causes"):
            causes = "; ".join(
                f"{shorten(cause, 120)} {ms:.1f} ms ({gaps:,.0f} gaps)" for cause, ms, gaps in result["idle_causes"]
            )
            lines += ["", f"GPU idle by cause (rank 0, per step: a host wait that drained it, or launches): {causes}"]
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
