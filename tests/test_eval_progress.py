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
from spawned_ranks import ForkedCLI
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


def test_ctrl_c_keeps_the_samples_that_finished_in_a_cell_it_cut_short(tiny_model, tmp_path, monkeypatch, capsys):
    """One cell of 3 passkey samples, Ctrl-C during the third: the two answers are kept, the cell named partial."""
    _interrupt_at_call(monkeypatch, 3)
    args = ["--suite", "infinitebench", "--tasks", "passkey", "--lengths", "256", "--samples", "3"]
    code, _out, err = run_main(monkeypatch, capsys, "eval", str(tiny_model), *args, "--out", str(tmp_path))
    assert code == 130, err
    (run_dir,) = tmp_path.iterdir()
    results = json.loads((run_dir / "results.json").read_text())
    assert list(results["suites"]["infinitebench"]["rows"]["passkey"]) == ["256"]
    assert "cells with fewer samples than asked: passkey at 256: 2 of 3 samples" in results["partial"], results
    assert len((run_dir / "predictions.jsonl").read_text().splitlines()) == 2


def test_sigterm_stops_eval_as_ctrl_c_does_even_with_sigint_ignored(tiny_model, tmp_path):
    """`mtrain eval ... &` from a script inherits SIGINT ignored; SIGTERM (kill, timeout, a scheduler) stops it
    and keeps what finished: exit code 143, never a silent kill."""
    import signal
    import time

    args = ["eval", str(tiny_model), "--suite", "infinitebench", "--tasks", "passkey", "--lengths", "256"]
    process = ForkedCLI(
        *args, "--samples", "3000", "--out", str(tmp_path), env={"OMP_NUM_THREADS": "1"}, ignore_sigint=True
    )
    seen = ""
    while "infinitebench: 0/" not in seen:  # the samples run
        line = process.stdout.readline()
        assert line, seen
        seen += line
    time.sleep(1)
    process.send_signal(signal.SIGINT)  # ignored, as in a background job
    time.sleep(0.5)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    out = seen + process.communicate(timeout=120)[0]
    assert process.returncode == 143, out[-3000:]
    assert "interrupted (SIGTERM)" in out and "Traceback" not in out, out[-3000:]


def test_lengths_far_past_the_model_are_refused_unless_forced(tiny_model, tmp_path, monkeypatch, capsys):
    """The tiny model's context is 1,024: 9K is more than 8x (refused before any prompt is built) unless
    --force-lengths. A KV cache beyond the device's memory is refused too."""
    args = ["eval", str(tiny_model), "--suite", "infinitebench", "--tasks", "passkey", "--samples", "1"]
    code, _out, err = run_main(monkeypatch, capsys, *args, "--lengths", "9k", "--out", str(tmp_path / "a"))
    assert code == 2 and "Traceback" not in err, err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line.startswith("error: --lengths 9,216: 9x the model's context (max_position_embeddings 1,024;"), line
    assert line.endswith("give shorter --lengths, or pass --force-lengths to run them anyway"), line
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    from mtrain_cli.eval.command import check_lengths
    from mtrain_cli.eval.registry import command_line, parse_options

    loaded = load_model(tiny_model, torch.device("cpu"))
    forced = parse_options(model_dir=tiny_model, lengths="9k", force_lengths=True, out=tmp_path)
    check_lengths(forced, loaded, memory_bytes=2**30)
    assert "--force-lengths" in command_line(forced)  # results.json's command reruns it as it ran
    options = parse_options(model_dir=tiny_model, lengths="8k", out=tmp_path)
    check_lengths(options, loaded, memory_bytes=2**30)  # 8x, and 2 x 2 layers x 2 heads x 16 x 4 B x 8K = 2 MiB
    with pytest.raises(UserError, match=r"--lengths 8,192: the KV caches of a batch of 1 take 0.0 GiB, more than"):
        check_lengths(options, loaded, memory_bytes=2**20)


def test_piped_progress_says_where_it_is_while_nothing_moves():
    """A 10M-token prompt takes minutes to build: piped output still gets a line every `every_s` seconds."""
    import io
    import time

    from rich.console import Console

    from mtrain_cli.eval.runner import _LoggedProgress

    console = Console(file=io.StringIO(), width=200)
    with _LoggedProgress(console, "prompts", every_s=0.1) as progress:
        progress.add_task("ruler: building prompts", total=1)
        time.sleep(0.55)
    lines = console.file.getvalue().splitlines()
    assert len(lines) >= 4 and all(line.startswith("ruler: building prompts: 0/1 prompts · ") for line in lines)
