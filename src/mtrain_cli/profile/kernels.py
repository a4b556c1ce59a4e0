"""`mtrain profile kernels`: our sparse kernels against dense SDPA and FlexAttention, in one run.

For each sequence length and pattern family (planted: estimated by our flex estimator on inputs with
planted vertical/slash structure; random: uniformly random verticals and slashes), times forward, backward
and forward+backward of our Triton kernels; dense SDPA with the cuDNN and flash backends; FlexAttention on
exactly the same pattern and on its slash blocks alone; and pattern estimation + block layout. Work is
counted on the blocks the layout computes (vertical columns as 1/block of a block each); TFLOP/s on active
work use 4·D FLOPs per (query, key) pair forward and 2.5× that backward. Density is the share of causal blocks
the layout computes (a slash counts every aligned block it crosses).
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F

from mtrain_cli.attention import AttentionConfig, BatchCache, document_spans
from mtrain_cli.attention.sparse import (
    PlanGraph,
    SparseAttentionFunction,
    attention_delta,
    autotuned_kernels,
    batch_geometry,
    build_layout,
    estimate_pattern,
    plan_sparse,
    reference_attention,
    sparse_backward,
    sparse_forward,
    tile_mask_bounds,
)
from mtrain_cli.profile.synthetic import planted_qkv, random_pattern


@dataclass(frozen=True)
class KernelProfileSpec:
    """What `mtrain profile kernels` runs; its defaults are the command's options."""

    lengths: list[int]
    patterns: list[str]  # "planted", "random"
    flex_lengths: tuple[int, ...]  # FlexAttention compiles per length: the anchor lengths
    block_sizes: tuple[int, ...]  # layout blocks to compare (kernel tiles follow)
    # far slashes planted per KV head, one planted case each: fewer planted slashes leave more of each row's
    # mass to the diffuse rest, so the estimator keeps more. At 128K: 16 -> density 0.081, 8 -> 0.131, 4 -> 0.193
    planted_slashes: tuple[int, ...]
    repeats: int
    num_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    random_vertical: int = 1024
    random_slash_spacing: int = 2048  # one random slash offset per this many tokens (about 12% density)
    settings: AttentionConfig = field(default_factory=AttentionConfig)


def cuda_time_ms(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median of `repeats` timed calls (CUDA events), after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def kernel_table(fn: Callable[[], Any], repeats: int) -> list[dict[str, Any]]:
    """CUDA time per kernel name (torch.profiler), averaged over `repeats` calls after one warm-up; largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    rows = [
        {"name": e.key[:90], "calls": e.count // repeats, "cuda_ms": e.device_time_total / 1e3 / repeats}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["cuda_ms"])


def fwd_bwd(run: Callable[[], torch.Tensor], inputs: list[torch.Tensor], dout: torch.Tensor) -> Callable[[], None]:
    def step():
        for t in inputs:
            t.grad = None
        run().backward(dout)

    return step


def plan_cost_in_step(
    q, k, v, doc_BS, scale: float, settings: AttentionConfig, layout, dout, layers: int, repeats: int
) -> tuple[float, float]:
    """-> per layer (fwd+bwd on a ready layout, plan + fwd+bwd), `layers` layers enqueued back to back.

    The plan issues no device sync, so in a step its host work overlaps the kernels of the layer before and
    what it adds is its GPU time plus launch gaps: the cost a training step pays. Timed alone, with nothing
    else queued, the plan measures its host time instead."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    cache, graph = BatchCache(), PlanGraph()  # a model's: one per run, shared by its layers

    def step(with_plan: bool) -> None:
        for _ in range(layers):
            layer_layout = plan_sparse(q, k, doc_BS, scale, settings, cache, graph).layout if with_plan else layout
            for t in leaves:
                t.grad = None
            SparseAttentionFunction.apply(*leaves, layer_layout, doc_BS, scale, cache).backward(dout)

    ready_ms = cuda_time_ms(lambda: step(False), repeats) / layers
    planned_ms = cuda_time_ms(lambda: step(True), repeats) / layers
    return ready_ms, planned_ms


def _sdpa(q, k, v, backend):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _active_pairs(layout) -> float:
    """(query, key) pairs the kernels compute, summed over batch and heads (blocks counted whole)."""
    return float(layout.active_blocks().sum()) * layout.block**2


def _relative_errors(pairs) -> dict[str, float]:
    return {
        name: float((got.detach().float() - want.detach()).norm() / want.detach().norm()) for name, got, want in pairs
    }


def _accuracy(spec: KernelProfileSpec, device: torch.device, inputs: str) -> dict[str, dict[str, float]]:
    """Relative error (Frobenius) of our half-precision kernels against the fp32 reference on the same layout,
    and, as an anchor, of dense SDPA (flash) in the same precision against dense fp32 on the same inputs."""
    seq_len, scale = 4096, spec.head_dim**-0.5
    if inputs == "planted":
        q, k, v = planted_qkv(1, spec.num_heads, spec.num_kv_heads, seq_len, spec.head_dim, spec.dtype, device)
    else:
        gen = torch.Generator(device="cpu").manual_seed(2)
        q, k, v = (
            torch.randn(1, h, seq_len, spec.head_dim, generator=gen).to(device, spec.dtype)
            for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads)
        )
    settings = replace(spec.settings, dense_below=0)
    cache = BatchCache()
    plan = plan_sparse(q, k, None, scale, settings, cache, PlanGraph())
    dout = torch.randn_like(q)
    from torch.nn.attention import SDPBackend

    def errors(run_half, run_fp32) -> dict[str, float]:
        half = [t.detach().requires_grad_() for t in (q, k, v)]
        full = [t.detach().float().requires_grad_() for t in (q, k, v)]
        out_half, out_full = run_half(*half), run_fp32(*full)
        out_half.backward(dout)
        out_full.backward(dout.float())
        return _relative_errors(
            [
                ("out", out_half, out_full),
                *((name, a.grad, b.grad) for name, a, b in zip(("dq", "dk", "dv"), half, full)),
            ]
        )

    doc = plan.document_ids_BS
    ours = errors(
        lambda *t: SparseAttentionFunction.apply(*t, plan.layout, doc, scale, cache),
        lambda *t: reference_attention(*t, plan.layout, doc, doc, scale)[0],
    )
    anchor = errors(lambda *t: _sdpa(*t, SDPBackend.FLASH_ATTENTION), lambda *t: _sdpa(*t, SDPBackend.MATH))
    return {"ours_sparse": ours, "dense_flash_anchor": anchor}


def _flex_step(q, k, v, dout, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    run = lambda: compiled(*leaves, block_mask=block_mask, enable_gqa=True)  # noqa: E731
    return run, fwd_bwd(run, leaves, dout)


def profile_case(
    spec: KernelProfileSpec,
    seq_len: int,
    pattern: str,
    block: int,
    device: torch.device,
    dense_cache: dict[int, dict[str, float]],
    log: Callable[[str], None],
    num_slash: int | None = None,
) -> dict[str, Any]:
    """One length × pattern × block; num_slash: the planted slashes per KV head (planted pattern only)."""
    H, Hk, D = spec.num_heads, spec.num_kv_heads, spec.head_dim
    scale = D**-0.5
    settings = replace(spec.settings, dense_below=0, block_size=block)  # one document
    if pattern == "planted":
        q, k, v = planted_qkv(1, H, Hk, seq_len, D, spec.dtype, device, num_slash=num_slash)
    else:
        gen = torch.Generator(device="cpu").manual_seed(1)
        q, k, v = (torch.randn(1, h, seq_len, D, generator=gen).to(device, spec.dtype) for h in (H, Hk, Hk))
    doc_BS = torch.zeros(1, seq_len, dtype=torch.int32, device=device)
    start_BS, length_BS = document_spans(doc_BS)
    cache, graph = BatchCache(), PlanGraph()

    if pattern == "planted":
        # per layer: the batch's geometry is cached across a model's layers, so it is timed apart (once per batch)
        plan_ms = cuda_time_ms(lambda: plan_sparse(q, k, doc_BS, scale, settings, cache, graph), repeats=spec.repeats)
        geometry_ms = cuda_time_ms(
            lambda: batch_geometry(doc_BS.clone(), 1, seq_len, device, settings, cache), repeats=spec.repeats
        )
        estimate_ms = cuda_time_ms(lambda: estimate_pattern(q, k, doc_BS, scale, settings), repeats=spec.repeats)
        plan = plan_sparse(q, k, doc_BS, scale, settings, cache, graph)
        layout, recall = plan.layout, float(plan.recall_BH.mean())
    else:
        chosen = random_pattern(
            1, H, seq_len, spec.random_vertical, seq_len // spec.random_slash_spacing, settings.local_window, device
        )
        plan_ms = cuda_time_ms(
            lambda: build_layout(chosen, start_BS, length_BS, seq_len, settings.block_size, 0), repeats=spec.repeats
        )
        layout, recall = build_layout(chosen, start_BS, length_BS, seq_len, settings.block_size, 0), None
        estimate_ms = geometry_ms = 0.0
    density = float(layout.density())
    density_ms = cuda_time_ms(layout.density, repeats=spec.repeats)  # accounting, read once per step for logs
    pairs = _active_pairs(layout)
    flops_fwd = 4.0 * D * pairs
    label = pattern if num_slash is None else f"{pattern} ({num_slash} slashes)"
    log(
        f"{seq_len // 1024}K {label}, block {block}: density {density:.3f}, recall {recall}, "
        f"plan {plan_ms:.2f} ms per layer (+ {geometry_ms:.2f} ms once per batch; density accounting "
        f"{density_ms:.2f} ms)"
    )

    dout = torch.randn_like(q)
    bounds = tile_mask_bounds(doc_BS, doc_BS, layout.block, layout.mask_shift)  # per batch, as in a model
    out, lse = sparse_forward(q, k, v, layout, doc_BS, doc_BS, scale, mask_bounds=bounds)
    fwd_ms = cuda_time_ms(
        lambda: sparse_forward(q, k, v, layout, doc_BS, doc_BS, scale, mask_bounds=bounds), spec.repeats
    )
    delta = attention_delta(out, dout)
    bwd_ms = cuda_time_ms(
        lambda: sparse_backward(
            q, k, v, out, lse, dout, layout, doc_BS, doc_BS, scale, delta_BHS=delta, mask_bounds=bounds
        ),
        spec.repeats,
    )
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ours = fwd_bwd(lambda: SparseAttentionFunction.apply(*leaves, layout, doc_BS, scale, cache), leaves, dout)
    torch.cuda.reset_peak_memory_stats(device)
    fwd_bwd_ms = cuda_time_ms(ours, spec.repeats)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30
    row = {
        "seq_len": seq_len,
        "pattern": pattern,
        "planted_slashes": num_slash,
        "block": block,
        "density": density,
        "recall": recall,
        "plan_alone_ms": plan_ms,
        "geometry_ms": geometry_ms,
        "density_ms": density_ms,
        "estimate_ms": estimate_ms,
        "sparse_fwd_ms": fwd_ms,
        "sparse_bwd_ms": bwd_ms,
        "sparse_fwd_bwd_ms": fwd_bwd_ms,
        "sparse_fwd_tflops": flops_fwd / fwd_ms / 1e9,
        "sparse_bwd_tflops": 2.5 * flops_fwd / bwd_ms / 1e9,
        "sparse_fwd_bwd_tflops": 3.5 * flops_fwd / fwd_bwd_ms / 1e9,
        "sparse_peak_gib": peak_gib,
    }
    log(
        f"  ours fwd {fwd_ms:.2f} ms · bwd {bwd_ms:.2f} ms · fwd+bwd {fwd_bwd_ms:.2f} ms "
        f"({row['sparse_fwd_bwd_tflops']:.0f} TFLOP/s active) · peak {peak_gib:.1f} GiB"
    )
    if pattern == "planted":
        ready_ms, planned_ms = plan_cost_in_step(
            q, k, v, doc_BS, scale, settings, layout, dout, layers=4, repeats=spec.repeats
        )
        row.update(plan_in_step_ms=planned_ms - ready_ms, plan_share_of_step=(planned_ms - ready_ms) / planned_ms)
        log(
            f"  plan in a 4-layer step: adds {planned_ms - ready_ms:.2f} ms per layer "
            f"({row['plan_share_of_step']:.1%} of {planned_ms:.1f} ms); alone {plan_ms:.2f} ms"
        )

    if seq_len not in dense_cache:
        from torch.nn.attention import SDPBackend

        dense = {}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            dl = [t.detach().requires_grad_() for t in (q, k, v)]
            try:
                dense[f"dense_{name}_fwd_bwd_ms"] = cuda_time_ms(
                    fwd_bwd(lambda: _sdpa(*dl, backend), dl, dout), spec.repeats
                )
            except RuntimeError as exc:  # a backend that cannot run this shape: recorded, not hidden
                dense[f"dense_{name}_error"] = str(exc).splitlines()[0][:200]
            log(f"  dense {name}: {dense.get(f'dense_{name}_fwd_bwd_ms', dense.get(f'dense_{name}_error'))}")
        dense_cache[seq_len] = dense
    row.update(dense_cache[seq_len])

    if seq_len in spec.flex_lengths:
        from mtrain_cli.profile.flex import block_masks

        for name, mask in block_masks(layout).items():
            fwd, step = _flex_step(q, k, v, dout, mask)
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            row[f"flex_{name}_compile_s"] = time.perf_counter() - t0
            row[f"flex_{name}_fwd_ms"] = cuda_time_ms(fwd, spec.repeats)
            row[f"flex_{name}_fwd_bwd_ms"] = cuda_time_ms(step, spec.repeats)
            fwd_ms, fwd_bwd_ms = row[f"flex_{name}_fwd_ms"], row[f"flex_{name}_fwd_bwd_ms"]
            log(f"  flex {name}: fwd {fwd_ms:.2f} ms, fwd+bwd {fwd_bwd_ms:.2f} ms")
    return row


def run_kernel_profile(
    spec: KernelProfileSpec, log: Callable[[str], None], save: Callable[[dict[str, Any]], None] = lambda result: None
) -> dict[str, Any]:
    """Run every case; `save` receives the partial result after each one (a long sweep keeps what it measured)."""
    if not torch.cuda.is_available():
        raise RuntimeError("mtrain profile kernels needs a CUDA GPU")
    device = torch.device("cuda")
    import triton

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "dtype": str(spec.dtype),
        },
        "settings": spec.settings.__dict__,
        "planted_slashes": list(spec.planted_slashes),
        "random_pattern": {"num_vertical": spec.random_vertical, "slash_spacing": spec.random_slash_spacing},
    }
    result["accuracy_vs_fp32"] = {inputs: _accuracy(spec, device, inputs) for inputs in ("random", "planted")}
    log(f"accuracy (relative error vs fp32 reference, 4K): {result['accuracy_vs_fp32']}")
    dense_cache: dict[int, dict[str, float]] = {}
    result["rows"] = rows = []
    for seq_len in spec.lengths:
        cases = [
            (pattern, num_slash)
            for pattern in spec.patterns
            for num_slash in (spec.planted_slashes if pattern == "planted" else (None,))
        ]
        for pattern, num_slash in cases:
            for block in spec.block_sizes:
                row = profile_case(spec, seq_len, pattern, block, device, dense_cache, log, num_slash)
                # the configs this case ran with (the autotuner's choice for its last key)
                row["autotuned"] = {
                    name: str(getattr(kernel, "best_config", None)) for name, kernel in autotuned_kernels().items()
                }
                log(f"  autotuned: {row['autotuned']}")
                rows.append(row)
                torch.cuda.empty_cache()
                save(result)
    return result


def kernel_profile_table(result: dict[str, Any]) -> str:
    def ms(row, key):
        value = row.get(key)
        return f"{value:.1f}" if isinstance(value, float) and math.isfinite(value) else "–"

    lines = [
        f"{result['device']} · torch {result['torch']} · triton {result['triton']} · "
        f"{result['shape']['num_heads']} q heads / {result['shape']['num_kv_heads']} kv heads, "
        f"head dim {result['shape']['head_dim']}, {result['shape']['dtype']}, causal, forward+backward (ms)",
        "",
        "| length | pattern | block | density | recall | ours fwd | ours bwd | ours fwd+bwd | TFLOP/s active | "
        "plan per layer in a step (share) | plan alone | geometry per batch | dense cuDNN | dense flash | "
        "flex exact | flex slash-only | ours vs cuDNN | ours vs flex exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        recall = f"{r['recall']:.3f}" if r["recall"] is not None else "–"
        vs_cudnn = (
            f"{r['dense_cudnn_fwd_bwd_ms'] / r['sparse_fwd_bwd_ms']:.1f}×" if "dense_cudnn_fwd_bwd_ms" in r else "–"
        )
        vs_flex = f"{r['sparse_fwd_bwd_ms'] / r['flex_exact_fwd_bwd_ms']:.2f}" if "flex_exact_fwd_bwd_ms" in r else "–"
        plan_in_step = f"{r['plan_in_step_ms']:.1f} ({r['plan_share_of_step']:.1%})" if "plan_in_step_ms" in r else "–"
        pattern = r["pattern"] if r.get("planted_slashes") is None else f"{r['pattern']} ({r['planted_slashes']})"
        lines.append(
            f"| {r['seq_len'] // 1024}K | {pattern} | {r['block']} | {r['density']:.3f} | "
            f"{recall} | "
            f"{ms(r, 'sparse_fwd_ms')} | {ms(r, 'sparse_bwd_ms')} | {ms(r, 'sparse_fwd_bwd_ms')} | "
            f"{r['sparse_fwd_bwd_tflops']:.0f} | {plan_in_step} | {ms(r, 'plan_alone_ms')} | "
            f"{ms(r, 'geometry_ms')} | {ms(r, 'dense_cudnn_fwd_bwd_ms')} | "
            f"{ms(r, 'dense_flash_fwd_bwd_ms')} | {ms(r, 'flex_exact_fwd_bwd_ms')} | "
            f"{ms(r, 'flex_slash_only_fwd_bwd_ms')} | {vs_cudnn} | {vs_flex} |"
        )
    return "\n".join(lines)
