"""The crossover rule: a sparse layer whose plan would cost more than dense attention (the measured cost
model) runs dense for that forward (same result as dense mode), re-plans only every REPROBE_EVERY forwards,
is judged by its previous plan once it runs sparse, keeps its decision through the activation-checkpoint
recompute, and is counted in the step line and the summary. The rule is injected here; on a GPU the trainer
applies the shipped table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_setup import route_counts, small_run

import mtrain_cli.attention.sparse.ops as ops
from mtrain_cli.attention.crossover import (
    COSTS_H100,
    NEVER_SPARSE,
    PAYS_BELOW,
    REPROBE_EVERY,
    CrossoverPolicy,
    SparseCost,
    sparse_cost,
)
from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.config import load_config
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.train.checkpoint import read_state
from mtrain_cli.train.loop import Trainer, build_trainer

CPU = torch.device("cpu")
FULL = AttentionConfig(
    mode="sparse", pattern="flex", p=1.0, cap=10**6, last_q=16, block_size=16, local_window=16, dense_below=0
)
SPARSE = AttentionConfig(
    mode="sparse",
    pattern="budget",
    num_vertical=1,
    num_slash=1,
    last_q=16,
    block_size=16,
    local_window=2,
    num_sink=1,
    dense_below=0,
)
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "crossover_h100.json"


@pytest.fixture
def model_and_batch():
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=2"))
    model = build_model(config, load_tokenizer(config), CPU)
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 58]
    batch = {
        "input_ids": torch.randint(0, 300, (1, sum(lengths)), generator=gen),
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None],
    }
    return model, batch


def above(share: float):
    """A cost rule under which a plan pays while its work (ranges and verticals alike) is below `share`."""
    per_share = PAYS_BELOW / share
    return lambda seq_len, head_dim: SparseCost(plan=0.0, fixed=0.0, per_range=per_share, per_vertical=per_share)


def count_plans(monkeypatch) -> list[int]:
    made = []
    original = ops.plan_sparse

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, "plan_sparse", counting)
    return made


def test_table_interpolates_each_term_in_log_length_and_holds_its_ends():
    cost = lambda x: SparseCost(plan=x, fixed=x / 2, per_range=1 + x, per_vertical=2 * x)  # noqa: E731
    table = {64: [(1024, cost(0.2)), (4096, cost(0.6))], 128: [(1024, cost(0.5))]}
    got = sparse_cost(2048, 64, table)
    for name, want in vars(cost(0.4)).items():
        assert getattr(got, name) == pytest.approx(want)
    assert sparse_cost(512, 64, table) == cost(0.2) and sparse_cost(10**6, 64, table) == cost(0.6)
    assert sparse_cost(2048, 80, table).plan == pytest.approx(0.4)  # nearest measured head dim
    assert sparse_cost(2048, 256, table) == cost(0.5)


def test_cost_prices_vertical_work_apart_from_range_work():
    cost = SparseCost(plan=0.1, fixed=0.1, per_range=0.5, per_vertical=2.0)
    assert cost.relative(0.4, 0.1) == pytest.approx(0.6) and cost.pays(0.4, 0.1)
    assert not cost.pays(0.1, 0.4)  # the same total work, gathered: slower than dense
    # four packed documents: dense attention does a quarter of the work, the plan costs the same
    assert cost.relative(0.4, 0.1, visible_share=0.25) == pytest.approx(0.8 + 0.2 + 0.2)
    assert not cost.pays(0.4, 0.1, visible_share=0.25)
    assert not cost.never_pays and SparseCost(plan=0.6, fixed=0.5, per_range=1.0, per_vertical=1.0).never_pays


def test_shipped_table_is_the_committed_measurement():
    measured = json.loads(RESULTS.read_text())["table"]
    assert {
        int(d): [(length, SparseCost(**terms)) for length, terms in points] for d, points in measured.items()
    } == COSTS_H100


def test_above_the_crossover_a_layer_runs_dense_with_the_dense_result(model_and_batch, monkeypatch):
    model, batch = model_and_batch
    with torch.no_grad():
        with AttentionRouter():
            dense_logits = model(**batch).logits
        made = count_plans(monkeypatch)
        router = AttentionRouter(FULL, crossover=CrossoverPolicy(above(0.5)))
        before = router.calls().get("dense-crossover", 0)
        with router, router.micro_batch():
            logits = model(**batch).logits
    assert len(made) == 2 and router.calls()["dense-crossover"] == before + 2  # planned, then dense
    torch.testing.assert_close(logits, dense_logits, rtol=0, atol=0)
    stats = router.sparse_stats()
    assert stats["layers"] == route_counts({"dense-crossover": 2})
    assert stats["attention_work"] == 1.0
    assert "sparse_recall" not in stats  # no sparse plan ran


def test_below_the_crossover_a_layer_runs_sparse(model_and_batch):
    model, batch = model_and_batch
    with torch.no_grad():
        with AttentionRouter():
            dense_logits = model(**batch).logits
        router = AttentionRouter(SPARSE, crossover=CrossoverPolicy(above(0.9)))
        with router, router.micro_batch():
            logits = model(**batch).logits
    stats = router.sparse_stats()
    assert stats["layers"] == route_counts({"sparse": 2})
    assert 0.0 < stats["attention_work"] < 0.9
    assert float((logits - dense_logits).abs().max()) > 1e-2  # really sparse


def test_a_sparse_layer_is_judged_by_its_previous_plan_without_planning_again(model_and_batch, monkeypatch):
    """Once a layer runs sparse, the decision reads its last plan's work (copied without blocking a forward
    ago): a layer whose plans stop paying goes dense before planning again."""
    model, batch = model_and_batch
    made = count_plans(monkeypatch)
    rule = {"share": 0.9}
    router = AttentionRouter(
        SPARSE, crossover=CrossoverPolicy(lambda seq_len, head_dim: above(rule["share"])(seq_len, head_dim))
    )
    per_forward = []
    with torch.no_grad(), router:
        for share in (0.9, 0.9, 0.03, 0.03):
            rule["share"] = share  # 0.03: still plans at NEVER_SPARSE work, but not at this plan's
            before = len(made)
            with router.micro_batch():
                model(**batch)
            per_forward.append(len(made) - before)
    assert per_forward == [2, 2, 0, 0]
    stats = router.sparse_stats()
    assert stats["layers"] == route_counts({"sparse": 4, "dense-crossover": 4})


def test_a_dense_layer_replans_every_reprobe_forwards(model_and_batch, monkeypatch):
    model, batch = model_and_batch
    made = count_plans(monkeypatch)
    router = AttentionRouter(FULL, crossover=CrossoverPolicy(above(0.5)))
    per_forward = []
    with torch.no_grad(), router:
        for _ in range(2 * REPROBE_EVERY + 1):
            before = len(made)
            with router.micro_batch():
                model(**batch)
            per_forward.append(len(made) - before)
    assert per_forward == ([2] + [0] * (REPROBE_EVERY - 1)) * 2 + [2]
    assert router.sparse_stats()["layers"]["dense-crossover"] == 2 * len(per_forward)


def test_where_the_crossover_is_near_zero_nothing_is_planned(model_and_batch, monkeypatch):
    model, batch = model_and_batch
    made = count_plans(monkeypatch)
    router = AttentionRouter(SPARSE, crossover=CrossoverPolicy(above(NEVER_SPARSE / 2)))
    with torch.no_grad(), router, router.micro_batch():
        model(**batch)
    assert made == [] and router.sparse_stats()["layers"]["dense-crossover"] == 2


class WorkSplit:
    """A stand-in for a sparse plan: all the policy reads of one is its work split (range, vertical)."""

    def __init__(self, range_share: float):
        self.range_share = range_share

    def work_split_bound(self) -> torch.Tensor:
        return torch.tensor([self.range_share, 0.0], dtype=torch.float64)


def test_a_restored_policy_routes_every_layer_as_the_uninterrupted_one(tmp_path):
    """The policy's clock is its count of forwards. Driven by plans whose work moves across the crossover, a
    policy restored from its state_dict (through torch.save, as checkpoints hold it) after forward 13 plans and
    routes every layer of every later forward as the policy that never stopped."""
    num_layers, num_forwards, stop = 3, 40, 13
    # layer 0 never pays, layer 1 always does, layer 2 stops paying at forward 20
    shares = [[0.7, 0.1, 0.1 if f < 20 else 0.7] for f in range(num_forwards)]

    def drive(policy: CrossoverPolicy, forwards: range) -> list[tuple[int, int, bool, bool]]:
        log = []
        for f in forwards:
            policy.start_forward()
            for layer in range(num_layers):
                planned = []

                def make_plan(f=f, layer=layer):
                    planned.append(True)
                    return WorkSplit(shares[f][layer])

                plan = policy.plan_or_dense(layer, 4096, 128, make_plan)
                log.append((f, layer, bool(planned), plan is not None))
        return log

    whole = drive(CrossoverPolicy(above(0.5)), range(num_forwards))
    first = CrossoverPolicy(above(0.5))
    before = drive(first, range(stop))
    torch.save(first.state_dict(), tmp_path / "state.pt")
    resumed = CrossoverPolicy(above(0.5))
    resumed.load_state_dict(torch.load(tmp_path / "state.pt"))
    assert before + drive(resumed, range(stop, num_forwards)) == whole
    # every kind of decision happened after the stop: planned and sparse, planned and dense, dense unplanned
    kinds = {(planned, sparse) for f, _, planned, sparse in whole if f >= stop}
    assert kinds == {(True, True), (True, False), (False, False)}


def test_trainer_counts_crossover_layers_in_steps_and_summary(tmp_path, monkeypatch):
    """With activation checkpointing the recompute reuses the dense decision (same saved tensors)."""
    monkeypatch.setattr("mtrain_cli.train.parts.crossover_rule", lambda device: above(0.5))
    config = load_config(
        "tiny",
        small_run(
            2,
            tmp_path,
            "attention.mode=sparse",
            "attention.block_size=16",
            "attention.dense_below=0",
            "attention.last_q=16",
            "attention.p=1.0",
            "train.activation_checkpointing=true",
        ),
    )
    out = io.StringIO()
    trainer = build_trainer(config, tmp_path, Console(file=out, width=200))
    before = trainer.router.calls()
    summary = trainer.fit()
    after = trainer.router.calls()
    layers = trainer.model.config.num_hidden_layers
    assert after.get("dense-crossover-reused", 0) - before.get("dense-crossover-reused", 0) == 2 * layers
    assert after.get("sparse-reference", 0) == before.get("sparse-reference", 0)
    assert summary["attention_layers"] == route_counts({"dense-crossover": 2 * layers})
    assert f"sparse layers 0/{layers} (dense-crossover {layers})" in out.getvalue()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["layers"]["dense-crossover"] for s in steps if "loss" in s] == [layers, layers]


@pytest.mark.parametrize("pays_below", [0.5, 2.0])
def test_a_resumed_run_keeps_the_crossovers_memory(tmp_path, monkeypatch, pays_below):
    """Checkpoints hold each layer's crossover state. Every layer dense (0.5): resumed from step 5, a run re-probes
    its layers at the forward the uninterrupted run does, not at once. Every layer sparse (2.0): each decides on
    its last plan's work split, read back from the checkpoint. Either way the state at steps 10 and 12 is the
    uninterrupted run's."""
    monkeypatch.setattr("mtrain_cli.train.parts.crossover_rule", lambda device: above(pays_below))
    made = count_plans(monkeypatch)
    sparse = ["attention.mode=sparse", "attention.block_size=16", "attention.dense_below=0", "attention.last_q=16"]
    sparse.append("attention.probe_windows=4")  # with 16 windows of one query, steps 10 and 12 planned alike

    def trainer(run_dir: Path) -> Trainer:
        run_dir.mkdir()
        config = load_config("tiny", small_run(12, tmp_path, *sparse, "checkpoint.every=5", "checkpoint.keep_last=5"))
        return build_trainer(config, run_dir, Console(file=io.StringIO()))

    whole = trainer(tmp_path / "whole")
    whole.fit()
    plans_whole = len(made)
    resumed = trainer(tmp_path / "resumed")
    resumed.resume(tmp_path / "whole" / "checkpoints" / "step_000005")
    del made[:]
    resumed.fit()
    layers = whole.model.config.num_hidden_layers
    states = {}
    for step in (10, 12):
        saved = [
            read_state(run / "checkpoints" / f"step_{step:06d}") for run in (tmp_path / "whole", tmp_path / "resumed")
        ]
        assert saved[0].crossover == saved[1].crossover and saved[0].crossover["num_forwards"] == step
        states[step] = saved[0].crossover
    if pays_below < 1:
        # judged dense by the validation before step 1 (forward 0), re-probed at forward 8 (step 8); the resumed
        # run's one probe of each layer is that one (validation at step 12 falls in the dense stretch)
        assert plans_whole == 2 * layers and len(made) == layers
        assert sorted(states[12]["dense_since"].items()) == [(layer, 8) for layer in range(layers)]
    else:  # a plan every forward, the last one's split remembered
        assert states[12]["dense_since"] == {} and sorted(states[12]["last_split"]) == list(range(layers))
        assert states[10]["last_split"] != states[12]["last_split"]


def test_the_crossover_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setattr("mtrain_cli.train.parts.crossover_rule", lambda device: above(0.5))
    config = load_config(
        "tiny",
        small_run(
            1,
            tmp_path,
            "attention.mode=sparse",
            "attention.block_size=16",
            "attention.dense_below=0",
            "attention.last_q=16",
            "attention.p=1.0",
            "attention.crossover=false",
        ),
    )
    metrics = build_trainer(config, tmp_path, Console(file=io.StringIO())).train_step().attention
    assert metrics["layers"]["dense-crossover"] == 0
    assert metrics["layers"]["sparse"] == config.model.num_hidden_layers


def test_profile_layouts_and_fit_measure_what_the_cost_terms_mean():
    from mtrain_cli.attention.documents import document_spans
    from mtrain_cli.attention.sparse.ops import visible_blocks, work_split
    from mtrain_cli.profile.crossover import fit_kernel_time, full_range_layout, full_vertical_layout

    doc_BS = torch.zeros(1, 256, dtype=torch.int32)
    visible = visible_blocks(document_spans(doc_BS)[0], 32)
    assert work_split(full_range_layout(2, doc_BS, 32), visible).tolist() == [1.0, 0.0, 1.0]
    assert work_split(full_vertical_layout(2, doc_BS, 32), visible).tolist() == pytest.approx([0.0, 1.0, 1.0], abs=0.1)
    packed_BS = torch.arange(4).repeat_interleave(64)[None].int()  # 4 documents of 2 blocks: 12 of 36 visible
    packed_visible = visible_blocks(document_spans(packed_BS)[0], 32)
    assert work_split(full_range_layout(2, packed_BS, 32), packed_visible).tolist() == pytest.approx(
        [1.0, 0.0, 12 / 36]
    )
    points = [(r, v, 0.5 + 2.0 * r + 6.0 * v) for r, v in ((1.0, 0.0), (0.0, 1.0), (0.2, 0.05), (0.1, 0.3))]
    assert fit_kernel_time(points) == pytest.approx((0.5, 2.0, 6.0))
    assert fit_kernel_time([(1.0, 0.0, 1.0), (0.0, 1.0, 2.0), (0.5, 0.0, 0.2)])[0] == 0.0  # no negative fixed part
