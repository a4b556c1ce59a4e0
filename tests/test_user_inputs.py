"""What a user gives is theirs and is kept as given: a model without a recipe gets the typed defaults, its own
shape and only the user's data; every path of a run is stored resolved; the documented defaults are the real
ones; bad optimizer settings, damaged model files, unusable output directories and a wandb without login are
one line each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from fixtures.eval_corpus import prose, write_tiny_model
from spawned_ranks import run_forked_cli
from tiny_setup import cli_env, only_run_dir, run_cli, set_args

from mtrain_cli.config import default_recipe, load_config
from mtrain_cli.errors import UserError
from mtrain_cli.eval.registry import parse_options

DOCS = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"


def one_line_error(result, exit_code: int = 2) -> str:
    assert result.returncode == exit_code, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write_documents(path: Path, field: str, count: int = 40) -> Path:
    with open(path, "w") as handle:
        for index in range(count):
            handle.write(json.dumps({field: prose(index, 60)}) + "\n")
    return path


SMALL = ["data.seq_len=256", "data.num_val_rows=1", "train.warmup_steps=0", "logging.every=1"]


# -- 1. a user's model needs no recipe ------------------------------------------------------------------------


def test_a_users_model_without_a_recipe_trains_on_its_own_shape_and_only_the_users_data(tmp_path):
    """No demo data (the shipped short-context mix), no demo name, description, lr or model shape."""
    model = write_tiny_model(tmp_path / "my-model", max_position_embeddings=128, rope_theta=50000.0)
    data = write_documents(tmp_path / "mine.jsonl", field="content")
    result = run_cli(
        "extend",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output-dir",
        str(tmp_path / "runs"),
        *set_args(["data.text_field=content", "train.num_steps=2", "checkpoint.export=false", *SMALL]),
    )
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp_path / "runs")
    assert run_dir.name.startswith("my-model-")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["run"]["name"] == "my-model" and saved["run"]["description"] == ""
    assert saved["data"]["sources"] == [str(data)] and saved["data"]["short_sources"] == []
    assert saved["data"]["short_fraction"] == 0.0
    assert saved["train"]["lr"] == 2e-5  # fine-tuning a given model; the demo recipe's is 5e-4
    shape = {key: saved["model"][key] for key in ("hidden_size", "num_hidden_layers", "max_position_embeddings")}
    assert shape == {"hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 128}
    assert saved["model"]["rope_theta"] == 50000.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["packing"]["num_documents"] == 40 and summary["packing"]["num_short_rows"] == 0


def test_config_yaml_records_the_model_directorys_own_shape_and_rope(tmp_path):
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    llama3["original_max_position_embeddings"] = 8192
    published = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
    published |= {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0}
    published |= {"max_position_embeddings": 131072, "rope_scaling": llama3, "tie_word_embeddings": False}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(published))
    model = load_config(None, [f"model.path={tmp_path / 'llama'}", "data.sources=[x.jsonl]"]).model
    for key, value in published.items():
        assert getattr(model, "architecture" if key == "model_type" else key) == value, key


def test_without_a_recipe_the_extended_context_is_the_default_length_and_the_documented_lr():
    fresh = load_config(None, ["data.sources=[data/corpus/long.jsonl]"])
    assert fresh.run.name == "run" and fresh.train.lr == 1e-3
    assert fresh.data.seq_len == fresh.extended_context() == 8 * fresh.model.max_position_embeddings
    assert fresh.data.short_sources == [] and fresh.data.short_fraction == 0.0


def test_bare_extend_is_the_demo_and_data_alone_is_not():
    assert default_recipe(model=None, data=[]) == "tiny"
    assert default_recipe(model=None, data=["mine.jsonl"]) is None
    assert default_recipe(model=Path("m"), data=[]) is None
    with pytest.raises(UserError, match="data.sources is empty; pass your long documents with --data"):
        load_config(None)


def _documented_defaults() -> dict[str, str]:
    """field -> default as docs/recipes.md's table writes it, where a row lists as many defaults as fields."""
    found = {}
    for line in DOCS.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        fields = re.findall(r"`([a-z_.]+)`", cells[0])
        defaults = [d.strip() for d in cells[1].split(",")]
        if len(fields) != len(defaults) or "." not in fields[0]:  # other tables (RoPE methods) name no field
            continue
        section = fields[0].split(".")[0]
        for name, default in zip(fields, defaults):
            found[name if "." in name else f"{section}.{name}"] = default
    return found


def _parse_default(text: str):
    text = text.strip("`")
    if text in ("none", "null"):
        return None
    if text in ("true", "false"):
        return text == "true"
    try:
        return yaml.safe_load(text) if not re.fullmatch(r"\d+(\.\d+)?e-?\d+", text) else float(text)
    except yaml.YAMLError:
        return text


def dry_run_config(*args: str) -> dict:
    """The resolved config `mtrain extend ... --dry-run` prints (YAML between its rule and the plan table)."""
    result = run_cli("extend", *args, "--dry-run")
    assert result.returncode == 0, result.stderr + result.stdout
    lines = result.stdout.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if "resolved config" in line) + 1 :]
    end = next(i for i, line in enumerate(lines) if line.strip() == "plan")
    return yaml.safe_load("\n".join(lines[:end]))


def test_the_documented_defaults_are_what_a_run_without_a_recipe_gets(tmp_path):
    data = write_documents(tmp_path / "mine.jsonl", field="text")
    defaults = dry_run_config("--data", str(data))
    documented = _documented_defaults()
    assert len(documented) > 50, "the table's layout changed: fix _documented_defaults"
    checked = 0
    for name, text in documented.items():
        if name.count(".") > 1:  # a field of an optional section (train.lora.*): that section is off by default
            continue
        section, key = name.split(".")
        if key not in defaults[section] or " " in text or "·" in text or name == "data.sources":  # prose, --data
            continue
        value, real = _parse_default(text), defaults[section][key]
        if real is None and value == "auto":  # an optional switch: null is `auto`
            value = None
        if name == "parallel.layout" and value == "auto":  # resolved with the config, by the attention mode
            value = {"dense": "zigzag", "sparse": "stripe"}[defaults["attention"]["mode"]]
        if real is None and value is not None:
            continue  # decided at run time, e.g. LOCAL_WORLD_SIZE
        if isinstance(real, list):
            real = real or None
        if isinstance(value, str) and real == str(Path(value).resolve()):  # a path, stored resolved
            value = real
        assert value == real, f"docs/recipes.md says {name} defaults to {text}; a run without a recipe gets {real!r}"
        checked += 1
    assert checked > 40
    assert defaults["data"]["sources"] == [str(data)] and defaults["train"]["lr"] == 1e-3  # documented in prose
    assert (
        defaults["run"]["name"] == "run"
        and defaults["data"]["seq_len"] == 8 * defaults["model"]["max_position_embeddings"]
    )


# -- 2. every path of a run is stored resolved ------------------------------------------------------------------


def test_relative_paths_are_stored_resolved_so_the_run_resumes_and_evaluates_from_elsewhere(tmp_path):
    here, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (here / "models").mkdir(parents=True)
    elsewhere.mkdir()
    write_tiny_model(here / "models" / "base", max_position_embeddings=64)
    write_documents(here / "docs.jsonl", field="text")
    overrides = [*SMALL, "train.num_steps=2", "checkpoint.every=1", "checkpoint.export=false"]
    first = run_cli(
        "extend",
        "--model",
        "models/base",
        "--data",
        "docs.jsonl",
        "--output-dir",
        "runs",
        *set_args(overrides),
        cwd=here,
    )
    assert first.returncode == 0, first.stderr + first.stdout
    run_dir = only_run_dir(here / "runs")
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["path"] == str(here / "models" / "base")
    assert saved["data"]["sources"] == [str(here / "docs.jsonl")]
    assert saved["run"]["output_dir"] == str(here / "runs")

    resumed = run_cli("extend", "--resume", str(run_dir), "--set", "train.num_steps=3", cwd=elsewhere)
    assert resumed.returncode == 0, resumed.stderr + resumed.stdout
    evaluated = run_cli(
        "eval",
        str(run_dir / "checkpoints" / "step_000003"),
        *("--suite", "infinitebench", "--tasks", "passkey", "--lengths", "256", "--samples", "1"),
        cwd=elsewhere,
    )
    assert evaluated.returncode == 0, evaluated.stderr + evaluated.stdout


def test_eval_stores_every_path_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    options = parse_options(
        model_dir=Path("model"), suite="ruler,pg19", lengths="1k", samples=1, out=Path("out"), pg19_dir=Path("books"),
        haystack_dir=Path("essays"), squad_file=Path("squad.json"), hotpot_file=Path("hotpot.json"),
    )  # fmt: skip
    for path in (options.model_dir, options.out, options.pg19_dir, options.haystack_dir, options.squad_file):
        assert path.is_absolute() and path.parent == tmp_path, path
    assert options.hotpot_file == tmp_path / "hotpot.json"


# -- 6, 7, 11. one line each ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.beta1=2", "train.beta1 2.0 must be in [0, 1)"),
        ("train.beta2=1", "train.beta2 1.0 must be in [0, 1)"),
        ("train.weight_decay=-1", "train.weight_decay -1.0 must be >= 0"),
        (
            "train.warmup_steps=20",
            "train.warmup_steps 20 must be in [0, train.num_steps=3] (warm-up is part of the run)",
        ),
    ],
)
def test_optimizer_settings_are_checked_and_say_the_fix(override, expected, tmp_path):
    steps = ["--set", "train.num_steps=3"] if "warmup" in override else []
    line = one_line_error(run_cli("extend", "--dry-run", "--set", override, *steps, "--output-dir", str(tmp_path)))
    assert expected in line
    if "warmup" in override:
        assert "--set train.warmup_steps=0" in line  # the fix, as a flag to pass


@pytest.mark.parametrize("size", [4, 1000, 100_000])
def test_a_truncated_safetensors_file_is_one_line_in_extend_and_eval(tmp_path, size):
    model = write_tiny_model(tmp_path / "model")
    weights = model / "model.safetensors"
    full = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size)
    data = write_documents(tmp_path / "docs.jsonl", field="text")
    extend = one_line_error(run_cli("extend", "--model", str(model), "--data", str(data)))
    evaluate = one_line_error(run_cli("eval", str(model), "--out", str(tmp_path / "out")))
    for line in (extend, evaluate):
        assert f"{model}: model.safetensors is truncated" in line, line
        assert "copy the model's weights again" in line
    if size > 1000:
        assert f"its tensors need {full:,}" in extend
    assert not (tmp_path / "out").exists()


def test_a_model_whose_config_json_is_not_json_is_named_not_its_tokenizer(tmp_path):
    model = write_tiny_model(tmp_path / "model")
    (model / "config.json").write_text('{"model_type": "qwen2",\n')
    data = write_documents(tmp_path / "docs.jsonl", field="text")
    for result in (
        run_cli("extend", "--model", str(model), "--data", str(data)),
        run_cli("eval", str(model), "--out", str(tmp_path / "out")),
    ):
        line = one_line_error(result)
        assert "config.json is not valid JSON (line 2, column 1" in line and "tokenizer" not in line, line


def test_a_json_data_file_of_numbers_names_the_record(tmp_path):
    (tmp_path / "list.json").write_text("[1, 2, 3]")
    line = one_line_error(run_cli("extend", "--data", str(tmp_path / "list.json"), "--output-dir", str(tmp_path)))
    assert "list.json' record 0 is a number, not an object; each document needs a 'text' string" in line
    assert "Value(" not in line


def test_eval_out_inside_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("")
    line = one_line_error(run_cli("eval", str(write_tiny_model(tmp_path / "m")), "--out", str(tmp_path / "afile/x")))
    assert f"--out {tmp_path / 'afile' / 'x'} is inside {tmp_path / 'afile'}, a file, not a directory" in line


def test_wandb_without_a_login_is_one_line_naming_the_fixes(tmp_path):
    pytest.importorskip("wandb")
    env = {**cli_env(), "HOME": str(tmp_path), "WANDB_DIR": str(tmp_path)}  # no ~/.netrc holding a key
    for variable in ("WANDB_API_KEY", "WANDB_MODE"):
        env.pop(variable, None)
    overrides = [*SMALL, "model.hidden_size=64", "model.intermediate_size=128", "model.num_hidden_layers=1"]
    overrides += ["model.max_position_embeddings=64", "context.factor=4", "train.num_steps=1", "logging.wandb=true"]
    args = ["extend", *set_args(overrides), "--output-dir", str(tmp_path / "r")]
    line = one_line_error(run_forked_cli(*args, env=env, timeout=300))
    assert "logging.wandb=true: Weights & Biases did not start" in line
    assert "wandb login" in line and "WANDB_MODE=offline" in line
    assert not any((tmp_path / "r").iterdir())  # the run stopped before its first step: its directory is gone
