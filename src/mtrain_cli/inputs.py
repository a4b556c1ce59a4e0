"""Local inputs a command reads, checked before torch, transformers and datasets are imported: a mistyped
path answers in a fraction of a second, in one line naming the option, the path, what is there instead and
the fix."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from mtrain_cli.config import Config, read_model_config
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
    if config:
        read_model_config(directory, label)  # one line if config.json is not JSON
    if weights:
        for file in sorted(directory.glob("*.safetensors")):
            problem = safetensors_problem(file)
            if problem:
                raise UserError(f"{label} {path}: {file.name} is {problem}; copy the model's weights again")
    return directory


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be read, from its header alone (cheap at any size), or None: the format is
    an 8-byte little-endian header length, a JSON header naming each tensor's byte range, then the data."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8)) if size >= 8 else (None,)
            if header_len is None or 8 + header_len > size:
                return f"truncated or not safetensors ({size:,} bytes; no complete header)"
            header = json.loads(handle.read(header_len))
    except (OSError, ValueError) as exc:
        return f"not readable as safetensors ({' '.join(str(exc).split())[:120]})"
    try:
        ends = [int(item["data_offsets"][1]) for key, item in header.items() if key != "__metadata__"]
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        return "not safetensors (its header does not list tensors' data offsets)"
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        return f"truncated ({size:,} bytes; its tensors need {needed:,})"
    return None


DATA_KINDS = "a local .jsonl/.json/.parquet/.txt file, a directory of them, or a save_to_disk directory"


def check_local_inputs(config: Config) -> None:
    """What `mtrain extend` will read exists: the model directory (if any) and every data source. The readers
    check the contents (model/build.py, data/sources.py)."""
    if config.model.path:
        check_model_directory(config.model.path, tokenizer=config.model.tokenizer is None, weights=True)
    for source in [*config.data.sources, *config.data.short_sources]:
        if not Path(source).expanduser().exists():
            raise UserError(f"data source {source!r} does not exist; pass {DATA_KINDS}")


def check_output_parent(path: str | Path, label: str, fix: str) -> None:
    """`path` is a directory, or can be made one: no file on the way and the nearest existing directory writable.
    One line naming `label`, the path, the file in the way, and `fix` otherwise."""
    path = Path(path).expanduser()
    for parent in [path, *path.parents]:
        if parent.exists():
            if not parent.is_dir():
                what = "is a file" if parent == path else f"is inside {parent}, a file"
                raise UserError(f"{label} {path} {what}, not a directory; {fix}")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise UserError(f"{label} {path}: {parent} is not writable; {fix}")
            return
