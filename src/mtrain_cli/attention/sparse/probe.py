"""Probe scoring for pattern estimation: the probe rows' softmax over all keys, reduced three ways.

`score_probes` returns, per batch row and head, the probabilities of the Q = W·R probe rows stored
*skewed* (row r of window w at columns key + R - r, zeros elsewhere), so that a column sum over r is the
mass of one slash offset; the vertical score of every key (column sums); and each row's mass per key
block (for recall). On CUDA it runs the Triton kernels of probe_kernels.py (two passes over K, nothing
but the skewed probabilities written at full size); elsewhere, and as their test oracle, plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtrain_cli.attention.sparse.probe_kernels import probe_mass


@dataclass(frozen=True)
class ProbeScores:
    skew_BHQC: torch.Tensor  # fp32 [B, H, Q, S + R]: row q = w·R + r holds p(key) at column key + R - r
    vertical_BHS: torch.Tensor  # fp32: probe mass on each key, summed over the probe rows
    block_mass_BHQN: torch.Tensor  # fp32: each probe row's mass per key block
    rows_per_window: int


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
    skew_BHQC = torch.zeros(B, H, Q, S + R, dtype=torch.float32, device=k_BHkSD.device)
    st = skew_BHQC.stride()
    # element (q, key) of the view lands at q·(S + R) + key + R - q % R (windows of R rows restart the skew)
    skew_view = skew_BHQC.view(B, H, Q // R, R, S + R).as_strided(
        (B, H, Q // R, R, S), (st[0], st[1], R * (S + R), S + R - 1, 1), R)
    skew_view.copy_(prob_BHQS.view(B, H, Q // R, R, S))
    nb = -(-S // block)
    block_mass_BHQN = torch.nn.functional.pad(prob_BHQS, (0, nb * block - S)).view(B, H, Q, nb, block).sum(-1)
    return ProbeScores(skew_BHQC, prob_BHQS.sum(2), block_mass_BHQN, R)


def score_probes(probe_BHQD: torch.Tensor, k_BHkSD: torch.Tensor, pos_BQ: torch.Tensor, lo_BQ: torch.Tensor,
                 rows_per_window: int, scale: float, block: int) -> ProbeScores:
    """pos_BQ: each probe row's position, -1 for a row that is not real; lo_BQ: its document's start."""
    if probe_BHQD.device.type == "cuda":
        skew, vertical, block_mass = probe_mass(probe_BHQD, k_BHkSD, pos_BQ, lo_BQ, rows_per_window, scale, block)
        return ProbeScores(skew, vertical, block_mass, rows_per_window)
    return score_probes_torch(probe_BHQD, k_BHkSD, pos_BQ, lo_BQ, rows_per_window, scale, block)
