"""`mtrain profile crossover`: the work share above which sparse attention is slower than dense, per length
and head dim (the table attention/crossover.py ships).

For each length S and head dim, one document of planted inputs (profile/synthetic.py) in a real model's
attention shape, forward+backward in bf16:
- dense: mtrain's dense path, what a layer above the crossover runs (one document: SDPA is_causal);
- full: our sparse kernels on a layout that computes every causal block (work share 1);
- plan: what pattern estimation + layout add per layer inside a step of 4 layers (profile/kernels.py);
- planted: our kernels on the plan of the planted inputs, at its work share w.
Sparse kernel time is a line in the work share through the two measured points, fixed + (full − fixed)·share
(fixed: the per-row passes, which at low shares cost more than their blocks); the crossover is the share
where plan + that line reaches dense: (dense − plan − fixed) / (full − fixed), clamped to [0, 1].
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from datetime import date
from typing import Any, Callable

import torch

from mtrain_cli.attention.dense import dense_attention
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.ops import SparseAttentionFunction, plan_sparse
from mtrain_cli.attention.sparse.pattern import SENTINEL, Pattern, SparseSettings, document_spans
from mtrain_cli.profile.kernels import _fwd_bwd, cuda_time_ms, plan_cost_in_step
from mtrain_cli.profile.synthetic import planted_qkv

# head dim -> (query heads, KV heads): the Qwen2.5-0.5B and Qwen2.5-3B attention shapes
HEADS = {64: (14, 2), 128: (16, 2)}


@dataclass(frozen=True)
class CrossoverSpec:
    lengths: list[int]
    head_dims: tuple[int, ...]
    repeats: int
    planted_slashes: int = 8
    settings: SparseSettings = SparseSettings(dense_below=0)  # one long document: probed and planned


def _full_layout(seq_len: int, heads: int, doc_BS: torch.Tensor, block: int):
    """Every row dense over its causal range: no slashes or verticals, every document below dense_below."""
    B, device = doc_BS.shape[0], doc_BS.device
    empty = Pattern(torch.full((B, heads, 1), SENTINEL, dtype=torch.int32, device=device),
                    torch.full((B, heads, 1), SENTINEL, dtype=torch.int32, device=device))
    start_BS, length_BS = document_spans(doc_BS)
    return build_layout(empty, start_BS, length_BS, seq_len, block, dense_below=2**62)


def measure(seq_len: int, head_dim: int, spec: CrossoverSpec, device: torch.device) -> dict[str, Any]:
    H, Hk = HEADS[head_dim]
    scale = head_dim ** -0.5
    q, k, v = planted_qkv(1, H, Hk, seq_len, head_dim, torch.bfloat16, device, num_slash=spec.planted_slashes)
    doc_BS = torch.zeros(1, seq_len, dtype=torch.int32, device=device)
    dout = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def sparse_step(layout) -> Callable[[], None]:
        return _fwd_bwd(lambda: SparseAttentionFunction.apply(*leaves, layout, doc_BS, scale), leaves, dout)

    dense_ms = cuda_time_ms(_fwd_bwd(lambda: dense_attention(*leaves, doc_BS, scale), leaves, dout), spec.repeats)
    full_ms = cuda_time_ms(sparse_step(_full_layout(seq_len, H, doc_BS, spec.settings.block_size)), spec.repeats)
    plan = plan_sparse(q, k, doc_BS, scale, spec.settings)
    share = float(plan.work_share)
    ready_ms, planned_ms = plan_cost_in_step(q, k, v, doc_BS, scale, spec.settings, plan.layout, dout, layers=4,
                                             repeats=spec.repeats)
    plan_ms = planned_ms - ready_ms
    # sparse kernel time as a line in the work share through the two measured points: a fixed cost (the
    # per-row passes) plus a cost per block
    fixed_ms = max(0.0, (ready_ms - share * full_ms) / (1.0 - share))
    crossover = (dense_ms - plan_ms - fixed_ms) / (full_ms - fixed_ms)
    return {"seq_len": seq_len, "head_dim": head_dim, "heads": H, "kv_heads": Hk, "dense_ms": dense_ms,
            "sparse_full_ms": full_ms, "plan_ms": plan_ms, "planted_work_share": share,
            "planted_sparse_ms": ready_ms, "sparse_fixed_ms": fixed_ms, "crossover": min(1.0, max(0.0, crossover))}


def run_crossover_profile(spec: CrossoverSpec, log: Callable[[str], None],
                          save: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    device = torch.device("cuda")
    import triton

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "triton": triton.__version__, "python": platform.python_version(),
                              "date": date.today().isoformat(), "settings": spec.settings.__dict__,
                              "planted_slashes": spec.planted_slashes, "rows": []}
    for head_dim in spec.head_dims:
        for seq_len in spec.lengths:
            row = measure(seq_len, head_dim, spec, device)
            log(f"{seq_len // 1024}K, head dim {head_dim}: dense {row['dense_ms']:.2f} ms · sparse at full work "
                f"{row['sparse_full_ms']:.2f} ms · plan {row['plan_ms']:.2f} ms · planted share "
                f"{row['planted_work_share']:.3f}: {row['planted_sparse_ms']:.2f} ms (fixed part "
                f"{row['sparse_fixed_ms']:.2f}) · crossover {row['crossover']:.3f}")
            result["rows"].append(row)
            torch.cuda.empty_cache()
            save(result)
    result["table"] = {str(d): [[r["seq_len"], round(r["crossover"], 3)] for r in result["rows"] if r["head_dim"] == d]
                       for d in spec.head_dims}
    return result


def markdown_table(result: dict[str, Any]) -> str:
    lines = [f"{result['device']} · torch {result['torch']} · triton {result['triton']} · {result['date']} · bf16, "
             f"one document, forward+backward (ms); plan per layer inside a 4-layer step", "",
             "| length | head dim | heads (q/kv) | dense | sparse, full work | plan | crossover share | "
             "planted share | planted sparse | fixed part |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['seq_len'] // 1024}K | {r['head_dim']} | {r['heads']}/{r['kv_heads']} | "
                     f"{r['dense_ms']:.2f} | {r['sparse_full_ms']:.2f} | {r['plan_ms']:.2f} | {r['crossover']:.3f} | "
                     f"{r['planted_work_share']:.3f} | {r['planted_sparse_ms']:.2f} | "
                     f"{r['sparse_fixed_ms']:.2f} |")
    return "\n".join(lines)
