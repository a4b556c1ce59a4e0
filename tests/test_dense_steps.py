"""Dense steps (`attention.dense_every`): every that-many steps a sparse run trains one step with dense attention in
every layer, counted as the route `dense-step`; the other steps stay sparse and the dense check skips dense steps.
Under cp the dense step runs the dense ring (tests/test_distributed_train.py)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from test_dense_check import SPARSE
from tiny_setup import small_run

from mtrain_cli.attention import AttentionConfig
from mtrain_cli.config import load_config
from mtrain_cli.errors import UserError
from mtrain_cli.train.loop import build_trainer


def fit(tmp_path: Path, name: str, *overrides: str, num_steps: int) -> tuple[dict, list[dict], str, int]:
    """-> the run's summary, its step records, its console output and the model's layer count."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    out = io.StringIO()
    config = load_config("tiny", small_run(num_steps, tmp_path, "checkpoint.export=false", *overrides))
    trainer = build_trainer(config, run_dir, Console(file=out, width=250))
    summary = trainer.fit()
    records = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return summary, records, out.getvalue(), trainer.model.config.num_hidden_layers


def test_dense_every_step_trains_as_dense_attention_does(tmp_path):
    """Packed multi-document rows, three steps: each step's loss (so each update before it) equals dense mode's."""
    _, dense, _, _ = fit(tmp_path, "dense", "attention.mode=dense", num_steps=3)
    summary, every, _, layers = fit(tmp_path, "every1", *SPARSE, "attention.dense_every=1", num_steps=3)
    _, sparse, _, _ = fit(tmp_path, "sparse", *SPARSE, num_steps=3)
    assert [r["loss"] for r in every] == [r["loss"] for r in dense]
    assert sparse[0]["loss"] != dense[0]["loss"]  # the sparse settings really are sparse on this model
    assert summary["attention_layers"]["dense-step"] == 3 * layers and summary["attention_layers"]["sparse"] == 0


def test_dense_steps_are_counted_and_the_others_stay_sparse(tmp_path):
    overrides = [*SPARSE, "attention.dense_every=2", "attention.check_every=1"]
    summary, records, out, layers = fit(tmp_path, "every2", *overrides, num_steps=4)
    _, sparse, _, _ = fit(tmp_path, "sparse", *SPARSE, num_steps=1)
    assert [r["layers"]["dense-step"] for r in records] == [0, layers, 0, layers]
    assert [r["layers"]["sparse"] for r in records] == [layers, 0, layers, 0]
    assert records[0]["loss"] == sparse[0]["loss"]  # step 1 is the sparse run's step 1
    assert [r["step"] for r in records if "dense_check_gap" in r] == [1, 3]  # a dense step has nothing to check
    assert summary["dense_check"]["checks"] == 2
    assert summary["attention_layers"]["dense-step"] == 2 * layers
    assert f"sparse layers 0/{layers} (dense-step {layers})" in out  # the step line


def test_dense_every_below_zero_is_one_line():
    with pytest.raises(UserError, match=r"attention.dense_every -1 must be >= 0"):
        AttentionConfig(dense_every=-1)
