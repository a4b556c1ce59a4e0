"""`mtrain profile ring` (under torchrun): one attention layer, forward+backward, across W ranks.

Modes, all in one run on the same inputs (planted vertical/slash structure, `profile/synthetic.py`):
- sparse-stripe: our estimator's pattern, stripe token layout, flat ring;
- sparse-zigzag: the same pattern on the zigzag layout;
- sparse-hierarchical: sparse-stripe over declared nodes of --node-size ranks (inner + outer ring);
- dense-zigzag: every block computed, zigzag (the dense baseline): chunk pairs inside one document run the
  library (cuDNN on GPU; here the row is one document, so all of them), cut pairs our kernels;
- torch-cp-cudnn / torch-cp-flash (GPU): PyTorch's own `context_parallel` with SDPA, for reference.
For each: median wall time; the same ring with transfers skipped (pure compute: the difference is the
communication not hidden); per-rank busy time with each step synchronised (imbalance = max/mean); the work
each rank did (active blocks; imbalance again); TFLOP/s per GPU on active work (4·D FLOPs per computed
pair forward, ×3.5 forward+backward); pattern estimation + layout time; chunk pairs on the library and on our
kernels (all ranks); and, when torch-cp-cudnn ran, `vs_torch_cp_cudnn` = torch CP cuDNN's fwd+bwd time / this
row's (above 1: faster than PyTorch's ring).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mtrain_cli.attention import AttentionConfig, BatchCache
from mtrain_cli.attention.ring import DIRECT, StepRunner, plan_dense_ring, plan_ring, ring_attention
from mtrain_cli.attention.sparse import PlanGraph
from mtrain_cli.errors import UserError
from mtrain_cli.parallel import (
    RingTopology,
    TokenLayout,
    build_topology,
    layout_unit,
    local_node_size,
    splits_into_nodes,
)
from mtrain_cli.profile.report import write_report
from mtrain_cli.profile.synthetic import planted_qkv

MIN_PLAN_REPEATS = 20
SPARSE_MODES = ("sparse-stripe", "sparse-zigzag", "sparse-hierarchical", "dense-zigzag")


@dataclass(frozen=True)
class RingProfileSpec:
    seq_len: int
    modes: list[str]
    node_size: int
    num_heads: int = 16
    num_kv_heads: int = 2
    head_dim: int = 128
    repeats: int = 5
    engine: str = "triton"
    settings: AttentionConfig = field(default_factory=AttentionConfig)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _median_seconds(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up (and autotune)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ComputeOnly:
    """Every ring step computes on the local K/V: the same work without transfers."""

    transfers = False

    def __call__(self, phase: str, compute: Callable[[], None]) -> None:
        compute()


class TimedSteps:
    """Each ring step's compute timed alone (synchronised before and after): the rank's busy time."""

    transfers = True

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, list[float]] = {"forward": [], "backward": []}

    def __call__(self, phase: str, compute: Callable[[], None]) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        compute()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds[phase].append(time.perf_counter() - t0)


def _gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    local = torch.tensor(values, dtype=torch.float64, device=device)
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, local)
    return [s.tolist() for s in shards]


def _profile_mode(
    spec: RingProfileSpec, mode: str, q, k, v, doc, dout, topos: dict[str, RingTopology], device: torch.device
) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = "zigzag" if mode.endswith("zigzag") else "stripe"
    topo = topos["hierarchical" if mode == "sparse-hierarchical" else "flat"]
    token_layout = TokenLayout(kind, world, spec.settings.block_size, spec.seq_len)
    index = token_layout.positions(rank).to(device)
    local = [t[:, :, index].contiguous() for t in (q, k, v)]
    scale = spec.head_dim**-0.5
    doc_local = doc[:, index]
    cache, graph = BatchCache(), PlanGraph()  # a model's: one per run, shared by its layers

    def make_plan():
        if mode == "dense-zigzag":  # made once per batch (the first call), then a cache hit
            heads = (q.shape[0], q.shape[1])
            return plan_dense_ring(doc_local, token_layout, topo, heads, scale, spec.engine, device, cache), None
        return plan_ring(*local[:2], doc_local, token_layout, topo, scale, spec.settings, spec.engine, cache, graph)

    # a GPU plans in milliseconds, and a rank's late start between the barriers counts in it: more repeats
    plan_repeats = max(spec.repeats, MIN_PLAN_REPEATS) if device.type == "cuda" else spec.repeats
    plan_s = _median_seconds(make_plan, device, plan_repeats)
    plan, pattern = make_plan()
    leaves = [t.detach().requires_grad_() for t in local]

    def step(run_step: StepRunner = DIRECT) -> None:
        for t in leaves:
            t.grad = None
        ring_attention(*leaves, plan, topo, run_step).backward(dout[:, :, index])

    wall_s = _median_seconds(step, device, spec.repeats)
    compute_s = _median_seconds(lambda: step(ComputeOnly()), device, spec.repeats)
    timed = TimedSteps(device)
    step(timed)
    busy_s = sum(timed.seconds["forward"]) + sum(timed.seconds["backward"])
    steps_s = [f + b for f, b in zip(timed.seconds["forward"], timed.seconds["backward"])]
    work = [float(w) for w in plan.work_by_source().values()]
    pairs = [pair for chunk_pairs in plan.pairs_by_source.values() for pair in chunk_pairs]
    num_library = sum(pair.plain is not None for pair in pairs)
    pair_counts = [sum(r) for r in zip(*_gather_floats([num_library, len(pairs) - num_library], device))]
    busy = [r[0] for r in _gather_floats([busy_s], device)]
    work_by_rank = _gather_floats(work, device)
    wall = max(r[0] for r in _gather_floats([wall_s], device))
    compute = max(r[0] for r in _gather_floats([compute_s], device))
    total_pairs = sum(sum(r) for r in work_by_rank) * spec.settings.block_size**2
    work_totals = [sum(r) for r in work_by_rank]
    return {
        "mode": mode,
        "world": world,
        "node_size": topo.node_size,
        "seq_len": spec.seq_len,
        "recall": None if mode == "dense-zigzag" else float(pattern.recall_BH.mean()),
        "fwd_bwd_ms": wall * 1e3,
        "compute_only_ms": compute * 1e3,
        "comm_not_hidden_share": max(0.0, (wall - compute) / wall),
        "plan_ms": plan_s * 1e3,
        "busy_ms_by_rank": [b * 1e3 for b in busy],
        "busy_imbalance": max(busy) / statistics.mean(busy),
        "work_blocks_by_rank": work_totals,
        "work_imbalance": max(work_totals) / statistics.mean(work_totals),
        "step_ms_rank0": [s * 1e3 for s in steps_s] if rank == 0 else None,
        "library_pairs": int(pair_counts[0]),  # chunk pairs (all ranks) a library kernel runs
        "kernel_pairs": int(pair_counts[1]),  # chunk pairs our kernels run (cut by a document boundary, or sparse)
        "tflops_per_gpu_active": 3.5 * 4 * spec.head_dim * total_pairs / wall / world / 1e12,
    }


def _profile_torch_cp(spec: RingProfileSpec, backend_name: str, q, k, v, dout, device) -> dict[str, Any]:
    """PyTorch's context_parallel (head-tail ring over SDPA) on the same shape, for reference (GPU only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    cq, ck, cv, cdo = (t.detach().clone() for t in (q, k, v, dout))

    def step() -> None:
        with context_parallel(mesh, buffers=[cq, ck, cv, cdo], buffer_seq_dims=[2, 2, 2, 2]), sdpa_kernel(backend):
            leaves = [t.detach().requires_grad_() for t in (cq, ck, cv)]
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(cdo)

    try:
        wall = _median_seconds(step, device, spec.repeats)
    except Exception as exc:  # recorded in the results, never hidden
        return {"mode": f"torch-cp-{backend_name}", "error": str(exc).splitlines()[0][:300]}
    causal_pairs = spec.num_heads * spec.seq_len * (spec.seq_len + 1) / 2
    return {
        "mode": f"torch-cp-{backend_name}",
        "world": dist.get_world_size(),
        "seq_len": spec.seq_len,
        "fwd_bwd_ms": wall * 1e3,
        "tflops_per_gpu_active": 3.5 * 4 * spec.head_dim * causal_pairs / wall / dist.get_world_size() / 1e12,
    }


def run_ring_profile(spec: RingProfileSpec, device: torch.device, log: Callable[[str], None]) -> dict[str, Any]:
    world = dist.get_world_size()
    topos = {"flat": build_topology(world)}
    if "sparse-hierarchical" in spec.modes:
        topos["hierarchical"] = build_topology(spec.node_size)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = planted_qkv(1, spec.num_heads, spec.num_kv_heads, spec.seq_len, spec.head_dim, dtype, device)
    doc = torch.zeros(1, spec.seq_len, dtype=torch.int32, device=device)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    rows = []
    for mode in spec.modes:
        if mode.startswith("torch-cp-"):
            row = _profile_torch_cp(spec, mode.removeprefix("torch-cp-"), q, k, v, dout, device)
        else:
            row = _profile_mode(spec, mode, q, k, v, doc, dout, topos, device)
        rows.append(row)
        log(
            f"{mode}: "
            + ", ".join(
                f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                for key, value in row.items()
                if key not in ("mode", "step_ms_rank0")
            )
        )
    add_torch_cp_ratio(rows)
    import triton

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {
        "device": device_name,
        "world": world,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "backend": dist.get_backend(),
        "engine": spec.engine,
        "shape": {
            "num_heads": spec.num_heads,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "dtype": str(dtype),
        },
        "settings": spec.settings.__dict__,
        "rows": rows,
    }


def add_torch_cp_ratio(rows: list[dict[str, Any]]) -> None:
    """Each of our rows gets `vs_torch_cp_cudnn` = torch CP cuDNN's fwd+bwd ms / the row's (above 1: ours is
    faster), when torch-cp-cudnn ran."""
    torch_ms = next((r["fwd_bwd_ms"] for r in rows if r["mode"] == "torch-cp-cudnn" and "error" not in r), None)
    for row in rows:
        if torch_ms is not None and row["mode"] in SPARSE_MODES:
            row["vs_torch_cp_cudnn"] = torch_ms / row["fwd_bwd_ms"]


def ring_table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['device']} × {result['world']} ({result['backend']}, engine {result['engine']}) · "
        f"torch {result['torch']} · triton {result['triton']} · one attention layer, forward+backward",
        "",
        "| mode | length | fwd+bwd ms | vs torch CP cuDNN (its ms / ours) | compute only ms | comm not hidden | "
        "busy imbalance | work imbalance | TFLOP/s/GPU active | plan ms | recall | pairs library / ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['mode']} | – | error: {r['error']} | | | | | | | | | |")
            continue

        def f(key, fmt):
            return format(r[key], fmt) if r.get(key) is not None else "–"

        pairs = f"{r['library_pairs']} / {r['kernel_pairs']}" if "library_pairs" in r else "–"
        lines.append(
            f"| {r['mode']} | {r['seq_len'] // 1024}K | {f('fwd_bwd_ms', '.1f')} | {f('vs_torch_cp_cudnn', '.2f')} | "
            f"{f('compute_only_ms', '.1f')} | {f('comm_not_hidden_share', '.1%')} | "
            f"{f('busy_imbalance', '.3f')} | {f('work_imbalance', '.3f')} | {f('tflops_per_gpu_active', '.0f')} | "
            f"{f('plan_ms', '.1f')} | {f('recall', '.3f')} | {pairs} |"
        )
    return "\n".join(lines)


def profile_ring_main(
    seq_len: int,
    modes: list[str],
    node_size: int | None,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    repeats: int,
    out: Path | None,
    log: Callable[[str], None],
) -> None:
    """`mtrain profile ring`: validate against the torchrun launch, set up the process group, run, report."""
    if "WORLD_SIZE" not in os.environ:
        raise UserError(
            "mtrain profile ring runs under torchrun, e.g. torchrun --nproc-per-node 4 -m mtrain_cli "
            "profile ring --seq-len 256k"
        )
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    known = set(SPARSE_MODES) | ({"torch-cp-cudnn", "torch-cp-flash"} if cuda else set())
    if not modes or set(modes) - known:
        raise UserError(
            f"--modes {','.join(modes)!r}: unknown or unavailable here: "
            f"{', '.join(sorted(set(modes) - known))}; choose from {', '.join(sorted(known))}"
        )
    nodes = local_node_size(node_size, world)
    if "sparse-hierarchical" in modes and not splits_into_nodes(world, nodes):
        raise UserError(
            f"--node-size {nodes} must split the {world} ranks into 2 or more nodes for "
            f"sparse-hierarchical (e.g. --node-size {max(1, world // 2)})"
        )
    unit = layout_unit("zigzag", world, block_size)  # zigzag's, a multiple of stripe's: one length for every mode
    if seq_len % unit:
        raise UserError(f"--seq-len {seq_len} must be divisible by 2×world×block = {unit}")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        spec = RingProfileSpec(
            seq_len,
            modes,
            nodes,
            heads,
            kv_heads,
            head_dim,
            repeats,
            engine="triton" if cuda else "reference",
            settings=AttentionConfig(block_size=block_size, dense_below=0, probe_windows=1),
        )  # one long document, planted: MTraining's probe, as profile/synthetic.py's planted_case
        rank0 = dist.get_rank() == 0
        result = run_ring_profile(spec, device, log=log if rank0 else lambda line: None)
        if rank0:
            table = ring_table(result)
            log(table)
            write_report(out, result, table)
    finally:
        dist.destroy_process_group()
