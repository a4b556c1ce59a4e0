"""Backward pass, block dK/dV of vertical-slash sparse attention (launched by kernels_bwd.sparse_backward).

Key-major, one program per (key block, batch·kv head), no atomics: for every query head of the GQA group
(K/V are never repeated) it walks key block j's work list, the dense range of query blocks first, then the
rows j + Δ of the head's Δ slice, and accumulates dK = Σ dSᵀ Q and dV = Σ Pᵀ dO over them, recomputing P and
dS = P ∘ (dP − Δ) per tile from the saved LSE and Δ rows. Out in fp32 (or added into fp32 gradients: ring mode);
the vertical columns' share is added afterwards by kernels_vertical's fold.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mtrain_cli.attention.sparse.kernels import (
    LOG2E_K,
    _dkdv_step,
    configs,
    element_mask,
    key_tile_needs_mask,
    prune_tiles,
    work_ranges,
)


@triton.jit
def _query_block(DELTA_bh, j, t, n_dense, dn_lo, sl_lo):
    """Query block of entry t of key block j's list: the dense range first, then rows j + Δ of the slice."""
    delta = tl.load(DELTA_bh + sl_lo + t - n_dense, mask=t >= n_dense, other=0)
    return tl.where(t < n_dense, dn_lo + t, j + delta)


# 3 stages took 8% off this pass against 2 on H200 (bench/results/step_variants_strong128k_h200.md)
@triton.autotune(
    configs=configs(({"SUB_M": 64},), ((8, 2), (4, 2), (8, 3), (4, 3))),
    key=["HEAD_DIM", "BLOCK", "ACCUM", "Sq", "Sk"],
    prune_configs_by=prune_tiles(warps_from_block=True),
    cache_results=True,  # persisted in Triton's cache by GPU target and shape: later runs skip the tuning
    restore_value=["DK", "DV"],
)
@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DEL,
    DK,
    DV,
    DOCQ,
    DOCK,
    ROWEND,
    DELTA,
    COL,
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
    sdkb,
    sdkh,
    sdks,
    sdvb,
    sdvh,
    sdvs,
    sdcqb,
    sdckb,
    sreb,
    sdlb,
    sdlh,
    scb,
    sch,
    Hk,
    G,
    Sq,
    Sk,
    SHIFT,
    qk_scale,
    scale,
    BLOCK: tl.constexpr,
    SUB_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ACCUM: tl.constexpr,
):
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
    row_end = tl.load(ROWEND + b * sreb + j)
    acc_dk = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    acc_dv = tl.zeros([BLOCK, HEAD_DIM], tl.float32)
    # TMA descriptors over the group's heads ([G, S, D] and [G, S]), made once per program rather than per
    # head: each one made on the device is a global write, a fence and CTA barriers. Row statistics come by
    # TMA too: pointer loads in the accumulator's column layout were 32 scalar copies per thread per tile
    # (every row read by many threads) and spilled. Rows past the chunk read 0 (their Q and dO are 0 too).
    q_desc = tl.make_tensor_descriptor(
        Q + b * sqb + hk * G * sqh, shape=[G, Sq, HEAD_DIM], strides=[sqh, sqs, 1], block_shape=[1, SUB_M, HEAD_DIM]
    )
    do_desc = tl.make_tensor_descriptor(
        DO + b * sdob + hk * G * sdoh,
        shape=[G, Sq, HEAD_DIM],
        strides=[sdoh, sdos, 1],
        block_shape=[1, SUB_M, HEAD_DIM],
    )
    lse_desc = tl.make_tensor_descriptor(
        LSE + b * slb + hk * G * slh, shape=[G, Sq], strides=[slh, 1], block_shape=[1, SUB_M]
    )
    del_desc = tl.make_tensor_descriptor(
        DEL + b * slb + hk * G * slh, shape=[G, Sq], strides=[slh, 1], block_shape=[1, SUB_M]
    )
    for g in range(G):
        h = hk * G + g
        col = COL + b * scb + h * sch + j * 6
        sl_lo, sl_hi, dn_lo, dn_hi, _, _ = work_ranges(col)
        DELTA_bh = DELTA + b * sdlb + h * sdlh
        n_dense = dn_hi - dn_lo
        for t in range(0, n_dense + sl_hi - sl_lo):
            qb = _query_block(DELTA_bh, j, t, n_dense, dn_lo, sl_lo)
            for sub in tl.static_range(BLOCK // SUB_M):
                offs_m = qb * BLOCK + sub * SUB_M + tl.arange(0, SUB_M)
                q = q_desc.load([g, qb * BLOCK + sub * SUB_M, 0]).reshape(SUB_M, HEAD_DIM)
                do = do_desc.load([g, qb * BLOCK + sub * SUB_M, 0]).reshape(SUB_M, HEAD_DIM)
                lse = lse_desc.load([g, qb * BLOCK + sub * SUB_M]).reshape(SUB_M)
                lse2 = tl.where(lse == -float("inf"), float("inf"), lse * LOG2E_K)
                delta = del_desc.load([g, qb * BLOCK + sub * SUB_M]).reshape(SUB_M)
                s_T = tl.dot(k, tl.trans(q))
                q_first = qb * BLOCK + sub * SUB_M
                if key_tile_needs_mask(q_first + SHIFT, q_first + SUB_M - 1, j * BLOCK + BLOCK - 1, row_end):
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
