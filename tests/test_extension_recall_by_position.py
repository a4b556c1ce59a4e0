"""bench.extension.recall_by_position measures the mass a pattern keeps for any query from the pattern's index
lists: it must equal the mass inside the layout the kernels run (the reference mask), and on the probe rows
themselves the planner's own recall."""

from __future__ import annotations

import pytest
import torch

from bench.extension.recall_by_position import (
    ROWS,
    causal_probs,
    coverage,
    covered_pairs,
    measure,
    oracle_blocks,
    parse_variants,
    pooled_blocks,
)
from mtrain_cli.attention import AttentionConfig, document_spans
from mtrain_cli.attention.sparse import build_layout, estimate_pattern
from mtrain_cli.attention.sparse.reference import allowed_mask

SETTINGS = AttentionConfig(
    mode="sparse", pattern="budget", num_vertical=3, num_slash=3, last_q=ROWS, probe_windows=1, block_size=16,
    local_window=16, num_sink=2, dense_below=64,
)  # fmt: skip
S, SCALE = 320, 0.25


def inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, S, 16, generator=gen, dtype=torch.float64), torch.randn(
        1, 2, S, 16, generator=gen, dtype=torch.float64
    )


class TwoWindows:
    """The budget pattern of `inputs()` and two evaluation windows of ROWS queries, as `measure` sees them."""

    def __init__(self):
        q, k = inputs()
        doc = torch.zeros(1, S, dtype=torch.long)
        pattern = estimate_pattern(q, k, doc, SCALE, SETTINGS)
        self.pos_Q = torch.cat([torch.arange(e - ROWS + 1, e + 1) for e in (150, 310)])
        self.q_HSD, self.k_HSD = q[0], k[0].repeat_interleave(2, 0)
        self.prob_HQS = causal_probs(self.q_HSD[:, self.pos_Q], self.k_HSD, self.pos_Q, SCALE)
        self.delta_HB, column_HS = coverage(pattern, S, 16)
        self.covered_HQS = covered_pairs(self.pos_Q, self.delta_HB, column_HS, 16)

    def pooled(self, counts: list[int]) -> dict[str, float]:
        w = self
        return pooled_blocks(w.q_HSD, w.k_HSD, w.prob_HQS, w.covered_HQS, w.delta_HB, w.pos_Q, SCALE, 16, counts)


@pytest.mark.parametrize("probe_windows", [1, 4])
def test_kept_mass_is_the_mass_inside_the_layout(probe_windows):
    settings = AttentionConfig(**{**vars(SETTINGS), "probe_windows": probe_windows})
    q, k = inputs()
    doc = torch.zeros(1, S, dtype=torch.long)
    pattern = estimate_pattern(q, k, doc, SCALE, settings)
    layout = build_layout(pattern, *document_spans(doc), S, 16, settings.dense_below)
    pos_Q = torch.arange(70, S, 7)
    prob_HQS = causal_probs(q[0][:, pos_Q], k[0].repeat_interleave(2, 0), pos_Q, SCALE)
    got_HQ = (prob_HQS * covered_pairs(pos_Q, *coverage(pattern, S, 16), 16)).sum(-1)
    want_HQ = (prob_HQS * allowed_mask(layout, doc, doc)[0][:, pos_Q]).sum(-1)
    torch.testing.assert_close(got_HQ, want_HQ, atol=1e-12, rtol=1e-12)
    assert float(got_HQ.min()) < 0.99  # the pattern drops some mass


def test_kept_mass_on_the_probe_rows_is_the_planners_recall():
    q, k = inputs()
    probe_Q = torch.arange(S - ROWS, S)  # the last last_q queries: the probe
    got = measure(q, k, SCALE, {"budget": SETTINGS}, probe_Q)["budget"]
    assert got["kept"] == pytest.approx(got["probe_recall"], abs=1e-6)
    assert got["kept"] < 0.99 and 0 < got["density"] < 1


def test_variants_are_checked_as_recipe_settings():
    variants = parse_variants("probe_windows=4;probe_windows=4,p=0.8")
    assert list(variants) == ["shipped", "probe_windows=4", "probe_windows=4,p=0.8"]
    assert (variants["probe_windows=4,p=0.8"].p, variants["probe_windows=4,p=0.8"].probe_windows) == (0.8, 4)
    with pytest.raises(SystemExit, match="probe_windows 999 must be at most attention.last_q 512"):
        parse_variants("probe_windows=999")


def test_oracle_blocks_add_the_missed_mass_of_the_best_key_blocks():
    """k more key blocks per window, chosen from the true attention: from scratch, per head and window, the k key
    blocks holding most of the mass the layout misses; all blocks keep everything."""
    w = TwoWindows()
    prob_HQS, covered_HQS = w.prob_HQS, w.covered_HQS
    got = oracle_blocks(prob_HQS, covered_HQS, 16, [2, 20])
    kept = float((prob_HQS * covered_HQS).sum(-1).mean())
    want = 0.0
    for h in range(prob_HQS.shape[0]):
        for w in range(2):
            rows = slice(w * ROWS, (w + 1) * ROWS)
            missed_B = [
                float((prob_HQS[h, rows, b * 16 : (b + 1) * 16] * ~covered_HQS[h, rows, b * 16 : (b + 1) * 16]).sum())
                for b in range(S // 16)
            ]
            want += sum(sorted(missed_B)[-2:]) / ROWS
    want = kept + want / (prob_HQS.shape[0] * 2)
    assert got["top2_kept"] == pytest.approx(want, abs=1e-12) and got["top2_kept"] > kept + 0.01
    assert got["top20_kept"] == pytest.approx(1.0, abs=1e-12)  # 20 blocks: all of the 320 keys
    nb = S // 16
    assert got["top2_density"] == pytest.approx((1 + 2 * (nb - 1)) / (nb * (nb + 1) / 2))
    assert got["top20_density"] == pytest.approx(1.0)


def test_planned_blocks_take_the_best_visible_blocks_by_each_estimate():
    """A planner's k more key blocks per query block, among the visible key blocks the slashes leave: by mean query ·
    mean key, or by one probe query a block. Every such block keeps all the mass; one block is the best, from
    scratch."""
    w = TwoWindows()
    q_HSD, k_HSD, pos_Q, prob_HQS, delta_HB, covered_HQS = (
        w.q_HSD,
        w.k_HSD,
        w.pos_Q,
        w.prob_HQS,
        w.delta_HB,
        w.covered_HQS,
    )
    got = w.pooled([1, S // 16])
    assert got[f"pooled{S // 16}_kept"] == pytest.approx(1.0, abs=1e-12)
    mean_q, mean_k = q_HSD.view(4, S // 16, 16, 16).mean(2), k_HSD.view(4, S // 16, 16, 16).mean(2)
    want = 0.0
    for h in range(4):
        for i, pos in enumerate(pos_Q.tolist()):
            row = pos // 16
            free = [j for j in range(row + 1) if not bool(delta_HB[h, row - j])]
            best = max(free, key=lambda j: float(mean_q[h, row] @ mean_k[h, j]))
            keys = covered_HQS[h, i].clone()
            keys[best * 16 : min((best + 1) * 16, pos + 1)] = True
            want += float((prob_HQS[h, i] * keys).sum())
    assert got["pooled1_kept"] == pytest.approx(want / (4 * len(pos_Q)), abs=1e-12)
    assert got["pooled1_kept"] > float((prob_HQS * covered_HQS).sum(-1).mean())
    # strided: the block holding most of the previous query block's last query's mass
    assert got[f"strided{S // 16}_kept"] == pytest.approx(1.0, abs=1e-12)
    want = 0.0
    for i, pos in enumerate(pos_Q.tolist()):
        row = pos // 16
        probe = torch.tensor([row * 16 - 1])
        probe_HS = causal_probs(q_HSD[:, probe], k_HSD, probe, SCALE)[:, 0]
        for h in range(4):
            free = [j for j in range(row + 1) if not bool(delta_HB[h, row - j])]
            best = max(free, key=lambda j, h=h: float(probe_HS[h, j * 16 : (j + 1) * 16].sum()))
            keys = covered_HQS[h, i].clone()
            keys[best * 16 : min((best + 1) * 16, pos + 1)] = True
            want += float((prob_HQS[h, i] * keys).sum())
    assert got["strided1_kept"] == pytest.approx(want / (4 * len(pos_Q)), abs=1e-12)


def test_block_choices_report_each_window_and_their_mean():
    w = TwoWindows()
    got = {**oracle_blocks(w.prob_HQS, w.covered_HQS, 16, [3]), **w.pooled([3])}
    for name in ("top3", "pooled3", "strided3"):
        by_window = got[f"{name}_kept_by_window"]
        assert len(by_window) == 2 and sum(by_window) / 2 == pytest.approx(got[f"{name}_kept"], abs=1e-12)
