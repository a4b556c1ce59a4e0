"""Probe scoring for pattern estimation: the probe rows' softmax over all keys, reduced three ways.

`score_probes` returns, per batch row and head, the probabilities of the Q = W·R probe rows (at column
key + R, with R zero columns either side, so that a strided view shifting row r of a window by r columns
turns each slash offset into one column: `ProbeScores.slash_mass`); the vertical score of every key (column
sums); and each row's mass per key block (for recall). On CUDA it runs the Triton kernels of
probe_kernels.py (two passes over K, nothing but the probabilities written at full size); elsewhere, and as
their test oracle, plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain_cli.attention.sparse.probe_kernels import probe_mass


@dataclass(frozen=True)
class ProbeScores:
    prob_BHQC: torch.Tensor  # fp32 [B, H, Q, S + 2R]: row q holds p(key) at column key + R; zeros around
    vertical_BHS: torch.Tensor  # fp32: probe mass on each key, summed over the probe rows
    block_mass_BHQN: torch.Tensor  # fp32: each probe row's mass per key block
    rows_per_window: int

    def slash_mass(self) -> torch.Tensor:
        """fp32 [B, H, W, S + R]: column c of window w sums its rows' p at key c - R + r (row r = the window's
        r-th probe), the mass of slash offset d = end_w + 1 - c. Row r is read r columns to the right through
        a strided view (row stride + 1), so the reduction is one coalesced pass with nothing copied."""
        B, H, Q, width = self.prob_BHQC.shape
        R, S = self.rows_per_window, self.vertical_BHS.shape[-1]
        assert width == S + 2 * R and self.prob_BHQC.stride(3) == 1
        st = self.prob_BHQC.stride()
        diagonal_BHWRC = self.prob_BHQC.as_strided((B, H, Q // R, R, S + R), (st[0], st[1], R * st[2], st[2] + 1, 1),
                                                   self.prob_BHQC.storage_offset())
        return diagonal_BHWRC.sum(3)


def score_probes_torch(probe_BHQD: torch.Tensor, k_BHkSD: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor,
                       rows_per_window: int, scale: float, block: int) -> ProbeScores:
    """Plain-torch scoring (fp32): the CPU path and the oracle of the Triton kernels."""
    B, H, Q, D = probe_BHQD.shape
    Hk, S = k_BHkSD.shape[1], k_BHkSD.shape[2]
    R = rows_per_window
    score_BHQS = (probe_BHQD.float().reshape(B, Hk, H // Hk * Q, D) @ k_BHkSD.float().transpose(-1, -2)).view(
        B, H, Q, S) * scale
    key_S = torch.arange(S, device=k_BHkSD.device)
    visible_BQS = (key_S <= pos_BQ[..., None]) & (key_S >= lo_BQ[..., None])
    prob_BHQS = score_BHQS.masked_fill_(~visible_BQS[:, None], -torch.inf).softmax(-1).nan_to_num_(0.0)
    nb = -(-S // block)
    block_mass_BHQN = torch.nn.functional.pad(prob_BHQS, (0, nb * block - S)).view(B, H, Q, nb, block).sum(-1)
    return ProbeScores(torch.nn.functional.pad(prob_BHQS, (R, R)), prob_BHQS.sum(2), block_mass_BHQN, R)


def score_probes(probe_BHQD: torch.Tensor, k_BHkSD: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor,
                 rows_per_window: int, scale: float, block: int) -> ProbeScores:
    """pos_BQ: each probe row's position, -1 for a row that is not real; lo_BQ: its document's start."""
    if probe_BHQD.device.type == "cuda":
        prob, vertical, block_mass = probe_mass(probe_BHQD, k_BHkSD, pos_BQ, lo_BQ, rows_per_window, scale, block)
        return ProbeScores(prob, vertical, block_mass, rows_per_window)
    return score_probes_torch(probe_BHQD, k_BHkSD, pos_BQ, lo_BQ, rows_per_window, scale, block)
