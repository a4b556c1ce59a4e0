"""Pattern estimation: selection rules, recall measured independently, recall on planted structure."""

from __future__ import annotations

import torch

from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.ops import plan_sparse
from mtrain_cli.attention.sparse.pattern import SENTINEL, SparseSettings, select_indices, document_spans, estimate_pattern
from mtrain_cli.attention.sparse.reference import allowed_mask
from mtrain_cli.profile.synthetic import planted_qkv


def chosen(index_N: torch.Tensor) -> list[int]:
    return [int(i) for i in index_N if i < SENTINEL]


def test_flex_keeps_the_smallest_set_reaching_p_plus_forced_entries():
    score = torch.tensor([[[0.05, 0.5, 0.0, 0.3, 0.1, 0.05]]])
    forced = torch.zeros_like(score, dtype=torch.bool)
    forced[..., 5] = True
    flex = SparseSettings(selection="flex", p=0.75, cap=10)
    assert chosen(select_indices(score, forced, flex, 0)[0, 0]) == [1, 3, 5]  # 0.5 + 0.3 >= 0.75, plus the forced one
    assert chosen(select_indices(score, forced, SparseSettings(selection="flex", p=0.95, cap=2), 0)[0, 0]) == [1, 3, 5]
    budget = SparseSettings(selection="budget")
    assert chosen(select_indices(score, forced, budget, 2)[0, 0]) == [1, 3, 5]
    assert chosen(select_indices(score, forced, budget, 10)[0, 0]) == [0, 1, 3, 4, 5]  # zero-score entries never join


def test_sinks_and_local_window_are_always_kept():
    torch.manual_seed(0)
    doc = torch.tensor([[0] * 100 + [1] * 60])
    q, k = torch.randn(1, 2, 160, 8), torch.randn(1, 1, 160, 8)
    s = SparseSettings(selection="budget", num_vertical=0, num_slash=0, last_q=8, block_size=16, num_sink=3,
                       local_window=5, dense_below=50)
    pattern = estimate_pattern(q, k, doc, 0.3, s)
    for h in range(2):
        assert chosen(pattern.vertical_BHV[0, h]) == [0, 1, 2, 100, 101, 102]  # each long document's sinks
        assert chosen(pattern.slash_BHL[0, h]) == [0, 1, 2, 3, 4]


def test_recall_equals_probe_mass_inside_the_layout_mask():
    """Recall recomputed from scratch: fp64 softmax of the probe rows, summed over the layout's dense mask."""
    torch.manual_seed(1)
    lengths = [70, 20, 90]  # long, short (dense, not probed), long
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    S, H, R = doc.shape[1], 2, 8
    q, k = torch.randn(1, H, S, 8), torch.randn(1, 1, S, 8)
    s = SparseSettings(selection="budget", num_vertical=3, num_slash=3, last_q=R, block_size=16, local_window=4,
                       num_sink=1, dense_below=40)
    plan = plan_sparse(q, k, doc, 0.3, s)
    mask_HSS = allowed_mask(plan.layout, plan.document_ids_BS, plan.document_ids_BS)[0]
    scores_HSS = (q[0].double() @ k[0, 0].double().T) * 0.3
    pos = torch.arange(S)
    same_doc_causal = (pos[None, :] <= pos[:, None]) & (doc[0][:, None] == doc[0][None, :])
    prob_HSS = scores_HSS.masked_fill(~same_doc_causal, -torch.inf).softmax(-1)
    probe_rows = torch.cat([torch.arange(69 - R + 1, 70), torch.arange(S - R, S)])  # ends of the long documents
    covered = (prob_HSS[:, probe_rows] * mask_HSS[:, probe_rows]).sum((1, 2))
    expected = covered / prob_HSS[:, probe_rows].sum((1, 2))
    torch.testing.assert_close(plan.recall_BH[0].double(), expected, atol=1e-5, rtol=1e-5)
    assert float(expected.min()) < 0.999  # a real test: the pattern drops some mass


def test_planted_structure_recall_at_90_percent_sparsity():
    q, k, _ = planted_qkv(1, 4, 1, 65536, 64, torch.float32, torch.device("cpu"), seed=0)
    plan = plan_sparse(q, k, None, 64 ** -0.5, SparseSettings())  # MTraining's flex: p = 0.9, cap 4096
    assert float(plan.density) <= 0.10
    assert float(plan.recall_BH.min()) >= 0.95


def test_planted_structure_recall_on_a_packed_row():
    """Three long documents in one row: each is probed at its own end, recall holds for all of them."""
    parts = [planted_qkv(1, 4, 1, 20480, 64, torch.float32, torch.device("cpu"), seed=s) for s in range(3)]
    q = torch.cat([p[0] for p in parts], 2)
    k = torch.cat([p[1] for p in parts], 2)
    doc = torch.arange(3).repeat_interleave(20480)[None]
    plan = plan_sparse(q, k, doc, 64 ** -0.5, SparseSettings())
    assert float(plan.recall_BH.min()) >= 0.95
    start, length = document_spans(doc)
    layout = build_layout(estimate_pattern(q, k, doc, 64 ** -0.5, SparseSettings()), start, length, q.shape[2], 128,
                          8192)
    assert float(layout.density()) < 0.2  # of the causal triangle; documents cut it to about a third
