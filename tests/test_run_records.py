"""Issue 21, nothing a user had is ever lost: damaged checkpoints (resume falls back, eval names the file), a
finished run, failed commands that must not touch the run's files, one metrics line per step and a whole-run
summary after a kill, no orphan run directories, --output-dir on a file, an export that generates with its
KV cache and knows its context. The run directory's rules are in src/mtrain_cli/train/records.py."""

from __future__ import annotations

import hashlib
import io
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from spawned_ranks import run_cli_ranks
from tiny_setup import only_run_dir, run_cli, set_args, small_run, step_losses
from transformers import AutoTokenizer

from mtrain_cli.config import load_config
from mtrain_cli.errors import UserError
from mtrain_cli.eval.loading import load_model
from mtrain_cli.train.checkpoint import checkpoint_dirs, read_state
from mtrain_cli.train.loop import Trainer
from mtrain_cli.train.records import plan_resume
from mtrain_cli.train.run import run_extend

STEPS = 6
# constant schedule: a resume that raises train.num_steps replays the earlier steps bit for bit
RUN = ["checkpoint.every=2", "checkpoint.keep_last=3", "train.eval_every=3", "train.schedule=constant"]


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def truncate(file: Path, keep: float = 0.5) -> None:
    with open(file, "r+b") as handle:
        handle.truncate(int(file.stat().st_size * keep))


def tree(run_dir: Path) -> dict[str, str]:
    """Every file under the run directory and its checksum."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 6-step run with its export: checkpoints at steps 2, 4, 6; validation at 0, 3, 6."""
    out = tmp_path_factory.mktemp("finished")
    return run_extend(load_config("tiny", small_run(STEPS, out, *RUN)), None, quiet()).run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    """A copy of the finished run to damage (config.yaml's paths are absolute: the copy resumes as is)."""
    return Path(shutil.copytree(finished_run, tmp_path / finished_run.name))


# -- item 1: damaged checkpoints ------------------------------------------------------------------------------


def test_resume_falls_back_past_a_truncated_checkpoint_and_says_which_file(finished_run, run_copy):
    truncate(run_copy / "checkpoints" / "step_000006" / "dcp" / "__0_0.distcp")
    original_config = (run_copy / "config.yaml").read_bytes()
    result = run_cli("extend", "--resume", str(run_copy), "--set", "train.num_steps=8")
    assert result.returncode == 0, result.stderr + result.stdout
    output = " ".join(result.stdout.split())  # the console wraps long lines
    assert "step_000006/dcp/__0_0.distcp is truncated (" in output and "bytes; its items need" in output
    assert "resuming from" in output and "step_000004 instead" in output and "at step 4" in output
    assert re.search(r"done in [\d.]+s \(training [\d.]+s over the run's 2 legs\)", output), output

    summary = json.loads((run_copy / "summary.json").read_text())
    assert any("step_000006/dcp/__0_0.distcp is truncated" in w for w in summary["warnings"]), summary["warnings"]
    assert any("train.num_steps 6 → 8" in w for w in summary["warnings"]), summary["warnings"]
    # one line per step and per validation; the replayed steps 5, 6 equal the first run's bit for bit
    lines = records(run_copy)
    assert [(r["step"], "val_loss" in r) for r in lines] == [
        (0, True),
        (1, False),
        (2, False),
        (3, False),
        (3, True),
        (4, False),
        (5, False),
        (6, False),
        (6, True),
        (7, False),
        (8, False),
        (8, True),
    ]
    first = step_losses(finished_run)
    for step, losses in step_losses(run_copy).items():
        assert step > STEPS or losses == first[step], (step, losses, first[step])
    assert summary["steps"] == {"start": 4, "end": 8} and summary["resumed_at"] == [4]
    assert sorted(summary["val_loss"], key=int) == ["0", "3", "6", "8"]
    # the settings changed: config.yaml now says 8 steps, the previous one is kept as it was
    assert (run_copy / "config.until_step_000004.yaml").read_bytes() == original_config
    assert "num_steps: 8" in (run_copy / "config.yaml").read_text()
    # the damaged checkpoint was overwritten by the replay, the one resumed from kept by the pruning
    assert [step for step, _ in checkpoint_dirs(run_copy / "checkpoints")] == [4, 6, 8]
    assert read_state(run_copy / "checkpoints" / "step_000006").step == 6


def test_resume_with_no_intact_checkpoint_is_one_line_and_changes_nothing(run_copy):
    checkpoints = run_copy / "checkpoints"
    truncate(checkpoints / "step_000006" / "dcp" / "__0_0.distcp")
    (checkpoints / "step_000004" / "dcp" / ".metadata").unlink()
    (checkpoints / "step_000002" / "state_rank0.pt").write_bytes(b"")
    before = tree(run_copy)
    result = run_cli("extend", "--resume", str(run_copy), *set_args(["train.lr=0.5", "train.num_steps=8"]))
    assert result.returncode == 2, result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    error = result.stderr
    assert "no intact checkpoint to resume from" in error
    assert f"{checkpoints / 'step_000006' / 'dcp' / '__0_0.distcp'} is truncated" in error
    assert f"{checkpoints / 'step_000004' / 'dcp' / '.metadata'} is missing" in error
    assert f"{checkpoints / 'step_000002' / 'state_rank0.pt'} is empty" in error
    assert tree(run_copy) == before


def test_eval_of_a_damaged_checkpoint_is_one_line_naming_the_file(run_copy, tmp_path):
    checkpoints = run_copy / "checkpoints"
    truncate(checkpoints / "step_000006" / "dcp" / "__0_0.distcp", keep=0.05)  # into the model's items
    with pytest.raises(
        UserError,
        match=r"step_000006/dcp/__0_0.distcp is truncated .*pass an intact checkpoint "
        r"of the run instead, e\.g\. .*step_000004",
    ):
        load_model(checkpoints / "step_000006", torch.device("cpu"))
    (checkpoints / "step_000004" / "dcp" / "__0_0.distcp").unlink()
    with pytest.raises(UserError, match=r"step_000004/dcp/__0_0.distcp is missing; .*e\.g\. .*step_000002$"):
        load_model(checkpoints / "step_000004", torch.device("cpu"))
    assert load_model(checkpoints / "step_000002", torch.device("cpu")).source == "checkpoint"

    result = run_cli(
        "eval",
        str(checkpoints / "step_000006"),
        "--suite",
        "niah",
        "--lengths",
        "1k",
        "--samples",
        "1",
        "--out",
        str(tmp_path / "evals"),
    )
    assert result.returncode == 2, result.stderr + result.stdout
    assert (
        len(result.stderr.strip().splitlines()) == 1 and "step_000006/dcp/__0_0.distcp is truncated" in result.stderr
    ), result.stderr


def test_a_checkpoint_of_mtrain_before_dcp_is_refused_in_one_line(run_copy):
    """model.pt, optimizer.pt, state.pt (torch.save, one process) are neither read nor migrated: one line."""
    old = run_copy / "checkpoints" / "step_000006"
    shutil.rmtree(old)
    old.mkdir()
    for name in ("model.pt", "optimizer.pt", "state.pt"):
        torch.save({}, old / name)
    before = tree(run_copy)
    result = run_cli("extend", "--resume", str(run_copy), "--set", "train.num_steps=8")
    assert result.returncode == 2, result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{old} was written by an mtrain before DCP checkpoints (model.pt" in result.stderr
    with pytest.raises(UserError, match=r"step_000006 was written by an mtrain before DCP checkpoints"):
        load_model(old, torch.device("cpu"))
    assert tree(run_copy) == before


# -- items 2 and 3: a finished run, failed resumes ------------------------------------------------------------


@pytest.mark.parametrize("case", ["finished", "beyond the last step", "model does not fit", "bad setting"])
def test_a_resume_that_does_nothing_or_fails_changes_no_file(run_copy, case):
    before = tree(run_copy)
    extra = {
        "finished": [],
        "beyond the last step": ["train.num_steps=4"],
        "model does not fit": ["train.lr=0.5", "train.num_steps=8", "model.hidden_size=96"],
        "bad setting": ["train.lr=0.5", "train.num_steps=8", "train.dtype=bf16"],
    }[case]
    result = run_cli("extend", "--resume", str(run_copy), *set_args(extra))
    if case == "finished":
        assert result.returncode == 0, result.stderr + result.stdout
        assert (
            f"run {run_copy} already finished at step 6/6; raise train.num_steps with --set to train further"
            in " ".join(result.stdout.split())
        )
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 2, result.stderr + result.stdout
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
        expected = {
            "beyond the last step": "its newest checkpoint is step 6, beyond train.num_steps 4",
            "model does not fit": "does not fit the model and optimizer built from the config (size mismatch",
            "bad setting": "train.dtype bf16 on cpu",
        }[case]
        assert expected in result.stderr, result.stderr
    assert tree(run_copy) == before


# -- item 4: kill -9 and resume --------------------------------------------------------------------------------


def test_killed_run_resumes_to_one_line_per_step_and_a_whole_run_summary(finished_run, run_copy):
    """As a kill -9 after step 6 was logged, before its checkpoint: steps 5 and 6 are trained again."""
    shutil.rmtree(run_copy / "checkpoints" / "step_000006")
    shutil.rmtree(run_copy / "export")
    (run_copy / "summary.json").unlink()
    with open(run_copy / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 7, "loss": 5.9')  # a line cut by the kill
    config_before = (run_copy / "config.yaml").read_bytes()
    at_checkpoint = read_state(run_copy / "checkpoints" / "step_000004").wall_s
    resumed_from = tree(run_copy / "checkpoints" / "step_000004")
    config = load_config(str(run_copy / "config.yaml"))
    summary = run_extend(config, run_copy, quiet()).summary
    # its files are only read: training on never writes into them
    assert tree(run_copy / "checkpoints" / "step_000004") == resumed_from

    assert (run_copy / "config.yaml").read_bytes() == config_before  # same settings: not rewritten
    assert not list(run_copy.glob("config.until_*"))
    assert not any("changed settings" in warning for warning in summary["warnings"]), summary["warnings"]

    # one line per step and validation, the same losses bit for bit; the cut line is gone
    def losses(run_dir: Path) -> list[tuple[int, float]]:
        return [(r["step"], r.get("loss", r.get("val_loss"))) for r in records(run_dir)]

    assert losses(run_copy) == losses(finished_run) and len(losses(run_copy)) == STEPS + 3
    first = json.loads((finished_run / "summary.json").read_text())
    assert summary["val_loss"] == first["val_loss"] and set(summary["val_loss"]) == {"0", "3", "6"}
    assert summary["final_train_loss"] == first["final_train_loss"]  # over steps 1..6, not this leg's 5..6
    assert summary["steps"] == {"start": 4, "end": 6} and summary["resumed_at"] == [4]
    assert at_checkpoint > 0 and summary["wall_s"] > at_checkpoint
    assert json.loads((run_copy / "summary.json").read_text())["wall_s"] == summary["wall_s"]


def test_run_killed_after_its_last_checkpoint_is_finished_by_a_resume(finished_run, run_copy):
    """The last checkpoint is on disk, the export and summary are not: a resume trains nothing and writes them."""
    shutil.rmtree(run_copy / "export")
    (run_copy / "summary.json").unlink()
    metrics = (run_copy / "metrics.jsonl").read_bytes()
    summary = run_extend(load_config(str(run_copy / "config.yaml")), run_copy, quiet()).summary
    assert (run_copy / "export" / "model.safetensors").is_file()
    assert (run_copy / "metrics.jsonl").read_bytes() == metrics
    first = json.loads((finished_run / "summary.json").read_text())
    assert summary["final_train_loss"] == first["final_train_loss"] and summary["val_loss"] == first["val_loss"]
    assert summary["steps"] == {"start": 6, "end": 6}


def test_settings_given_on_resume_are_the_ones_trained_with(run_copy):
    """The checkpoint restores the optimizer's lr; --set train.lr on resume applies from the next step."""
    config = load_config(str(run_copy / "config.yaml"), ["train.num_steps=8", "train.lr=3e-4"])
    summary = run_extend(config, run_copy, quiet()).summary
    lr = {r["step"]: r["lr"] for r in records(run_copy) if "lr" in r}
    assert lr[6] != 3e-4 and lr[7] == lr[8] == 3e-4  # constant schedule
    assert any("train.lr 0.0005 → 0.0003" in w for w in summary["warnings"]), summary["warnings"]
    assert "lr: 0.0003" in (run_copy / "config.yaml").read_text()
    assert "lr: 0.0005" in (run_copy / "config.until_step_000006.yaml").read_text()


# -- items 5 and 6: no orphan run directories, --output-dir on a file ------------------------------------------


def test_a_start_that_fails_leaves_no_run_directory(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    out.mkdir()
    result = run_cli("extend", *set_args(small_run(2, out, "train.dtype=bf16")))  # fails building the trainer
    assert result.returncode == 2 and "train.dtype bf16" in result.stderr
    assert list(out.iterdir()) == []

    def fail_at(step: int):
        def launch_step(self):
            if self.step + 1 == step:
                raise RuntimeError("out of memory")
            return original(self)

        return launch_step

    original = Trainer.launch_step
    config = load_config("tiny", small_run(3, out, "checkpoint.every=3"))
    monkeypatch.setattr(Trainer, "launch_step", fail_at(1))  # after the step-0 validation line, before step 1
    with pytest.raises(RuntimeError, match="out of memory"):
        run_extend(config, None, quiet())
    assert list(out.iterdir()) == []

    # step 2 fails to launch while step 1 is in flight: step 1 is read and logged first, the run directory stays
    monkeypatch.setattr(Trainer, "launch_step", fail_at(2))
    with pytest.raises(RuntimeError, match="out of memory"):
        run_extend(config, None, quiet())
    run_dir = only_run_dir(out)
    assert [r["step"] for r in records(run_dir) if "loss" in r] == [1]
    shutil.rmtree(run_dir)

    def user_file_then_fail(self):  # anything the user put in the directory is kept, and so is the directory
        (self.run_dir / "notes.txt").write_text("mine")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(Trainer, "launch_step", user_file_then_fail)
    with pytest.raises(RuntimeError):
        run_extend(config, None, quiet())
    assert [p.name for p in only_run_dir(out).iterdir()] == ["notes.txt"]


def test_output_dir_that_is_a_file_is_one_line(tmp_path):
    file = tmp_path / "runs.txt"
    file.write_text("not a directory")
    for output_dir, problem in ((file, "is a file, not a directory"), (file / "sub", f"is inside {file}, a file")):
        result = run_cli("extend", "--output-dir", str(output_dir), *set_args(small_run(1, output_dir)))
        assert result.returncode == 2, result.stderr + result.stdout
        assert len(result.stderr.strip().splitlines()) == 1 and problem in result.stderr, result.stderr
        assert "packed" not in result.stdout  # said before the data is read
    assert file.read_text() == "not a directory"


# -- item 7: the export --------------------------------------------------------------------------------------


def test_export_generates_with_its_cache_and_knows_its_context(finished_run):
    export = finished_run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["use_cache"] is True and config["max_position_embeddings"] == 256
    assert json.loads((export / "generation_config.json").read_text())["use_cache"] is True
    assert json.loads((export / "tokenizer_config.json").read_text())["model_max_length"] == 256
    assert AutoTokenizer.from_pretrained(export, local_files_only=True).model_max_length == 256


# -- distributed (DCP) checkpoints under gloo ------------------------------------------------------------------


@pytest.mark.slow
def test_sharded_checkpoints_fall_back_and_name_the_damaged_file(tmp_path):
    out = tmp_path / "runs"
    args = small_run(
        4,
        out,
        "checkpoint.every=2",
        "checkpoint.keep_last=2",
        "checkpoint.export=false",
        "parallel.dp=2",
        "train.schedule=constant",
    )
    first = run_cli_ranks(2, "extend", *set_args(args))
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = only_run_dir(out)
    expected = step_losses(run_dir)
    checkpoints = run_dir / "checkpoints"
    truncate(checkpoints / "step_000004" / "dcp" / "__1_0.distcp")

    resumed = run_cli_ranks(2, "extend", "--resume", str(run_dir), "--set", "train.num_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    output = " ".join(resumed.stdout.split())
    assert "step_000004/dcp/__1_0.distcp is truncated" in output and "step_000002 instead" in output
    got = step_losses(run_dir)
    assert sorted(got) == list(range(1, 7)) and all(len(losses) == 1 for losses in got.values())
    for step in (1, 2, 3, 4):
        assert got[step][0] == pytest.approx(expected[step][0], rel=1e-6)

    # mtrain eval reads a sharded checkpoint's model items (a file's first part): a damaged one is named
    truncate(checkpoints / "step_000006" / "dcp" / "__0_0.distcp", keep=0.05)
    with pytest.raises(UserError, match=r"step_000006/dcp/__0_0.distcp is truncated .*e\.g\. .*step_000004"):
        load_model(checkpoints / "step_000006", torch.device("cpu"))
    (checkpoints / "step_000004" / "dcp" / ".metadata").unlink()
    with pytest.raises(UserError, match=r"step_000004/dcp/.metadata is missing"):
        load_model(checkpoints / "step_000004", torch.device("cpu"))
    # every rank reaches the same verdict from the files alone: none intact is one line, before any loading
    with pytest.raises(
        UserError,
        match=r"no intact checkpoint to resume from: .*__0_0.distcp is truncated .*"
        r"\.metadata is missing",
    ):
        plan_resume(run_dir, load_config(str(run_dir / "config.yaml"), ["train.num_steps=8"]))
