"""FLOP counts behind the step line's MFU: ours (the pairs each document's causal attention holds) and
torchtitan's (every pair of the sequence), on a packed row."""

import torch

from mtrain_cli.train.flops import causal_pairs, torchtitan_flops, training_flops


def test_packed_rows_count_only_the_pairs_inside_documents_and_torchtitan_counts_every_pair():
    doc_BS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2]])  # documents of 3, 2 and 5 tokens
    assert causal_pairs(doc_BS) == 6 + 3 + 15
    N, L, H, D, S = 1000, 2, 4, 8, 10
    ours = training_flops(N, S, causal_pairs(doc_BS), L, H, D)
    assert ours == 6 * N * S + 12 * H * D * 24 * L
    # torchtitan: 6·N + 12·L·H·D·S per token, i.e. all S² pairs of the row at 12·H·D FLOPs per layer
    assert torchtitan_flops(N, S, S, L, H, D) == 6 * N * S + 12 * H * D * S * S * L
    assert torchtitan_flops(N, S, S, L, H, D) > ours
