"""The recall controller (attention/recall_control.py): on a planted pattern it raises the limits of a head short of
its recall target and lowers them where a head is above it, never below `attention.p` nor past the density
ceiling; its state round-trips through a checkpoint, and a training run resumed from one (on 1 process, or on 2
under gloo) limits and routes every layer as the uninterrupted run does."""

from __future__ import annotations

import io
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from spawned_ranks import run_cli_ranks
from tiny_setup import run_cli, set_args, small_run

from mtrain_cli.attention import BatchCache, LayerObservation, RecallController
from mtrain_cli.attention.recall_control import KEEP_MAX, LAG
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.ops import plan_sparse
from mtrain_cli.attention.sparse.plan_graph import PlanGraph
from mtrain_cli.config import load_config
from mtrain_cli.errors import UserError
from mtrain_cli.train.checkpoint import read_state
from mtrain_cli.train.loop import build_trainer

S, D, BLOCK = 1024, 16, 16
SETTINGS = AttentionConfig(
    mode="sparse", p=0.8, cap=16, last_q=32, probe_windows=2, block_size=BLOCK, local_window=BLOCK,
    dense_below=0, num_sink=1, recall_target=0.95, max_density=0.6,
)  # fmt: skip


def planted(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two packed documents; head 0 attends broadly (random q/k), head 1 to one planted key column of each: at p 0.8
    and cap 16 head 0 keeps far less of its mass than 0.95, head 1 more."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, S, D, generator=gen) * 0.5
    k = torch.randn(1, 2, S, D, generator=gen) * 0.5
    direction = torch.randn(D, generator=gen)
    q[:, 1] = direction * 3 + 0.1 * torch.randn(S, D, generator=gen)
    for doc_start in (0, 600):
        k[:, 1, doc_start + 40] = direction * 3
    doc = torch.cat([torch.zeros(600, dtype=torch.long), torch.ones(S - 600, dtype=torch.long)])[None]
    return q, k, doc


def observe_step(controller: RecallController, step: int, seed: int) -> tuple[list[float], float]:
    """One step of the controller's loop on planted inputs -> (recall per head, density) of its plan."""
    controller.start_step(step)
    q, k, doc = planted(seed)
    limits = controller.limits(0, 2, S, q.device)
    plan = plan_sparse(q, k, doc, D**-0.5, SETTINGS, BatchCache(), PlanGraph(), limits)
    recall = plan.recall_BH.mean(0).tolist()
    density = float(plan.density)
    chosen = [int(c) for c in plan.chosen_BH.amax(0).tolist()]
    controller.observe(step, {0: LayerObservation(recall, chosen, density)})
    return recall, density


def test_limits_follow_the_recall_target_on_a_planted_pattern():
    controller = RecallController(SETTINGS)
    recalls, densities, keeps, caps = [], [], [], []
    for step in range(1, 13):
        recall, density = observe_step(controller, step, seed=step)
        recalls.append(recall)
        densities.append(density)
        keeps.append(list(controller.keep.get(0, [SETTINGS.p] * 2)))
        caps.append(list(controller.cap.get(0, [SETTINGS.cap] * 2)))
    # the first LAG steps plan with the settings' own limits; there head 0 is short of the target, head 1 above it
    assert recalls[0][0] < 0.8 < 0.95 < recalls[0][1]
    assert keeps[LAG - 1] == [SETTINGS.p, SETTINGS.p]
    # head 0: a larger share and cap, and so a higher recall; head 1, above the target at p, keeps p
    assert keeps[-1][0] > 0.99 and caps[-1][0] >= 8 * SETTINGS.cap
    assert recalls[-1][0] > 0.95 > recalls[0][0] + 0.2
    assert all(step[1] == SETTINGS.p for step in keeps)
    assert all(SETTINGS.p <= k <= KEEP_MAX for step in keeps for k in step)
    assert all(c <= S for step in caps for c in step)


def test_a_head_above_its_target_gives_back_what_was_added_but_never_goes_below_p():
    controller = RecallController(SETTINGS)
    controller.observe(1, {0: LayerObservation([0.5, 0.999], [4, 4], 0.2)})
    controller.start_step(1 + LAG)
    raised = controller.keep[0][0]
    assert raised > SETTINGS.p and controller.keep[0][1] == SETTINGS.p
    keeps = []
    for step in range(2, 40):  # head 0 now above its target every step
        controller.observe(step, {0: LayerObservation([0.999, 0.999], [4, 4], 0.2)})
        controller.start_step(step + LAG)
        keeps.append(controller.keep[0][0])
    assert keeps[0] < raised and all(a >= b for a, b in itertools.pairwise(keeps))
    assert keeps[-1] == pytest.approx(SETTINGS.p) and min(keeps) >= SETTINGS.p


def test_a_layer_past_the_density_ceiling_runs_dense_then_is_planned_again():
    controller = RecallController(SETTINGS)
    controller.observe(1, {3: LayerObservation([0.5, 0.99], [16, 2], SETTINGS.max_density + 0.1)})
    controller.start_step(2)
    assert not controller.runs_dense(3)  # step 2 uses what steps <= 0 saw
    controller.start_step(3)
    assert controller.runs_dense(3) and not controller.runs_dense(2)
    controller.start_step(3 + 8)
    assert not controller.runs_dense(3)


def test_the_state_round_trips_and_an_update_lands_two_steps_later():
    controller = RecallController(SETTINGS)
    controller.observe(1, {0: LayerObservation([0.6, 0.999], [16, 3], 0.2)})
    controller.start_step(2)
    controller.observe(2, {0: LayerObservation([0.7, 0.99], [32, 3], 0.3)})
    state = controller.state_dict()
    twin = RecallController(SETTINGS)
    twin.load_state_dict(state)
    for c in (controller, twin):
        c.start_step(3)  # applies step 1's observation
    assert twin.state_dict() == controller.state_dict()
    assert controller.keep[0][0] > SETTINGS.p == controller.keep[0][1] and controller.cap[0] == [32, 16]
    assert len(controller.pending) == 1  # step 2's waits for step 4
    limits = controller.limits(0, 2, 64, torch.device("cpu"))
    assert limits.width == 32 and limits.cap_H.tolist() == [32, 16]
    assert controller.limits(0, 2, 24, torch.device("cpu")).width == 24  # never wider than the sequence


@pytest.mark.parametrize(
    ("field", "value"), [("recall_target", 1.0), ("recall_target", 0.0), ("max_density", 0.0), ("check_warn", 0.0)]
)
def test_bad_settings_are_one_line(field, value):
    with pytest.raises(UserError, match=f"attention.{field}"):
        AttentionConfig(**{field: value})
    with pytest.raises(UserError, match="attention.pattern=flex"):
        AttentionConfig(pattern="budget", recall_target=0.9)


SPARSE = [
    "attention.mode=sparse",
    "attention.block_size=16",
    "attention.dense_below=0",
    "attention.last_q=16",
    "attention.probe_windows=4",
    "attention.p=0.6",
    "attention.cap=8",
    "attention.recall_target=0.9",
    "attention.max_density=1.0",
    "attention.check_every=0",
]


def test_layers_past_the_density_ceiling_run_dense_and_are_counted(tmp_path):
    """At 256 tokens every plan of the tiny model computes more than 0.2 of the causal blocks: from step 3 on (the
    observations of step 1) its layers run dense, counted as the designed switch `dense-recall`."""
    overrides = small_run(4, tmp_path, *SPARSE, "attention.max_density=0.2")
    out = io.StringIO()
    summary = build_trainer(load_config("tiny", overrides), tmp_path, Console(file=out, width=250)).fit()
    layers = summary["attention_layers"]
    assert layers["sparse"] == 2 * 2 and layers["dense-recall"] == 2 * 2  # 2 layers, steps 1-2 / 3-4
    assert summary["recall_control"]["dense_layers_now"] == [0, 1]
    assert "(dense-recall 2)" in out.getvalue()


def test_a_resumed_run_limits_and_routes_every_layer_as_the_uninterrupted_run(tmp_path):
    def trainer(run_dir: Path, num_steps: int = 8):
        run_dir.mkdir()
        overrides = small_run(num_steps, tmp_path, *SPARSE, "checkpoint.every=4", "checkpoint.keep_last=5")
        return build_trainer(load_config("tiny", overrides), run_dir, Console(file=io.StringIO()))

    whole = trainer(tmp_path / "whole")
    summary = whole.fit()
    assert summary["recall_control"]["keep_mean"] != pytest.approx(0.6)  # the limits moved
    resumed = trainer(tmp_path / "resumed")
    resumed.resume(tmp_path / "whole" / "checkpoints" / "step_000004")
    resumed.fit()
    assert resumed.router.recall.state_dict() == whole.router.recall.state_dict()
    saved = [read_state(run / "checkpoints" / "step_000008") for run in (tmp_path / "whole", tmp_path / "resumed")]
    assert saved[0].recall == saved[1].recall and saved[0].recall["keep"]
    losses = [
        [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line][-4:]
        for run in (tmp_path / "whole", tmp_path / "resumed")
    ]
    assert [_loss(line) for line in losses[0]] == [_loss(line) for line in losses[1]]


@pytest.mark.slow
def test_a_checkpoint_resumes_on_two_processes_with_the_same_limits(tmp_path):
    """gloo, cp = 2: the ring's plans take the controller's limits; a one-process checkpoint's state is loaded on
    both ranks, and they update it alike (every rank sees the same observations). The dense check runs the dense
    ring there."""
    first = tmp_path / "first"
    overrides = small_run(4, first, *SPARSE, "checkpoint.every=2", "checkpoint.keep_last=5")
    result = run_cli("extend", *set_args(overrides))
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = [p for p in first.iterdir() if p.is_dir()]
    at_four = read_state(run_dir / "checkpoints" / "step_000004").recall
    assert at_four["keep"] and [step for step, _ in at_four["pending"]] == [3, 4]
    args = ["--resume", str(run_dir), "--set", "parallel.cp=2", "--set", "train.num_steps=6"]
    result = run_cli_ranks(2, "extend", *args, "--set", "attention.check_every=1")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    checked = {r["step"]: r["dense_check_gap"] for r in records if "dense_check_gap" in r}
    assert sorted(checked) == [5, 6] and all(math.isfinite(gap) for gap in checked.values())  # the dense ring ran
    after = [read_state(run_dir / "checkpoints" / "step_000006", rank) for rank in (0, 1)]
    assert after[0].recall == after[1].recall and after[0].recall["keep"] != at_four["keep"]
    assert all(math.isfinite(k) for heads in after[0].recall["keep"].values() for k in heads)


def _loss(line: str) -> float:
    return json.loads(line)["loss"]
