"""Config tree, recipes, overrides and the CLI's contract for bad input: one line, the field, exit code 2."""

from __future__ import annotations

import pytest
from tiny_setup import run_cli

from mtrain_cli.config import Config, default_recipe, load_config, to_yaml
from mtrain_cli.errors import UserError
from mtrain_cli.resources import list_recipes


def error_line(overrides: list[str], recipe: str | None = "tiny") -> str:
    with pytest.raises(UserError) as excinfo:
        load_config(recipe, overrides)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_tiny_recipe_is_the_default_and_resolves_shipped_paths():
    config = load_config(default_recipe(model=None, data=[]))
    assert isinstance(config, Config)
    assert config.run.name == "tiny" and config.model.architecture == "qwen2"
    assert config.context.method == "yarn" and config.context.factor == 8.0
    assert config.extended_context() == 2048 == config.data.seq_len
    assert [p.split("/")[-3:] for p in config.data.sources] == [
        ["data", "corpus", "passkey_long.jsonl"],
        ["data", "corpus", "long.jsonl"],
    ]
    assert config.model.tokenizer.endswith("data/tokenizer")


def test_overrides_are_typed_and_win_over_the_recipe():
    config = load_config(
        "tiny",
        [
            "train.lr=1e-5",
            "train.num_steps=7",
            "train.warmup_steps=0",
            "context.factor=16",
            "train.schedule=constant",
            "logging.wandb=true",
            "data.sources=[a.jsonl, b.jsonl]",
            "train.grad_clip=0",
        ],
    )
    assert config.train.lr == 1e-5 and isinstance(config.train.lr, float)
    assert config.train.num_steps == 7 and config.context.factor == 16.0
    assert config.train.schedule == "constant" and config.logging.wandb is True
    assert [p.split("/")[-1] for p in config.data.sources] == ["a.jsonl", "b.jsonl"]
    assert config.extended_context() == 256 * 16


@pytest.mark.parametrize(
    "overrides, layout",
    [
        ([], "zigzag"),  # dense attention: zigzag, whose one-document chunk pairs run cuDNN
        (["attention.mode=sparse"], "stripe"),  # sparse: stripe balances sparse work
        (["parallel.layout=stripe"], "stripe"),  # an explicit choice is kept (the trainer warns on dense)
        (["attention.mode=sparse", "parallel.layout=zigzag"], "zigzag"),
    ],
)
def test_layout_auto_resolves_by_attention_mode_and_keeps_an_explicit_choice(overrides, layout):
    config = load_config("tiny", ["parallel.cp=2", *overrides])
    assert config.parallel.layout == layout
    assert load_config("qwen2.5-3b-512k", ["attention.mode=dense"]).parallel.layout == "zigzag"


def test_resolved_config_round_trips_through_yaml(tmp_path):
    config = load_config("tiny", ["train.lr=3e-4"])
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(config))
    assert load_config(str(saved)) == config


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["train.lrr=1e-5"], "unknown config key 'train.lrr'; did you mean 'train.lr'?"),
        (["trian.lr=1e-5"], "unknown config key 'trian'"),
        (["train.lr=fast"], "train.lr 'fast' must be a number"),
        (["train.num_steps=1.5"], "train.num_steps 1.5 must be an integer"),
        (["train.schedule=linear"], "train.schedule 'linear' is not one of cosine, constant"),
        (["train.activation_checkpointing=maybe"], "train.activation_checkpointing 'maybe' must be true or false"),
        (["train.num_steps=0"], "train.num_steps 0 must be > 0"),
        (["train.warmup_steps=400"], "train.warmup_steps 400 must be in [0, train.num_steps=300]"),
        (["data.seq_len=4096"], "data.seq_len 4096 exceeds the extended context 2048"),
        (["context.factor=1"], "context.factor 1.0 must be > 1"),
        (["context.method=theta"], "context.rope_theta is required when context.method=theta"),
        (["model.num_attention_heads=3"], "model.hidden_size 128 must be divisible by model.num_attention_heads 3"),
        (["model.num_key_value_heads=3"], "model.num_attention_heads 4 must be a multiple of"),
        (["data.short_fraction=1.5"], "data.short_fraction 1.5 must be in [0, 1)"),
        (
            ["parallel.cp=3"],
            "data.seq_len 2048 must be divisible by 2×cp×block = 192 for the zigzag layout; use data.seq_len=2112",
        ),
        (
            ["parallel.cp=3", "attention.mode=sparse"],
            "data.seq_len 2048 must be divisible by cp×block = 96 for the stripe layout; use data.seq_len=2112",
        ),
        (["parallel.hierarchical=true"], "parallel.hierarchical needs parallel.cp > 1"),
        (["train.lr"], "--set 'train.lr' must look like key=value"),
        (["train.lr.x=1"], "--set train.lr.x: 'lr' is a value, not a section"),
    ],
)
def test_bad_values_name_the_field_the_value_and_the_fix(overrides, expected):
    assert expected in error_line(overrides)


def test_unknown_recipe_lists_the_shipped_ones():
    message = error_line([], recipe="nope")
    assert "nope" in message and "tiny" in message


def test_every_shipped_recipe_loads_and_has_a_description():
    recipes = dict(list_recipes())
    assert "tiny" in recipes
    for name, description in recipes.items():
        assert description, f"recipe {name} has no run.description"
        load_config(name)


# -- through the real console script ---------------------------------------------------------------------------


def test_help_lists_the_commands():
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("extend", "recipes", "env"):
        assert command in result.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["extend", "--set", "train.lrr=1"], "unknown config key 'train.lrr'"),
        (["extend", "--set", "train.lr=fast"], "train.lr 'fast' must be a number"),
        (["extend", "--recipe", "missing.yaml"], "missing.yaml"),
        (["extend", "--model", "/nonexistent/model"], "/nonexistent/model"),
        (["extend", "--data", "/nonexistent/long.jsonl"], "/nonexistent/long.jsonl"),
        (["extend", "--resume", "/nonexistent/run"], "--resume /nonexistent/run"),
    ],
)
def test_cli_bad_input_is_one_line_with_exit_code_2(args, expected, tmp_path):
    result = run_cli(*args, "--output-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_dry_run_prints_the_plan_without_training(tmp_path):
    result = run_cli("extend", "--dry-run", "--set", "context.factor=16", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "factor 16" in out and "256 → 4,096 tokens" in out
    assert "YaRN attention factor" in out and f"{0.1 * __import__('math').log(16) + 1:.4f}" in out
    assert "interpolated" in out and "memory per GPU" in out and "tokens per step" in out
    assert not any(tmp_path.iterdir()), "a dry run must not create a run directory"


def test_recipes_and_env_commands():
    recipes = run_cli("recipes")
    assert recipes.returncode == 0 and "tiny" in recipes.stdout
    env = run_cli("env")
    assert env.returncode == 0 and "torch" in env.stdout and "transformers" in env.stdout
