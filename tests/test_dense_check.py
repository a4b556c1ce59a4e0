"""The dense check (train/dense_check.py): its gap is exactly 0 when training attention is dense; a sparse run's gap
reaches metrics.jsonl, the step line, summary.json and wandb, and warns past its threshold; the check changes no
training loss."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from tiny_setup import small_run

from mtrain_cli.config import load_config
from mtrain_cli.train.dense_check import DenseCheck
from mtrain_cli.train.loop import build_trainer

# really sparse on the tiny model: a share 0.5 of the probe mass, at most 4 columns and offsets a head
SPARSE = [
    "attention.mode=sparse",
    "attention.block_size=16",
    "attention.dense_below=0",
    "attention.last_q=16",
    "attention.p=0.5",
    "attention.cap=4",
    "attention.local_window=16",
]


def fit(tmp_path: Path, name: str, *overrides: str, num_steps: int = 3):
    run_dir = tmp_path / name
    run_dir.mkdir()
    out = io.StringIO()
    config = load_config("tiny", small_run(num_steps, tmp_path, "checkpoint.export=false", *overrides))
    trainer = build_trainer(config, run_dir, Console(file=out, width=250))
    return trainer, run_dir, out


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_the_gap_is_exactly_zero_when_training_attention_is_dense(tmp_path):
    trainer, run_dir, _ = fit(tmp_path, "dense", "attention.mode=dense")
    assert trainer.dense_check is None  # dense mode has nothing to check by default
    trainer.dense_check = DenseCheck(1, 0.01, trainer.pc)  # the check's forward, against a dense training forward
    summary = trainer.fit()
    gaps = [r["dense_check_gap"] for r in step_records(run_dir)]
    assert gaps == [0.0, 0.0, 0.0]
    assert summary["dense_check"]["checks"] == 3 and summary["dense_check"]["gap_mean"] == 0.0


def test_a_sparse_runs_gap_is_reported_everywhere_and_warns(tmp_path, monkeypatch):
    logged: list[dict] = []

    class FakeRun:
        def log(self, metrics, step):
            logged.append(dict(metrics))

        def finish(self):
            pass

    monkeypatch.setattr("wandb.init", lambda **_: FakeRun())
    overrides = [*SPARSE, "attention.check_every=1", "attention.check_warn=1e-6", "logging.wandb=true"]
    trainer, run_dir, out = fit(tmp_path, "sparse", *overrides)
    summary = trainer.fit()
    records = step_records(run_dir)
    gaps = [r["dense_check_gap"] for r in records]
    assert len(gaps) == 3 and sum(gaps) / 3 > 1e-4  # sparse attention really costs loss here
    for r in records:
        assert r["dense_check_gap"] == pytest.approx(r["loss"] - r["dense_check_loss"])
        assert r["dense_check_gap_rel"] == pytest.approx(r["dense_check_gap"] / r["dense_check_loss"])
    assert [m.get("dense_check_gap") for m in logged if "loss" in m] == gaps  # wandb
    assert f"vs dense {gaps[0]:+.4f}" in out.getvalue()  # the step line
    check = summary["dense_check"]
    assert check["checks"] == 3 and check["gap_mean"] == pytest.approx(sum(gaps) / 3)
    assert check["gap_last_fifth"] == pytest.approx(gaps[-1])  # step 3 of 3
    assert check["seconds"] > 0 and 0 < check["share_of_training"] < 1
    (warning,) = check["warnings"]  # once, when the window of 3 checks first passes the threshold
    assert warning.startswith("step 3: sparse attention costs") and warning in summary["warnings"]


def test_checks_do_not_change_the_training_losses(tmp_path):
    losses = {}
    for every in (0, 2):
        trainer, run_dir, _ = fit(tmp_path, f"every{every}", *SPARSE, f"attention.check_every={every}", num_steps=4)
        trainer.fit()
        records = step_records(run_dir)
        losses[every] = [r["loss"] for r in records]
        assert [r["step"] for r in records if "dense_check_gap" in r] == ([2, 4] if every else [])
    assert losses[0] == losses[2]
