"""Output piped to a file (logs, CI) stays readable: no line wrapped mid-field, no progress bars of datasets or
transformers, an eta that the first step does not distort, a true "done in", a final loss that says what it is,
no profiler markers, and recipe descriptions a user can read."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from tiny_setup import cli_env, only_run_dir, set_args, small_run

from mtrain_cli.config import load_config
from mtrain_cli.resources import list_recipes
from mtrain_cli.train import progress
from mtrain_cli.train.progress import RunLogger

TQDM = re.compile(r"\d+%\||it/s\]|examples/s\]")


def piped(*args: str, cwd: Path | None = None, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI with stdout and stderr going to pipes and no COLUMNS: what a log file or CI sees."""
    environment = {**cli_env(), **env}
    environment.pop("COLUMNS", None)
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "mtrain_cli", *args], capture_output=True, text=True, env=environment, cwd=cwd
    )
    return result, time.perf_counter() - started


def test_piped_extend_output_is_one_line_per_record_without_foreign_bars(tmp_path):
    """A fresh datasets cache makes `datasets` build the json split (its bar), the export writes safetensors
    (transformers' bar): neither shows; rich does not wrap the step lines at 80 columns."""
    overrides = small_run(4, tmp_path / "runs", "logging.every=2")
    result, seconds = piped("extend", *set_args(overrides), HF_DATASETS_CACHE=str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr + result.stdout
    out = result.stdout
    assert not TQDM.search(out + result.stderr), (out + result.stderr)[-3000:]
    step_lines = [line for line in out.splitlines() if re.match(r"step +\d+/4 ", line)]
    assert [line.split()[1] for line in step_lines] == ["1/4", "2/4", "4/4"], out
    assert all("gnorm" in line and len(line) > 80 for line in step_lines), out  # whole, not wrapped at 80
    assert "eta" not in step_lines[0] and "eta" in step_lines[1]  # the first step predicts nothing

    (done,) = [line for line in out.splitlines() if line.startswith("done in")]
    match = re.match(
        r"done in ([\d.]+)s \(training ([\d.]+)s\) · final train loss [\d.]+ \(mean of the last 4 steps\)", done
    )
    assert match, done
    command_s, training_s = float(match.group(1)), float(match.group(2))
    assert training_s < command_s <= seconds and command_s > 0.5 * seconds, (command_s, training_s, seconds)
    assert "summary.json" in done and str(only_run_dir(tmp_path / "runs") / "export") in done


def test_the_eta_counts_the_steps_after_the_first(tmp_path, monkeypatch):
    """Step 1 (data, allocator, compilation) took 10 s, the others 1 s each: the eta of step 3 of 10 is 7 s."""
    clock = iter([100.0, 110.0, 111.0, 112.0])  # the logger's start, then the end of steps 1, 2, 3
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    config = load_config("tiny", ["train.num_steps=10", "train.warmup_steps=0", "logging.every=1"])
    console = Console(file=io.StringIO(), width=300)
    with RunLogger(config, tmp_path, 0, console) as logger:
        for step in (1, 2, 3):
            logger.log_step({"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0,
                             "tflops": 0.0, "peak_mem_gib": 0.1})  # fmt: skip
    lines = [line for line in console.file.getvalue().splitlines() if line.startswith("step")]
    assert "eta" not in lines[0]
    assert lines[1].endswith("eta 8s") and lines[2].endswith("eta 7s"), lines


def test_profile_step_prints_no_profiler_markers(tmp_path):
    result, _ = piped(
        "profile", "step", "--recipe", "tiny", "--steps", "1", "--warmup", "0",
        *set_args(["data.seq_len=256", "model.num_hidden_layers=1", "data.num_val_rows=1"]),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr + result.stdout
    assert "| step (wall) |" in result.stdout
    assert "USDT" not in result.stdout + result.stderr and "profiler_start" not in result.stderr, result.stderr


def test_recipe_descriptions_name_no_issue_numbers():
    for name, description in list_recipes():
        assert not re.search(r"\bissue\s*#?\d+", description, re.IGNORECASE), (name, description)


def test_piped_rules_and_lines_keep_their_whole_text():
    """The demo's step titles are rules of about 120 characters: piped, rich's 80 columns cut them with '…'."""
    title = "1/4 extend data/tiny-base 256 -> 2048 tokens with YaRN: mtrain extend --recipe tiny --model data/tiny-base"
    code = (
        f"from mtrain_cli.cli.usage import output_console\nc = output_console()\nc.rule({title!r})\nc.print('x ' * 150)"
    )
    environment = cli_env()
    environment.pop("COLUMNS", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr
    rule, line = result.stdout.splitlines()
    assert title in rule and "…" not in rule
    assert line.strip() == ("x " * 150).strip()
