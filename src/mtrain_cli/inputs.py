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


def safetensors_header(file: Path) -> dict:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, data_offsets), read without its data:
    cheap at any size. The format: an 8-byte little-endian header length, the header, then the data. Raises
    ValueError naming what is wrong."""
    size = file.stat().st_size
    try:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8)) if size >= 8 else (None,)
            if header_len is None or 8 + header_len > size:
                raise ValueError(f"truncated or not safetensors ({size:,} bytes; no complete header)")
            header = json.loads(handle.read(header_len))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not readable as safetensors ({' '.join(str(exc).split())[:120]})") from None
    try:
        ends = [int(item["data_offsets"][1]) for key, item in header.items() if key != "__metadata__"]
    except (AttributeError, KeyError, TypeError, IndexError, ValueError):
        raise ValueError("not safetensors (its header does not list tensors' data offsets)") from None
    needed = 8 + header_len + max(ends, default=0)
    if size < needed:
        raise ValueError(f"truncated ({size:,} bytes; its tensors need {needed:,})")
    return {key: item for key, item in header.items() if key != "__metadata__"}


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be read, from its header alone, or None."""
    try:
        safetensors_header(file)
    except ValueError as exc:
        return str(exc)
    return None


DATA_KINDS = "a local .jsonl/.json/.parquet/.txt file, a directory of them, or a save_to_disk directory"


def check_local_inputs(config: Config, fresh_run: bool = True) -> None:
    """What `mtrain extend` (and its --dry-run) will read exists: the model directory (if any, with readable
    weights) and every data source; a fresh run's output directory can be written. The readers check the
    contents (model/build.py, data/sources.py; train/parts.py's read_inputs runs them for both)."""
    if config.model.path:
        check_model_directory(config.model.path, tokenizer=config.model.tokenizer is None, weights=True)
    for source in [*config.data.sources, *config.data.short_sources]:
        if not Path(source).expanduser().exists():
            raise UserError(f"data source {source!r} does not exist; pass {DATA_KINDS}")
    if fresh_run:
        check_output_dir(config.run.output_dir)


def check_output_dir(output_dir: str) -> None:
    """run.output_dir (--output-dir) must be a directory or creatable as one."""
    check_output_parent(
        output_dir, "run.output_dir", "pass a writable directory with --output-dir (run directories are made inside it)"
    )


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
