"""Local inputs a command reads, checked before torch, transformers and datasets are imported: a mistyped
path answers in a fraction of a second, in one line naming the option, the path, what is there instead and
the fix."""

from __future__ import annotations

from pathlib import Path

from mtrain_cli.config import Config
from mtrain_cli.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
HF_DIRECTORY = (
    "pass a local Hugging Face model directory (what save_pretrained writes: config.json, *.safetensors "
    "weights and the tokenizer files)"
)


def directory_contents(directory: Path) -> str:
    """'it is empty' or 'it holds a, b, ...': what a directory that is not what was asked for holds instead."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    if not names:
        return "it is empty"
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return f"it holds {', '.join(names[:6])}{more}"


def has_weights(directory: Path) -> bool:
    return any(
        next(directory.glob(pattern), None) is not None
        for pattern in ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin")
    )


def check_model_directory(
    path: str | Path,
    label: str = "--model",
    config: bool = True,
    tokenizer: bool = True,
    weights: bool = False,
    fix: str = HF_DIRECTORY,
) -> Path:
    """The local HF model directory at `path`, or one line naming `label`, the path, the files it lacks
    (config.json / tokenizer / weights, as asked), what it holds instead, and `fix`."""
    directory = Path(path).expanduser()
    if not directory.exists():
        raise UserError(f"{label} {path} does not exist; {fix}")
    if not directory.is_dir():
        raise UserError(f"{label} {path} is a file, not a directory; {fix}")
    missing = []
    if config and not (directory / "config.json").is_file():
        missing.append("config.json")
    if weights and not has_weights(directory):
        missing.append("weights (*.safetensors)")
    if tokenizer and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer.json / tokenizer_config.json")
    if missing:
        raise UserError(
            f"{label} {path} is not a Hugging Face model directory: it has no "
            f"{' and no '.join(missing)} ({directory_contents(directory)}); {fix}"
        )
    return directory


DATA_KINDS = "a local .jsonl/.json/.parquet/.txt file, a directory of them, or a save_to_disk directory"


def check_local_inputs(config: Config) -> None:
    """What `mtrain extend` will read exists: the model directory (if any) and every data source. The readers
    check the contents (model.py, data/sources.py)."""
    if config.model.path:
        check_model_directory(config.model.path, tokenizer=config.model.tokenizer is None, weights=True)
    for source in [*config.data.sources, *config.data.short_sources]:
        if not Path(source).expanduser().exists():
            raise UserError(f"data source {source!r} does not exist; pass {DATA_KINDS}")
