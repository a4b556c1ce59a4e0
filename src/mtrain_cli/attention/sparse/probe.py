"""Probe scoring for pattern estimation: the probe rows' softmax over this process's keys, reduced three ways.

`score_probes` returns, per batch row and head, the probabilities of the Q = W·R probe rows, the vertical
score of every key (column sums) and each row's mass per key block (for recall); `slash_scores` sums them along
diagonals. On CUDA these run the Triton kernels of probe_kernels.py (two passes over K that skip the key tiles
no probe row sees, nothing but the probabilities written at full size, then one read of what the rows see);
elsewhere, and as their test oracle, plain torch.

The keys may be a ring rank's share of the sequence (`ProbeKeys`): tiles of `block` keys, each contiguous
in the global frame. A probe buffer row holds each run of globally adjacent tiles with R zero columns
before and after it, so that reading row r of a window r columns to the right turns each slash offset into
one column (`ProbeScores.slash_mass`, the slash kernel) without mixing keys that are not neighbours. In one
process the keys are the whole row: one run, at column key + R. The softmax is global: row maxima and
sums are combined across processes by `reduce` (the identity in one process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain_cli.attention.sparse.probe_kernels import probe_mass, probe_slash
from mtrain_cli.attention.sparse.probe_keys import ProbeKeys, Reduce, one_process

# fp32 elements of the torch slash scores' gathered grid at once (256 MiB): a chunk of probe windows
SLASH_GRID_ELEMENTS = 2**26


@dataclass(frozen=True)
class ProbeScores:
    # [B, H, Q, width]: row q holds p(key) at the key's column (ProbeKeys), zero in the zero columns; from the
    # kernels in bf16 (readers sum in fp32), undefined where the row does not see the key (readers mask by pos_BQ,
    # lo_BQ)
    prob_BHQC: torch.Tensor
    vertical_BHN: torch.Tensor  # probe mass on each local key, summed over the probe rows
    block_mass_BHQT: torch.Tensor  # each probe row's mass per local key tile
    rows_per_window: int

    def slash_mass(self) -> torch.Tensor:
        """[B, H, W, width - R]: column c of window w sums its rows' p at column c + r (row r = the window's
        r-th probe), one slash offset of one run of keys (pattern.slash_columns says which). Row r is read r
        columns to the right through a strided view (row stride + 1): one coalesced pass, nothing copied."""
        B, H, Q, width = self.prob_BHQC.shape
        R = self.rows_per_window
        assert self.prob_BHQC.stride(3) == 1
        st = self.prob_BHQC.stride()
        diagonal_BHWRC = self.prob_BHQC.as_strided(
            (B, H, Q // R, R, width - R), (st[0], st[1], R * st[2], st[2] + 1, 1), self.prob_BHQC.storage_offset()
        )
        return diagonal_BHWRC.sum(3)


def score_probes_torch(
    probe_BHQD: torch.Tensor,
    k_BHkND: torch.Tensor,
    pos_BQ: torch.Tensor,
    lo_BQ: torch.Tensor,
    keys: ProbeKeys,
    scale: float,
    reduce: Reduce = one_process,
) -> ProbeScores:
    """Plain-torch scoring (fp32, or fp64 inputs in fp64): the CPU path and the oracle of the Triton kernels."""
    B, H, Q, D = probe_BHQD.shape
    Hk, N = k_BHkND.shape[1], k_BHkND.shape[2]
    dtype = torch.promote_types(probe_BHQD.dtype, torch.float32)
    score_BHQN = (probe_BHQD.to(dtype).reshape(B, Hk, H // Hk * Q, D) @ k_BHkND.to(dtype).transpose(-1, -2)).view(
        B, H, Q, N
    ) * scale
    visible_BQN = (keys.pos_N <= pos_BQ[..., None]) & (keys.pos_N >= lo_BQ[..., None])
    score_BHQN.masked_fill_(~visible_BQN[:, None], -torch.inf)
    row_max_BHQ = reduce(score_BHQN.amax(-1), "max")
    exp_BHQN = torch.exp(score_BHQN - torch.where(row_max_BHQ == -torch.inf, 0.0, row_max_BHQ)[..., None])
    total_BHQ = reduce(exp_BHQN.sum(-1))
    prob_BHQN = exp_BHQN / torch.where(total_BHQ > 0, total_BHQ, 1.0)[..., None]
    T = -(-N // keys.block)
    block_mass_BHQT = torch.nn.functional.pad(prob_BHQN, (0, T * keys.block - N)).view(B, H, Q, T, keys.block).sum(-1)
    prob_BHQC = prob_BHQN.new_zeros(B, H, Q, keys.width).index_copy_(3, keys.column_N, prob_BHQN)
    return ProbeScores(prob_BHQC, prob_BHQN.sum(2), block_mass_BHQT, keys.pad)


def score_probes(
    probe_BHQD: torch.Tensor,
    k_BHkND: torch.Tensor,
    pos_BQ: torch.Tensor,
    lo_BQ: torch.Tensor,
    keys: ProbeKeys,
    scale: float,
    reduce: Reduce = one_process,
) -> ProbeScores:
    """pos_BQ: each probe row's global position, -1 for a row that is not real; lo_BQ: its document's start;
    k_BHkND: this process's keys (`keys` says where they are)."""
    if probe_BHQD.device.type == "cuda":
        prob, vertical, block_mass = probe_mass(probe_BHQD, k_BHkND, pos_BQ, lo_BQ, keys, scale, reduce)
        return ProbeScores(prob, vertical, block_mass, keys.pad)
    return score_probes_torch(probe_BHQD, k_BHkND, pos_BQ, lo_BQ, keys, scale, reduce)


def slash_scores(
    scores: ProbeScores, slash_col_BWKS: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor
) -> torch.Tensor:
    """[B, H, S]: this process's slash scores, offset d summing every probe row's probability on the key d tokens
    back. slash_col_BWKS: where window w's slash masses hold offset d in each run of keys (pattern.slash_columns);
    pos_BQ, lo_BQ: the probe rows' positions and document starts. On CUDA one kernel reads only what the rows see;
    elsewhere `slash_mass`, gathered a chunk of windows at a time."""
    if scores.prob_BHQC.is_cuda:
        return probe_slash(scores.prob_BHQC, slash_col_BWKS, pos_BQ, lo_BQ, scores.rows_per_window)
    diag_BHWC = scores.slash_mass()
    B, H = diag_BHWC.shape[:2]
    W, K, S = slash_col_BWKS.shape[1:]
    chunk = max(1, SLASH_GRID_ELEMENTS // (B * H * K * S))  # the grid is [B, H, windows, K·S]
    slash_BHS = diag_BHWC.new_zeros(B, H, S)
    for lo in range(0, W, chunk):
        col_BWX = slash_col_BWKS[:, lo : lo + chunk].reshape(B, 1, -1, K * S)
        grid_BHWX = diag_BHWC[:, :, lo : lo + chunk].gather(3, col_BWX.expand(B, H, -1, K * S))
        slash_BHS += grid_BHWX.view(B, H, -1, S).sum(2)
    return slash_BHS
