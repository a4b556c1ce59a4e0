"""Probe: the forward block pass as a warp-specialized Hopper kernel (Gluon) whose query-block pairs share K/V tiles.

A question for the next kernel rewrite, not a kernel of mtrain: the forward moves one 32 KB K/V tile from L2 per
computed block pair and runs near that wall (about 7 TB/s at 128K, 13.1%; bench/results/sparse_kernels_h100.md).
Rows i and i + 1 of a head read key blocks i - Δ and i + 1 - Δ over one sorted Δ list, and a slash crosses two
key blocks, so Δ and Δ + 1 are mostly both listed: the two rows then read a common key block. On the planted
13.1% pattern the union of two adjacent rows' key blocks is 63% of the blocks they read one by one (two heads of
a GQA group on one row: 56%, but that depends on the heads agreeing). Does loading each union tile once lift the
forward past that wall, and what bounds it then?

Structure. One CTA per two query blocks (i0 = 2p, i1 = 2p + 1) of a head, three partitions:
- producer (1 warp): loads both Q tiles, then walks the merged work list of both rows (key blocks in descending
  order) and TMA-loads each step's K and V tile into a ring of stages, signalled on an mbarrier;
- consumer 0 and consumer 1 (a warpgroup each): the online softmax of one row, on the steps whose key block its
  row reads; every step is waited for and released by both consumers (the empty barriers count two), so a
  consumer can never lap the other. FA3's in-warpgroup overlap: tile t + 1's S = Q Kᵀ is issued before tile t's
  O += P V, so the softmax of t + 1 runs while P V of t is on the tensor cores.
SHARE=False loads a common tile twice (once for each consumer's step): the same kernel without the sharing.
Between two steps of one consumer there is at most one step of the other (Δ lists are shared and shifted by one),
so a consumer holding its previous tile for P V never waits on more than three stages.

Scope: one document (the causal mask on the diagonal tile only), block 64, head dim 128, bf16, no ring offsets,
no vertical columns (the forward's gather loop is separate; here its slices are emptied for the Triton kernel too).
O and LSE are checked against _forward_kernel on the same layout before anything is timed.

    PYTHONPATH=src python3 bench/gluon_fwd_probe.py --length 128k --planted-slashes 8 --out $OUT/probe.json
    PYTHONPATH=src python3 bench/gluon_fwd_probe.py --compile-only   # sm_90 build on a machine without a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

LN2 = gl.constexpr(0.6931471805599453)
BLOCK = gl.constexpr(64)
HEAD_DIM = gl.constexpr(128)
KV_BYTES = gl.constexpr(2 * 64 * 128 * 2)

MMA_S = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
MMA_O = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 16]))
TILE_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
NONE = gl.constexpr(-(2 ** 30))  # key block of a finished list: below every real one


@gluon.jit
def _row_list(ROW, b, h, i, H, NQB):
    """-> (slash lo, entries) of query block i (none past the last block)."""
    sl_lo = 0
    n = 0
    if i < NQB:
        row = ROW + ((b * H + h) * NQB + i) * 6
        sl_lo = gl.load(row)
        n = gl.load(row + 1) - sl_lo
    return sl_lo, n


@gluon.jit
def _next_step(dp, i0, sl0, n0, t0, i1, sl1, n1, t1, SHARE: gl.constexpr):
    """Merged walk of rows i0 and i1 (key blocks i - Δ, descending): the next key block and whether each row
    reads it at this step. Without SHARE a block both rows read is two steps, row i0's first."""
    valid0 = t0 < n0
    valid1 = t1 < n1
    kb0 = gl.where(valid0, i0 - gl.load(dp + sl0 + t0, mask=valid0, other=0), NONE)
    kb1 = gl.where(valid1, i1 - gl.load(dp + sl1 + t1, mask=valid1, other=0), NONE)
    use0 = valid0 & (kb0 >= kb1)
    if SHARE:
        use1 = valid1 & (kb1 >= kb0)
    else:
        use1 = valid1 & (kb1 > kb0)
    return gl.maximum(kb0, kb1), use0, use1


@gluon.jit
def _producer(row_descs, row_smems, q_bar, K_desc, V_desc, k_bufs, v_bufs, ready, empty, ROW, DELTA, b, h, hk, Hk,
              i0, H, NQB, L, S, NUM_ROW_TILES: gl.constexpr, STAGES: gl.constexpr, SHARE: gl.constexpr,
              MODE: gl.constexpr):
    """Each consumer's row tiles (Q; the dQ probe: Q and dO) once, then the merged walk's K/V tiles."""
    for c in gl.static_range(2):
        if i0 + c < NQB:
            mbarrier.expect(q_bar.index(c), NUM_ROW_TILES * BLOCK * HEAD_DIM * 2)
            for r in gl.static_range(NUM_ROW_TILES):
                tma.async_copy_global_to_shared(row_descs[r], [(b * H + h) * S + (i0 + c) * BLOCK, 0],
                                                q_bar.index(c), row_smems[r].index(c))
    if MODE < 2:
        dp = DELTA + (b * H + h) * L
        sl0, n0 = _row_list(ROW, b, h, i0, H, NQB)
        sl1, n1 = _row_list(ROW, b, h, i0 + 1, H, NQB)
        kv_row = (b * Hk + hk) * S
        t0 = 0
        t1 = 0
        u = 0
        while (t0 < n0) | (t1 < n1):
            kb, use0, use1 = _next_step(dp, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, SHARE)
            s = u % STAGES
            mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, KV_BYTES)
            tma.async_copy_global_to_shared(K_desc, [kv_row + kb * BLOCK, 0], bar, k_bufs.index(s))
            tma.async_copy_global_to_shared(V_desc, [kv_row + kb * BLOCK, 0], bar, v_bufs.index(s))
            t0 += use0.to(gl.int32)
            t1 += use1.to(gl.int32)
            u += 1


@gluon.jit
def _to_own_step(dp, i0, sl0, n0, t0, i1, sl1, n1, t1, u, ready, empty, C: gl.constexpr, STAGES: gl.constexpr,
                 SHARE: gl.constexpr, MODE: gl.constexpr):
    """Walk (waiting for and releasing) the other row's steps up to this consumer's next one, or to the end."""
    kb, use0, use1 = _next_step(dp, i0, sl0, n0, t0, i1, sl1, n1, t1, SHARE)
    mine = use1 if C == 1 else use0
    while (mine.to(gl.int32) == 0) & ((t0 < n0) | (t1 < n1)):
        if MODE < 2:
            s = u % STAGES
            mbarrier.wait(ready.index(s), (u // STAGES) & 1)
            mbarrier.arrive(empty.index(s))
        t0 += use0.to(gl.int32)
        t1 += use1.to(gl.int32)
        u += 1
        kb, use0, use1 = _next_step(dp, i0, sl0, n0, t0, i1, sl1, n1, t1, SHARE)
        mine = use1 if C == 1 else use0
    return kb, use0, use1, t0, t1, u


@gluon.jit
def _start_pingpong(turn, n0, n1, C: gl.constexpr, PINGPONG: gl.constexpr):
    """FA3's ping-pong: the two consumers take turns to issue their wgmmas, so one's softmax runs while the other's
    matmuls use the tensor cores. Turns alternate for the loop iterations both rows have (min(n0, n1) - 1);
    consumer 1 gives consumer 0 the first. -> that count."""
    num_turns = gl.minimum(n0, n1) - 1
    if PINGPONG:
        if C == 1:
            if num_turns > 0:
                mbarrier.arrive(turn.index(0))
    return num_turns


@gluon.jit
def _wait_turn(turn, k, num_turns, C: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        if k <= num_turns:
            mbarrier.wait(turn.index(C), (k - 1) & 1)


@gluon.jit
def _pass_turn(turn, k, num_turns, C: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        if k <= num_turns:
            mbarrier.arrive(turn.index(1 - C))


@gluon.jit
def _q_operand(q_s, QREG: gl.constexpr):
    """QREG: Q as the register A operand of S = Q Kᵀ, so the 64-wide wgmma reads only Kᵀ from shared memory."""
    if QREG:
        q_a = q_s.load(gl.DotOperandLayout(0, MMA_S, 2))
    else:
        q_a = q_s
    return q_a


@gluon.jit
def _scores(q_s, k_s, ASYNC: gl.constexpr):
    zero = gl.zeros([BLOCK, BLOCK], gl.float32, MMA_S)
    s = warpgroup_mma(q_s, k_s.permute((1, 0)), zero, use_acc=False, is_async=ASYNC)
    return s


@gluon.jit
def _softmax(s, kb, i, m, l, qk_scale, MODE: gl.constexpr):
    """Mask the diagonal tile; -> (P as the next wgmma's A operand, running max, sum, rescale factor).
    MODE 3 (wgmmas only): S itself as P, nothing else."""
    if MODE == 3:
        return (gl.convert_layout(s.to(gl.bfloat16), gl.DotOperandLayout(0, MMA_O, 2)), m, l,
                gl.full([BLOCK], 1.0, gl.float32, gl.SliceLayout(1, MMA_O)))
    if kb == i:
        rows = i * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_S))
        cols = kb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, MMA_S))
        s = gl.where(cols[None, :] <= rows[:, None], s, -float("inf"))
    m_new = gl.maximum(m, gl.max(s, 1) * qk_scale)
    m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m - m_safe)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    l = l * alpha + gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(0, MMA_O, 2))
    return p_op, m_new, l, gl.convert_layout(alpha, gl.SliceLayout(1, MMA_O))


@gluon.jit
def _consumer(O, LSE, q_smem, q_bar, k_bufs, v_bufs, ready, empty, turn, ROW, DELTA, b, h, i0, H, NQB, L, S, qk_scale,
              C: gl.constexpr, STAGES: gl.constexpr, SHARE: gl.constexpr, MODE: gl.constexpr, QREG: gl.constexpr,
              PINGPONG: gl.constexpr):
    i = i0 + C
    dp = DELTA + (b * H + h) * L
    sl0, n0 = _row_list(ROW, b, h, i0, H, NQB)
    sl1, n1 = _row_list(ROW, b, h, i0 + 1, H, NQB)
    q_s = q_smem.index(C)
    m = gl.full([BLOCK], -float("inf"), gl.float32, gl.SliceLayout(1, MMA_S))
    l = gl.zeros([BLOCK], gl.float32, gl.SliceLayout(1, MMA_S))
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, MMA_O)
    t0 = 0
    t1 = 0
    u = 0
    n_own = n1 if C == 1 else n0
    num_turns = _start_pingpong(turn, n0, n1, C, PINGPONG)
    if n_own > 0:
        mbarrier.wait(q_bar.index(C), 0)
        q_a = _q_operand(q_s, QREG)
        # first own tile: scores and softmax; its P V waits for the next tile's scores
        kb, use0, use1, t0, t1, u = _to_own_step(dp, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, u, ready, empty, C,
                                                 STAGES, SHARE, MODE)
        s_prev = u % STAGES
        if MODE < 2:
            mbarrier.wait(ready.index(s_prev), (u // STAGES) & 1)
        p_op = gl.zeros([BLOCK, BLOCK], gl.bfloat16, gl.DotOperandLayout(0, MMA_O, 2))
        if MODE != 1:
            sc = _scores(q_a, k_bufs.index(s_prev), False)
            p_op, m, l, _ = _softmax(sc, kb, i, m, l, qk_scale, MODE)
        t0 += use0.to(gl.int32)
        t1 += use1.to(gl.int32)
        u += 1
        for k in range(1, n_own):
            kb, use0, use1, t0, t1, u = _to_own_step(dp, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, u, ready, empty, C,
                                                     STAGES, SHARE, MODE)
            st = u % STAGES
            if MODE < 2:
                mbarrier.wait(ready.index(st), (u // STAGES) & 1)
            if MODE != 1:
                _wait_turn(turn, k, num_turns, C, PINGPONG)
                sc = _scores(q_a, k_bufs.index(st), True)
                acc = warpgroup_mma(p_op, v_bufs.index(s_prev), acc, is_async=True)
                _pass_turn(turn, k, num_turns, C, PINGPONG)
                sc = warpgroup_mma_wait(num_outstanding=1, deps=[sc])
                p_op, m, l, alpha = _softmax(sc, kb, i, m, l, qk_scale, MODE)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                acc = acc * alpha[:, None]
            if MODE < 2:
                mbarrier.arrive(empty.index(s_prev))
            s_prev = st
            t0 += use0.to(gl.int32)
            t1 += use1.to(gl.int32)
            u += 1
        if MODE != 1:
            acc = warpgroup_mma(p_op, v_bufs.index(s_prev), acc)
        if MODE < 2:
            mbarrier.arrive(empty.index(s_prev))
    # the other row's steps after this row's last one
    kb, use0, use1, t0, t1, u = _to_own_step(dp, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, u, ready, empty, C, STAGES,
                                             SHARE, MODE)
    if n_own > 0:
        _store(O, LSE, acc, m, l, b, h, i, H, S)


@gluon.jit
def _store(O, LSE, acc, m, l, b, h, i, H, S):
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    l_o = gl.convert_layout(l, gl.SliceLayout(1, MMA_O))
    o = gl.convert_layout((acc / l_o[:, None]).to(gl.bfloat16), out_l)
    rows = i * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, out_l))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_l))
    gl.store(O + ((b * H + h) * S + rows[:, None]) * HEAD_DIM + cols[None, :], o)
    lse = (m + gl.log2(l)) * LN2
    lse_rows = i * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_S))
    gl.store(LSE + (b * H + h) * S + lse_rows, lse)


@gluon.jit
def _pipeline_barriers(STAGES: gl.constexpr):
    """-> (q_bar, ready, empty, turn): each row's Q tiles landed; a K/V stage loaded; a stage released by both
    consumers; the ping-pong turns. Initialised and fenced."""
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_bar.index(c), count=1)
        mbarrier.init(turn.index(c), count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # both consumers release every step
    fence_async_shared()
    return q_bar, ready, empty, turn


@gluon.jit
def _fwd_ws_kernel(Q, K, V, O, LSE, ROW, DELTA, H, G, S, NQB, L, qk_scale,
                   STAGES: gl.constexpr, SHARE: gl.constexpr, MODE: gl.constexpr, QREG: gl.constexpr,
                   PINGPONG: gl.constexpr):
    """MODE 0: the pass; 1: loads only (consumers wait and release, no math); 2: math only (no K/V loads);
    3: the wgmmas only (no loads, no softmax)."""
    p = gl.num_programs(0) - 1 - gl.program_id(0)  # late rows see the most blocks: launch them first
    bh = gl.program_id(1)
    Hk = H // G
    b = bh // H
    h = bh % H
    hk = h // G
    i0 = 2 * p
    B = gl.num_programs(1) // H
    q_desc = tma.make_tensor_descriptor(Q, [B * H * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    k_desc = tma.make_tensor_descriptor(K, [B * Hk * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    v_desc = tma.make_tensor_descriptor(V, [B * Hk * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK, HEAD_DIM], TILE_SMEM)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, HEAD_DIM], TILE_SMEM)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, HEAD_DIM], TILE_SMEM)
    q_bar, ready, empty, turn = _pipeline_barriers(STAGES)
    gl.warp_specialize([
        (_consumer, (O, LSE, q_smem, q_bar, k_bufs, v_bufs, ready, empty, turn, ROW, DELTA, b, h, i0, H, NQB, L, S,
                     qk_scale, 0, STAGES, SHARE, MODE, QREG, PINGPONG)),
        (_consumer, (O, LSE, q_smem, q_bar, k_bufs, v_bufs, ready, empty, turn, ROW, DELTA, b, h, i0, H, NQB, L, S,
                     qk_scale, 1, STAGES, SHARE, MODE, QREG, PINGPONG)),
        (_producer, ((q_desc,), (q_smem,), q_bar, k_desc, v_desc, k_bufs, v_bufs, ready, empty, ROW, DELTA, b, h,
                     hk, Hk, i0, H, NQB, L, S, 1, STAGES, SHARE, MODE)),
    ], [4, 1], [240, 24])


def launch_layout(q, k, layout):
    """-> (grid of query-block pairs, row ranges, Δ lists, GQA group) for a probe launch; checks its scope."""
    from mtrain_cli.attention.sparse.kernels import provide_descriptor_scratch

    B, H, S, D = q.shape
    assert layout.block == 64 and D == 128 and S % 64 == 0 and layout.mask_shift == 0
    assert int((layout.row_BHM6[..., 3] - layout.row_BHM6[..., 2]).sum()) == 0, "merged walk: no dense ranges"
    provide_descriptor_scratch()
    grid = (triton.cdiv(layout.num_q_blocks, 2), B * H)
    return grid, layout.row_BHM6.contiguous(), layout.delta_BHL.contiguous(), H // k.shape[1]


def forward_ws(q, k, v, layout, scale, share: bool = True, stages: int = 4, mode: int = 0, qreg: bool = False,
               pingpong: bool = False):
    """bf16 O and fp32 LSE of the block pass (no verticals), one document per row, block 64, head dim 128."""
    from mtrain_cli.attention.sparse.kernels import LOG2E as log2e

    B, H, S, D = q.shape
    grid, row, deltas, group = launch_layout(q, k, layout)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    _fwd_ws_kernel[grid](q, k, v, out, lse, row, deltas, H, group, S, layout.num_q_blocks, deltas.shape[-1],
                         scale * log2e, STAGES=stages, SHARE=share, MODE=mode, QREG=qreg, PINGPONG=pingpong, num_warps=4,
                         maxnreg=168)
    return out, lse


def compile_report(fn, name: str, constexprs: dict) -> None:
    """Build a probe kernel (any of the three) for sm_90 without a GPU and print its registers, spills and shared
    memory."""
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {arg: ("*bf16" if arg in ("Q", "K", "V", "O", "DO") else "*fp32" if arg in ("LSE", "DEL", "DQ", "DK", "DV")
                 else "*i32" if arg in ("ROW", "DELTA", "COL") else "fp32" if arg in ("qk_scale", "scale") else
                 "constexpr" if arg in constexprs else "i32") for arg in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(fn.arg_names)  # pointers and lengths
             if sig[arg].startswith("*") or arg in ("S", "Sq", "Sk")}
    compiled = triton.compile(GluonASTSource(fn=fn, signature=sig, attrs=attrs, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
    out = Path(f"/tmp/gluon_{name}")
    out.mkdir(exist_ok=True)
    (out / "k.cubin").write_bytes(compiled.asm["cubin"])
    (out / "k.ttgir").write_text(compiled.asm["ttgir"])
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    usage = subprocess.run([bin_dir / "cuobjdump", "-res-usage", out / "k.cubin"], capture_output=True, text=True)
    line = next(ln.strip() for ln in usage.stdout.splitlines() if "REG:" in ln)
    print(f"{name}: {line.split('SHARED')[0]}shared {compiled.metadata.shared / 1024:.1f} KB", flush=True)


def probe_args(description: str, default_stages: str) -> argparse.Namespace:
    """The command line both probes take."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--length", default="128k")
    parser.add_argument("--planted-slashes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--stages", default=default_stages)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.stage_counts = [int(x) for x in args.stages.split(",")]
    return args


def block_pass_case(args: argparse.Namespace, script: str):
    """-> (planted case, its layout with the vertical slices emptied (the block pass alone), its mask bounds, the
    result's header). The forward of the full layout is in the case's plan."""
    from mtrain_cli.attention.sparse.kernels import tile_mask_bounds
    from mtrain_cli.lengths import parse_lengths
    from mtrain_cli.profile.synthetic import planted_case

    seq_len = parse_lengths(args.length)[0]
    case = planted_case(seq_len, torch.device("cuda"), num_slash=args.planted_slashes)
    full_layout = case.plan.layout
    row = full_layout.row_BHM6.clone()
    row[..., 5] = row[..., 4]
    layout = dataclasses.replace(full_layout, row_BHM6=row)
    bounds = tile_mask_bounds(case.doc_BS, case.doc_BS, layout.block, layout.mask_shift)
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seq_len": seq_len, "planted_slashes": args.planted_slashes, "density": float(full_layout.density()),
              "block_pairs": int((row[..., 1] - row[..., 0]).sum()),
              "command": f"PYTHONPATH=src python3 bench/{script} --length {args.length} --planted-slashes "
                         f"{args.planted_slashes} --repeats {args.repeats} --stages {args.stages}"}
    return case, layout, bounds, header


def write_result(result: dict, out: Path | None) -> None:
    print(json.dumps(result, indent=1), flush=True)
    if out:
        out.write_text(json.dumps(result, indent=1))


VARIANTS = ((False, False, False), (True, False, False), (True, True, False), (True, True, True))  # share, qreg, pingpong


def _variant_name(share: bool, stages: int, qreg: bool, pingpong: bool) -> str:
    return f"ws_{'shared' if share else 'split'}_{stages}stages{'_qreg' if qreg else ''}{'_pingpong' if pingpong else ''}"


def main() -> None:
    args = probe_args(__doc__.splitlines()[0], "4,5")
    if args.compile_only:
        for stages in args.stage_counts:
            for share, qreg, pingpong in VARIANTS:
                compile_report(_fwd_ws_kernel, _variant_name(share, stages, qreg, pingpong),
                               {"STAGES": stages, "SHARE": share, "MODE": 0, "QREG": qreg, "PINGPONG": pingpong})
        return
    from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
    from mtrain_cli.profile.kernels import cuda_time_ms

    case, layout, bounds, result = block_pass_case(args, "gluon_fwd_probe.py")
    q, k, v, doc, scale, full_layout = case.q, case.k, case.v, case.doc_BS, case.scale, case.plan.layout
    want_o, want_lse = sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds)
    variants = [(_variant_name(share, stages, qreg, pingpong), share, stages, qreg, pingpong)
                for stages in args.stage_counts for share, qreg, pingpong in VARIANTS]
    for name, share, stages, qreg, pingpong in variants:
        got_o, got_lse = forward_ws(q, k, v, layout, scale, share, stages, qreg=qreg, pingpong=pingpong)
        again_o, _ = forward_ws(q, k, v, layout, scale, share, stages, qreg=qreg, pingpong=pingpong)
        result[name] = {"max_abs_error_vs_triton": {"o": float((got_o.float() - want_o.float()).abs().max()),
                                                    "lse": float((got_lse - want_lse).abs().max())},
                        "bit_identical_to_triton": bool(torch.equal(got_o, want_o)),
                        "bit_identical_repeat": bool(torch.equal(again_o, got_o))}
        print(name, result[name], flush=True)
    flops = 4 * result["block_pairs"] * 64 * 64 * q.shape[-1]
    triton_ms = cuda_time_ms(lambda: sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds), args.repeats)
    result["triton_forward_block_pass_ms"] = triton_ms
    result["triton_forward_with_verticals_ms"] = cuda_time_ms(
        lambda: sparse_forward(q, k, v, full_layout, doc, doc, scale, mask_bounds=bounds), args.repeats)
    for name, share, stages, qreg, pingpong in variants:
        ms = cuda_time_ms(lambda: forward_ws(q, k, v, layout, scale, share, stages, qreg=qreg, pingpong=pingpong),  # noqa: B023
                          args.repeats)
        result[name]["ms"] = ms
        result[name]["tflops_executed"] = flops / ms / 1e9
        for mode_name, mode in (("loads_only", 1), ("math_only", 2), ("wgmmas_only", 3)):  # what bounds it (outputs unchecked)
            result[name][mode_name + "_ms"] = cuda_time_ms(
                lambda: forward_ws(q, k, v, layout, scale, share, stages, mode, qreg, pingpong), args.repeats)  # noqa: B023
        print(name, result[name], flush=True)
    result["triton_tflops_executed"] = flops / triton_ms / 1e9
    result["triton_forward_block_pass_ms_again"] = cuda_time_ms(
        lambda: sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds), args.repeats)  # drift check
    write_result(result, args.out)


if __name__ == "__main__":
    main()
