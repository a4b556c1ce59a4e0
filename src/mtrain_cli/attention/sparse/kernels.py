"""Triton kernels for vertical-slash sparse attention: shared pieces; passes in kernels_fwd / kernels_bwd.

Algorithm. The layout (layout.py) gives every query block i three kinds of work: a slice of the head's
sorted block-offset list Δ (slash blocks i - Δ), a dense range of key blocks (rows of short documents),
and a slice of the head's sorted vertical columns, of which the columns inside slash blocks are skipped
so each (query, key) pair is computed once. Key block j gets the transposed view: a slice of the same Δ
list (rows j + Δ) and a dense range of query blocks.

Kernels.
- forward (kernels_fwd): one program per (query block, batch·head); online softmax over the slash
  blocks, the dense blocks and the gathered vertical columns; writes O and LSE (fp32, natural log), or
  merges into an existing fp32 O / LSE (ring mode) with the stable sigmoid / log-sigmoid form.
- backward (kernels_bwd), no atomics, so gradients are bit-reproducible: dQ, query-major, the forward's
  walk; vertical dK/dV, one program per chunk of a head's vertical columns walking every query block
  that reads them, writing per-head partial sums; block dK/dV, key-major, one program per (key block,
  batch·kv head) walking the Δ slice and dense range of each query head of its group (GQA heads sum
  without K/V being repeated); a fold adds each head's vertical partials for columns inside the block.
- Masks: causal (global positions q_offset + i ≥ k_offset + j), same document, sequence tails. Each pass
  is one loop over a block's work list (dense range, then slash blocks) with a single copy of the tile
  code; the element mask is built and applied only on tiles that need it (`tile_needs_mask`: the diagonal,
  document boundaries, tails), a small branch inside the loop. Most tiles of a long document need none,
  and the mask's integer compares cost about as much as the softmax's exponentials. (Peeling the masked
  blocks into a second loop instead tripled the code; on H100 its backward did not compile and run
  within 45 s per autotune config.)
- Rows (forward, dQ) are launched last-first: late rows see the most blocks and should start first.

Autograd: ops.SparseAttentionFunction calls these; the model hook (attention/hook.py) is the entry point.

Tiles: the layout block (64 on GPU) is the query tile; key sub-tiles and pipeline stages are autotuned over
a short list for Hopper, with one warpgroup per 64 rows. A slash crosses two key blocks in every block row and
both are computed whole, so a 64 block computes about a third fewer pairs than 128 on the same pattern; its
smaller tiles run slower per pair, but less so (128K on H100: 53 against 75 ms, bench/results). Under
TRITON_INTERPRET=1 a single small config runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
INTERPRET_K = tl.constexpr(INTERPRET)
LOG2E = 1.4426950408889634
LOG2E_K = tl.constexpr(LOG2E)
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: must be a constexpr global
MIXED_BLOCK = -4  # block_documents of a block holding several documents (ids are >= -1) or a sequence tail
MIXED = tl.constexpr(MIXED_BLOCK)


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


def provide_descriptor_scratch() -> None:
    """Give Triton the global memory it asks for when kernels build TMA tensor descriptors on the device.
    Triton keeps the allocator in a context variable, so launchers set it on every call: backward runs on
    autograd's own thread."""
    triton.set_allocator(_descriptor_scratch)


def configs(tiles: tuple[dict[str, int], ...], warps_stages: tuple[tuple[int, int], ...]) -> list[triton.Config]:
    """Autotune list: tile sizes × (warps, stages); one tiny config (16-wide tiles) for the interpreter."""
    if INTERPRET:
        return [triton.Config(dict.fromkeys(tiles[0], 16), num_warps=1, num_stages=1)]
    return [triton.Config(t, num_warps=w, num_stages=st) for t in tiles for w, st in warps_stages]


def prune_tiles(warps_from_block: bool = False):
    """Drop configs whose tiles exceed the layout block (e.g. block 64 with 128-wide tiles). warps_from_block (kernels
    whose program owns one block of rows or keys): keep one warpgroup, 4 warps, per 64 of them, the rows of one
    wgmma. At block 128, 16 warps cap registers at 128 and spill; at block 64, 8 warps split 64-row tiles."""
    def prune(cfgs, named_args, **kwargs):
        block = kwargs["BLOCK"] if "BLOCK" in kwargs else named_args["BLOCK"]  # constexprs come as kwargs
        kept = [c for c in cfgs if max(c.kwargs.values()) <= block
                and (INTERPRET or not warps_from_block or c.num_warps == 4 * max(1, block // 64))]
        return kept or [triton.Config(dict.fromkeys(cfgs[0].kwargs, block), num_warps=4, num_stages=2)]
    return {"early_config_prune": prune}


@triton.jit
def work_ranges(entry):
    """A block's six layout ints: slash slice lo/hi, dense range lo/hi, vertical slice lo/hi."""
    return (tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3), tl.load(entry + 4),
            tl.load(entry + 5))


@triton.jit
def element_mask(q_pos, dq, k_idx, dk, Sk):
    """[M, N] causal ∧ same document ∧ inside the key chunk (key-local coordinates)."""
    return (k_idx[None, :] <= q_pos[:, None]) & (dq[:, None] == dk[None, :]) & (k_idx[None, :] < Sk)


def block_documents(document_ids_BS: torch.Tensor, block: int) -> torch.Tensor:
    """int32 [B, blocks]: the document of each block of `block` tokens, MIXED_BLOCK where it holds several or
    runs past the sequence. Kernels decide per tile with one scalar load which tiles need element masks."""
    B, S = document_ids_BS.shape
    num_blocks = -(-S // block)
    ids_BNK = F.pad(document_ids_BS, (0, num_blocks * block - S), value=MIXED_BLOCK).view(B, num_blocks, block)
    lo_BN, hi_BN = ids_BNK.amin(-1), ids_BNK.amax(-1)
    return torch.where(lo_BN == hi_BN, lo_BN, MIXED_BLOCK).to(torch.int32).contiguous()


@triton.jit
def tile_needs_mask(q_first, k_last, q_block_doc, k_block_doc):
    """False when every pair of the tile is visible: all keys at or before the first query (key-local
    positions), and the query and key blocks inside one and the same document (block_documents)."""
    return (k_last > q_first) | (q_block_doc == MIXED) | (k_block_doc != q_block_doc)


@triton.jit
def merge_lse(o_prev, lse_prev, o_cur, lse_cur):
    """Merge two normalised partial outputs by their LSE (fp32): o = o_prev + σ(lse_cur - lse_prev)·(o_cur - o_prev).

    The sigmoid / log-sigmoid form stays finite for any gap; two empty partials stay empty (-inf)."""
    both_empty = (lse_prev == -float("inf")) & (lse_cur == -float("inf"))
    diff = tl.where(both_empty, 0.0, lse_cur - lse_prev)
    w_cur = 1.0 / (1.0 + tl.exp(-diff))
    o = o_prev + w_cur[:, None] * (o_cur - o_prev)
    lse = tl.maximum(lse_prev, lse_cur) + tl.log(1.0 + tl.exp(-tl.abs(diff)))
    return o, tl.where(both_empty, -float("inf"), lse)


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
