"""Backward pass: dQ, dK, dV of vertical-slash sparse attention, deterministic (see kernels.py).

Launches, none with atomics:
- Δ = rowsum(dO ∘ O) per row, fp32.
- dQ, query-major (the forward's walk): dS = P ∘ (dP - Δ) recomputed per key tile, dQ += dS K.
- vertical partials, one program per (chunk of a head's vertical columns, segment of its rows, batch·head):
  walks the query blocks that read the chunk and accumulates that head's dK/dV of those columns into
  [B, H, segment, V, D] fp32; the segments are summed in torch (few verticals would leave SMs idle).
- block dK/dV, key-major, one program per (key block, batch·kv head): for every query head of the GQA
  group it walks the dense range and the Δ slice of query blocks that computed this key block; fp32 out.
- fold, one program per (key block, batch·kv head): adds every head's vertical partials of the columns
  inside the block (one-hot products) and writes the gradients' dtype. Apart from the block pass, which
  then keeps its registers for its two accumulators.
ACCUM adds into existing fp32 gradients (ring mode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtrain_cli.attention.sparse.kernels import (INTERPRET, INTERPRET_K, LOG2E, LOG2E_K, block_documents, configs, element_mask,
                                              prune_tiles, provide_descriptor_scratch, tile_needs_mask, work_ranges)
from mtrain_cli.attention.sparse.kernels_fwd import _masked_scores, _work_block
from mtrain_cli.attention.sparse.layout import BlockLayout
from mtrain_cli.attention.sparse.pattern import SENTINEL


# -- Δ = rowsum(dO ∘ O) --------------------------------------------------------------------------------------------

@triton.jit
def _delta_kernel(O, DO, DEL, sob, soh, sos, sdob, sdoh, sdos, H, S, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m < S
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(DEL + bh * S + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


def attention_delta(out_BHSD: torch.Tensor, dout_BHSD: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, S] rowsum(dO ∘ O), read once in the inputs' dtypes (torch would materialise fp32 copies)."""
    B, H, S, D = out_BHSD.shape
    delta_BHS = torch.empty(B, H, S, dtype=torch.float32, device=out_BHSD.device)
    rows = 16 if INTERPRET else 64
    _delta_kernel[(-(-S // rows), B * H)](out_BHSD, dout_BHSD, delta_BHS, *out_BHSD.stride()[:3],
                                          *dout_BHSD.stride()[:3], H, S, ROWS=rows, HEAD_DIM=D)
    return delta_BHS


# -- dQ ----------------------------------------------------------------------------------------------------------

@triton.jit
def _dq_step(acc, s, do, lse2, delta, k, v, qk_scale):
    """dQ update from raw scores s [M, N] (masked pairs -inf) of a key/value tile."""
    p = tl.exp2(s * qk_scale - lse2[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return acc + tl.dot(ds.to(k.dtype), k)


@triton.autotune(configs=configs(({"SUB_N": 64}, {"SUB_N": 128}), ((8, 2),)),
                 key=["HEAD_DIM", "BLOCK", "ACCUM", "Sq", "Sk"], prune_configs_by=prune_tiles(), restore_value=["DQ"])
@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DEL, DQ, DOCQ, DOCK, BDOCQ, BDOCK, DELTA, BITMAP, VCOL, ROW,
               sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos, slb, slh, sdqb_, sdqh_, sdqs_,
               sdcqb, sdckb, sbqb, sbkb, sdlb, sdlh, sbmb, sbmh, svcb, svch, srb, srh,
               H, G, Sq, Sk, NKB, SHIFT, qk_scale, scale,
               BLOCK: tl.constexpr, SUB_N: tl.constexpr, VCHUNK: tl.constexpr, HEAD_DIM: tl.constexpr,
               ACCUM: tl.constexpr):
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest rows first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = i * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=row_ok[:, None],
                 other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == -float("inf"), float("inf"), lse * LOG2E_K)  # empty rows: P = 0
    delta = tl.load(DEL + b * slb + h * slh + offs_m, mask=row_ok, other=0.0)
    dq = tl.load(DOCQ + b * sdcqb + offs_m, mask=row_ok, other=-2)
    q_block_doc = tl.load(BDOCQ + b * sbqb + i)
    q_pos = offs_m + SHIFT
    K_b = K + b * skb + hk * skh
    V_b = V + b * svb + hk * svh
    k_desc = tl.make_tensor_descriptor(K_b, shape=[Sk, HEAD_DIM], strides=[sks, 1], block_shape=[SUB_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V_b, shape=[Sk, HEAD_DIM], strides=[svs, 1], block_shape=[SUB_N, HEAD_DIM])
    DOCK_b = DOCK + b * sdckb
    BDOCK_b = BDOCK + b * sbkb
    row = ROW + b * srb + h * srh + i * 6
    sl_lo, sl_hi, dn_lo, dn_hi, vt_lo, vt_hi = work_ranges(row)

    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    DELTA_bh = DELTA + b * sdlb + h * sdlh
    n_dense = dn_hi - dn_lo
    for t in range(0, n_dense + sl_hi - sl_lo):  # the forward's walk
        kb = _work_block(DELTA_bh, i, t, n_dense, dn_lo, sl_lo)
        k_block_doc = tl.load(BDOCK_b + kb)
        for sub in tl.static_range(BLOCK // SUB_N):
            offs_n = kb * BLOCK + sub * SUB_N + tl.arange(0, SUB_N)
            k = k_desc.load([kb * BLOCK + sub * SUB_N, 0])
            v = v_desc.load([kb * BLOCK + sub * SUB_N, 0])
            s = tl.dot(q, tl.trans(k))
            if tile_needs_mask(i * BLOCK + SHIFT, kb * BLOCK + sub * SUB_N + SUB_N - 1, q_block_doc, k_block_doc):
                s = _masked_scores(s, q_pos, dq, offs_n, DOCK_b, Sk)
            acc = _dq_step(acc, s, do, lse2, delta, k, v, qk_scale)
    VCOL_bh = VCOL + b * svcb + h * svch
    BITMAP_bh = BITMAP + b * sbmb + h * sbmh
    for t0 in range(vt_lo, vt_hi, VCHUNK):
        offs_t = t0 + tl.arange(0, VCHUNK)
        in_slice = offs_t < vt_hi
        cols = tl.load(VCOL_bh + offs_t, mask=in_slice, other=0)
        covered = tl.load(BITMAP_bh + i - cols // BLOCK + NKB - 1, mask=in_slice, other=1)
        use = in_slice & (covered == 0)
        k = tl.load(K_b + cols[:, None] * sks + offs_d[None, :], mask=use[:, None], other=0.0)
        v = tl.load(V_b + cols[:, None] * svs + offs_d[None, :], mask=use[:, None], other=0.0)
        dk = tl.load(DOCK_b + cols, mask=use, other=-3)
        mask = element_mask(q_pos, dq, cols, dk, Sk) & use[None, :]
        acc = _dq_step(acc, tl.where(mask, tl.dot(q, tl.trans(k)), -float("inf")), do, lse2, delta, k, v, qk_scale)

    dq_ptrs = DQ + b * sdqb_ + h * sdqh_ + offs_m[:, None] * sdqs_ + offs_d[None, :]
    acc = acc * scale
    if ACCUM:
        acc += tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0)
    tl.store(dq_ptrs, acc.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# -- dK/dV -------------------------------------------------------------------------------------------------------

@triton.jit
def _dkdv_step(acc_dk, acc_dv, s_T, v, q, do, lse2, delta, qk_scale):
    """Key-major update with a [M, D] query tile: raw scores held transposed, [N keys, M queries], masked -inf."""
    p_T = tl.exp2(s_T * qk_scale - lse2[None, :])
    acc_dv += tl.dot(p_T.to(do.dtype), do)
    dp_T = tl.dot(v, tl.trans(do))
    ds_T = p_T * (dp_T - delta[None, :])
    acc_dk += tl.dot(ds_T.to(q.dtype), q)
    return acc_dk, acc_dv


@triton.jit
def _load_row_stats(LSE_h, DEL_h, offs_m, Sq):
    """log2-scaled LSE (+inf for empty rows and rows past the chunk: P = 0 there) and Δ of rows offs_m."""
    row_ok = offs_m < Sq
    lse = tl.load(LSE_h + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == -float("inf"), float("inf"), lse * LOG2E_K)
    return lse2, tl.load(DEL_h + offs_m, mask=row_ok, other=0.0)


@triton.jit
def _load_query_tile(Q_h, DO_h, LSE_h, DEL_h, offs_m, sqs, sdos, Sq, HEAD_DIM: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(Q_h + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO_h + offs_m[:, None] * sdos + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse2, delta = _load_row_stats(LSE_h, DEL_h, offs_m, Sq)
    return q, do, lse2, delta


@triton.jit
def _add_rows(acc, onehot, part, SPLIT: tl.constexpr):
    """acc + onehot @ part for fp32 `part`. SPLIT (GPU): on tensor cores, part split into three bf16 pieces
    (8 + 8 + 8 bits of mantissa, all of fp32's), each product exact since a one-hot row picks one value, fp32
    accumulation; an IEEE fp32 dot runs on the FMA units instead. The interpreter keeps the IEEE dot (its
    bf16 dot is wrong), so CPU tests check that form and the GPU tests the split."""
    if SPLIT:
        onehot = onehot.to(tl.bfloat16)
        hi = part.to(tl.bfloat16)
        rest = part - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(onehot, hi, acc)
        acc = tl.dot(onehot, mid, acc)
        return tl.dot(onehot, lo, acc)
    return acc + tl.dot(onehot.to(tl.float32), part, input_precision="ieee")


@triton.jit
def _query_block(DELTA_bh, j, t, n_dense, dn_lo, sl_lo):
    """Query block of entry t of key block j's list: the dense range first, then rows j + Δ of the slice."""
    delta = tl.load(DELTA_bh + sl_lo + t - n_dense, mask=t >= n_dense, other=0)
    return tl.where(t < n_dense, dn_lo + t, j + delta)


@triton.autotune(configs=configs(({"SUB_M": 64},), ((8, 2),)),
                 key=["HEAD_DIM", "BLOCK", "ACCUM", "Sq", "Sk"], prune_configs_by=prune_tiles(),
                 restore_value=["DK", "DV"])
@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DEL, DK, DV, DOCQ, DOCK, BDOCQ, BDOCK, DELTA, COL,
                 sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos, slb, slh,
                 sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                 sdcqb, sdckb, sbqb, sbkb, sdlb, sdlh, scb, sch,
                 Hk, G, Sq, Sk, SHIFT, qk_scale, scale,
                 BLOCK: tl.constexpr, SUB_M: tl.constexpr, HEAD_DIM: tl.constexpr, ACCUM: tl.constexpr):
    j = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    offs_n = j * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = offs_n < Sk
    k = tl.load(K + b * skb + hk * skh + offs_n[:, None] * sks + offs_d[None, :], mask=inside[:, None], other=0.0)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svs + offs_d[None, :], mask=inside[:, None], other=0.0)
    DOCQ_b = DOCQ + b * sdcqb
    DOCK_b = DOCK + b * sdckb
    dk = tl.load(DOCK_b + offs_n, mask=inside, other=-3)
    k_block_doc = tl.load(BDOCK + b * sbkb + j)
    BDOCQ_b = BDOCQ + b * sbqb
    acc_dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    acc_dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    for g in range(G):
        h = hk * G + g
        Q_h = Q + b * sqb + h * sqh
        DO_h = DO + b * sdob + h * sdoh
        q_desc = tl.make_tensor_descriptor(Q_h, shape=[Sq, HEAD_DIM], strides=[sqs, 1], block_shape=[SUB_M, HEAD_DIM])
        do_desc = tl.make_tensor_descriptor(DO_h, shape=[Sq, HEAD_DIM], strides=[sdos, 1],
                                            block_shape=[SUB_M, HEAD_DIM])
        LSE_h = LSE + b * slb + h * slh
        DEL_h = DEL + b * slb + h * slh
        col = COL + b * scb + h * sch + j * 6
        sl_lo, sl_hi, dn_lo, dn_hi, _, _ = work_ranges(col)
        DELTA_bh = DELTA + b * sdlb + h * sdlh
        n_dense = dn_hi - dn_lo
        for t in range(0, n_dense + sl_hi - sl_lo):
            qb = _query_block(DELTA_bh, j, t, n_dense, dn_lo, sl_lo)
            q_block_doc = tl.load(BDOCQ_b + qb)
            for sub in tl.static_range(BLOCK // SUB_M):
                offs_m = qb * BLOCK + sub * SUB_M + tl.arange(0, SUB_M)
                q = q_desc.load([qb * BLOCK + sub * SUB_M, 0])
                do = do_desc.load([qb * BLOCK + sub * SUB_M, 0])
                lse2, delta = _load_row_stats(LSE_h, DEL_h, offs_m, Sq)
                s_T = tl.dot(k, tl.trans(q))
                if tile_needs_mask(qb * BLOCK + sub * SUB_M + SHIFT, j * BLOCK + BLOCK - 1, q_block_doc, k_block_doc):
                    dq = tl.load(DOCQ_b + offs_m, mask=offs_m < Sq, other=-2)
                    s_T = tl.where(tl.trans(element_mask(offs_m + SHIFT, dq, offs_n, dk, Sk)), s_T, -float("inf"))
                acc_dk, acc_dv = _dkdv_step(acc_dk, acc_dv, s_T, v, q, do, lse2, delta, qk_scale)

    acc_dk = acc_dk * scale
    dk_ptrs = DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :]
    dv_ptrs = DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :]
    if ACCUM:
        acc_dk += tl.load(dk_ptrs, mask=inside[:, None], other=0.0)
        acc_dv += tl.load(dv_ptrs, mask=inside[:, None], other=0.0)
    tl.store(dk_ptrs, acc_dk.to(DK.dtype.element_ty), mask=inside[:, None])
    tl.store(dv_ptrs, acc_dv.to(DV.dtype.element_ty), mask=inside[:, None])


@triton.jit
def _fold_kernel(DK32, DV32, DK, DV, PDK, PDV, VCOL, COL, s32b, s32h, s32s, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                 spb, sph, sps, svcb, svch, scb, sch, Hk, G, Sk, scale,
                 BLOCK: tl.constexpr, VCHUNK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Key block j of a KV head: the block pass's fp32 dK/dV plus every query head's vertical partial sums
    of the columns inside the block (one-hot rows), written in the gradients' dtype. Apart from the block
    pass so that pass keeps its registers for its own two accumulators."""
    j = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    offs_n = j * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = offs_n < Sk
    fold_dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    fold_dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    SPLIT_ROWS: tl.constexpr = not INTERPRET_K
    for g in range(G):
        h = hk * G + g
        vt_lo = tl.load(COL + b * scb + h * sch + j * 6 + 4)
        vt_hi = tl.load(COL + b * scb + h * sch + j * 6 + 5)
        VCOL_bh = VCOL + b * svcb + h * svch
        for t0 in range(vt_lo, vt_hi, VCHUNK):
            offs_t = t0 + tl.arange(0, VCHUNK)
            in_slice = offs_t < vt_hi
            cols = tl.load(VCOL_bh + offs_t, mask=in_slice, other=-1)
            onehot = offs_n[:, None] == cols[None, :]
            part = PDK + b * spb + h * sph + offs_t[:, None] * sps + offs_d[None, :]
            fold_dk = _add_rows(fold_dk, onehot, tl.load(part, mask=in_slice[:, None], other=0.0), SPLIT_ROWS)
            part = PDV + b * spb + h * sph + offs_t[:, None] * sps + offs_d[None, :]
            fold_dv = _add_rows(fold_dv, onehot, tl.load(part, mask=in_slice[:, None], other=0.0), SPLIT_ROWS)
    rows_32 = b * s32b + hk * s32h + offs_n[:, None] * s32s + offs_d[None, :]
    dk = tl.load(DK32 + rows_32, mask=inside[:, None], other=0.0) + fold_dk * scale
    dv = tl.load(DV32 + rows_32, mask=inside[:, None], other=0.0) + fold_dv
    tl.store(DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=inside[:, None])
    tl.store(DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=inside[:, None])


# -- vertical partials --------------------------------------------------------------------------------------------

@triton.autotune(configs=configs(({"SUB_M": 32}, {"SUB_M": 64}), ((4, 2), (8, 2))), key=["HEAD_DIM", "BLOCK", "Sq", "Sk"],
                 prune_configs_by=prune_tiles())
@triton.jit
def _vertical_kernel(Q, K, V, DO, LSE, DEL, PDK, PDV, DOCQ, DOCK, BITMAP, VCOL, ROW, VCH,
                     sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdob, sdoh, sdos, slb, slh,
                     spb, sph, spg, sps, sdcqb, sdckb, sbmb, sbmh, svcb, svch, srb, srh, svhb, svhh,
                     H, G, Sq, Sk, NKB, SHIFT, qk_scale, NUM_SEGMENTS,
                     BLOCK: tl.constexpr, SUB_M: tl.constexpr, VCHUNK: tl.constexpr, HEAD_DIM: tl.constexpr):
    c = tl.program_id(0) // NUM_SEGMENTS
    seg = tl.program_id(0) % NUM_SEGMENTS
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_t = c * VCHUNK + tl.arange(0, VCHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    VCOL_bh = VCOL + b * svcb + h * svch
    cols = tl.load(VCOL_bh + offs_t)  # padded to whole chunks with SENTINEL
    real = cols < Sk
    cols = tl.where(real, cols, 0)
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + offs_d[None, :], mask=real[:, None], other=0.0)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + offs_d[None, :], mask=real[:, None], other=0.0)
    DOCQ_b = DOCQ + b * sdcqb
    dk = tl.load(DOCK + b * sdckb + cols, mask=real, other=-3)
    Q_h = Q + b * sqb + h * sqh
    DO_h = DO + b * sdob + h * sdoh
    LSE_h = LSE + b * slb + h * slh
    DEL_h = DEL + b * slb + h * slh
    BITMAP_bh = BITMAP + b * sbmb + h * sbmh
    first_row = tl.load(VCH + b * svhb + h * svhh + c * 2)
    last_row = tl.load(VCH + b * svhb + h * svhh + c * 2 + 1)
    seg_rows = tl.cdiv(tl.maximum(last_row - first_row + 1, 0), NUM_SEGMENTS)  # this program's share
    row_lo = first_row + seg * seg_rows
    row_hi = tl.minimum(row_lo + seg_rows - 1, last_row)
    acc_dk = tl.zeros([VCHUNK, HEAD_DIM], tl.float32)
    acc_dv = tl.zeros([VCHUNK, HEAD_DIM], tl.float32)
    for i in range(row_lo, row_hi + 1):
        row = ROW + b * srb + h * srh + i * 6
        vt_lo = tl.load(row + 4)
        vt_hi = tl.load(row + 5)
        covered = tl.load(BITMAP_bh + i - cols // BLOCK + NKB - 1, mask=real, other=1)
        use = real & (offs_t >= vt_lo) & (offs_t < vt_hi) & (covered == 0)  # the forward's exact choice
        for sub in tl.static_range(BLOCK // SUB_M):
            offs_m = i * BLOCK + sub * SUB_M + tl.arange(0, SUB_M)
            q, do, lse2, delta = _load_query_tile(Q_h, DO_h, LSE_h, DEL_h, offs_m, sqs, sdos, Sq, HEAD_DIM)
            dq = tl.load(DOCQ_b + offs_m, mask=offs_m < Sq, other=-2)
            mask_T = tl.trans(element_mask(offs_m + SHIFT, dq, cols, dk, Sk)) & use[:, None]
            s_T = tl.where(mask_T, tl.dot(k, tl.trans(q)), -float("inf"))
            acc_dk, acc_dv = _dkdv_step(acc_dk, acc_dv, s_T, v, q, do, lse2, delta, qk_scale)
    part = b * spb + h * sph + seg * spg + offs_t[:, None] * sps + offs_d[None, :]
    tl.store(PDK + part, acc_dk)
    tl.store(PDV + part, acc_dv)


# -- launcher -----------------------------------------------------------------------------------------------------

def sparse_backward(q_BHSD: torch.Tensor, k_BHkSD: torch.Tensor, v_BHkSD: torch.Tensor, out_BHSD: torch.Tensor,
                    lse_BHS: torch.Tensor, dout_BHSD: torch.Tensor, layout: BlockLayout, doc_q_BSq: torch.Tensor,
                    doc_k_BSk: torch.Tensor, scale: float, grads: tuple[torch.Tensor, ...] | None = None,
                    delta_BHS: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv) for this (query chunk, key chunk) pair.

    lse is the *final* LSE of the rows (over every chunk) and delta = rowsum(dO ∘ O) of the final output; given
    `grads` (fp32 dq, dk, dv), this chunk's gradients are added into them in place (ring mode)."""
    B, H, Sq, D = q_BHSD.shape
    Hk = k_BHkSD.shape[1]
    Sk = layout.k_len
    dout_BHSD = dout_BHSD.contiguous()
    if delta_BHS is None:
        delta_BHS = attention_delta(out_BHSD, dout_BHSD)
    lse_BHS, delta_BHS = lse_BHS.contiguous(), delta_BHS.contiguous()
    accum = grads is not None
    if accum:
        dq_BHSD, dk_BHkSD, dv_BHkSD = grads
        if any(g.dtype != torch.float32 for g in grads):
            raise ValueError("accumulated gradients must be fp32")
    else:
        dq_BHSD, dk_BHkSD, dv_BHkSD = torch.empty_like(q_BHSD), torch.empty_like(k_BHkSD), torch.empty_like(v_BHkSD)
    doc_q, doc_k = doc_q_BSq.to(torch.int32).contiguous(), doc_k_BSk.to(torch.int32).contiguous()
    block_doc_q, block_doc_k = block_documents(doc_q, layout.block), block_documents(doc_k, layout.block)
    G = H // Hk
    shift = layout.mask_shift
    vc = layout.vertical_chunk
    # The list is padded to a bound; the true width arrived on the host during the forward.
    num_chunks = max(-(-layout.num_vertical.get() // vc), 1)
    vcol_BHV = layout.vcol_BHV[..., :num_chunks * vc]
    if vcol_BHV.shape[-1] != num_chunks * vc:  # pad to whole chunks so the vertical kernel reads no bounds
        vcol_BHV = torch.nn.functional.pad(vcol_BHV, (0, num_chunks * vc - vcol_BHV.shape[-1]), value=SENTINEL)
    vchunk_BHC2 = layout.vchunk_BHC2[:, :, :num_chunks]
    # A chunk's rows are split over segments (separate partial sums, added below in a fixed order) so that
    # few verticals still fill the GPU; many verticals need no split.
    num_segments = max(1, min(16, -(-1024 // (num_chunks * B * H)), layout.num_q_blocks // 4))
    seg_dk = torch.empty(B, H, num_segments, num_chunks * vc, D, dtype=torch.float32, device=q_BHSD.device)
    seg_dv = torch.empty_like(seg_dk)
    qk_scale = scale * LOG2E
    provide_descriptor_scratch()
    common = (*q_BHSD.stride()[:3], *k_BHkSD.stride()[:3], *v_BHkSD.stride()[:3], *dout_BHSD.stride()[:3],
              *lse_BHS.stride()[:2])

    _vertical_kernel[(num_chunks * num_segments, B * H)](
        q_BHSD, k_BHkSD, v_BHkSD, dout_BHSD, lse_BHS, delta_BHS, seg_dk, seg_dv, doc_q, doc_k,
        layout.delta_bitmap_BHX, vcol_BHV, layout.row_BHM6, vchunk_BHC2,
        *common, *seg_dk.stride()[:4], doc_q.stride(0), doc_k.stride(0),
        *layout.delta_bitmap_BHX.stride()[:2], *vcol_BHV.stride()[:2], *layout.row_BHM6.stride()[:2],
        *vchunk_BHC2.stride()[:2],
        H, G, Sq, Sk, layout.num_k_blocks, shift, qk_scale, num_segments,
        BLOCK=layout.block, VCHUNK=vc, HEAD_DIM=D)
    part_dk, part_dv = seg_dk.sum(2), seg_dv.sum(2)
    _dq_kernel[(layout.num_q_blocks, B * H)](
        q_BHSD, k_BHkSD, v_BHkSD, dout_BHSD, lse_BHS, delta_BHS, dq_BHSD, doc_q, doc_k, block_doc_q, block_doc_k,
        layout.delta_BHL, layout.delta_bitmap_BHX, layout.vcol_BHV, layout.row_BHM6,
        *common, *dq_BHSD.stride()[:3], doc_q.stride(0), doc_k.stride(0), block_doc_q.stride(0),
        block_doc_k.stride(0), *layout.delta_BHL.stride()[:2],
        *layout.delta_bitmap_BHX.stride()[:2], *layout.vcol_BHV.stride()[:2], *layout.row_BHM6.stride()[:2],
        H, G, Sq, Sk, layout.num_k_blocks, shift, qk_scale, scale,
        BLOCK=layout.block, VCHUNK=vc, HEAD_DIM=D, ACCUM=accum)
    # the block pass writes fp32 (ring mode: adds into the fp32 gradients); the fold adds the verticals
    dk32, dv32 = (dk_BHkSD, dv_BHkSD) if accum else (torch.empty_like(k_BHkSD, dtype=torch.float32),
                                                      torch.empty_like(v_BHkSD, dtype=torch.float32))
    _dkdv_kernel[(layout.num_k_blocks, B * Hk)](
        q_BHSD, k_BHkSD, v_BHkSD, dout_BHSD, lse_BHS, delta_BHS, dk32, dv32, doc_q, doc_k,
        block_doc_q, block_doc_k, layout.delta_BHL, layout.col_BHN6,
        *common, *dk32.stride()[:3], *dv32.stride()[:3],
        doc_q.stride(0), doc_k.stride(0), block_doc_q.stride(0), block_doc_k.stride(0),
        *layout.delta_BHL.stride()[:2], *layout.col_BHN6.stride()[:2],
        Hk, G, Sq, Sk, shift, qk_scale, scale,
        BLOCK=layout.block, HEAD_DIM=D, ACCUM=accum)
    assert dk32.stride() == dv32.stride()
    _fold_kernel[(layout.num_k_blocks, B * Hk)](
        dk32, dv32, dk_BHkSD, dv_BHkSD, part_dk, part_dv, vcol_BHV, layout.col_BHN6, *dk32.stride()[:3],
        *dk_BHkSD.stride()[:3], *dv_BHkSD.stride()[:3], *part_dk.stride()[:3], *vcol_BHV.stride()[:2],
        *layout.col_BHN6.stride()[:2], Hk, G, Sk, scale,
        BLOCK=layout.block, VCHUNK=vc, HEAD_DIM=D, num_warps=8)
    return dq_BHSD, dk_BHkSD, dv_BHkSD
