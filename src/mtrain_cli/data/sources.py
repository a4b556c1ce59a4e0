"""Load a local text dataset (txt, jsonl/json, parquet, or a `save_to_disk` directory) as a `datasets.Dataset`.

Everything is local: nothing is fetched from a hub. jsonl/json/parquet go through `datasets`' packaged builders,
so the result is backed by cache files and later `.map` calls (tokenisation) are cached by fingerprint.
"""

from __future__ import annotations

from pathlib import Path

import datasets

from mtrain_cli.errors import UserError

_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}  # suffix -> reader
_SUPPORTED = "a local .jsonl/.json/.parquet/.txt file, a directory of them, or a save_to_disk directory"


def load_text_dataset(path: str, text_field: str = "text", split: str = "train") -> datasets.Dataset:
    """The dataset at `path` with a string column `text_field`.

    A single .txt file is ONE document; a directory of .txt files is one document per file (sorted by name).
    A `DatasetDict` saved to disk contributes its `split`.
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise UserError(f"data source {path!r} does not exist; pass {_SUPPORTED}")
    if source.is_dir() and _is_saved_dataset(source):
        ds = _load_saved(source, path, split)
    else:
        ds = _load_files(_data_files(source, path), path, text_field)
    _check_text_column(ds, path, text_field)
    return ds


def _is_saved_dataset(directory: Path) -> bool:
    return (directory / "dataset_dict.json").exists() or (directory / "state.json").exists()


def _load_saved(directory: Path, path: str, split: str) -> datasets.Dataset:
    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"split {split!r} is not in the saved dataset {path!r}; "
                            f"available splits: {sorted(loaded)}")
        return loaded[split]
    return loaded


def _data_files(source: Path, path: str) -> list[Path]:
    """The files to read: `source` itself, or the supported files under a directory (one format only)."""
    if source.is_file():
        if _kind(source) is None:
            raise UserError(f"data source {path!r} has an unsupported extension {source.suffix!r}; "
                            f"pass {_SUPPORTED}")
        return [source]
    files = sorted(f for f in source.rglob("*") if f.is_file() and _kind(f) is not None
                   and not any(part.startswith(".") for part in f.relative_to(source).parts))
    if not files:
        raise UserError(f"data source {path!r} is a directory with no .jsonl/.json/.parquet/.txt files; "
                        f"pass {_SUPPORTED}")
    kinds = {_kind(f) for f in files}
    if len(kinds) > 1:
        raise UserError(f"data source {path!r} mixes file formats ({', '.join(sorted(kinds))}); "
                        f"put one format per directory and list each directory in data.sources")
    return files


def _kind(file: Path) -> str | None:
    """The `datasets` builder for a file ("json", "parquet", "text" read by us), None when unsupported."""
    return _KINDS.get(file.suffix.lower())


def _load_files(files: list[Path], path: str, text_field: str) -> datasets.Dataset:
    kind = _kind(files[0])
    if kind == "text":
        texts = [_read_text(f, path) for f in files]
        return datasets.Dataset.from_dict({text_field: texts})
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as error:  # the builders raise many types; the user needs the one-line cause
        cause = (str(error.__cause__ or error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"data source {path!r} could not be read as {kind}: {cause}; "
                        f"fix the file or convert it") from error


def _read_text(file: Path, path: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"data source {path!r}: {str(file)!r} is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}); re-encode it as UTF-8") from error


def _check_text_column(ds: datasets.Dataset, path: str, text_field: str) -> None:
    if text_field not in ds.column_names:
        raise UserError(f"data.text_field {text_field!r} is not a column of {path!r}; "
                        f"available columns: {ds.column_names}; set data.text_field to one of them")
    feature = ds.features[text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        raise UserError(f"data.text_field {text_field!r} of {path!r} holds {feature}, not strings; "
                        f"set data.text_field to a text column (columns: {ds.column_names})")
