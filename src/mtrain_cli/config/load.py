"""Loading a config: YAML recipe -> dict -> dotted overrides -> typed tree -> paths and defaults resolved ->
validated (checks.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.config.checks import validate
from mtrain_cli.config.tree import Config
from mtrain_cli.errors import UserError
from mtrain_cli.families import FAMILIES
from mtrain_cli.resources import recipe_path, shipped_path

DEMO_RECIPE = "tiny"


def default_recipe(model: object, data: object) -> str | None:
    """The recipe of a command given no --recipe: the demo when it names neither a model nor data, else none
    (the typed defaults, the model's own shape and only the user's data: nothing of the demo is mixed in)."""
    return DEMO_RECIPE if not model and not data else None


def load_config(recipe: str | None, overrides: list[str] = ()) -> Config:
    """Resolve a recipe name or path (None: the typed defaults), apply `key=value` overrides, fill what the
    model directory decides, resolve paths and defaults, validate."""
    path = recipe_path(recipe) if recipe is not None else None
    raw = _read_recipe(path) if path is not None else {}
    for item in overrides:
        apply_override(raw, item)
    config = _build(Config, raw, prefix="")
    _resolve_paths(config, base=path.parent if path is not None else Path.cwd())
    _take_model_shape(config)
    _resolve_defaults(config)
    validate(config)
    return config


def _read_recipe(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"recipe {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise UserError(
            f"recipe {path} {_yaml_problem(exc, text)}; fix the YAML there (indent with spaces, "
            f"close brackets and quotes, quote values that contain ': ')"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"recipe {path} must be a mapping of sections (run, model, data, ...)")
    return raw


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Rebuild a saved (already resolved) config, e.g. a run directory's config.yaml."""
    config = _build(Config, raw, prefix="")
    _resolve_defaults(config)
    validate(config)
    return config


def attention_from_dict(raw: dict[str, Any]) -> AttentionConfig:
    """The `attention` section alone, coerced and checked as in a recipe (e.g. a run's, for eval)."""
    return _build(AttentionConfig, raw, prefix="attention.")


def _yaml_problem(exc: yaml.YAMLError, text: str) -> str:
    """'line 12, column 3: <problem> (<context> at line 11, column 8)' for a YAML error in `text` (1-based)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        problem = exc.problem or exc.context or "invalid YAML"
        where = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
        context = exc.context_mark
        if (
            exc.problem
            and exc.context
            and context is not None
            and (context.line, context.column) != (mark.line, mark.column)
        ):
            where += f" ({exc.context} started at line {context.line + 1}, column {context.column + 1})"
        return where
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow, by position in `text`
        before = text[: exc.position]
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        return (
            f"line {before.count(chr(10)) + 1}, column {exc.position - (before.rfind(chr(10)) + 1) + 1}: "
            f"character #x{code:02x}: {exc.reason}"
        )
    return f"is not valid YAML: {' '.join(str(exc).split())}"


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `section.key=value` override in place; the value is parsed as YAML."""
    if "=" not in item:
        raise UserError(f"--set {item!r} must look like key=value, e.g. --set train.lr=1e-5")
    key, _, text = item.partition("=")
    parts = key.strip().split(".")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        if not text.strip().startswith(("[", "{", '"', "'")):
            value = text  # plain text that YAML rejects (e.g. 'a: b: c') is the string itself
        else:  # a list, mapping or quoted string that is broken: say where, not a confusing type error later
            where = _yaml_problem(exc, text)
            where = where.replace("line 1, column", "column") if "\n" not in text else where
            fix = {"[": f"write a list as --set {key.strip()}='[a, b]'", "{": "close the braces: {key: value}"}.get(
                text.strip()[0], "close the quotes"
            )
            raise UserError(
                f"--set {key.strip()}: the value {text.strip()!r} is not valid YAML at {where}; {fix}"
            ) from None
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"--set {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{prefix.rstrip('.') or 'recipe'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            fix = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {', '.join(names)}"
            raise UserError(f"unknown config key '{prefix}{key}'; {fix}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, name: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, prefix=f"{name}.")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        if inner is bool and type(None) in args:  # an optional switch: null or `auto` decides at run time
            if value == "auto":
                return None
            if not isinstance(value, bool):
                raise UserError(f"{name} {value!r} must be true, false or auto")
        return _coerce(inner, value, name)
    if origin is Literal:
        if value not in args:
            raise UserError(f"{name} {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{name} {value!r} must be a mapping, e.g. {{rope_type: llama3, factor: 8}}")
        return dict(value)
    if origin in (list, tuple):  # tuple[X, ...]: a list in YAML, a tuple where the config must hash
        if isinstance(value, str) or (origin is tuple and isinstance(value, int) and not isinstance(value, bool)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{name} {value!r} must be a list, e.g. [a, b]")
        items = [_coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"{name} {value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise UserError(f"{name} {value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{name} {value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise UserError(f"{name} {value!r} must be a string")
        return str(value)
    raise AssertionError(f"unsupported config type {hint} for {name}")


def _resolve_paths(config: Config, base: Path) -> None:
    """Every path of a run is stored absolute, so the run resumes and evaluates from any directory. Data paths in
    recipes are relative to the recipe file, or name shipped files (data/...)."""

    def resolve(text: str) -> str:
        path = Path(text).expanduser()
        for candidate in (path, base / path, shipped_path(text)):
            if candidate is not None and candidate.exists():
                return str(candidate.resolve())
        return text  # missing: reported as given, with its field name, by inputs.py / the data loader

    config.data.sources = [resolve(p) for p in config.data.sources]
    config.data.short_sources = [resolve(p) for p in config.data.short_sources]
    m = config.model
    m.path = str(Path(m.path).expanduser().resolve()) if m.path is not None else None
    if m.tokenizer is not None:
        m.tokenizer = str(Path(m.tokenizer).expanduser().resolve())
    elif m.path is None:
        m.tokenizer = str(shipped_path("data/tokenizer"))
    config.run.output_dir = str(Path(config.run.output_dir).expanduser().resolve())


def read_model_config(path: str | Path, label: str = "--model") -> dict[str, Any] | None:
    """The config.json of model directory `path` as a dict; None where there is none (reported by the caller
    with what the directory holds); UserError where it is not JSON."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        return None
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
        raise UserError(
            f"{label} {path}: config.json is not valid JSON{where}; restore it from the model's source "
            f"(save_pretrained writes it)"
        ) from None
    if not isinstance(value, dict):
        raise UserError(f"{label} {path}: config.json holds no JSON object; restore it from the model's source")
    return value


def _take_model_shape(config: Config) -> None:
    """A model directory decides the model's shape: its config.json's values replace the fresh-model fields,
    so config.yaml records the model that is trained."""
    m = config.model
    if m.path is None or (hf := read_model_config(m.path)) is None:
        return
    missing = [key for key in _MODEL_SHAPE_REQUIRED if not isinstance(hf.get(key), int) or isinstance(hf[key], bool)]
    if missing and hf.get("model_type") in FAMILIES:  # else model/build.py names the unsupported model_type
        # transformers would fill them with its class defaults: a model of another shape
        raise UserError(
            f"--model {m.path}: config.json has no integer {', '.join(missing)}; restore config.json from the "
            f"model's source (save_pretrained writes it)"
        )
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    values = {
        "architecture": hf.get("model_type"),
        "num_key_value_heads": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
        "rope_theta": hf.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None),
        **{key: hf.get(key) for key in _MODEL_SHAPE},
    }
    for key, value in values.items():
        default = getattr(m, key)
        if key == "architecture":
            if value in FAMILIES:  # else model/build.py names the unsupported model_type
                m.architecture = value
        elif isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, (int, float)):
            continue
        elif isinstance(default, float) or isinstance(value, type(default)):
            setattr(m, key, type(default)(value))
    if isinstance(hf.get("head_dim"), int):
        m.head_dim = hf["head_dim"]
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
        m.rope_scaling = {key: value for key, value in rope.items() if key != "rope_theta"}


_MODEL_SHAPE = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
)
_MODEL_SHAPE_REQUIRED = _MODEL_SHAPE[:5]


def _resolve_defaults(config: Config) -> None:
    """Defaults that depend on other fields, stored resolved (config.yaml says what was trained)."""
    if config.run.name is None:
        config.run.name = Path(config.model.path).name if config.model.path else "run"
    if config.train.lr is None:
        config.train.lr = FINE_TUNE_LR if config.model.path else FRESH_MODEL_LR
    if config.train.warmup_steps is None:  # a short run the user did not give a warm-up still runs
        config.train.warmup_steps = min(WARMUP_STEPS, max(0, config.train.num_steps) // 10)
    if config.data.seq_len is None:
        config.data.seq_len = config.extended_context()
    if config.parallel.layout == "auto":
        config.parallel.layout = "zigzag" if config.attention.mode == "dense" else "stripe"


FRESH_MODEL_LR = 1e-3
WARMUP_STEPS = 20
FINE_TUNE_LR = 2e-5  # MTraining's rate for Qwen2.5-3B 32K -> 512K
