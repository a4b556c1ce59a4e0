"""Pattern estimation: selection rules, recall measured independently, recall on planted structure."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

import pytest
import torch

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.ring.cp_attention import dense_pattern, rank_probe_keys
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.layout import build_layout
from mtrain_cli.attention.sparse.ops import plan_sparse
from mtrain_cli.attention.sparse.pattern import SENTINEL, FlexLimits, estimate_pattern, probe_rows, select_indices
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.attention.sparse.reference import allowed_mask
from mtrain_cli.profile.synthetic import planted_qkv


def chosen(index_N: torch.Tensor) -> list[int]:
    return [int(i) for i in index_N if i < SENTINEL]


def test_flex_keeps_the_smallest_set_reaching_p_plus_forced_entries():
    score = torch.tensor([[[0.05, 0.5, 0.0, 0.3, 0.1, 0.05]]])
    forced = torch.zeros_like(score, dtype=torch.bool)
    forced[..., 5] = True
    flex = AttentionConfig(pattern="flex", p=0.75, cap=10)
    assert chosen(select_indices(score, forced, flex, 0, 1)[0][0, 0]) == [
        1,
        3,
        5,
    ]  # 0.5 + 0.3 >= 0.75, plus the forced one
    assert chosen(select_indices(score, forced, AttentionConfig(pattern="flex", p=0.95, cap=2), 0, 1)[0][0, 0]) == [
        1,
        3,
        5,
    ]
    budget = AttentionConfig(pattern="budget")
    assert chosen(select_indices(score, forced, budget, 2, 1)[0][0, 0]) == [1, 3, 5]
    assert chosen(select_indices(score, forced, budget, 10, 1)[0][0, 0]) == [
        0,
        1,
        3,
        4,
        5,
    ]  # zero-score entries never join


@pytest.mark.parametrize("probe_windows", [1, 2])
def test_sinks_and_local_window_are_always_kept(probe_windows):
    torch.manual_seed(0)
    doc = torch.tensor([[0] * 100 + [1] * 60])
    q, k = torch.randn(1, 2, 160, 8), torch.randn(1, 1, 160, 8)
    s = AttentionConfig(
        pattern="budget",
        num_vertical=0,
        num_slash=0,
        last_q=8,
        block_size=16,
        num_sink=3,
        local_window=5,
        dense_below=50,
        probe_windows=probe_windows,
    )
    pattern = estimate_pattern(q, k, doc, 0.3, s)
    for h in range(2):
        assert chosen(pattern.vertical_BHV[0, h]) == [0, 1, 2, 100, 101, 102]  # each long document's sinks
        assert chosen(pattern.slash_BHL[0, h]) == [0, 1, 2, 3, 4]


# the probe rows of documents 0..69 and 90..179 (20 short tokens between): their last 8, or the last 4 before
# each half of them
PROBES = {
    1: [*range(62, 70), *range(172, 180)],
    2: [*range(31, 35), *range(66, 70), *range(131, 135), *range(176, 180)],
}


@pytest.mark.parametrize("probe_windows", sorted(PROBES))
def test_recall_equals_probe_mass_inside_the_layout_mask(probe_windows):
    """Recall recomputed from scratch: fp64 softmax of the probe rows, summed over the layout's dense mask."""
    torch.manual_seed(1)
    lengths = [70, 20, 90]  # long, short (dense, not probed), long
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    S, H, R = doc.shape[1], 2, 8
    q, k = torch.randn(1, H, S, 8), torch.randn(1, 1, S, 8)
    s = AttentionConfig(
        pattern="budget",
        num_vertical=3,
        num_slash=3,
        last_q=R,
        block_size=16,
        local_window=4,
        num_sink=1,
        dense_below=40,
        probe_windows=probe_windows,
    )
    rows = probe_rows(doc, s)
    assert sorted(int(p) for p in rows.pos_BQ[0] if p >= 0) == PROBES[probe_windows]
    plan = plan_sparse(q, k, doc, 0.3, s, BatchCache(), PlanGraph())
    mask_HSS = allowed_mask(plan.layout, plan.document_ids_BS, plan.document_ids_BS)[0]
    scores_HSS = (q[0].double() @ k[0, 0].double().T) * 0.3
    pos = torch.arange(S)
    same_doc_causal = (pos[None, :] <= pos[:, None]) & (doc[0][:, None] == doc[0][None, :])
    prob_HSS = scores_HSS.masked_fill(~same_doc_causal, -torch.inf).softmax(-1)
    probed = torch.tensor(PROBES[probe_windows])
    covered = (prob_HSS[:, probed] * mask_HSS[:, probed]).sum((1, 2))
    expected = covered / prob_HSS[:, probed].sum((1, 2))
    torch.testing.assert_close(plan.recall_BH[0].double(), expected, atol=1e-5, rtol=1e-5)
    assert float(expected.min()) < 0.999  # a real test: the pattern drops some mass


def test_planted_structure_recall_at_90_percent_sparsity():
    q, k, _ = planted_qkv(1, 4, 1, 65536, 64, torch.float32, torch.device("cpu"), seed=0)
    # MTraining's flex (p = 0.9, cap 4096) and probe (the last 64 queries): planted structure is the same at every
    # position, so spread windows only add the noise that early windows' short rows hold on their few keys
    settings = AttentionConfig(p=0.9, last_q=64, probe_windows=1)
    plan = plan_sparse(q, k, None, 64**-0.5, settings, BatchCache(), PlanGraph())
    assert float(plan.density) <= 0.10
    assert float(plan.recall_BH.min()) >= 0.95


def test_index_lists_are_padded_to_widths_triton_specializes_alike():
    """Triton builds a kernel again when an integer argument changes from a multiple of 16 to not (or to 1). The
    vertical list's width followed the number of long documents (4 sinks each + cap), and the dense ring's lists
    were one wide: each new count of documents rebuilt every attention kernel in the middle of a run."""
    torch.manual_seed(0)
    settings = AttentionConfig(
        last_q=8, probe_windows=2, block_size=16, num_sink=4, local_window=8, dense_below=64, cap=40
    )
    widths = set()
    for num_docs in range(1, 7):
        doc = torch.arange(num_docs).repeat_interleave(96)[None]
        q, k = torch.randn(1, 2, doc.shape[1], 8), torch.randn(1, 1, doc.shape[1], 8)
        pattern = estimate_pattern(q, k, doc, 0.3, settings)
        widths |= {pattern.vertical_BHV.shape[-1], pattern.slash_BHL.shape[-1]}
        assert pattern.vertical_BHV.shape[-1] >= num_docs * 4 + 40  # every sink and the cap still fit
    dense = dense_pattern(1, 2, torch.device("cpu"))
    widths |= {dense.vertical_BHV.shape[-1], dense.slash_BHL.shape[-1]}
    assert all(width % 16 == 0 for width in widths), widths
    assert chosen(dense.vertical_BHV[0, 0]) == [] and chosen(dense.slash_BHL[0, 0]) == [0]
    # the kernels' unspecialized arguments are theirs (Triton ignores a name that is not)
    from mtrain_cli.attention.sparse import kernels_vertical, probe_kernels

    for kernel, names in [
        (probe_kernels._probe_partials_kernel, probe_kernels.PARTIALS_ROW_ARGS),
        (probe_kernels._probe_mass_kernel, probe_kernels.MASS_ROW_ARGS),
        (kernels_vertical._vertical_kernel.fn, kernels_vertical.VERTICAL_VARYING_ARGS),  # under its autotuner
    ]:
        assert set(names) <= set(inspect.signature(kernel.fn).parameters), names


def test_planted_structure_recall_on_a_packed_row():
    """Three long documents in one row: each is probed at its own end, recall holds for all of them."""
    parts = [planted_qkv(1, 4, 1, 20480, 64, torch.float32, torch.device("cpu"), seed=s) for s in range(3)]
    q = torch.cat([p[0] for p in parts], 2)
    k = torch.cat([p[1] for p in parts], 2)
    doc = torch.arange(3).repeat_interleave(20480)[None]
    settings = AttentionConfig(probe_windows=1)  # MTraining's probe, at each document's end
    plan = plan_sparse(q, k, doc, 64**-0.5, settings, BatchCache(), PlanGraph())
    assert float(plan.recall_BH.min()) >= 0.95
    start, length = document_spans(doc)
    layout = build_layout(estimate_pattern(q, k, doc, 64**-0.5, settings), start, length, q.shape[2], 128, 8192)
    assert float(layout.density()) < 0.2  # of the causal triangle; documents cut it to about a third


def check_probe_kernels(probe, k, rows, want):
    """The probe kernels (interpreted on CPU) against the torch oracle `want` (ProbeScores) for `rows`' probe rows.

    The kernels define the probability buffer only where the row sees the key (and zero in the zero columns): those
    entries match, and the slash kernel and the recall's covered mass give the oracle's numbers from a buffer whose
    other entries are NaN, so nothing reads them."""
    from mtrain_cli.attention.sparse import pattern as pattern_module
    from mtrain_cli.attention.sparse.probe import ProbeScores, slash_scores
    from mtrain_cli.attention.sparse.probe_kernels import probe_mass, probe_slash
    from mtrain_cli.attention.sparse.probe_keys import one_process

    keys = rows.keys
    prob, vertical, block_mass = probe_mass(probe, k, rows.pos_BQ, rows.lo_BQ, keys, 0.4, one_process)
    B, Q = rows.pos_BQ.shape
    seen_BQN = (keys.pos_N <= rows.pos_BQ[..., None]) & (keys.pos_N >= rows.lo_BQ[..., None])
    defined_BQC = torch.ones(B, Q, keys.width, dtype=torch.bool, device=prob.device)
    defined_BQC[..., keys.column_N] = seen_BQN
    defined_BHQC = defined_BQC[:, None].expand_as(prob)
    # bf16: within 2^-7 of each probability (2^-8 on a GPU, which rounds to nearest; the interpreter truncates),
    # and so of what is summed from them
    assert prob.dtype == torch.bfloat16
    torch.testing.assert_close(prob[defined_BHQC].float(), want.prob_BHQC[defined_BHQC], atol=1e-6, rtol=2**-7)
    torch.testing.assert_close(vertical, want.vertical_BHN, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(block_mass, want.block_mass_BHQT, atol=1e-6, rtol=1e-5)
    assert not prob.index_select(3, keys.pad_columns_P).any()
    assert not defined_BQC.all()  # some of the buffer is not seen: the check below means something

    poisoned = torch.where(defined_BHQC, prob, torch.nan)
    got_slash = probe_slash(poisoned, rows.slash_col_BWKS, rows.pos_BQ, rows.lo_BQ, keys.pad)
    on_cpu = dataclasses.replace(want, prob_BHQC=want.prob_BHQC.cpu())  # the torch path, on a GPU too
    want_slash = slash_scores(on_cpu, rows.slash_col_BWKS.cpu(), rows.pos_BQ.cpu(), rows.lo_BQ.cpu())
    torch.testing.assert_close(got_slash.cpu(), want_slash.cpu(), atol=1e-6, rtol=2**-7)
    assert float(want_slash.sum()) > 0
    H, S = prob.shape[1], keys.local_of_global_S.shape[0]
    vertical_BHV = torch.arange(0, S, 3, dtype=torch.int32, device=prob.device).expand(B, H, -1)
    slash_BHL = torch.tensor([0, 5, 17], dtype=torch.int32, device=prob.device).expand(B, H, -1)
    covered = [
        pattern_module._covered_mass(
            ProbeScores(buffer, vertical, block_mass, keys.pad), rows, vertical_BHV, slash_BHL, keys.block
        )
        for buffer in (poisoned, want.prob_BHQC)
    ]
    torch.testing.assert_close(covered[0], covered[1], atol=1e-6, rtol=2**-7)
    assert bool(covered[0].isfinite().all()) and float(covered[0].sum()) > 0


@pytest.mark.parametrize("dtype,block", [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 32)])
def test_triton_probe_kernels_match_torch_scoring(dtype, block, monkeypatch):
    """The probe kernels (interpreted on CPU) against the torch oracle: padded probabilities, vertical scores,
    block masses, on a packed row with two probed windows, one row that is not real, GQA and a length that is
    not a multiple of the block. 24 probe rows in blocks of 16, the second half empty: a program per block,
    their column sums added over the blocks. Block 32 with a small tile budget: programs step through their key
    tile in two sub-tiles."""
    from mtrain_cli.attention.sparse import probe_kernels
    from mtrain_cli.attention.sparse.pattern import probe_rows
    from mtrain_cli.attention.sparse.probe import score_probes_torch

    monkeypatch.setattr(probe_kernels, "ROW_BLOCK", 16)
    monkeypatch.setattr(probe_kernels, "PROBE_TILE_ELEMENTS", 256)  # 16 probe rows × 16 keys per step
    monkeypatch.setattr(probe_kernels, "SLASH_BLOCK", 16)  # blocks of offsets past the first document's windows

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    torch.manual_seed(3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lengths = [75, 30, 92]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(device)
    S, H, Hk, D, R = doc.shape[1], 4, 2, 16, 12
    q, k = torch.randn(1, H, S, D, device=device).to(dtype), (torch.randn(1, Hk, S, D, device=device) * 2).to(dtype)
    # each document's last R queries (windows: the ring test below)
    rows = probe_rows(doc, AttentionConfig(last_q=R, probe_windows=1, dense_below=40, block_size=block))
    W = rows.pos_BWR.shape[1]
    pos = rows.pos_BQ.clone()
    pos[0, 3] = -1  # a row that is not real: no mass anywhere
    rows = dataclasses.replace(rows, pos_BQ=pos)
    probe = q.gather(2, rows.pos_BWR.reshape(1, 1, W * R, 1).expand(1, H, W * R, D))
    want = score_probes_torch(probe, k, pos, rows.lo_BQ, rows.keys, 0.4)
    check_probe_kernels(probe, k, rows, want)
    assert float(want.vertical_BHN.sum()) == pytest.approx(H * (W * R - 1), rel=1e-5)  # each real row sums to 1
    # row q's probabilities sit R columns to the right of their keys
    assert torch.equal(
        want.prob_BHQC[0, 0, 0, R : R + S] > 0,
        (torch.arange(S, device=device) <= pos[0, 0]) & (torch.arange(S, device=device) >= rows.lo_BQ[0, 0]),
    )


@pytest.mark.parametrize("kind,probe_windows", [("stripe", 1), ("zigzag", 1), ("zigzag", 2)])
def test_triton_probe_kernels_match_torch_scoring_on_a_ring_ranks_keys(kind, probe_windows, monkeypatch):
    """A ring rank's keys: the kernels mask by global key positions and store each run of contiguous keys
    between zero columns, as the torch oracle does; the buffer holds every local key's probability once. With
    two probe windows a document, one window's rows end mid-document and the rows fill two row blocks."""
    from mtrain_cli.attention.sparse import probe_kernels
    from mtrain_cli.attention.sparse.pattern import probe_queries, probe_rows
    from mtrain_cli.attention.sparse.probe import score_probes_torch
    from mtrain_cli.parallel.layouts import TokenLayout, padded_length

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    torch.manual_seed(4)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(probe_kernels, "ROW_BLOCK", 16)
    monkeypatch.setattr(probe_kernels, "SLASH_BLOCK", 16)
    block, R = 16, 8
    lengths = [75, 30, 92]
    S = padded_length(sum(lengths), kind, 2, block)
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    doc = torch.nn.functional.pad(doc, (0, S - len(doc)), value=-1)[None].to(device)
    q, k = torch.randn(1, 4, S, 16, device=device), torch.randn(1, 2, S, 16, device=device) * 2
    settings = AttentionConfig(last_q=R, dense_below=40, block_size=block, probe_windows=probe_windows)
    layout = TokenLayout(kind, 2, block, S)
    index = layout.positions(0)  # zigzag: chunks 0 and 3
    rows = probe_rows(doc, settings, keys_for=functools.partial(rank_probe_keys, layout, 0, block, device))
    probe = probe_queries(q, probe_rows(doc, settings))  # every probe query: what the ring's reduce gathers
    k_local = k[:, :, index.to(device)]
    want = score_probes_torch(probe, k_local, rows.pos_BQ, rows.lo_BQ, rows.keys, 0.4)
    check_probe_kernels(probe, k_local, rows, want)
    assert rows.keys.width > len(index) + 2 * rows.keys.pad  # more than one run of keys: zero columns between
    assert float(want.vertical_BHN.sum()) > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_plan_equals_eager_plan():
    """On a GPU the plan replays one CUDA graph: its layout and recall equal the eager plan's bit for bit, on the
    layer that captures, on a later layer that replays, on a second batch of the same shapes (its geometry copied
    into the graph, no capture), on a batch of other shapes (a capture, its graph sharing the first's memory
    pool and key input) and on a batch of the first shapes again (the first graph, kept)."""
    from mtrain_cli.attention.sparse.layout import layout_arrays
    from mtrain_cli.attention.sparse.ops import batch_geometry, plan_sparse
    from mtrain_cli.attention.sparse.pattern import estimate_from_probes, probe_queries

    device = torch.device("cuda")
    settings = AttentionConfig(block_size=64, last_q=64, dense_below=1024, cap=256)
    cache, graph = BatchCache(), PlanGraph()
    # two long documents a row, two (the same shapes), one, two again
    for lengths, num_captures in (([3000, 500, 2600], 1), ([4000, 2100], 1), ([6100], 2), ([2000, 4100], 2)):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].to(device)
        S = doc.shape[1]
        for seed in (0, 1):  # two layers of one batch
            gen = torch.Generator().manual_seed(seed + len(lengths))
            q = torch.randn(1, 8, S, 64, generator=gen).to(device, torch.bfloat16)
            k = torch.randn(1, 2, S, 64, generator=gen).to(device, torch.bfloat16)
            plan = plan_sparse(q, k, doc, 0.125, settings, cache, graph)
            assert graph.num_captures == num_captures, lengths
            geo = batch_geometry(doc, 1, S, device, settings, cache)
            pattern = estimate_from_probes(probe_queries(q, geo.rows), k, geo.rows, 0.125, settings)
            want = layout_arrays(pattern, geo.layout)
            got = plan.layout
            for name in ("delta_BHL", "delta_bitmap_BHX", "vcol_BHV", "row_BHM6", "col_BHN6", "vchunk_BHC2"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert got.num_vertical.get() == int(want.num_vertical)
            assert torch.equal(plan.recall_BH, pattern.recall_BH)


def test_plan_graph_inputs_take_another_batch_of_the_same_shapes():
    """What a graph replayed for a new batch reads: its own copies of the first batch's geometry, with the new
    batch's copied in. Two packings of one length with two long documents a row have the same signature, and
    after the copy every tensor (probe rows, their keys, layout geometry) equals the new batch's."""
    from mtrain_cli.attention.sparse.ops import batch_geometry
    from mtrain_cli.attention.sparse.plan_graph import _clone, _copy_into, _signature

    settings = AttentionConfig(block_size=64, last_q=64, dense_below=1024, cap=256)
    cache, geometries = BatchCache(), []
    for lengths in ([3000, 500, 2600], [1100, 4000, 1000]):
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        geometries.append(batch_geometry(doc, 1, doc.shape[1], doc.device, settings, cache))
    first, second = geometries
    for part in ("layout", "rows"):
        a, b = getattr(first, part), getattr(second, part)
        assert _signature(a) == _signature(b)
        buffers = _clone(a)
        _copy_into(buffers, b)
        checked = 0
        for name, value in vars(b).items():
            mine = getattr(buffers, name)
            if isinstance(value, torch.Tensor):
                assert mine is not value and torch.equal(mine, value), name
                checked += 1
        assert checked >= 8
    assert torch.equal(buffers.keys.column_N, second.rows.keys.column_N)  # nested: the probe keys
    assert not torch.equal(first.rows.end_BW, second.rows.end_BW)  # the two batches differ


def test_plan_graph_keeps_the_graphs_of_its_last_shapes(monkeypatch):
    """The graph cache on CPU, each "graph" replaying the eager plan on the graph's own inputs: a batch of shapes
    seen before replays that shapes' graph (its geometry copied in) with no capture, bit-equal to the eager plan;
    past MAX_GRAPHS shapes the least recently used graph goes."""
    from mtrain_cli.attention.sparse import plan_graph
    from mtrain_cli.attention.sparse.layout import layout_arrays
    from mtrain_cli.attention.sparse.ops import batch_geometry
    from mtrain_cli.attention.sparse.pattern import estimate_from_probes, probe_queries

    class EagerGraph:
        def __init__(self, entry, scale, settings):
            self.entry, self.scale, self.settings = entry, scale, settings

        def replay(self):
            e = self.entry
            e.pattern = estimate_from_probes(
                e.probe_BHQD, e.k_BHkSD, e.rows, self.scale, self.settings, limits=e.limits
            )
            e.arrays = [layout_arrays(e.pattern, g) for g in e.geometries]

    def capture(key, anchor, probe_BHQD, k_in, rows, geometries, scale, settings, limits, reduce, pool, side):
        assert (pool, side) == ("pool", "stream")  # one pool and one capture stream for every graph
        rows_in, geometries_in = plan_graph._clone(rows), tuple(plan_graph._clone(g) for g in geometries)
        limits_in = plan_graph._clone(limits)
        entry = plan_graph._Captured(
            key, anchor, rows_in, geometries_in, None, probe_BHQD.clone(), k_in, limits_in, None, None
        )
        entry.graph = EagerGraph(entry, scale, settings)
        return entry

    monkeypatch.setattr(plan_graph, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "stream")
    monkeypatch.setattr(plan_graph, "MAX_GRAPHS", 2)
    settings = AttentionConfig(block_size=64, last_q=64, dense_below=1024, cap=256)
    cache, graph = BatchCache(), PlanGraph()
    # (document lengths of the row, captures so far, the shapes kept: long documents a row, most recent last)
    steps = [
        ([3000, 500, 2600], 1, [2]),
        ([6100], 2, [2, 1]),
        ([2000, 4100], 2, [1, 2]),  # the two-document graph, kept: no capture
        ([1500, 1500, 3100], 3, [2, 3]),  # a third shape: the one-document graph, least recently used, goes
        ([6100], 4, [3, 1]),
    ]
    for lengths, num_captures, kept in steps:
        doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
        S = doc.shape[1]
        gen = torch.Generator().manual_seed(len(lengths) + S)
        q, k = torch.randn(1, 4, S, 32, generator=gen), torch.randn(1, 2, S, 32, generator=gen)
        geo = batch_geometry(doc, 1, S, doc.device, settings, cache)
        probe = probe_queries(q, geo.rows)
        # per-head shares that change from batch to batch: an input of the graph, as the probe queries are
        limits = FlexLimits(torch.tensor([0.5, 0.7, 0.9, 0.99]) ** (1 + len(lengths)), torch.full((4,), 200), 256)
        got, (arrays,) = graph.replay(probe, k, geo.rows, (geo.layout,), geo, 0.125, settings, limits)
        assert graph.num_captures == num_captures, lengths
        windows = settings.probe_windows
        assert [entry.rows.end_BW.shape[1] // windows for entry in graph.captured.values()] == kept, lengths
        pattern = estimate_from_probes(probe, k, geo.rows, 0.125, settings, limits=limits)
        want = layout_arrays(pattern, geo.layout)
        for name in ("delta_BHL", "delta_bitmap_BHX", "vcol_BHV", "row_BHM6", "col_BHN6", "vchunk_BHC2"):
            assert torch.equal(getattr(arrays, name), getattr(want, name)), (lengths, name)
        for name in ("vertical_BHV", "slash_BHL", "recall_BH"):
            assert torch.equal(getattr(got, name), getattr(pattern, name)), (lengths, name)
    assert len(graph.keys_in) == 1  # one key shape: one key input, shared by every graph


def test_slash_mass_sums_each_offset_over_a_windows_rows():
    """ProbeScores.slash_mass, read through its strided view, against a loop over (window, row, key)."""
    from mtrain_cli.attention.sparse.probe import ProbeScores

    torch.manual_seed(0)
    B, H, W, R, S = 1, 2, 2, 4, 23
    prob_BHQS = torch.rand(B, H, W * R, S)
    scores = ProbeScores(torch.nn.functional.pad(prob_BHQS, (R, R)), prob_BHQS.sum(2), prob_BHQS[..., :1], R)
    want = torch.zeros(B, H, W, S + R)
    for w in range(W):
        for r in range(R):
            for key in range(S):
                want[:, :, w, key + R - r] += prob_BHQS[:, :, w * R + r, key]  # column c: offset end_w + 1 - c
    torch.testing.assert_close(scores.slash_mass(), want)


@pytest.mark.parametrize("grid_elements", [1, 2**26])  # one probe window a chunk; all windows at once
def test_slash_scores_sum_each_probe_rows_diagonal(grid_elements, monkeypatch):
    """probe_statistics' slash score of offset d is the probe rows' probability on the key d tokens back, summed
    over rows and windows (fp64 softmax within each document, from scratch), whatever the windows' chunking."""
    from mtrain_cli.attention.sparse import pattern as pattern_module
    from mtrain_cli.attention.sparse import probe

    monkeypatch.setattr(probe, "SLASH_GRID_ELEMENTS", grid_elements)
    torch.manual_seed(2)
    lengths = [70, 20, 90]  # long, short (not probed), long
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    S, H = doc.shape[1], 2
    q, k = torch.randn(1, H, S, 8, dtype=torch.float64), torch.randn(1, 1, S, 8, dtype=torch.float64)
    s = AttentionConfig(last_q=8, block_size=16, dense_below=40, probe_windows=4)
    rows = probe_rows(doc, s)
    _, _, slash_BHS = pattern_module.probe_statistics(pattern_module.probe_queries(q, rows), k, rows, 0.3)
    pos = torch.arange(S)
    same_doc_causal = (pos[None, :] <= pos[:, None]) & (doc[0][:, None] == doc[0][None, :])
    prob_HSS = ((q[0] @ k[0, 0].T) * 0.3).masked_fill(~same_doc_causal, -torch.inf).softmax(-1)
    want_HS = torch.zeros(H, S, dtype=torch.float64)
    for row in (int(p) for p in rows.pos_BQ[0] if p >= 0):
        for key in range(row + 1):
            want_HS[:, row - key] += prob_HSS[:, row, key]  # zero outside the row's document
    torch.testing.assert_close(slash_BHS[0], want_HS, atol=1e-12, rtol=1e-12)
    assert rows.slash_col_BWKS.shape[1] == 8  # 2 long documents x 4 windows: 8 chunks at grid_elements 1


def test_head_groups_hold_whole_key_heads_within_the_buffer(monkeypatch):
    from mtrain_cli.attention.sparse import pattern as pattern_module

    monkeypatch.setattr(pattern_module, "PROBE_BUFFER_BYTES", 100)
    assert pattern_module.head_group(32, 8, 1) == 32  # everything fits
    assert pattern_module.head_group(32, 8, 25) == 4  # one key head's group of 4
    assert pattern_module.head_group(32, 8, 40) == 2  # half of one
    assert pattern_module.head_group(12, 4, 30) == 3  # 3 fit: one group of 3
    assert pattern_module.head_group(12, 4, 12) == 6  # 8 would fit, but does not divide 12 into whole groups
    assert pattern_module.head_group(32, 8, 1000) == 1  # one head at least, over the budget


@pytest.mark.parametrize("pattern", ["flex", "budget"])
def test_estimating_heads_in_groups_gives_the_pattern_of_all_at_once(pattern, monkeypatch):
    """A packed row, GQA (4 query heads on 2 key heads), flex with a different share and cap in every head: the
    pattern, recall and counts of one head at a time, or two (one key head's), equal those of all heads at once."""
    from mtrain_cli.attention.sparse import pattern as pattern_module

    torch.manual_seed(5)
    lengths = [70, 20, 90]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    S = doc.shape[1]
    q, k = torch.randn(1, 4, S, 8) * 2, torch.randn(1, 2, S, 8)
    s = AttentionConfig(
        pattern=pattern,
        cap=12,
        num_vertical=5,
        num_slash=5,
        last_q=8,
        probe_windows=2,
        block_size=16,
        dense_below=40,
        num_sink=1,
    )
    limits = (
        FlexLimits(torch.tensor([0.5, 0.7, 0.9, 0.99]), torch.tensor([3, 12, 6, 12]), 12) if pattern == "flex" else None
    )
    all_heads = estimate_pattern(q, k, doc, 0.3, s, limits=limits)
    rows = probe_rows(doc, s)
    for heads, buffer_bytes in [(1, 1), (2, 2 * rows.pos_BQ.shape[1] * rows.keys.width * 4)]:
        monkeypatch.setattr(pattern_module, "PROBE_BUFFER_BYTES", buffer_bytes)
        assert pattern_module.head_group(4, 2, rows.pos_BQ.shape[1] * rows.keys.width * 4) == heads
        grouped = estimate_pattern(q, k, doc, 0.3, s, limits=limits)
        for name in ("vertical_BHV", "slash_BHL", "chosen_BH"):
            assert torch.equal(getattr(grouped, name), getattr(all_heads, name)), (heads, name)
        torch.testing.assert_close(grouped.recall_BH, all_heads.recall_BH, atol=1e-6, rtol=1e-6)
    # the heads chose differently: a mix-up of heads would show
    assert len({tuple(v.tolist()) for v in all_heads.vertical_BHV[0]}) == 4


def test_a_probe_buffer_past_the_kernels_offsets_is_refused_with_the_fix(monkeypatch):
    """The probe kernels address their buffer with int32 offsets: a buffer past 2^31 elements is a UserError naming
    the settings to lower, not an illegal memory access (checked before any launch, so no GPU is needed)."""
    from mtrain_cli.attention.sparse import probe_kernels
    from mtrain_cli.errors import UserError

    doc = torch.zeros(1, 96, dtype=torch.long)
    rows = probe_rows(doc, AttentionConfig(last_q=16, probe_windows=1, dense_below=40, block_size=16))
    probe, k = torch.randn(1, 2, 16, 8), torch.randn(1, 1, 96, 8)
    elements = 2 * 16 * rows.keys.width
    monkeypatch.setattr(probe_kernels, "MAX_PROBE_ELEMENTS", elements)
    with pytest.raises(UserError, match="lower attention.max_probe_rows or attention.last_q"):
        probe_kernels.probe_mass(probe, k, rows.pos_BQ, rows.lo_BQ, rows.keys, 0.3, lambda x, op="sum": x)
