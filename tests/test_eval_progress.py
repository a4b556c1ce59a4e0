"""`mtrain eval` shows progress from its first second (prompt building included, and within a long prompt's
prefill), keeps what finished when Ctrl-C stops it, fails when it measured nothing, and points an unfinished run
to its newest checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures.eval_corpus import (
    one_thread,  # noqa: F401  (autouse: this module runs on one thread)
    write_tiny_model,
)
from tiny_setup import cli_env

from mtrain_cli.cli import main
from mtrain_cli.errors import UserError
from mtrain_cli.eval.loading import load_model
from mtrain_cli.eval.runner import Runner


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["mtrain", *args])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def test_piped_eval_reports_prompt_building_before_anything_runs(tiny_model, tmp_path):
    env = {**cli_env(), "OMP_NUM_THREADS": "1"}
    env.pop("COLUMNS")
    args = ["eval", str(tiny_model), "--suite", "niah", "--lengths", "512", "--samples", "1", "--out", str(tmp_path)]
    result = subprocess.run([sys.executable, "-m", "mtrain_cli", *args], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "it/s]" not in result.stderr and "Loading weights" not in result.stderr, result.stderr  # no tqdm bars
    lines = result.stdout.splitlines()
    first = lines.index("niah: building prompts: 0/11 prompts · 0s")  # 11 depths × 1 sample, said at once
    done = next(i for i, line in enumerate(lines) if line.startswith("niah: building prompts: 11/11 prompts"))
    running = next(i for i, line in enumerate(lines) if line.startswith("niah: 0/"))
    assert first < done < running, result.stdout
    assert any(line.startswith("niah: ") and " tokens · " in line and "/" in line for line in lines[running + 1 :])


def test_every_prefill_chunk_moves_the_progress(tiny_model):
    loaded = load_model(tiny_model, torch.device("cpu"))
    runner = Runner(loaded.model, loaded.tokenizer, prefill_chunk=32)
    told: list[int] = []
    runner.on_tokens = told.append
    runner.generate([list(range(5, 105))], [2])
    assert told == [32, 32, 32, 4]  # a 100-token prompt moves the bar four times before its answer is decoded


def _interrupt_at_call(monkeypatch, call: int) -> None:
    generate, calls = Runner.generate, []

    def interrupted(self, prompts, max_new_tokens):
        calls.append(len(prompts[0]))
        if len(calls) == call:
            raise KeyboardInterrupt
        return generate(self, prompts, max_new_tokens)

    monkeypatch.setattr(Runner, "generate", interrupted)


EVAL = ["--suite", "niah,infinitebench", "--tasks", "niah,passkey", "--lengths", "256,512", "--samples", "1"]


def test_ctrl_c_keeps_the_cells_that_finished_marked_partial(tiny_model, tmp_path, monkeypatch, capsys):
    """Prompts run longest first: NIAH's 11 prompts (depths) at 512 tokens finish, Ctrl-C comes during the first
    at 256; InfiniteBench never starts."""
    _interrupt_at_call(monkeypatch, 12)
    code, out, err = run_main(monkeypatch, capsys, "eval", str(tiny_model), *EVAL, "--out", str(tmp_path))
    assert code == 130, err
    (run_dir,) = tmp_path.iterdir()
    assert f"interrupted (Ctrl-C): the results that finished are in {run_dir}, marked partial" in out
    results = json.loads((run_dir / "results.json").read_text())
    assert list(results["suites"]) == ["niah"]
    rows = results["suites"]["niah"]["rows"]
    assert len(rows) == 12 and all(list(cells) == ["512"] for cells in rows.values()), rows  # 11 depths + mean
    partial = results["partial"]
    assert partial.startswith("partial: Ctrl-C stopped niah") and "not run: infinitebench" in partial, partial
    assert partial in results["notes"] and partial in (run_dir / "summary.md").read_text()
    predictions = (run_dir / "predictions.jsonl").read_text().splitlines()
    assert [json.loads(line)["length"] for line in predictions] == [512] * 11


def test_ctrl_c_before_any_result_leaves_no_run_directory(tiny_model, tmp_path, monkeypatch, capsys):
    _interrupt_at_call(monkeypatch, 1)
    code, out, err = run_main(monkeypatch, capsys, "eval", str(tiny_model), *EVAL, "--out", str(tmp_path))
    assert code == 130, err
    assert "interrupted (Ctrl-C) in niah before any result; removed" in out
    assert not any(tmp_path.iterdir())


def test_an_eval_that_measured_nothing_is_an_error(tiny_model, tmp_path, monkeypatch, capsys):
    args = ["--suite", "infinitebench", "--tasks", "passkey", "--lengths", "16", "--samples", "1"]
    code, out, err = run_main(monkeypatch, capsys, "eval", str(tiny_model), *args, "--out", str(tmp_path))
    assert code == 2, out
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: nothing was measured: every task was skipped at lengths 16"), err
    assert "skipped infinitebench/passkey at 16" in out  # the reason, above the error


def test_an_unfinished_run_without_export_points_to_its_newest_checkpoint(tmp_path):
    run_dir = tmp_path / "run-20261127"
    for step in (50, 82):
        (run_dir / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    (run_dir / "config.yaml").write_text("run: {name: run}\n")
    with pytest.raises(UserError) as excinfo:
        load_model(run_dir, torch.device("cpu"))
    message = str(excinfo.value)
    assert f"e.g. the newest: {run_dir / 'checkpoints' / 'step_000082'}" in message
    assert "step_000100" not in message
    (run_dir / "checkpoints" / "step_000050").rmdir()
    (run_dir / "checkpoints" / "step_000082").rmdir()
    with pytest.raises(UserError, match="it has no checkpoint either"):
        load_model(run_dir, torch.device("cpu"))
