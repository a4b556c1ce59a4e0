"""A new user's first runs: a run name is a name, never a path; `--dry-run` refuses every input the run refuses,
with the same one line (exit code 2), and stays fast; a config.json without its shape or weights of another shape
are one line each; a short run needs no warm-up setting."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.eval_corpus import prose
from spawned_ranks import run_forked_cli
from tiny_setup import cli_env, error_line, run_cli, set_args

from mtrain_cli.config import load_config
from mtrain_cli.resources import shipped_path

SMALL = [
    "data.seq_len=256",
    "data.num_val_rows=1",
    "train.num_steps=2",
    "train.warmup_steps=0",
    "checkpoint.export=false",
]


@pytest.fixture
def model(tmp_path) -> Path:
    """The shipped tiny base (weights, config.json, tokenizer), copied to be spoiled."""
    return Path(shutil.copytree(shipped_path("data/tiny-base"), tmp_path / "model"))


def write_jsonl(path: Path, lines: list[str] | bytes) -> Path:
    path.write_bytes(lines if isinstance(lines, bytes) else "".join(line + "\n" for line in lines).encode())
    return path


def documents(count: int = 20) -> list[str]:
    return [json.dumps({"text": prose(index, 40)}) for index in range(count)]


# -- 1. a run name with a path in it -------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../escape", "/abs/path", "a/b", ".."])
def test_a_run_name_with_a_path_is_refused_and_nothing_is_written_outside(tmp_path, name):
    out = tmp_path / "out" / "runs"
    for dry in ([], ["--dry-run"]):
        line = error_line(run_cli("extend", "--set", f"run.name={name}", "--output-dir", str(out), *dry))
        assert line.startswith(f"error: run.name {name!r} must be a name, not a path"), line
        assert "--output-dir" in line and "set run.name=" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even the output directory


# -- 2, 3. the dry run refuses what the run refuses ----------------------------------------------------------


def _without_hidden_size(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    del config["hidden_size"]
    (model / "config.json").write_text(json.dumps(config))


def _empty_weights(model: Path) -> None:
    (model / "model.safetensors").write_bytes(b"")


def _other_shape(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] = 256  # the weights hold 384
    (model / "config.json").write_text(json.dumps(config))


# case -> (how it spoils the model / data / arguments, what its one line says)
CASES = {
    "a missing data file": (
        lambda t, m: ["--data", str(t / "gone.jsonl")],
        "data source '{t}/gone.jsonl' does not exist",
    ),
    "a number as text": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", [*documents(), '{"text": 5}']))],
        "line 21 has a 'text' that is a number, not a string",
    ),
    "a list as a record": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", [*documents(), '["a"]']))],
        "line 21 is a list, not an object",
    ),
    "a null text": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", [*documents(), '{"text": null}']))],
        "line 21 has no 'text' field",
    ),
    "UTF-16": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", "\n".join(documents()).encode("utf-16")))],
        "line 1 is not UTF-8 text (byte 0xff at offset 0)",
    ),
    "broken JSON": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", [*documents(), '{"text": ']))],
        "line 21 could not be read as json",
    ),
    "an empty file": (lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", b""))], "is empty (no documents)"),
    "a missing column": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", ['{"body": "x"}']))],
        "data.text_field 'text' is not a column of",
    ),
    "too little data": (
        lambda t, m: ["--data", str(write_jsonl(t / "d.jsonl", ['{"text": "a few words"}']))],
        "data.num_val_rows 1 leaves no training rows",
    ),
    "0-byte weights": (
        lambda t, m: _empty_weights(m) or [],
        "model.safetensors is truncated or not safetensors (0 bytes",
    ),
    "config.json without hidden_size": (
        lambda t, m: _without_hidden_size(m) or [],
        "config.json has no integer hidden_size; restore config.json",
    ),
    "weights of another shape": (
        lambda t, m: _other_shape(m) or [],
        "weight 'model.layers.0.mlp.gate_proj.weight' has shape [384, 128], but its config.json makes it [256, 128]",
    ),
    "an output directory that is a file": (
        lambda t, m: (t / "afile").write_text("") or ["--output-dir", str(t / "afile")],
        "run.output_dir {t}/afile is a file, not a directory",
    ),
    "a name with a slash": (lambda t, m: ["--set", "run.name=a/b"], "run.name 'a/b' must be a name, not a path"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_dry_run_refuses_what_the_run_refuses_with_the_same_line(tmp_path, model, case):
    spoil, expected = CASES[case]
    good = ["--data", str(write_jsonl(tmp_path / "good.jsonl", documents()))]
    args = ["extend", "--model", str(model), *good, "--output-dir", str(tmp_path / "runs"), *set_args(SMALL)]
    args += spoil(tmp_path, model)  # a later --data or --output-dir replaces the good one
    if "--data" in args[args.index("--output-dir") :]:
        del args[args.index("--data") : args.index("--data") + 2]
    started = time.perf_counter()
    dry = error_line(run_cli(*args, "--dry-run"))
    dry_s = time.perf_counter() - started
    run = error_line(run_cli(*args))
    assert dry == run and expected.replace("{t}", str(tmp_path)) in dry, (dry, run)
    assert dry_s < 10, f"the dry run took {dry_s:.1f}s"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_dry_run_of_good_inputs_plans_them(tmp_path, model):
    data = write_jsonl(tmp_path / "good.jsonl", documents())
    args = ["--model", str(model), "--data", str(data), "--output-dir", str(tmp_path / "runs"), *set_args(SMALL)]
    result = run_cli("extend", *args, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "packed 20 documents" in result.stdout and "parameters" in result.stdout
    assert not (tmp_path / "runs").exists()


# -- 9. a warm-up the user did not set follows train.num_steps ---------------------------------------------


def test_a_warm_up_not_set_follows_the_number_of_steps(tmp_path):
    data = str(write_jsonl(tmp_path / "d.jsonl", documents()))
    for num_steps, warmup in ((3, 0), (100, 10), (300, 20), (5000, 20)):
        config = load_config(None, [f"data.sources=[{data}]", f"train.num_steps={num_steps}"])
        assert config.train.warmup_steps == warmup, num_steps
    # the recipes a newcomer meets first (bare `mtrain extend` runs tiny) leave the warm-up to that rule
    for recipe in ("tiny", "llama3.1-8b-64k-lora", "qwen3-8b-256k"):
        assert load_config(recipe, [f"data.sources=[{data}]", "train.num_steps=3"]).train.warmup_steps == 0, recipe
        assert load_config(recipe, [f"data.sources=[{data}]"]).train.warmup_steps == 20, recipe
    set_by_user = load_config(None, [f"data.sources=[{data}]", "train.num_steps=300", "train.warmup_steps=50"])
    assert set_by_user.train.warmup_steps == 50
    line = error_line(run_cli("extend", "--data", data, "--set", "train.num_steps=3", "--set", "train.warmup_steps=5"))
    assert "train.warmup_steps 5 must be in [0, train.num_steps=3]" in line


def test_a_config_json_without_its_shape_is_refused_before_torch_is_imported(tmp_path, model):
    _without_hidden_size(model)
    data = write_jsonl(tmp_path / "good.jsonl", documents())
    command = [sys.executable, "-X", "importtime", "-m", "mtrain_cli", "extend", "--model", str(model)]
    result = subprocess.run(
        [*command, "--data", str(data), "--dry-run"], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines()}
    assert result.returncode == 2 and "config.json has no integer hidden_size" in result.stderr
    assert not imported & {"torch", "transformers", "datasets"}, sorted(imported)


def test_a_broken_json_line_is_our_one_line_alone(tmp_path):
    """datasets' json builder logs its own "Failed to load JSON ..." before raising: not shown (a process of its
    own, so the builder's logger writes to the real stderr)."""
    data = write_jsonl(tmp_path / "d.jsonl", [*documents(2), '{"text": '])
    result = run_forked_cli("extend", "--data", str(data), "--output-dir", str(tmp_path / "runs"))
    assert error_line(result).endswith(
        "line 3 could not be read as json (Expecting value at column 10); fix or remove that line"
    )


# -- 10. the small ones ----------------------------------------------------------------------------------------


def test_dash_h_is_help_on_every_command(monkeypatch, capsys):
    from test_cli_errors import all_commands, run_main

    for path, _ in all_commands():
        code, out, err = run_main(monkeypatch, capsys, *path, "-h")
        assert code == 0 and "Usage: mtrain" in out, (path, err)


def test_shell_completion_completes_commands_and_flags():
    # Typer otherwise asks the parent process for the shell, and CI's is sh.
    show_env = {**cli_env(), "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    script = subprocess.run(
        [sys.executable, "-m", "mtrain_cli", "--show-completion", "bash"],
        capture_output=True,
        text=True,
        env=show_env,
        timeout=60,
    )
    assert script.returncode == 0 and "_MTRAIN_COMPLETE=complete_bash" in script.stdout, script.stderr
    for words, expected in (("mtrain ex", "extend"), ("mtrain extend --dr", "--dry-run")):
        env = {**cli_env(), "_MTRAIN_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "1"}
        env["COMP_CWORD"] = str(len(words.split()) - 1)
        completed = subprocess.run([sys.executable, "-m", "mtrain_cli"], capture_output=True, text=True, env=env)
        assert completed.stdout.split() == [expected], (words, completed.stdout, completed.stderr)


def test_piped_recipes_keep_their_whole_descriptions():
    from mtrain_cli.resources import list_recipes

    env = {key: value for key, value in cli_env().items() if key != "COLUMNS"}
    result = subprocess.run(
        [sys.executable, "-m", "mtrain_cli", "recipes"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for name, description in list_recipes():
        assert any(line.split() == [name, *description.split()] for line in result.stdout.splitlines()), name
