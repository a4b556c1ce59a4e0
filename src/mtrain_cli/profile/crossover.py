"""`mtrain profile crossover`: what a sparse layer costs relative to dense attention, per length and head dim
(the table attention/crossover.py ships).

For each length S and head dim, one document in a real model's attention shape, forward+backward in bf16:
- dense: mtrain's dense path, what a layer the rule sends dense runs (one document: SDPA is_causal);
- ranges: our kernels on a layout that walks every causal block as a tile (range work share 1);
- verticals: our kernels on a layout that gathers every causal column as a vertical (vertical share 1);
- planted and random: our kernels on the plans of planted inputs (profile/synthetic.py: few strong lines)
  and of random inputs (what a randomly initialised model gives: cap-limited, many verticals), each inside
  a step of 4 layers, with and without the plan (profile/kernels.py): the plan's cost is the difference.
Kernel time is modelled as fixed + per_range·r + per_vertical·v in the two work shares (r, v), fitted by
least squares to the four kernel points; the table stores every term relative to dense, with the plan's
cost the larger of the two plans' (attention/crossover.py says how a layer is judged by them).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import date
from typing import Any

import torch

from mtrain_cli.attention import (
    MEASURED_HEADS,
    AttentionConfig,
    BatchCache,
    SparseCost,
    dense_attention,
    document_spans,
)
from mtrain_cli.attention.sparse import (
    SENTINEL,
    Pattern,
    PlanGraph,
    SparseAttentionFunction,
    build_layout,
    plan_sparse,
    visible_blocks,
    work_split,
)
from mtrain_cli.profile.kernels import cuda_time_ms, fwd_bwd, plan_cost_in_step
from mtrain_cli.profile.synthetic import planted_qkv


@dataclass(frozen=True)
class CrossoverSpec:
    lengths: list[int]
    head_dims: tuple[int, ...]
    repeats: int
    planted_slashes: int = 8
    settings: AttentionConfig = field(default_factory=lambda: AttentionConfig(dense_below=0))  # one long document


def _layout_of(vertical_BHV: torch.Tensor, doc_BS: torch.Tensor, block: int, dense_below: int):
    B, H = vertical_BHV.shape[:2]
    no_slash = torch.full((B, H, 1), SENTINEL, dtype=torch.int32, device=doc_BS.device)
    start_BS, length_BS = document_spans(doc_BS)
    return build_layout(Pattern(vertical_BHV, no_slash), start_BS, length_BS, doc_BS.shape[1], block, dense_below)


def full_range_layout(heads: int, doc_BS: torch.Tensor, block: int):
    """Every row dense over its causal range: no slashes or verticals, every document below dense_below."""
    none_BHV = torch.full((doc_BS.shape[0], heads, 1), SENTINEL, dtype=torch.int32, device=doc_BS.device)
    return _layout_of(none_BHV, doc_BS, block, dense_below=2**62)


def full_vertical_layout(heads: int, doc_BS: torch.Tensor, block: int):
    """Every column a vertical: each row gathers all the keys up to its diagonal."""
    B, S = doc_BS.shape
    columns_BHV = torch.arange(S, dtype=torch.int32, device=doc_BS.device).expand(B, heads, S).contiguous()
    return _layout_of(columns_BHV, doc_BS, block, dense_below=0)


def fit_kernel_time(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(range share, vertical share, ms) points -> (fixed, per_range, per_vertical) ms by least squares, none
    negative (a negative fixed part is refitted at zero)."""
    A = torch.tensor([[1.0, r, v] for r, v, _ in points], dtype=torch.float64)
    t = torch.tensor([[ms] for *_, ms in points], dtype=torch.float64)
    fixed, per_range, per_vertical = torch.linalg.lstsq(A, t).solution.flatten().tolist()
    if fixed < 0:
        per_range, per_vertical = torch.linalg.lstsq(A[:, 1:], t).solution.flatten().tolist()
        fixed = 0.0
    return fixed, max(per_range, 0.0), max(per_vertical, 0.0)


def measure(seq_len: int, head_dim: int, spec: CrossoverSpec, device: torch.device) -> dict[str, Any]:
    H, Hk = MEASURED_HEADS[head_dim]
    scale, block = head_dim**-0.5, spec.settings.block_size
    doc_BS = torch.zeros(1, seq_len, dtype=torch.int32, device=device)
    visible = visible_blocks(document_spans(doc_BS)[0], block)
    planted = planted_qkv(1, H, Hk, seq_len, head_dim, torch.bfloat16, device, num_slash=spec.planted_slashes)
    gen = torch.Generator(device="cpu").manual_seed(0)
    random = tuple(torch.randn(1, h, seq_len, head_dim, generator=gen).to(device, torch.bfloat16) for h in (H, Hk, Hk))
    dout = torch.randn_like(planted[0])
    cache, graph = BatchCache(), PlanGraph()

    def kernel_ms(layout, qkv) -> float:
        leaves = [t.detach().requires_grad_() for t in qkv]
        return cuda_time_ms(
            fwd_bwd(lambda: SparseAttentionFunction.apply(*leaves, layout, doc_BS, scale, cache), leaves, dout),
            spec.repeats,
        )

    leaves = [t.detach().requires_grad_() for t in planted]
    row: dict[str, Any] = {
        "seq_len": seq_len,
        "head_dim": head_dim,
        "heads": H,
        "kv_heads": Hk,
        "block": block,
        "dense_ms": cuda_time_ms(
            fwd_bwd(lambda: dense_attention(*leaves, doc_BS, scale, cache), leaves, dout), spec.repeats
        ),
    }
    points, plan_ms = [], []
    for name, layout in (
        ("ranges", full_range_layout(H, doc_BS, block)),
        ("verticals", full_vertical_layout(H, doc_BS, block)),
    ):
        r, v, _ = work_split(layout, visible).tolist()
        row[name] = {"range_share": r, "vertical_share": v, "ms": kernel_ms(layout, planted)}
        points.append((r, v, row[name]["ms"]))
    for name, (q, k, v_) in (("planted", planted), ("random", random)):
        plan = plan_sparse(q, k, doc_BS, scale, spec.settings, cache, graph)
        r, v, _ = plan.work_split_bound().tolist()
        ready_ms, planned_ms = plan_cost_in_step(
            q, k, v_, doc_BS, scale, spec.settings, plan.layout, dout, layers=4, repeats=spec.repeats
        )
        row[name] = {
            "range_share": r,
            "vertical_share": v,
            "ms": ready_ms,
            "plan_ms": planned_ms - ready_ms,
            "recall": float(plan.recall_BH.mean()),
        }
        points.append((r, v, ready_ms))
        plan_ms.append(planned_ms - ready_ms)
    fixed, per_range, per_vertical = fit_kernel_time(points)
    dense = row["dense_ms"]
    cost = SparseCost(
        plan=max(0.0, max(plan_ms)) / dense,
        fixed=fixed / dense,
        per_range=per_range / dense,
        per_vertical=per_vertical / dense,
    )
    row["cost"] = asdict(cost)
    row["fit_error_ms"] = {
        name: fixed
        + per_range * row[name]["range_share"]
        + per_vertical * row[name]["vertical_share"]
        - row[name]["ms"]
        for name in ("ranges", "verticals", "planted", "random")
    }
    row["random_pays"] = cost.pays(row["random"]["range_share"], row["random"]["vertical_share"])
    return row


def run_crossover_profile(
    spec: CrossoverSpec, log: Callable[[str], None], save: Callable[[dict[str, Any]], None] = lambda result: None
) -> dict[str, Any]:
    device = torch.device("cuda")
    import triton

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": date.today().isoformat(),
        "settings": spec.settings.__dict__,
        "planted_slashes": spec.planted_slashes,
        "rows": [],
    }
    for head_dim in spec.head_dims:
        for seq_len in spec.lengths:
            row = measure(seq_len, head_dim, spec, device)
            c = row["cost"]
            log(
                f"{seq_len // 1024}K, head dim {head_dim}: dense {row['dense_ms']:.2f} ms · ranges "
                f"{row['ranges']['ms']:.2f} · verticals {row['verticals']['ms']:.2f} · relative cost: plan "
                f"{c['plan']:.3f} + fixed {c['fixed']:.3f} + {c['per_range']:.3f}·r + {c['per_vertical']:.3f}·v · "
                f"random plan (r {row['random']['range_share']:.3f}, v {row['random']['vertical_share']:.3f}) "
                f"{'pays' if row['random_pays'] else 'runs dense'}"
            )
            result["rows"].append(row)
            torch.cuda.empty_cache()
            save(result)
    result["table"] = {
        str(d): [
            [r["seq_len"], {k: round(x, 4) for k, x in r["cost"].items()}] for r in result["rows"] if r["head_dim"] == d
        ]
        for d in spec.head_dims
    }
    return result


def crossover_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']} · torch {result['torch']} · triton {result['triton']} · {result['date']} · bf16, "
        f"one document, forward+backward (ms); plans timed per layer inside a 4-layer step; cost terms "
        f"relative to dense",
        "",
        "| length | head dim | heads (q/kv) | dense ms | ranges ms | verticals ms | plan | fixed | per range | "
        "per vertical | random plan r / v | random: kernels ms (fit) | random plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        c, rnd = r["cost"], r["random"]
        fit = rnd["ms"] + r["fit_error_ms"]["random"]
        lines.append(
            f"| {r['seq_len'] // 1024}K | {r['head_dim']} | {r['heads']}/{r['kv_heads']} | "
            f"{r['dense_ms']:.2f} | {r['ranges']['ms']:.2f} | {r['verticals']['ms']:.2f} | {c['plan']:.3f} | "
            f"{c['fixed']:.3f} | {c['per_range']:.3f} | {c['per_vertical']:.3f} | "
            f"{rnd['range_share']:.3f} / {rnd['vertical_share']:.3f} | {rnd['ms']:.2f} ({fit:.2f}) | "
            f"{'pays' if r['random_pays'] else 'dense'} |"
        )
    return "\n".join(lines)
