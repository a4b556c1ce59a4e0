"""Probe: the dK/dV block pass as a warp-specialized Hopper kernel (Gluon), against our Triton kernel.

A question for the next kernel rewrite, not a kernel of mtrain: does the FA3 structure lift the key-major pass
that bounds the backward (latency-bound in Triton: tensor pipe 64% busy, see bench/results/sparse_kernels_h100.md)?

Structure. One CTA per two key blocks (j0 = 2p, j1 = 2p + 1) of a KV head, three partitions:
- producer (1 warp): walks both blocks' work lists (per query head of the GQA group: the dense range, then
  rows j + Δ of the slash slice), loads each query tile's Q, dO, LSE and Δ by TMA into that block's ring of
  stages, signalled on an mbarrier; the work-list loads sit here, off the math warps' path;
- consumer 0 and consumer 1 (a warpgroup each): the math of one key block, as _dkdv_kernel does it
  (Sᵀ = K Qᵀ, Pᵀ, dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ, dK += dSᵀ Q), each stage released by an mbarrier arrive.
Each consumer owns its key block's dK/dV, so no reduction and no atomics: bit-reproducible like the Triton pass.

Scope: one document per row (the element mask is the causal one, on the diagonal tile only), block 64, head dim
128, bf16, no ring offsets; the vertical pass and the fold are not part of it (as in _dkdv_kernel). The output is
checked against _dkdv_kernel's fp32 dK/dV on the same layout before anything is timed. Variants: wgmmas in
sequence or overlapped (async), a ring per consumer or one ring over the merged walk of both lists (a query tile
both blocks read is loaded once), and the async kernel without its math or without its loads (what bounds it).

Result on H100 (bench/results/sparse_gluon_dkdv_probe_h100.json): bit-identical to the Triton pass, 3-8% faster;
at 13.1% density the loads alone take 17.9 ms and the math alone 24-25.5 ms against 31 ms together.

    PYTHONPATH=src python3 bench/gluon_dkdv_probe.py --length 128k --planted-slashes 8 --out $OUT/probe.json
    PYTHONPATH=src python3 bench/gluon_dkdv_probe.py --compile-only   # sm_90 build on a machine without a GPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from gluon_fwd_probe import BLOCK, HEAD_DIM, MMA_O, MMA_S, TILE_SMEM, compile_report
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)

LOG2E = gl.constexpr(1.4426950408889634)
STAGES = gl.constexpr(2)  # per consumer: 2 × (Q + dO) tiles of 16 KB each, plus the row statistics
TILE_BYTES = gl.constexpr(2 * 64 * 128 * 2 + 2 * 64 * 4)

ROW_SMEM = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
FLAT_SMEM = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))


@gluon.jit
def _list_range(COL, DELTA, b, h, j, H, NKB, L):
    """-> (dense lo, count of dense entries, slash lo, total entries, pointer to the head's Δ list) of key block j."""
    col = COL + ((b * H + h) * NKB + j) * 6
    sl_lo = gl.load(col)
    sl_hi = gl.load(col + 1)
    dn_lo = gl.load(col + 2)
    dn_hi = gl.load(col + 3)
    n_dense = dn_hi - dn_lo
    return dn_lo, n_dense, sl_lo, n_dense + sl_hi - sl_lo, DELTA + (b * H + h) * L


@gluon.jit
def _query_block(delta_ptr, j, t, dn_lo, n_dense, sl_lo):
    if t < n_dense:
        qb = dn_lo + t
    else:
        qb = j + gl.load(delta_ptr + sl_lo + t - n_dense)
    return qb


@gluon.jit
def _load_tile(descs, bufs, ready, empty, it, NUM: gl.constexpr, row, bh, qb):
    """Producer: query tile qb's Q, dO rows (from `row`) and LSE, Δ (row bh) into stage it % NUM of a ring."""
    s = it % NUM
    mbarrier.wait(empty.index(s), ((it // NUM) & 1) ^ 1)
    bar = ready.index(s)
    mbarrier.expect(bar, TILE_BYTES)
    tma.async_copy_global_to_shared(descs[0], [row + qb * BLOCK, 0], bar, bufs[0].index(s))
    tma.async_copy_global_to_shared(descs[1], [row + qb * BLOCK, 0], bar, bufs[1].index(s))
    tma.async_copy_global_to_shared(descs[2], [bh, qb * BLOCK], bar, bufs[2].index(s))
    tma.async_copy_global_to_shared(descs[3], [bh, qb * BLOCK], bar, bufs[3].index(s))


@gluon.jit
def _tile_grads(k_smem, v_smem, bufs, s, dk, dv, keys, qb, j, qk_scale, ASYNC: gl.constexpr):
    """Consumer: dK, dV += one query tile's share, as _dkdv_kernel computes it (same wgmma shapes and order)."""
    q_s = bufs[0].index(s)
    do_s = bufs[1].index(s)
    lse = bufs[2].index(s)._reinterpret(gl.float32, [BLOCK], FLAT_SMEM).load(gl.SliceLayout(0, MMA_S))
    delta = bufs[3].index(s)._reinterpret(gl.float32, [BLOCK], FLAT_SMEM).load(gl.SliceLayout(0, MMA_S))
    lse2 = gl.where(lse == -float("inf"), float("inf"), lse * LOG2E)
    zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, MMA_S)
    if ASYNC:  # dPᵀ runs while Pᵀ is computed, dV while dSᵀ is (wgmma groups retire in order)
        s_T = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_T = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s_T = warpgroup_mma_wait(num_outstanding=1, deps=[s_T])
    else:
        s_T = warpgroup_mma(k_smem, q_s.permute((1, 0)), zero_s, use_acc=False)
    p_T = gl.exp2(s_T * qk_scale - lse2[None, :])
    if qb == j:  # the diagonal tile: keys after the query are masked (one document)
        rows = qb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, MMA_S))
        p_T = gl.where(rows[None, :] >= keys[:, None], p_T, 0.0)
    p_op = gl.convert_layout(p_T.to(gl.bfloat16), gl.DotOperandLayout(0, MMA_O, 2))
    if ASYNC:
        dv = warpgroup_mma(p_op, do_s, dv, is_async=True)
        dp_T = warpgroup_mma_wait(num_outstanding=1, deps=[dp_T])
    else:
        dp_T = warpgroup_mma(v_smem, do_s.permute((1, 0)), zero_s, use_acc=False)
        dv = warpgroup_mma(p_op, do_s, dv)
    ds_T = p_T * (dp_T - delta[None, :])
    ds_op = gl.convert_layout(ds_T.to(gl.bfloat16), gl.DotOperandLayout(0, MMA_O, 2))
    if ASYNC:
        dk = warpgroup_mma(ds_op, q_s, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=[dv, dk, p_op, ds_op])[:2]
    else:
        dk = warpgroup_mma(ds_op, q_s, dk)
    return dk, dv


@gluon.jit
def _store_grads(DK, DV, dk, dv, b, hk, Hk, j, Sk, scale):
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
    dk_out = gl.convert_layout(dk * scale, out_l)
    dv_out = gl.convert_layout(dv, out_l)
    rows = j * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, out_l))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_l))
    offs = (b * Hk + hk) * Sk * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    inside = (rows < Sk)[:, None]
    gl.store(DK + offs, dk_out, mask=inside)
    gl.store(DV + offs, dv_out, mask=inside)


@gluon.jit
def _producer(COL, DELTA, descs, bufs0, bufs1, ready0, ready1, empty0, empty1, b, hk, j0, H, G, NKB, L, Sq,
              MODE: gl.constexpr):
    if MODE == 2:  # math only: nothing is loaded (the consumers read stale tiles)
        return
    it0 = 0
    it1 = 0
    j1 = j0 + 1
    for g in range(G):
        h = hk * G + g
        dn0, nd0, sl0, n0, dp0 = _list_range(COL, DELTA, b, h, j0, H, NKB, L)
        dn1, nd1, sl1, n1, dp1 = dn0, nd0, sl0, 0, dp0
        if j1 < NKB:
            dn1, nd1, sl1, n1, dp1 = _list_range(COL, DELTA, b, h, j1, H, NKB, L)
        row = (b * H + h) * Sq
        for t in range(gl.maximum(n0, n1)):
            if t < n0:
                _load_tile(descs, bufs0, ready0, empty0, it0, STAGES, row, b * H + h,
                           _query_block(dp0, j0, t, dn0, nd0, sl0))
                it0 += 1
            if t < n1:
                _load_tile(descs, bufs1, ready1, empty1, it1, STAGES, row, b * H + h,
                           _query_block(dp1, j1, t, dn1, nd1, sl1))
                it1 += 1


@gluon.jit
def _consumer(COL, DELTA, DK, DV, k_smem, v_smem, kv_bar, bufs, ready, empty, b, hk, j, H, G, NKB, L, Sk,
              qk_scale, scale, ASYNC: gl.constexpr, MODE: gl.constexpr):
    if j < NKB:
        mbarrier.wait(kv_bar, 0)
        dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, MMA_O)
        dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, MMA_O)
        keys = j * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_S))
        it = 0
        for g in range(G):
            h = hk * G + g
            dn, nd, sl, n, dp = _list_range(COL, DELTA, b, h, j, H, NKB, L)
            for t in range(n):
                qb = _query_block(dp, j, t, dn, nd, sl)
                s = it % STAGES
                if MODE != 2:
                    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if MODE != 1:  # MODE 1, loads only: the producer's rate
                    dk, dv = _tile_grads(k_smem, v_smem, bufs, s, dk, dv, keys, qb, j, qk_scale, ASYNC)
                if MODE != 2:
                    mbarrier.arrive(empty.index(s))
                it += 1
        _store_grads(DK, DV, dk, dv, b, hk, H // G, j, Sk, scale)


@gluon.jit
def _next_pair(dp0, sl0, n0, t0, j0, dp1, sl1, n1, t1):
    """Merged walk of two key blocks' slash lists (both ascending in query block): the next query block and
    whether each block reads it."""
    qb0 = gl.where(t0 < n0, j0 + gl.load(dp0 + sl0 + t0, mask=t0 < n0, other=0), 2 ** 30)
    qb1 = gl.where(t1 < n1, j0 + 1 + gl.load(dp1 + sl1 + t1, mask=t1 < n1, other=0), 2 ** 30)
    return gl.minimum(qb0, qb1), qb0 <= qb1, qb1 <= qb0


@gluon.jit
def _head_lists(COL, DELTA, b, h, j0, H, NKB, L):
    """Slash lists of key blocks j0 and j0 + 1 for head h (the merged walk runs on layouts without dense ranges)."""
    _, _, sl0, n0, dp0 = _list_range(COL, DELTA, b, h, j0, H, NKB, L)
    sl1, n1, dp1 = sl0, 0, dp0
    if j0 + 1 < NKB:
        _, _, sl1, n1, dp1 = _list_range(COL, DELTA, b, h, j0 + 1, H, NKB, L)
    return dp0, sl0, n0, dp1, sl1, n1


@gluon.jit
def _producer_shared(COL, DELTA, descs, bufs, ready, empty, b, hk, j0, H, G, NKB, L, Sq):
    it = 0
    for g in range(G):
        h = hk * G + g
        dp0, sl0, n0, dp1, sl1, n1 = _head_lists(COL, DELTA, b, h, j0, H, NKB, L)
        t0 = 0
        t1 = 0
        while (t0 < n0) | (t1 < n1):
            qb, use0, use1 = _next_pair(dp0, sl0, n0, t0, j0, dp1, sl1, n1, t1)
            _load_tile(descs, bufs, ready, empty, it, 2 * STAGES, (b * H + h) * Sq, b * H + h, qb)
            t0 += use0.to(gl.int32)
            t1 += use1.to(gl.int32)
            it += 1


@gluon.jit
def _consumer_shared(COL, DELTA, DK, DV, k_smem, v_smem, kv_bar, bufs, ready, empty, b, hk, j0, C: gl.constexpr,
                     H, G, NKB, L, Sk, qk_scale, scale):
    """Consumer C (0 or 1) of the merged walk: waits for and releases every stage (the empty barriers count both
    consumers), computes only on the query tiles its key block j0 + C reads."""
    j = j0 + C
    if j < NKB:
        mbarrier.wait(kv_bar, 0)
    dk = gl.zeros([BLOCK, HEAD_DIM], gl.float32, MMA_O)
    dv = gl.zeros([BLOCK, HEAD_DIM], gl.float32, MMA_O)
    keys = j * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_S))
    it = 0
    for g in range(G):
        h = hk * G + g
        dp0, sl0, n0, dp1, sl1, n1 = _head_lists(COL, DELTA, b, h, j0, H, NKB, L)
        t0 = 0
        t1 = 0
        while (t0 < n0) | (t1 < n1):
            qb, use0, use1 = _next_pair(dp0, sl0, n0, t0, j0, dp1, sl1, n1, t1)
            s = it % (2 * STAGES)
            mbarrier.wait(ready.index(s), (it // (2 * STAGES)) & 1)
            if use1 if C == 1 else use0:
                dk, dv = _tile_grads(k_smem, v_smem, bufs, s, dk, dv, keys, qb, j, qk_scale, True)
            mbarrier.arrive(empty.index(s))
            t0 += use0.to(gl.int32)
            t1 += use1.to(gl.int32)
            it += 1
    if j < NKB:
        _store_grads(DK, DV, dk, dv, b, hk, H // G, j, Sk, scale)


@gluon.jit
def _stage_buffers(num: gl.constexpr):
    """Q, dO (bf16 tiles) and LSE, Δ (fp32 rows) of `num` stages."""
    return (gl.allocate_shared_memory(gl.bfloat16, [num, BLOCK, HEAD_DIM], TILE_SMEM),
            gl.allocate_shared_memory(gl.bfloat16, [num, BLOCK, HEAD_DIM], TILE_SMEM),
            gl.allocate_shared_memory(gl.float32, [num, 1, BLOCK], ROW_SMEM),
            gl.allocate_shared_memory(gl.float32, [num, 1, BLOCK], ROW_SMEM))


@gluon.jit
def _dkdv_ws_kernel(Q, K, V, DO, LSE, DEL, DK, DV, COL, DELTA, B, H, G, Sq, Sk, NKB, L, qk_scale, scale,
                    ASYNC: gl.constexpr, MODE: gl.constexpr, SHARED: gl.constexpr):
    """MODE 0: the pass; 1: loads only (consumers wait and release, no math); 2: math only (no loads).
    SHARED: one ring of 2·STAGES stages over the merged walk of both key blocks' lists (a query tile both
    blocks read is loaded once), instead of a ring per consumer."""
    p = gl.program_id(0)
    bhk = gl.program_id(1)
    Hk = H // G
    b = bhk // Hk
    hk = bhk % Hk
    j0 = 2 * p
    q_desc = tma.make_tensor_descriptor(Q, [B * H * Sq, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    do_desc = tma.make_tensor_descriptor(DO, [B * H * Sq, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    lse_desc = tma.make_tensor_descriptor(LSE, [B * H, Sq], [Sq, 1], [1, BLOCK], ROW_SMEM)
    del_desc = tma.make_tensor_descriptor(DEL, [B * H, Sq], [Sq, 1], [1, BLOCK], ROW_SMEM)
    descs = (q_desc, do_desc, lse_desc, del_desc)
    kv_desc_k = tma.make_tensor_descriptor(K, [B * Hk * Sk, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM],
                                           TILE_SMEM)
    kv_desc_v = tma.make_tensor_descriptor(V, [B * Hk * Sk, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM],
                                           TILE_SMEM)

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK, HEAD_DIM], TILE_SMEM)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK, HEAD_DIM], TILE_SMEM)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(kv_bar.index(c), count=1)
    fence_async_shared()
    for c in gl.static_range(2):
        if j0 + c < NKB:
            bar = kv_bar.index(c)
            mbarrier.expect(bar, 2 * BLOCK * HEAD_DIM * 2)
            row = (b * Hk + hk) * Sk + (j0 + c) * BLOCK
            tma.async_copy_global_to_shared(kv_desc_k, [row, 0], bar, k_smem.index(c))
            tma.async_copy_global_to_shared(kv_desc_v, [row, 0], bar, v_smem.index(c))

    if SHARED:
        bufs = _stage_buffers(2 * STAGES)
        ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release every stage
        fence_async_shared()
        gl.warp_specialize([
            (_consumer_shared, (COL, DELTA, DK, DV, k_smem.index(0), v_smem.index(0), kv_bar.index(0), bufs, ready,
                                empty, b, hk, j0, 0, H, G, NKB, L, Sk, qk_scale, scale)),
            (_consumer_shared, (COL, DELTA, DK, DV, k_smem.index(1), v_smem.index(1), kv_bar.index(1), bufs, ready,
                                empty, b, hk, j0, 1, H, G, NKB, L, Sk, qk_scale, scale)),
            (_producer_shared, (COL, DELTA, descs, bufs, ready, empty, b, hk, j0, H, G, NKB, L, Sq)),
        ], [4, 1], [240, 24])
    else:
        bufs0 = _stage_buffers(STAGES)
        bufs1 = _stage_buffers(STAGES)
        ready0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        ready1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty0 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty1 = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready0.index(i), count=1)
            mbarrier.init(ready1.index(i), count=1)
            mbarrier.init(empty0.index(i), count=1)
            mbarrier.init(empty1.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (COL, DELTA, DK, DV, k_smem.index(0), v_smem.index(0), kv_bar.index(0), bufs0, ready0, empty0,
                         b, hk, j0, H, G, NKB, L, Sk, qk_scale, scale, ASYNC, MODE)),
            (_consumer, (COL, DELTA, DK, DV, k_smem.index(1), v_smem.index(1), kv_bar.index(1), bufs1, ready1, empty1,
                         b, hk, j0 + 1, H, G, NKB, L, Sk, qk_scale, scale, ASYNC, MODE)),
            (_producer, (COL, DELTA, descs, bufs0, bufs1, ready0, ready1, empty0, empty1, b, hk, j0, H, G, NKB, L,
                         Sq, MODE)),
        ], [4, 1], [240, 24])


def dkdv_ws(q, k, v, dout, lse, delta, layout, scale, overlap: bool = True, mode: int = 0, shared: bool = False):
    """fp32 dK, dV of the block pass (no verticals), one document per row, block 64, head dim 128."""
    from mtrain_cli.attention.sparse.kernels import LOG2E as log2e, provide_descriptor_scratch

    B, H, S, D = q.shape
    Hk = k.shape[1]
    assert layout.block == 64 and D == 128 and S % 64 == 0 and layout.mask_shift == 0
    assert not shared or int((layout.col_BHN6[..., 3] - layout.col_BHN6[..., 2]).sum()) == 0, "merged walk: no dense ranges"
    provide_descriptor_scratch()
    dk = torch.empty(B, Hk, S, D, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    col = layout.col_BHN6.contiguous()
    deltas = layout.delta_BHL.contiguous()
    grid = (triton.cdiv(layout.num_k_blocks, 2), B * Hk)
    _dkdv_ws_kernel[grid](q, k, v, dout, lse.contiguous(), delta.contiguous(), dk, dv, col, deltas, B, H, H // Hk, S, S,
                          layout.num_k_blocks, deltas.shape[-1], scale * log2e, scale, ASYNC=overlap, MODE=mode, SHARED=shared,
                          num_warps=4,
                          maxnreg=168)
    return dk, dv


def _compile_only() -> None:
    """Build for sm_90 without a GPU: compile errors, registers and spills (cuobjdump), shared memory."""
    for overlap, shared in ((False, False), (True, False), (True, True)):
        compile_report(_dkdv_ws_kernel, f"dkdv_{'async' if overlap else 'sync'}_{'shared' if shared else 'split'}",
                       {"ASYNC": overlap, "MODE": 0, "SHARED": shared})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", default="128k")
    parser.add_argument("--planted-slashes", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.compile_only:
        _compile_only()
        return
    from mtrain_cli.attention.sparse import kernels_bwd
    from mtrain_cli.attention.sparse.kernels import LOG2E as log2e, provide_descriptor_scratch, tile_mask_bounds
    from mtrain_cli.attention.sparse.kernels_bwd import _tma_rows, attention_delta
    from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
    from mtrain_cli.lengths import parse_lengths
    from mtrain_cli.profile.kernels import cuda_time_ms
    from mtrain_cli.profile.synthetic import planted_case

    seq_len = parse_lengths(args.length)[0]
    case = planted_case(seq_len, torch.device("cuda"), num_slash=args.planted_slashes)
    q, k, v, doc, scale, layout, dout = case.q, case.k, case.v, case.doc_BS, case.scale, case.plan.layout, case.dout
    B, H, S, D = q.shape
    Hk = k.shape[1]
    bounds = tile_mask_bounds(doc, doc, layout.block, layout.mask_shift)
    out, lse = sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds)
    delta = attention_delta(out, dout)
    lse, delta = _tma_rows(lse), _tma_rows(delta)
    dense_entries = int((layout.col_BHN6[..., 3] - layout.col_BHN6[..., 2]).sum())

    def triton_pass():
        provide_descriptor_scratch()
        dk32 = torch.empty(B, Hk, S, D, dtype=torch.float32, device=q.device)
        dv32 = torch.empty_like(dk32)
        doc32 = doc.to(torch.int32).contiguous()
        common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride()[:2])
        kernels_bwd._dkdv_kernel[(layout.num_k_blocks, B * Hk)](
            q, k, v, dout, lse, delta, dk32, dv32, doc32, doc32, bounds[1], layout.delta_BHL, layout.col_BHN6,
            *common, *dk32.stride()[:3], *dv32.stride()[:3], doc32.stride(0), doc32.stride(0), bounds[1].stride(0),
            *layout.delta_BHL.stride()[:2], *layout.col_BHN6.stride()[:2], Hk, H // Hk, S, S, layout.mask_shift,
            scale * log2e, scale, BLOCK=layout.block, HEAD_DIM=D, ACCUM=False)
        return dk32, dv32

    want_dk, want_dv = triton_pass()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seq_len": seq_len, "planted_slashes": args.planted_slashes, "density": float(layout.density()),
              "dense_entries": dense_entries, "command": "PYTHONPATH=src python3 bench/gluon_dkdv_probe.py "
              f"--length {args.length} --planted-slashes {args.planted_slashes} --repeats {args.repeats}"}
    variants = (("ws_sync_mma", False, False), ("ws_async_mma", True, False), ("ws_shared_tiles", True, True))
    for name, overlap, shared in variants:
        got_dk, got_dv = dkdv_ws(q, k, v, dout, lse, delta, layout, scale, overlap, shared=shared)
        again_dk, _ = dkdv_ws(q, k, v, dout, lse, delta, layout, scale, overlap, shared=shared)
        result[name] = {"relative_error_vs_triton": {"dk": float((got_dk - want_dk).norm() / want_dk.norm()),
                                                     "dv": float((got_dv - want_dv).norm() / want_dv.norm())},
                        "bit_identical_repeat": bool(torch.equal(again_dk, got_dk))}
        print(name, result[name], flush=True)
    result["triton_dkdv_ms"] = cuda_time_ms(triton_pass, args.repeats)
    for name, overlap, shared in variants:
        result[name]["ms"] = cuda_time_ms(
            lambda: dkdv_ws(q, k, v, dout, lse, delta, layout, scale, overlap, shared=shared), args.repeats)  # noqa: B023
    for name, mode in (("ws_loads_only", 1), ("ws_math_only", 2)):  # what bounds the pass (outputs not checked)
        result[name + "_ms"] = cuda_time_ms(lambda: dkdv_ws(q, k, v, dout, lse, delta, layout, scale, True, mode),  # noqa: B023
                                            args.repeats)
    result["triton_dkdv_ms_again"] = cuda_time_ms(triton_pass, args.repeats)  # drift check
    print(json.dumps(result, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
