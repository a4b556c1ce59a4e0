"""Triton kernels for vertical-slash sparse attention: shared pieces; passes in kernels_fwd / kernels_bwd (with
kernels_dkdv and kernels_vertical).

Algorithm. The layout (layout.py) gives every query block i three kinds of work: a slice of the head's
sorted block-offset list Δ (slash blocks i - Δ), a dense range of key blocks (rows of short documents),
and a slice of the head's sorted vertical columns, of which the columns inside slash blocks are skipped
so each (query, key) pair is computed once. Key block j gets the transposed view: a slice of the same Δ
list (rows j + Δ) and a dense range of query blocks.

Kernels.
- forward (kernels_fwd): one program per (query block, batch·head); online softmax over the slash
  blocks and the dense blocks, two key blocks an update, then the gathered vertical columns; writes O and LSE
  (fp32, natural log), or
  merges into an existing fp32 O / LSE (ring mode) with the stable sigmoid / log-sigmoid form.
- backward (kernels_bwd), no atomics, so gradients are bit-reproducible: dQ, query-major, the forward's
  walk; vertical dK/dV, one program per chunk of a head's vertical columns walking every query block
  that reads them, writing per-head partial sums; block dK/dV, key-major, one program per (key block,
  batch·kv head) walking the Δ slice and dense range of each query head of its group (GQA heads sum
  without K/V being repeated); a fold adds each head's vertical partials for columns inside the block.
- Masks: causal (global positions q_offset + i ≥ k_offset + j), same document, sequence tails. Each pass
  is one loop over a block's work list (dense range, then slash blocks) with a single copy of the tile
  code; the element mask is built and applied only on tiles that need it (the diagonal, document
  boundaries, tails), a small branch inside the loop. Most tiles of a long document need none, and the
  mask's integer compares cost about as much as the softmax's exponentials. Which tiles need it is decided
  from positions against one bound per program (`tile_mask_bounds`), not a document id loaded per tile: such
  a load sits between the work-list load and the tile's TMA copy on every iteration. (Peeling the masked
  blocks into a second loop instead tripled the code; on H100 its backward did not compile and run
  within 45 s per autotune config.)
- Rows (forward, dQ) are launched last-first: late rows see the most blocks and should start first.

Autograd: ops.SparseAttentionFunction calls these; the attention router (attention/router.py) calls it.

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
MIXED_BLOCK = -4  # _block_documents of a block holding several documents (ids are >= -1) or a sequence tail
NEVER_KEY = 2**30  # tile_mask_bounds of a query block whose tiles always take the element mask


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


def provide_descriptor_scratch() -> None:
    """Give Triton the global memory it asks for when kernels build TMA tensor descriptors on the device.
    Triton keeps the allocator in a context variable, so launchers set it on every call: backward runs on
    autograd's own thread."""
    triton.set_allocator(_descriptor_scratch)


def kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when the kernels can read it in place, else a contiguous copy. They take any strides whose
    rows are 16-byte aligned with a contiguous last dimension (TMA's rule), such as transformers' [B, H, S, D]
    views of [B, S, H, D] projections; outputs and gradients follow the inputs' layout (`empty_like`), so the
    model's transpose back is free too."""
    align = 16 // t.element_size()
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s % align == 0 for s in t.stride()[:-1]):
        return t
    return t.contiguous()


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
        kept = [
            c
            for c in cfgs
            if max(c.kwargs.values()) <= block
            and (INTERPRET or not warps_from_block or c.num_warps == 4 * max(1, block // 64))
        ]
        return kept or [triton.Config(dict.fromkeys(cfgs[0].kwargs, block), num_warps=4, num_stages=2)]

    return {"early_config_prune": prune}


@triton.jit
def work_ranges(entry):
    """A block's six layout ints: slash slice lo/hi, dense range lo/hi, vertical slice lo/hi."""
    return (
        tl.load(entry),
        tl.load(entry + 1),
        tl.load(entry + 2),
        tl.load(entry + 3),
        tl.load(entry + 4),
        tl.load(entry + 5),
    )


@triton.jit
def element_mask(q_pos, dq, k_idx, dk, Sk):
    """[M, N] causal ∧ same document ∧ inside the key chunk (key-local coordinates)."""
    return (k_idx[None, :] <= q_pos[:, None]) & (dq[:, None] == dk[None, :]) & (k_idx[None, :] < Sk)


def _runs(document_ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (run of each position [B, S], first position of each run [B, S + 2]): runs of equal document ids,
    numbered from 0; a run's end is the next run's first position (S after the last run). One cumsum and one
    scatter: torch's cummax/cummin over 128K positions took 0.7-0.8 ms each on H100."""
    B, S = document_ids_BS.shape
    pos_BS = torch.arange(S, device=document_ids_BS.device, dtype=torch.int64).expand(B, S)
    starts_BS = F.pad(document_ids_BS[:, 1:] != document_ids_BS[:, :-1], (1, 0), value=True)
    run_BS = starts_BS.cumsum(1) - 1
    first_BR = torch.full((B, S + 2), S, dtype=torch.int64, device=document_ids_BS.device)
    first_BR.scatter_(1, torch.where(starts_BS, run_BS, S + 1), pos_BS)  # non-starts land in the spare slot S + 1
    return run_BS, first_BR


def _block_documents(document_ids_BS: torch.Tensor, block: int) -> torch.Tensor:
    """[B, blocks]: the document of each block of `block` tokens, MIXED_BLOCK where it holds several or runs
    past the sequence."""
    B, S = document_ids_BS.shape
    num_blocks = -(-S // block)
    ids_BNK = F.pad(document_ids_BS, (0, num_blocks * block - S), value=MIXED_BLOCK).view(B, num_blocks, block)
    lo_BN, hi_BN = ids_BNK.amin(-1), ids_BNK.amax(-1)
    return torch.where(lo_BN == hi_BN, lo_BN, MIXED_BLOCK)


MaskBounds = tuple[torch.Tensor, torch.Tensor]  # (key_start_BM, row_end_BN) of tile_mask_bounds


def tile_mask_bounds(doc_q_BSq: torch.Tensor, doc_k_BSk: torch.Tensor, block: int, shift: int) -> MaskBounds:
    """Which tiles can skip the element mask, as one int per block, so a kernel compares positions in its loop
    instead of loading a document id per tile (a dependent load, and a CTA barrier where it is pipelined).

    -> (key_start [B, query blocks], row_end [B, key blocks]), int32. Query block i, inside one document d:
    every key from key_start[i] up to its first query (key-local i·block + shift, clamped to the chunk) is in
    d; NEVER_KEY where the block holds several documents or runs past the chunk. Key block j, inside one
    document d and the chunk: every query row from the one level with its last key (query-local) up to
    row_end[j] - 1 is in d; -1 otherwise. A causal-visible tile with keys in the chunk then has only same-
    document pairs when its first key >= key_start (query-major walk) or its last row < row_end (key-major).

    About 30 small torch ops: callers that have them per batch pass them in (ops.SparseAttentionFunction, the
    ring plan's chunk pairs)."""
    Sq, Sk = doc_q_BSq.shape[1], doc_k_BSk.shape[1]
    doc_qb_BM, doc_kb_BN = _block_documents(doc_q_BSq, block), _block_documents(doc_k_BSk, block)
    device = doc_q_BSq.device
    run_k_BSk, first_k_BR = _runs(doc_k_BSk)
    key_at_M = (torch.arange(doc_qb_BM.shape[1], device=device) * block + shift).clamp(0, Sk - 1)
    same_BM = (doc_qb_BM != MIXED_BLOCK) & (doc_k_BSk[:, key_at_M] == doc_qb_BM)
    key_start_BM = torch.where(same_BM, first_k_BR.gather(1, run_k_BSk[:, key_at_M]), NEVER_KEY)
    run_q_BSq, first_q_BR = _runs(doc_q_BSq)
    row_at_N = (torch.arange(doc_kb_BN.shape[1], device=device) * block + block - 1 - shift).clamp(0, Sq - 1)
    same_BN = (doc_kb_BN != MIXED_BLOCK) & (doc_q_BSq[:, row_at_N] == doc_kb_BN)
    row_end_BN = torch.where(same_BN, first_q_BR.gather(1, run_q_BSq[:, row_at_N] + 1), -1)
    return key_start_BM.to(torch.int32).contiguous(), row_end_BN.to(torch.int32).contiguous()


@triton.jit
def query_tile_needs_mask(key_limit, k_first, k_last, key_start):
    """Query-major walk: False when every pair is visible: keys at or before key_limit (the first query,
    key-local, clamped to the chunk's last key) and from the query block's key_start on (tile_mask_bounds)."""
    return (k_last > key_limit) | (k_first < key_start)


@triton.jit
def key_tile_needs_mask(q_first, q_last_row, k_last, row_end):
    """Key-major walk: False when every pair is visible: keys at or before the first query (key-local) and
    rows before the key block's row_end (query-local, tile_mask_bounds)."""
    return (k_last > q_first) | (q_last_row >= row_end)


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
