"""The typed recipe tree: YAML recipes + dotted overrides -> one validated `Config`.

A recipe is YAML whose keys mirror the dataclasses below. Overrides use dotted paths
(`--set train.lr=1e-5`, values parsed as YAML). Every bad input is a `UserError` whose one line
names the field, the value and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.errors import UserError
from mtrain_cli.resources import recipe_path, shipped_path


@dataclass
class RunConfig:
    name: str | None = None  # default: the model directory's name (--model), else "run"
    description: str = ""
    output_dir: str = "runs"  # each run writes to <output_dir>/<name>-<timestamp>/
    seed: int = 0


@dataclass
class ModelConfig:
    # A local HF model directory, or None for a fresh model built from the fields below. With a directory the
    # fields below are read from its config.json (the model decides its shape; config.yaml records it).
    path: str | None = None
    tokenizer: str | None = None  # local tokenizer directory; default: `path`, else the shipped tokenizer
    architecture: Literal["qwen2", "llama", "qwen3", "mistral"] = "qwen2"
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size / num_attention_heads (Qwen3 sets its own)
    max_position_embeddings: int = 256  # the context the fresh model is "pretrained" for
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # a config.json's rope_scaling (e.g. Llama 3.1's llama3); None: plain
    tie_word_embeddings: bool = True


@dataclass
class ContextConfig:
    method: Literal["yarn", "llama3", "theta", "none"] = "yarn"  # rope.py: what each does from each starting RoPE
    factor: float = 8.0
    original_max_position_embeddings: int | None = None  # default: the model's max_position_embeddings
    rope_theta: float | None = None  # yarn, llama3: keep the model's theta when None; theta: the new base (required)
    beta_fast: float | None = None  # None: 32, or the model's own (llama3: high_freq_factor; yarn: beta_fast)
    beta_slow: float | None = None  # None: 1, or the model's own (llama3: low_freq_factor; yarn: beta_slow)
    attention_factor: float | None = None  # None: YaRN's default 0.1 * ln(factor) + 1


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=list)  # required: the user's documents (--data)
    text_field: str = "text"
    seq_len: int | None = None  # default: the extended context (context.factor × the model's context)
    short_sources: list[str] = field(default_factory=list)
    short_fraction: float = 0.0  # share of packed rows made of short-context documents
    packing: Literal["concat", "best_fit"] = "concat"  # best_fit never cuts a document of up to seq_len tokens
    num_val_rows: int = 4  # packed rows held out for validation loss
    num_proc: int = 1  # tokenisation workers (datasets.map)


@dataclass
class ParallelConfig:
    cp: int = 1  # context-parallel ranks per sequence
    dp: int = 1  # data-parallel (FSDP) ranks
    # token layout over the cp ranks; auto: stripe for sparse attention (balances sparse work), zigzag for dense
    # (balances causal work, and its one-document chunk pairs run cuDNN: ring/plain_pairs.py)
    layout: Literal["auto", "stripe", "zigzag"] = "auto"
    hierarchical: bool = False  # inner ring within a node, outer ring across nodes
    node_size: int | None = None  # ranks per node for the hierarchical ring; default LOCAL_WORLD_SIZE


@dataclass
class TrainConfig:
    num_steps: int = 300
    batch_size: int = 1  # sequences per micro-batch
    grad_accum: int = 1
    lr: float | None = None  # default: 2e-5 for a model directory (fine-tuning), 1e-3 for a fresh model
    min_lr_ratio: float = 0.1
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    activation_checkpointing: bool = False
    compile: bool | None = None  # torch.compile each decoder layer; None (`auto`): on when training on CUDA
    loss_chunk_size: int = 1024  # tokens per cross-entropy chunk; full logits are never materialised
    eval_every: int = 100
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class CheckpointConfig:
    every: int = 100
    keep_last: int = 2
    export: bool = True  # write a Hugging Face directory at the end


@dataclass
class LoggingConfig:
    every: int = 10
    wandb: bool = False
    wandb_project: str = "mtrain"


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def extended_context(self) -> int:
        """Context length after the extension recipe (the model's new max_position_embeddings)."""
        original = self.context.original_max_position_embeddings or self.model.max_position_embeddings
        return original if self.context.method == "none" else round(self.context.factor * original)

    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.train.grad_accum * self.data.seq_len * self.parallel.dp


# ---------------------------------------------------------------------------------------------
# Loading: YAML -> dict -> overrides -> typed tree -> validation


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
    if origin is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise UserError(f"{name} {value!r} must be a list, e.g. [a, b]")
        return [_coerce(args[0], v, f"{name}[{i}]") for i, v in enumerate(value)]
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
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    values = {
        "architecture": hf.get("model_type"),
        "num_key_value_heads": hf.get("num_key_value_heads", hf.get("num_attention_heads")),
        "rope_theta": hf.get("rope_theta", rope.get("rope_theta") if isinstance(rope, dict) else None),
        **{key: hf.get(key) for key in _MODEL_SHAPE},
    }
    architectures = typing.get_args(typing.get_type_hints(ModelConfig)["architecture"])
    for key, value in values.items():
        default = getattr(m, key)
        if key == "architecture":
            if value in architectures:  # else model.py names the unsupported model_type
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


def _resolve_defaults(config: Config) -> None:
    """Defaults that depend on other fields, stored resolved (config.yaml says what was trained)."""
    if config.run.name is None:
        config.run.name = Path(config.model.path).name if config.model.path else "run"
    if config.train.lr is None:
        config.train.lr = FINE_TUNE_LR if config.model.path else FRESH_MODEL_LR
    if config.data.seq_len is None:
        config.data.seq_len = config.extended_context()
    if config.parallel.layout == "auto":
        config.parallel.layout = "zigzag" if config.attention.mode == "dense" else "stripe"


FRESH_MODEL_LR = 1e-3
FINE_TUNE_LR = 2e-5  # MTraining's rate for Qwen2.5-3B 32K -> 512K


def validate(config: Config) -> None:
    """Cross-field checks; each failure is one line with the field, the value and the fix."""
    m, c, d, t, ck, p = config.model, config.context, config.data, config.train, config.checkpoint, config.parallel
    _positive(
        config,
        [
            "model.hidden_size",
            "model.intermediate_size",
            "model.num_hidden_layers",
            "model.num_attention_heads",
            "model.num_key_value_heads",
            "model.max_position_embeddings",
            "data.seq_len",
            "data.num_proc",
            "train.num_steps",
            "train.batch_size",
            "train.grad_accum",
            "train.lr",
            "train.loss_chunk_size",
            "train.eval_every",
            "checkpoint.every",
            "checkpoint.keep_last",
            "logging.every",
            "parallel.cp",
            "parallel.dp",
        ],
    )
    if m.path is None:
        if m.head_dim is not None and (m.head_dim <= 0 or m.head_dim % 2):
            raise UserError(f"model.head_dim {m.head_dim} must be a positive even number (RoPE rotates pairs)")
        if m.head_dim is None and m.hidden_size % m.num_attention_heads:
            raise UserError(
                f"model.hidden_size {m.hidden_size} must be divisible by model.num_attention_heads "
                f"{m.num_attention_heads}"
            )
        if m.num_attention_heads % m.num_key_value_heads:
            raise UserError(
                f"model.num_attention_heads {m.num_attention_heads} must be a multiple of "
                f"model.num_key_value_heads {m.num_key_value_heads}"
            )
    if c.method != "none" and c.factor <= 1.0:
        raise UserError(f"context.factor {c.factor} must be > 1 to extend the context (or set context.method=none)")
    if c.method == "theta" and c.rope_theta is None:
        raise UserError("context.rope_theta is required when context.method=theta, e.g. --set context.rope_theta=1e6")
    if c.beta_fast is not None and c.beta_slow is not None and c.beta_fast <= c.beta_slow:
        raise UserError(f"context.beta_fast {c.beta_fast} must be greater than context.beta_slow {c.beta_slow}")
    if m.path is None and d.seq_len > config.extended_context():
        raise UserError(
            f"data.seq_len {d.seq_len} exceeds the extended context {config.extended_context()} "
            f"(context.factor × original); raise context.factor or lower data.seq_len"
        )
    if not d.sources:
        raise UserError(
            "data.sources is empty; pass your long documents with --data PATH (a local .jsonl/.parquet/.txt "
            "file or dataset directory; repeatable), or list them in the recipe"
        )
    if not 0.0 <= d.short_fraction < 1.0:
        raise UserError(f"data.short_fraction {d.short_fraction} must be in [0, 1)")
    if d.short_fraction > 0 and not d.short_sources:
        raise UserError(f"data.short_fraction {d.short_fraction} needs data.short_sources (local short documents)")
    if d.num_val_rows < 0:
        raise UserError(f"data.num_val_rows {d.num_val_rows} must be >= 0")
    if not 0 <= t.warmup_steps <= t.num_steps:
        raise UserError(
            f"train.warmup_steps {t.warmup_steps} must be in [0, train.num_steps={t.num_steps}] (warm-up is part "
            f"of the run); set it too, e.g. --set train.warmup_steps={min(max(t.warmup_steps, 0), t.num_steps // 10)}"
        )
    for name, value in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
        if not 0.0 <= value < 1.0:
            raise UserError(f"{name} {value} must be in [0, 1) (AdamW's moment decay; the defaults are 0.9, 0.95)")
    if t.weight_decay < 0:
        raise UserError(f"train.weight_decay {t.weight_decay} must be >= 0 (0 turns decay off)")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise UserError(f"train.min_lr_ratio {t.min_lr_ratio} must be in [0, 1]")
    if t.grad_clip < 0:
        raise UserError(f"train.grad_clip {t.grad_clip} must be >= 0 (0 disables clipping)")
    if ck.keep_last < 1:
        raise UserError(f"checkpoint.keep_last {ck.keep_last} must be >= 1")
    _validate_parallel(p, d.seq_len, config.attention.block_size)


def check_launch(p: ParallelConfig, world: int, node_size: int, nproc_flag: bool = False) -> None:
    """The mesh against the launch, in one place: dp × cp processes, and a hierarchical ring's nodes of
    `node_size` ranks (parallel.node_size, else the launcher's ranks per node). nproc_flag: checked by
    `--nproc N` before it launches (world = N), so that it is said once rather than by every rank."""
    if p.dp * p.cp != world:
        if nproc_flag:
            raise UserError(
                f"--nproc {world}: parallel.dp {p.dp} × parallel.cp {p.cp} = {p.dp * p.cp}; set "
                f"parallel.dp={max(1, world // p.cp)} (and parallel.cp) so that dp × cp = {world}"
            )
        hint = (
            f"launch {p.dp * p.cp} processes (mtrain extend --nproc {p.dp * p.cp}, or torchrun --nproc-per-node "
            f"{p.dp * p.cp})"
            if world == 1
            else f"set parallel.dp={max(1, world // p.cp)}"
        )
        raise UserError(
            f"parallel.dp {p.dp} × parallel.cp {p.cp} = {p.dp * p.cp} does not match the {world} "
            f"launched process(es); {hint}"
        )
    if p.hierarchical and (p.cp % node_size or node_size >= p.cp):
        field = f"parallel.node_size {node_size}" if p.node_size is not None else f"the node size {node_size}"
        raise UserError(f"{field} must divide parallel.cp {p.cp} into 2 or more nodes; set parallel.node_size")


def _validate_parallel(p: ParallelConfig, seq_len: int, block: int) -> None:
    if p.node_size is not None and p.node_size < 1:
        raise UserError(f"parallel.node_size {p.node_size} must be >= 1")
    if p.hierarchical:
        if p.cp == 1:
            raise UserError("parallel.hierarchical needs parallel.cp > 1 (a ring to split into nodes)")
        if p.node_size is not None:
            check_launch(p, p.dp * p.cp, p.node_size)
    elif p.node_size is not None:
        raise UserError(f"parallel.node_size {p.node_size} is only used with parallel.hierarchical=true")
    if p.cp > 1:
        unit = p.cp * block * (2 if p.layout == "zigzag" else 1)
        if seq_len % unit:
            raise UserError(
                f"data.seq_len {seq_len} must be divisible by "
                f"{'2×' if p.layout == 'zigzag' else ''}cp×block = {unit} for the {p.layout} layout; "
                f"use data.seq_len={-(-seq_len // unit) * unit}"
            )


def _positive(config: Config, names: list[str]) -> None:
    for name in names:
        section, key = name.split(".")
        value = getattr(getattr(config, section), key)
        if value <= 0:
            raise UserError(f"{name} {value} must be > 0")


def to_yaml(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
