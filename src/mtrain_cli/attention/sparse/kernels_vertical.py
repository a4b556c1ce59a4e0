"""Gradients of the vertical columns (see kernels.py): partial sums per head, then a fold into dK/dV.

- partials, one program per (chunk of a head's vertical columns, segment of its rows, batch·head): walks the
  query blocks that read the chunk (skipping, as the forward does, columns a row's slash blocks cover) and
  accumulates that head's dK/dV of those columns into [B, H, segment, V, D] fp32; the segments are summed
  in torch in a fixed order (a split keeps few verticals from leaving SMs idle).
- fold, one program per (key block, batch·kv head), after the block pass: adds every query head's partials
  of the columns inside the block (one-hot products, on tensor cores) to the block pass's fp32 dK/dV and
  writes the gradients' dtype. Apart from the block pass so that pass keeps its registers for its own two
  accumulators (its spills fell from 98 to 52 registers and its time by 2 ms at 128K on H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mtrain_cli.attention.sparse.kernels import (
    INTERPRET_K,
    _dkdv_step,
    _load_query_tile,
    configs,
    element_mask,
    prune_tiles,
)
from mtrain_cli.attention.sparse.layout import BlockLayout
from mtrain_cli.attention.sparse.pattern import SENTINEL


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


VERTICAL_VARYING_ARGS = ("NUM_SEGMENTS",)


@triton.autotune(
    configs=configs(({"SUB_M": 32}, {"SUB_M": 64}), ((4, 2), (8, 2))),
    key=["HEAD_DIM", "BLOCK", "Sq", "Sk"],
    prune_configs_by=prune_tiles(),
    cache_results=True,  # persisted in Triton's cache by GPU target and shape: later runs skip the tuning
)
@triton.jit(do_not_specialize=VERTICAL_VARYING_ARGS)  # follows each layer's vertical count: one build for all
def _vertical_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DEL,
    PDK,
    PDV,
    DOCQ,
    DOCK,
    BITMAP,
    VCOL,
    ROW,
    VCH,
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
    spb,
    sph,
    spg,
    sps,
    sdcqb,
    sdckb,
    sbmb,
    sbmh,
    svcb,
    svch,
    srb,
    srh,
    svhb,
    svhh,
    H,
    G,
    Sq,
    Sk,
    NKB,
    SHIFT,
    qk_scale,
    NUM_SEGMENTS,
    BLOCK: tl.constexpr,
    SUB_M: tl.constexpr,
    VCHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
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


@triton.jit
def _fold_kernel(
    DK32,
    DV32,
    DK,
    DV,
    PDK,
    PDV,
    VCOL,
    COL,
    s32b,
    s32h,
    s32s,
    sdkb,
    sdkh,
    sdks,
    sdvb,
    sdvh,
    sdvs,
    spb,
    sph,
    sps,
    svcb,
    svch,
    scb,
    sch,
    Hk,
    G,
    Sk,
    scale,
    BLOCK: tl.constexpr,
    VCHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Key block j of a KV head: the block pass's fp32 dK/dV plus every query head's vertical partial sums
    of the columns inside the block (one-hot rows), written in the gradients' dtype."""
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
    tl.store(
        DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdks + offs_d[None, :],
        dk.to(DK.dtype.element_ty),
        mask=inside[:, None],
    )
    tl.store(
        DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvs + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=inside[:, None],
    )


# -- launchers ----------------------------------------------------------------------------------------------------


def vertical_partials(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    dout_BHSD: torch.Tensor,
    lse_BHS: torch.Tensor,
    delta_BHS: torch.Tensor,
    layout: BlockLayout,
    doc_q: torch.Tensor,
    doc_k: torch.Tensor,
    qk_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dK partials, dV partials [B, H, V, D] fp32, the vertical columns [B, H, V] they belong to)."""
    B, H, Sq, D = q_BHSD.shape
    vc = layout.vertical_chunk
    # The list is padded to a bound; the true width arrived on the host during the forward.
    num_chunks = max(-(-layout.num_vertical.get() // vc), 1)
    vcol_BHV = layout.vcol_BHV[..., : num_chunks * vc]
    if vcol_BHV.shape[-1] != num_chunks * vc:  # pad to whole chunks so the vertical kernel reads no bounds
        vcol_BHV = torch.nn.functional.pad(vcol_BHV, (0, num_chunks * vc - vcol_BHV.shape[-1]), value=SENTINEL)
    vchunk_BHC2 = layout.vchunk_BHC2[:, :, :num_chunks]
    # A chunk's rows are split over segments (separate partial sums, added below in a fixed order) so that
    # few verticals still fill the GPU; many verticals need no split.
    num_segments = max(1, min(16, -(-1024 // (num_chunks * B * H)), layout.num_q_blocks // 4))
    seg_dk = torch.empty(B, H, num_segments, num_chunks * vc, D, dtype=torch.float32, device=q_BHSD.device)
    seg_dv = torch.empty_like(seg_dk)
    _vertical_kernel[(num_chunks * num_segments, B * H)](
        q_BHSD,
        k_BHkSD,
        v_BHkSD,
        dout_BHSD,
        lse_BHS,
        delta_BHS,
        seg_dk,
        seg_dv,
        doc_q,
        doc_k,
        layout.delta_bitmap_BHX,
        vcol_BHV,
        layout.row_BHM6,
        vchunk_BHC2,
        *q_BHSD.stride()[:3],
        *k_BHkSD.stride()[:3],
        *v_BHkSD.stride()[:3],
        *dout_BHSD.stride()[:3],
        *lse_BHS.stride()[:2],
        *seg_dk.stride()[:4],
        doc_q.stride(0),
        doc_k.stride(0),
        *layout.delta_bitmap_BHX.stride()[:2],
        *vcol_BHV.stride()[:2],
        *layout.row_BHM6.stride()[:2],
        *vchunk_BHC2.stride()[:2],
        H,
        H // k_BHkSD.shape[1],
        Sq,
        layout.k_len,
        layout.num_k_blocks,
        layout.mask_shift,
        qk_scale,
        num_segments,
        BLOCK=layout.block,
        VCHUNK=vc,
        HEAD_DIM=D,
    )
    return seg_dk.sum(2), seg_dv.sum(2), vcol_BHV


def fold_verticals(
    dk32_BHkSD: torch.Tensor,
    dv32_BHkSD: torch.Tensor,
    dk_BHkSD: torch.Tensor,
    dv_BHkSD: torch.Tensor,
    part_dk: torch.Tensor,
    part_dv: torch.Tensor,
    vcol_BHV: torch.Tensor,
    layout: BlockLayout,
    scale: float,
) -> None:
    """dk, dv = the block pass's fp32 dk32, dv32 + the vertical partials (dk, dv may be dk32, dv32 themselves)."""
    B, Hk, _, D = dk32_BHkSD.shape
    H = part_dk.shape[1]
    assert dk32_BHkSD.stride() == dv32_BHkSD.stride()
    _fold_kernel[(layout.num_k_blocks, B * Hk)](
        dk32_BHkSD,
        dv32_BHkSD,
        dk_BHkSD,
        dv_BHkSD,
        part_dk,
        part_dv,
        vcol_BHV,
        layout.col_BHN6,
        *dk32_BHkSD.stride()[:3],
        *dk_BHkSD.stride()[:3],
        *dv_BHkSD.stride()[:3],
        *part_dk.stride()[:3],
        *vcol_BHV.stride()[:2],
        *layout.col_BHN6.stride()[:2],
        Hk,
        H // Hk,
        layout.k_len,
        scale,
        BLOCK=layout.block,
        VCHUNK=layout.vertical_chunk,
        HEAD_DIM=D,
        num_warps=8,
    )
