"""Backward pass: dQ, dK, dV of vertical-slash sparse attention, deterministic (see kernels.py).

Launches, none with atomics:
- Δ = rowsum(dO ∘ O) per row, fp32.
- dQ, query-major (the forward's walk): dS = P ∘ (dP - Δ) recomputed per key tile, dQ += dS K.
- vertical partials (kernels_vertical.py): each head's dK/dV of its vertical columns.
- block dK/dV (kernels_dkdv.py), key-major, one program per (key block, batch·kv head): for every query head of
  the GQA group it walks the dense range and the Δ slice of query blocks that computed this key block; fp32 out.
- fold (kernels_vertical.py): the vertical partials added into the block pass's dK/dV, in their dtype.
ACCUM adds into existing fp32 gradients (ring mode).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtrain_cli.attention.sparse.kernels import (
    INTERPRET,
    LOG2E,
    LOG2E_K,
    MaskBounds,
    configs,
    element_mask,
    kernel_layout,
    provide_descriptor_scratch,
    prune_tiles,
    query_tile_needs_mask,
    tile_mask_bounds,
    work_ranges,
)
from mtrain_cli.attention.sparse.kernels_dkdv import _dkdv_kernel
from mtrain_cli.attention.sparse.kernels_fwd import _masked_scores, _work_block
from mtrain_cli.attention.sparse.kernels_vertical import fold_verticals, vertical_partials
from mtrain_cli.attention.sparse.layout import BlockLayout

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
    _delta_kernel[(-(-S // rows), B * H)](
        out_BHSD, dout_BHSD, delta_BHS, *out_BHSD.stride()[:3], *dout_BHSD.stride()[:3], H, S, ROWS=rows, HEAD_DIM=D
    )
    return delta_BHS


# -- dQ ----------------------------------------------------------------------------------------------------------


@triton.jit
def _dq_step(acc, s, do, lse2, delta, k, v, qk_scale):
    """dQ update from raw scores s [M, N] (masked pairs -inf) of a key/value tile."""
    p = tl.exp2(s * qk_scale - lse2[:, None])
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return acc + tl.dot(ds.to(k.dtype), k)


# Deep pipelines pay on the K/V walk: on H200 (head dim 64, 128K) 4 stages took 14% off dQ against 2
# (bench/results/step_variants_strong128k_h200.md); a list, as more stages need more shared memory at larger tiles
@triton.autotune(
    configs=configs(({"SUB_N": 64}, {"SUB_N": 128}), ((8, 2), (4, 2), (8, 3), (4, 3), (8, 4), (4, 4))),
    key=["HEAD_DIM", "BLOCK", "ACCUM", "Sq", "Sk"],
    prune_configs_by=prune_tiles(warps_from_block=True),
    cache_results=True,  # persisted in Triton's cache by GPU target and shape: later runs skip the tuning
    restore_value=["DQ"],
)
@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DEL,
    DQ,
    DOCQ,
    DOCK,
    KSTART,
    DELTA,
    BITMAP,
    VCOL,
    ROW,
    sqb,
    sqh,
    sqs,
    skb,
    skh,
    sks,
    svb,
    svh,
    svs,
    sdob,
    sdoh,
    sdos,
    slb,
    slh,
    sdqb_,
    sdqh_,
    sdqs_,
    sdcqb,
    sdckb,
    sksb,
    sdlb,
    sdlh,
    sbmb,
    sbmh,
    svcb,
    svch,
    srb,
    srh,
    H,
    G,
    Sq,
    Sk,
    NKB,
    SHIFT,
    qk_scale,
    scale,
    BLOCK: tl.constexpr,
    SUB_N: tl.constexpr,
    VCHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ACCUM: tl.constexpr,
):
    i = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest rows first
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = i * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < Sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdos + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == -float("inf"), float("inf"), lse * LOG2E_K)  # empty rows: P = 0
    delta = tl.load(DEL + b * slb + h * slh + offs_m, mask=row_ok, other=0.0)
    dq = tl.load(DOCQ + b * sdcqb + offs_m, mask=row_ok, other=-2)
    key_start = tl.load(KSTART + b * sksb + i)
    key_limit = tl.minimum(i * BLOCK + SHIFT, Sk - 1)
    q_pos = offs_m + SHIFT
    K_b = K + b * skb + hk * skh
    V_b = V + b * svb + hk * svh
    k_desc = tl.make_tensor_descriptor(K_b, shape=[Sk, HEAD_DIM], strides=[sks, 1], block_shape=[SUB_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V_b, shape=[Sk, HEAD_DIM], strides=[svs, 1], block_shape=[SUB_N, HEAD_DIM])
    DOCK_b = DOCK + b * sdckb
    row = ROW + b * srb + h * srh + i * 6
    sl_lo, sl_hi, dn_lo, dn_hi, vt_lo, vt_hi = work_ranges(row)

    acc = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    DELTA_bh = DELTA + b * sdlb + h * sdlh
    n_dense = dn_hi - dn_lo
    for t in range(0, n_dense + sl_hi - sl_lo):  # the forward's walk
        kb = _work_block(DELTA_bh, i, t, n_dense, dn_lo, sl_lo)
        for sub in tl.static_range(BLOCK // SUB_N):
            offs_n = kb * BLOCK + sub * SUB_N + tl.arange(0, SUB_N)
            k = k_desc.load([kb * BLOCK + sub * SUB_N, 0])
            v = v_desc.load([kb * BLOCK + sub * SUB_N, 0])
            s = tl.dot(q, tl.trans(k))
            k_first = kb * BLOCK + sub * SUB_N
            if query_tile_needs_mask(key_limit, k_first, k_first + SUB_N - 1, key_start):
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


# -- launcher -----------------------------------------------------------------------------------------------------


def _tma_rows(x_BHS: torch.Tensor) -> torch.Tensor:
    """fp32 [B, H, S], contiguous, every (batch, head) row 16-byte aligned (TMA's rule for the dK/dV pass's row
    statistics): a copy with rows padded to a multiple of 4 only where S or the storage needs it."""
    x_BHS = x_BHS.contiguous()
    B, H, S = x_BHS.shape
    if S % 4 == 0 and x_BHS.data_ptr() % 16 == 0:
        return x_BHS
    padded_BHS = x_BHS.new_empty(B, H, -(-S // 4) * 4)[..., :S]
    padded_BHS.copy_(x_BHS)
    return padded_BHS


def sparse_backward(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    out_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    dout_BHSD: torch.Tensor,
    layout: BlockLayout,
    doc_q_BSq: torch.Tensor,
    doc_k_BSk: torch.Tensor,
    scale: float,
    grads: tuple[torch.Tensor, ...] | None = None,
    delta_BHS: torch.Tensor | None = None,
    mask_bounds: MaskBounds | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv) for this (query chunk, key chunk) pair.

    lse is the *final* LSE of the rows (over every chunk) and delta = rowsum(dO ∘ O) of the final output; given
    `grads` (fp32 dq, dk, dv), this chunk's gradients are added into them in place (ring mode). mask_bounds as in
    sparse_forward."""
    B, H, Sq, D = q_BHSD.shape
    Hk = k_BHkSD.shape[1]
    Sk = layout.k_len
    dout_BHSD = kernel_layout(dout_BHSD)
    if delta_BHS is None:
        delta_BHS = attention_delta(out_BHSD, dout_BHSD)
    lse_BHS, delta_BHS = _tma_rows(lse_BHS), _tma_rows(delta_BHS)
    accum = grads is not None
    if accum:
        dq_BHSD, dk_BHkSD, dv_BHkSD = grads
        if any(g.dtype != torch.float32 for g in grads):
            raise ValueError("accumulated gradients must be fp32")
    else:
        dq_BHSD, dk_BHkSD, dv_BHkSD = torch.empty_like(q_BHSD), torch.empty_like(k_BHkSD), torch.empty_like(v_BHkSD)
    doc_q, doc_k = doc_q_BSq.to(torch.int32).contiguous(), doc_k_BSk.to(torch.int32).contiguous()
    if mask_bounds is None:
        mask_bounds = tile_mask_bounds(doc_q, doc_k, layout.block, layout.mask_shift)
    key_start_BM, row_end_BN = mask_bounds
    G = H // Hk
    shift = layout.mask_shift
    qk_scale = scale * LOG2E
    provide_descriptor_scratch()
    common = (
        *q_BHSD.stride()[:3],
        *k_BHkSD.stride()[:3],
        *v_BHkSD.stride()[:3],
        *dout_BHSD.stride()[:3],
        *lse_BHS.stride()[:2],
    )

    part_dk, part_dv, vcol_BHV = vertical_partials(
        q_BHSD, k_BHkSD, v_BHkSD, dout_BHSD, lse_BHS, delta_BHS, layout, doc_q, doc_k, qk_scale
    )
    _dq_kernel[(layout.num_q_blocks, B * H)](
        q_BHSD,
        k_BHkSD,
        v_BHkSD,
        dout_BHSD,
        lse_BHS,
        delta_BHS,
        dq_BHSD,
        doc_q,
        doc_k,
        key_start_BM,
        layout.delta_BHL,
        layout.delta_bitmap_BHX,
        layout.vcol_BHV,
        layout.row_BHM6,
        *common,
        *dq_BHSD.stride()[:3],
        doc_q.stride(0),
        doc_k.stride(0),
        key_start_BM.stride(0),
        *layout.delta_BHL.stride()[:2],
        *layout.delta_bitmap_BHX.stride()[:2],
        *layout.vcol_BHV.stride()[:2],
        *layout.row_BHM6.stride()[:2],
        H,
        G,
        Sq,
        Sk,
        layout.num_k_blocks,
        shift,
        qk_scale,
        scale,
        BLOCK=layout.block,
        VCHUNK=layout.vertical_chunk,
        HEAD_DIM=D,
        ACCUM=accum,
    )
    # the block pass writes fp32 (ring mode: adds into the fp32 gradients); the fold adds the verticals. One
    # layout for both (the fold's strides), whatever k's and v's: rotary may leave k laid out unlike v.
    if accum:
        dk32, dv32 = dk_BHkSD, dv_BHkSD
    else:
        dk32 = torch.empty_like(k_BHkSD, dtype=torch.float32)
        dv32 = torch.empty_like(dk32)
    _dkdv_kernel[(layout.num_k_blocks, B * Hk)](
        q_BHSD,
        k_BHkSD,
        v_BHkSD,
        dout_BHSD,
        lse_BHS,
        delta_BHS,
        dk32,
        dv32,
        doc_q,
        doc_k,
        row_end_BN,
        layout.delta_BHL,
        layout.col_BHN6,
        *common,
        *dk32.stride()[:3],
        *dv32.stride()[:3],
        doc_q.stride(0),
        doc_k.stride(0),
        row_end_BN.stride(0),
        *layout.delta_BHL.stride()[:2],
        *layout.col_BHN6.stride()[:2],
        Hk,
        G,
        Sq,
        Sk,
        shift,
        qk_scale,
        scale,
        BLOCK=layout.block,
        HEAD_DIM=D,
        ACCUM=accum,
    )
    fold_verticals(dk32, dv32, dk_BHkSD, dv_BHkSD, part_dk, part_dv, vcol_BHV, layout, scale)
    return dq_BHSD, dk_BHkSD, dv_BHkSD
