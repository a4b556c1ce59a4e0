"""Probe: the dQ block pass as a warp-specialized Hopper kernel (Gluon) whose query-block pairs share K/V tiles.

The companion of gluon_fwd_probe.py (read its docstring first): the same CTA of two query blocks, the same producer
and merged walk, with _dq_kernel's math in the consumers: S = Q Kᵀ and dP = dO Vᵀ, dS = P ∘ (dP - Δ), dQ += dS K.
The next tile's S and dP are issued before this tile's dQ += dS K, so dS of the next tile is computed while that
wgmma runs; the K tile stays held until it retires. Q and dO of both rows: 4 × 16 KB; with 4 stages of K/V
(32 KB each) the CTA uses 192 KB of shared memory.

Scope as the forward probe: one document, block 64, head dim 128, bf16, no verticals (emptied for the Triton
kernel too); dQ (fp32) is checked against _dq_kernel's before anything is timed.

    PYTHONPATH=src python3 bench/gluon_dq_probe.py --length 128k --planted-slashes 8 --out $OUT/dq.json
    PYTHONPATH=src python3 bench/gluon_dq_probe.py --compile-only
"""

from __future__ import annotations


import torch
from gluon_fwd_probe import (BLOCK, HEAD_DIM, MMA_O, MMA_S, TILE_SMEM, _pass_turn, _pipeline_barriers, _producer,
                             _row_list, _start_pingpong, _to_own_step, _wait_turn, block_pass_case, compile_report,
                             launch_layout, probe_args, write_result)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _ds(sc, dp, kb, i, lse2, dlt, qk_scale):
    """dS = P ∘ (dP - Δ) of one tile (the diagonal tile masked), as the A operand of dQ += dS K."""
    p = gl.exp2(sc * qk_scale - lse2[:, None])
    if kb == i:
        rows = i * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_S))
        cols = kb * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, MMA_S))
        p = gl.where(cols[None, :] <= rows[:, None], p, 0.0)
    ds = p * (dp - dlt[:, None])
    return gl.convert_layout(ds.to(gl.bfloat16), gl.DotOperandLayout(0, MMA_O, 2))


@gluon.jit
def _dq_consumer(DQ, LSE, DEL, q_smem, do_smem, q_bar, k_bufs, v_bufs, ready, empty, turn, ROW, DELTA, b, h, i0, H,
                 NQB, L, S, qk_scale, scale, C: gl.constexpr, STAGES: gl.constexpr, SHARE: gl.constexpr,
                 MODE: gl.constexpr, PINGPONG: gl.constexpr):
    i = i0 + C
    dp_list = DELTA + (b * H + h) * L
    sl0, n0 = _row_list(ROW, b, h, i0, H, NQB)
    sl1, n1 = _row_list(ROW, b, h, i0 + 1, H, NQB)
    q_s = q_smem.index(C)
    do_s = do_smem.index(C)
    zero = gl.zeros([BLOCK, BLOCK], gl.float32, MMA_S)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, MMA_O)
    rows = i * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_S))
    t0 = 0
    t1 = 0
    u = 0
    n_own = n1 if C == 1 else n0
    num_turns = _start_pingpong(turn, n0, n1, C, PINGPONG)
    if n_own > 0:
        lse = gl.load(LSE + (b * H + h) * S + rows)
        lse2 = gl.where(lse == -float("inf"), float("inf"), lse * LOG2E)
        dlt = gl.load(DEL + (b * H + h) * S + rows)
        mbarrier.wait(q_bar.index(C), 0)
        kb, use0, use1, t0, t1, u = _to_own_step(dp_list, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, u, ready, empty, C,
                                                 STAGES, SHARE, MODE)
        s_prev = u % STAGES
        if MODE != 2:
            mbarrier.wait(ready.index(s_prev), (u // STAGES) & 1)
        ds_op = gl.zeros([BLOCK, BLOCK], gl.bfloat16, gl.DotOperandLayout(0, MMA_O, 2))
        if MODE != 1:
            sc = warpgroup_mma(q_s, k_bufs.index(s_prev).permute((1, 0)), zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_s, v_bufs.index(s_prev).permute((1, 0)), zero, use_acc=False, is_async=True)
            sc, dp = warpgroup_mma_wait(num_outstanding=0, deps=[sc, dp])
            ds_op = _ds(sc, dp, kb, i, lse2, dlt, qk_scale)
        t0 += use0.to(gl.int32)
        t1 += use1.to(gl.int32)
        u += 1
        for k in range(1, n_own):
            kb, use0, use1, t0, t1, u = _to_own_step(dp_list, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, u, ready, empty,
                                                     C, STAGES, SHARE, MODE)
            st = u % STAGES
            if MODE != 2:
                mbarrier.wait(ready.index(st), (u // STAGES) & 1)
            if MODE != 1:
                _wait_turn(turn, k, num_turns, C, PINGPONG)
                sc = warpgroup_mma(q_s, k_bufs.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
                dp = warpgroup_mma(do_s, v_bufs.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)
                acc = warpgroup_mma(ds_op, k_bufs.index(s_prev), acc, is_async=True)
                _pass_turn(turn, k, num_turns, C, PINGPONG)
                sc, dp = warpgroup_mma_wait(num_outstanding=1, deps=[sc, dp])
                ds_op = _ds(sc, dp, kb, i, lse2, dlt, qk_scale)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            if MODE != 2:
                mbarrier.arrive(empty.index(s_prev))
            s_prev = st
            t0 += use0.to(gl.int32)
            t1 += use1.to(gl.int32)
            u += 1
        if MODE != 1:
            acc = warpgroup_mma(ds_op, k_bufs.index(s_prev), acc)
        if MODE != 2:
            mbarrier.arrive(empty.index(s_prev))
    kb, use0, use1, t0, t1, u = _to_own_step(dp_list, i0, sl0, n0, t0, i0 + 1, sl1, n1, t1, u, ready, empty, C,
                                             STAGES, SHARE, MODE)
    if n_own > 0:
        rows_o = i * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA_O))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, MMA_O))
        gl.store(DQ + ((b * H + h) * S + rows_o[:, None]) * HEAD_DIM + cols[None, :], acc * scale)


@gluon.jit
def _dq_ws_kernel(Q, K, V, DO, LSE, DEL, DQ, ROW, DELTA, H, G, S, NQB, L, qk_scale, scale,
                  STAGES: gl.constexpr, SHARE: gl.constexpr, MODE: gl.constexpr, PINGPONG: gl.constexpr):
    """MODE 0: the pass; 1: loads only; 2: math only (as in the forward probe)."""
    p = gl.num_programs(0) - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    Hk = H // G
    b = bh // H
    h = bh % H
    hk = h // G
    i0 = 2 * p
    B = gl.num_programs(1) // H
    q_desc = tma.make_tensor_descriptor(Q, [B * H * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    do_desc = tma.make_tensor_descriptor(DO, [B * H * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    k_desc = tma.make_tensor_descriptor(K, [B * Hk * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    v_desc = tma.make_tensor_descriptor(V, [B * Hk * S, HEAD_DIM], [HEAD_DIM, 1], [BLOCK, HEAD_DIM], TILE_SMEM)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK, HEAD_DIM], TILE_SMEM)
    do_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK, HEAD_DIM], TILE_SMEM)
    k_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, HEAD_DIM], TILE_SMEM)
    v_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, HEAD_DIM], TILE_SMEM)
    q_bar, ready, empty, turn = _pipeline_barriers(STAGES)
    gl.warp_specialize([
        (_dq_consumer, (DQ, LSE, DEL, q_smem, do_smem, q_bar, k_bufs, v_bufs, ready, empty, turn, ROW, DELTA, b, h, i0,
                        H, NQB, L, S, qk_scale, scale, 0, STAGES, SHARE, MODE, PINGPONG)),
        (_dq_consumer, (DQ, LSE, DEL, q_smem, do_smem, q_bar, k_bufs, v_bufs, ready, empty, turn, ROW, DELTA, b, h, i0,
                        H, NQB, L, S, qk_scale, scale, 1, STAGES, SHARE, MODE, PINGPONG)),
        (_producer, ((q_desc, do_desc), (q_smem, do_smem), q_bar, k_desc, v_desc, k_bufs, v_bufs, ready, empty, ROW,
                     DELTA, b, h, hk, Hk, i0, H, NQB, L, S, 2, STAGES, SHARE, MODE)),
    ], [4, 1], [240, 24])


def dq_ws(q, k, v, dout, lse, delta, layout, scale, share: bool = True, stages: int = 4, mode: int = 0,
          pingpong: bool = False):
    """fp32 dQ of the block pass (no verticals), one document per row, block 64, head dim 128."""
    from mtrain_cli.attention.sparse.kernels import LOG2E as log2e

    B, H, S, D = q.shape
    grid, row, deltas, group = launch_layout(q, k, layout)
    dq = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
    _dq_ws_kernel[grid](q, k, v, dout, lse.contiguous(), delta.contiguous(), dq, row, deltas, H, group, S,
                        layout.num_q_blocks, deltas.shape[-1], scale * log2e, scale, STAGES=stages, SHARE=share,
                        MODE=mode, PINGPONG=pingpong, num_warps=4, maxnreg=168)
    return dq


VARIANTS = ((False, False), (True, False), (True, True))  # share, pingpong


def _variant_name(share: bool, stages: int, pingpong: bool) -> str:
    return f"ws_{'shared' if share else 'split'}_{stages}stages{'_pingpong' if pingpong else ''}"


def main() -> None:
    args = probe_args(__doc__.splitlines()[0], "4")
    if args.compile_only:
        for stages in args.stage_counts:
            for share, pingpong in VARIANTS:
                compile_report(_dq_ws_kernel, _variant_name(share, stages, pingpong),
                               {"STAGES": stages, "SHARE": share, "MODE": 0, "PINGPONG": pingpong})
        return
    from mtrain_cli.attention.sparse import kernels_bwd
    from mtrain_cli.attention.sparse.kernels import LOG2E as log2e, provide_descriptor_scratch
    from mtrain_cli.attention.sparse.kernels_bwd import _tma_rows, attention_delta
    from mtrain_cli.attention.sparse.kernels_fwd import sparse_forward
    from mtrain_cli.profile.kernels import cuda_time_ms

    case, layout, bounds, result = block_pass_case(args, "gluon_dq_probe.py")
    q, k, v, doc, scale, dout = case.q, case.k, case.v, case.doc_BS, case.scale, case.dout
    B, H, S, D = q.shape
    Hk = k.shape[1]
    out, lse = sparse_forward(q, k, v, layout, doc, doc, scale, mask_bounds=bounds)
    lse, delta = _tma_rows(lse), _tma_rows(attention_delta(out, dout))
    doc32 = doc.to(torch.int32).contiguous()

    def triton_pass():
        provide_descriptor_scratch()
        dq32 = torch.empty(B, H, S, D, dtype=torch.float32, device=q.device)
        common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *lse.stride()[:2])
        kernels_bwd._dq_kernel[(layout.num_q_blocks, B * H)](
            q, k, v, dout, lse, delta, dq32, doc32, doc32, bounds[0], layout.delta_BHL, layout.delta_bitmap_BHX,
            layout.vcol_BHV, layout.row_BHM6, *common, *dq32.stride()[:3], doc32.stride(0), doc32.stride(0),
            bounds[0].stride(0), *layout.delta_BHL.stride()[:2], *layout.delta_bitmap_BHX.stride()[:2],
            *layout.vcol_BHV.stride()[:2], *layout.row_BHM6.stride()[:2], H, H // Hk, S, S, layout.num_k_blocks,
            layout.mask_shift, scale * log2e, scale, BLOCK=layout.block, VCHUNK=layout.vertical_chunk, HEAD_DIM=D,
            ACCUM=False)
        return dq32

    want = triton_pass()
    variants = [(_variant_name(share, stages, pingpong), share, stages, pingpong)
                for stages in args.stage_counts for share, pingpong in VARIANTS]
    for name, share, stages, pingpong in variants:
        got = dq_ws(q, k, v, dout, lse, delta, layout, scale, share, stages, pingpong=pingpong)
        again = dq_ws(q, k, v, dout, lse, delta, layout, scale, share, stages, pingpong=pingpong)
        result[name] = {"relative_error_vs_triton": float((got - want).norm() / want.norm()),
                        "bit_identical_to_triton": bool(torch.equal(got, want)),
                        "bit_identical_repeat": bool(torch.equal(again, got))}
        print(name, result[name], flush=True)
    flops = 6 * result["block_pairs"] * 64 * 64 * D
    triton_ms = cuda_time_ms(triton_pass, args.repeats)
    result["triton_dq_block_pass_ms"] = triton_ms
    result["triton_tflops_executed"] = flops / triton_ms / 1e9
    for name, share, stages, pingpong in variants:
        ms = cuda_time_ms(lambda: dq_ws(q, k, v, dout, lse, delta, layout, scale, share, stages, pingpong=pingpong),  # noqa: B023
                          args.repeats)
        result[name]["ms"] = ms
        result[name]["tflops_executed"] = flops / ms / 1e9
        for mode_name, mode in (("loads_only", 1), ("math_only", 2)):
            result[name][mode_name + "_ms"] = cuda_time_ms(
                lambda: dq_ws(q, k, v, dout, lse, delta, layout, scale, share, stages, mode, pingpong), args.repeats)  # noqa: B023
        print(name, result[name], flush=True)
    result["triton_dq_block_pass_ms_again"] = cuda_time_ms(triton_pass, args.repeats)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
