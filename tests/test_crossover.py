"""The crossover rule: a sparse layer whose plan computes more of dense attention's work than the measured
crossover runs dense for that forward (same result as dense mode), re-plans only every REPROBE_EVERY
forwards, keeps its decision through the activation-checkpoint recompute, and is counted in the step line
and the summary. The rule is injected here; on a GPU the trainer applies the shipped table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny_setup import small_run

import mtrain_cli.attention.hook as hook
from mtrain_cli.attention.crossover import CROSSOVER_H100, NEVER_SPARSE, REPROBE_EVERY, crossover_share
from mtrain_cli.attention.hook import attention_calls, configure_attention, plan_cache, sparse_stats
from mtrain_cli.attention.sparse.pattern import SparseSettings
from mtrain_cli.config import load_config
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.train.loop import Trainer

CPU = torch.device("cpu")
FULL = SparseSettings(selection="flex", p=1.0, cap=10**6, last_q=16, block_size=16, local_window=16, dense_below=0)
SPARSE = SparseSettings(selection="budget", num_vertical=1, num_slash=1, last_q=16, block_size=16, local_window=2,
                        num_sink=1, dense_below=0)
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "crossover_h100.json"


@pytest.fixture(autouse=True)
def dense_afterwards():
    yield
    configure_attention(None)


@pytest.fixture
def model_and_batch():
    config = load_config("tiny", small_run(1, Path("unused"), "model.num_hidden_layers=2"))
    model = build_model(config, load_tokenizer(config), CPU)
    gen = torch.Generator().manual_seed(0)
    lengths = [70, 58]
    batch = {"input_ids": torch.randint(0, 300, (1, sum(lengths)), generator=gen),
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
             "document_ids": torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]}
    return model, batch


def count_plans(monkeypatch) -> list[int]:
    made = []
    original = hook.plan_sparse

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(hook, "plan_sparse", counting)
    return made


def test_table_interpolates_in_log_length_and_holds_its_ends():
    table = {64: [(1024, 0.2), (4096, 0.6)], 128: [(1024, 0.5)]}
    assert crossover_share(2048, 64, table) == pytest.approx(0.4)
    assert crossover_share(512, 64, table) == 0.2 and crossover_share(10**6, 64, table) == 0.6
    assert crossover_share(2048, 80, table) == pytest.approx(0.4)  # nearest measured head dim
    assert crossover_share(2048, 256, table) == 0.5


def test_shipped_table_is_the_committed_measurement():
    measured = json.loads(RESULTS.read_text())["table"]
    assert {int(d): [tuple(p) for p in points] for d, points in measured.items()} == CROSSOVER_H100


def test_above_the_crossover_a_layer_runs_dense_with_the_dense_result(model_and_batch, monkeypatch):
    model, batch = model_and_batch
    with torch.no_grad():
        dense_logits = model(**batch).logits
        made = count_plans(monkeypatch)
        configure_attention(FULL, crossover=lambda seq_len, head_dim: 0.5)
        before = attention_calls().get("dense-crossover", 0)
        with plan_cache():
            logits = model(**batch).logits
    assert len(made) == 2 and attention_calls()["dense-crossover"] == before + 2  # planned, then dense
    torch.testing.assert_close(logits, dense_logits, rtol=0, atol=0)
    stats = sparse_stats()
    assert stats["dense_layers"] == 2 and stats["sparse_layers"] == 0 and stats["attention_work"] == 1.0
    assert "sparse_recall" not in stats  # no sparse plan ran


def test_below_the_crossover_a_layer_runs_sparse(model_and_batch):
    model, batch = model_and_batch
    with torch.no_grad():
        dense_logits = model(**batch).logits
        configure_attention(SPARSE, crossover=lambda seq_len, head_dim: 0.9)
        with plan_cache():
            logits = model(**batch).logits
    stats = sparse_stats()
    assert stats["sparse_layers"] == 2 and stats["dense_layers"] == 0
    assert 0.0 < stats["attention_work"] < 0.9
    assert float((logits - dense_logits).abs().max()) > 1e-2  # really sparse


def test_a_dense_layer_replans_every_reprobe_forwards(model_and_batch, monkeypatch):
    model, batch = model_and_batch
    made = count_plans(monkeypatch)
    configure_attention(FULL, crossover=lambda seq_len, head_dim: 0.5)
    per_forward = []
    with torch.no_grad():
        for _ in range(2 * REPROBE_EVERY + 1):
            before = len(made)
            with plan_cache():
                model(**batch)
            per_forward.append(len(made) - before)
    assert per_forward == ([2] + [0] * (REPROBE_EVERY - 1)) * 2 + [2]
    assert sparse_stats()["dense_layers"] == 2 * len(per_forward)


def test_where_the_crossover_is_near_zero_nothing_is_planned(model_and_batch, monkeypatch):
    model, batch = model_and_batch
    made = count_plans(monkeypatch)
    configure_attention(SPARSE, crossover=lambda seq_len, head_dim: NEVER_SPARSE / 2)
    with torch.no_grad(), plan_cache():
        model(**batch)
    assert made == [] and sparse_stats()["dense_layers"] == 2


def test_trainer_counts_crossover_layers_in_steps_and_summary(tmp_path, monkeypatch):
    """With activation checkpointing the recompute reuses the dense decision (same saved tensors)."""
    monkeypatch.setattr("mtrain_cli.train.loop.crossover_rule", lambda device: lambda seq_len, head_dim: 0.5)
    config = load_config("tiny", small_run(2, tmp_path, "attention.mode=sparse", "attention.block_size=16",
                                           "attention.dense_below=0", "attention.last_q=16", "attention.p=1.0",
                                           "train.activation_checkpointing=true"))
    out = io.StringIO()
    trainer = Trainer(config, tmp_path, Console(file=out, width=200))
    before = attention_calls()
    summary = trainer.fit()
    after = attention_calls()
    layers = trainer.model.config.num_hidden_layers
    assert after.get("dense-crossover-reused", 0) - before.get("dense-crossover-reused", 0) == 2 * layers
    assert after.get("sparse-reference", 0) == before.get("sparse-reference", 0)
    assert summary["attention_layers"] == {"sparse": 0, "dense_by_crossover": 2 * layers}
    assert f"sparse layers 0/{layers} (rest dense: above crossover)" in out.getvalue()
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [s["dense_layers"] for s in steps if "loss" in s] == [layers, layers]


def test_the_crossover_can_be_switched_off(tmp_path, monkeypatch):
    monkeypatch.setattr("mtrain_cli.train.loop.crossover_rule", lambda device: lambda seq_len, head_dim: 0.5)
    config = load_config("tiny", small_run(1, tmp_path, "attention.mode=sparse", "attention.block_size=16",
                                           "attention.dense_below=0", "attention.last_q=16", "attention.p=1.0",
                                           "attention.crossover=false"))
    metrics = Trainer(config, tmp_path, Console(file=io.StringIO())).train_step()
    assert metrics["dense_layers"] == 0 and metrics["sparse_layers"] == config.model.num_hidden_layers
