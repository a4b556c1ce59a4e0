"""Load a local dataset (txt, jsonl/json, parquet, or a `save_to_disk` directory) as a `datasets.Dataset`: documents
(a string column, `data.text_field`) or conversations (a `messages` column of role/content messages, the `datasets`
chat convention; data/chat.py renders them).

Everything is local: nothing is fetched from a hub. jsonl/json/parquet go through `datasets`' packaged builders,
so the result is backed by cache files and later `.map` calls (tokenisation) are cached by fingerprint.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import datasets

from mtrain_cli.errors import UserError
from mtrain_cli.inputs import DATA_KINDS

_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}  # suffix -> reader
_SUPPORTED = DATA_KINDS


def load_text_dataset(path: str, text_field: str = "text", split: str = "train") -> datasets.Dataset:
    """The dataset at `path` with a string column `text_field`, or with a `messages` column of conversations.

    A single .txt file is ONE document; a directory of .txt files is one document per file (sorted by name).
    A `DatasetDict` saved to disk contributes its `split`.
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise UserError(f"data source {path!r} does not exist; pass {_SUPPORTED}")
    if source.is_dir() and _is_saved_dataset(source):
        ds, files = _load_saved(source, path, split), []
    else:
        files = _data_files(source, path)
        ds = _load_files(files, path, text_field)
    if ds.num_rows == 0:
        raise UserError(f"data source {path!r} is empty (no documents); {_fill_fix(files, text_field)}")
    if MESSAGES_FIELD in ds.column_names:
        _check_conversations(ds, files, path, text_field)
        return ds
    _check_text_column(ds, files, path, text_field)
    _check_text_values(ds, files, path, text_field)
    return ds


MESSAGES_FIELD = "messages"
ROLES = ("system", "user", "assistant", "tool")
CONVERSATION_FIX = (
    'each conversation needs "messages": a list of {"role": "system"|"user"|"assistant", "content": "..."} '
    "with at least one assistant message"
)


def conversation_problem(record: dict) -> str | None:
    """Why a record's `messages` is no conversation to train on (one clause and the fix), or None."""
    messages = record.get(MESSAGES_FIELD)
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else _json_kind(messages)
        return f"has a {MESSAGES_FIELD!r} that is {what}, not a list of messages; {CONVERSATION_FIX}"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"has message {index} that is {_json_kind(message)}, not an object; {CONVERSATION_FIX}"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"has message {index} with role {role!r} (not one of {', '.join(ROLES)}); {CONVERSATION_FIX}"
        if not isinstance(content, str):
            return f"has message {index} whose 'content' is {_json_kind(content)}, not a string; {CONVERSATION_FIX}"
    if not any(message["role"] == "assistant" for message in messages):
        return f"has no assistant message (nothing to learn from); {CONVERSATION_FIX}"
    return None


def _check_conversations(ds: datasets.Dataset, files: list[Path], path: str, text_field: str) -> None:
    """Every record's `messages` is a conversation (read in batches); the first that is not is named by its file
    and line where the source is json, else by its row."""
    for begin in range(0, ds.num_rows, 1024):
        for offset, messages in enumerate(ds[begin : begin + 1024][MESSAGES_FIELD]):
            problem = conversation_problem({MESSAGES_FIELD: messages})
            if problem is None:
                continue
            located = _first_problem(files, path, text_field) if files and _kind(files[0]) == "json" else None
            raise UserError(located or f"data source {path!r} row {begin + offset} {problem}")


def _is_saved_dataset(directory: Path) -> bool:
    return (directory / "dataset_dict.json").exists() or (directory / "state.json").exists()


def _load_saved(directory: Path, path: str, split: str) -> datasets.Dataset:
    loaded = datasets.load_from_disk(str(directory))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"split {split!r} is not in the saved dataset {path!r}; available splits: {sorted(loaded)}")
        return loaded[split]
    return loaded


def _data_files(source: Path, path: str) -> list[Path]:
    """The files to read: `source` itself, or the supported files under a directory (one format only)."""
    if source.is_file():
        if _kind(source) is None:
            raise UserError(f"data source {path!r} has an unsupported extension {source.suffix!r}; pass {_SUPPORTED}")
        return [source]
    files = sorted(
        f
        for f in source.rglob("*")
        if f.is_file()
        and _kind(f) is not None
        and not any(part.startswith(".") for part in f.relative_to(source).parts)
    )
    if not files:
        raise UserError(
            f"data source {path!r} is a directory with no .jsonl/.json/.parquet/.txt files; pass {_SUPPORTED}"
        )
    kinds = {_kind(f) for f in files}
    if len(kinds) > 1:
        raise UserError(
            f"data source {path!r} mixes file formats ({', '.join(sorted(kinds))}); "
            f"put one format per directory and list each directory in data.sources"
        )
    return files


def _kind(file: Path) -> str | None:
    """The `datasets` builder for a file ("json", "parquet", "text" read by us), None when unsupported."""
    return _KINDS.get(file.suffix.lower())


def _load_files(files: list[Path], path: str, text_field: str) -> datasets.Dataset:
    kind = _kind(files[0])
    if kind == "text":
        texts = [_read_text(f, path) for f in files]
        if not any(text.strip() for text in texts):
            raise UserError(f"data source {path!r} is empty (no text); {_fill_fix(files, text_field)}")
        return datasets.Dataset.from_dict({text_field: texts})
    if kind == "parquet":  # footers only: a broken or empty file is named before the builder logs its trace
        problem = _parquet_problem(files, path)
        if problem is not None:
            raise UserError(problem)
    try:
        with _builder_errors_unlogged(kind):
            return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as error:  # the builders raise many types; the user needs the one-line cause
        problem = _first_problem(files, path, text_field)
        if problem is not None:
            raise UserError(problem) from error
        cause = (str(error.__cause__ or error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(
            f"data source {path!r} could not be read as {kind}: {cause}; fix the file or convert it"
        ) from error


@contextlib.contextmanager
def _builder_errors_unlogged(kind: str) -> Iterator[None]:
    """The json builder logs the error it then raises ("Failed to load JSON from file ..."): the user gets the one
    line below, naming the line and the fix, not that one before it."""
    logger = logging.getLogger(f"datasets.packaged_modules.{kind}.{kind}")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _where(path: str, file: Path | None) -> str:
    """How a message names a file: the data source itself, or one file inside a source directory."""
    if file is None or str(file) == path or Path(path).expanduser() == file:
        return f"data source {path!r}"
    return f"data source {path!r}: {str(file)!r}"


def _fill_fix(files: list[Path], text_field: str) -> str:
    kinds = {_kind(f) for f in files}
    if kinds == {"text"}:
        what = "UTF-8 text"
    elif kinds == {"json"}:
        what = (
            f"one JSON object per line with a {text_field!r} string"
            if files[0].suffix.lower() == ".jsonl"
            else f"a JSON list of objects with a {text_field!r} string"
        )
    else:
        what = f"rows with a {text_field!r} string column"
    return f"add documents ({what}) or remove it from data.sources"


def _not_utf8(error: UnicodeDecodeError) -> str:
    return f"byte 0x{error.object[error.start]:02x} at offset {error.start}"


def _read_text(file: Path, path: str) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(
            f"{_where(path, file)} is not UTF-8 text ({_not_utf8(error)}); re-encode it as UTF-8, "
            f"e.g. iconv -f latin1 -t utf-8"
        ) from None


def _json_kind(value: object) -> str:
    """'an object', 'a list', ... for messages about a JSON value of the wrong shape."""
    for kind, name in (
        (dict, "an object"),
        (list, "a list"),
        (str, "a string"),
        (bool, "true/false"),
        ((int, float), "a number"),
    ):
        if isinstance(value, kind):
            return name
    return "null"


def _first_problem(files: list[Path], path: str, text_field: str) -> str | None:
    """The first concrete problem in `files` (read again in Python: only when loading failed or found bad
    values), as a one-line message naming the file, the line or record, and the fix; None if none is found."""
    if _kind(files[0]) == "parquet":
        return _parquet_problem(files, path)
    if _kind(files[0]) != "json":
        return None
    found_any = False
    for file in files:
        problem, records = _json_file_problem(file, path, text_field)
        if problem is not None:
            return problem
        found_any = found_any or records > 0
    if not found_any:
        return f"data source {path!r} is empty (no documents); {_fill_fix(files, text_field)}"
    return None


def _json_file_problem(file: Path, path: str, text_field: str) -> tuple[str | None, int]:
    """(problem, number of records) of one .json/.jsonl file: a JSON document (a list of objects) or JSON
    lines (one object per line, as datasets reads both)."""
    where = _where(path, file)
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        return (f"{where} line {line} is not UTF-8 text ({_not_utf8(error)}); re-encode the file as UTF-8", 0)
    if not text.strip():
        return None, 0
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        if error.msg != "Extra data":  # a JSON document that is broken, or a first line that is
            return (
                f"{where} line {error.lineno} could not be read as json ({error.msg} at column {error.colno}); "
                f"fix or remove that line",
                0,
            )
    else:
        if isinstance(document, dict):  # one object: one record (JSON lines with a single line)
            document = [document]
        if not isinstance(document, list):
            return (f"{where} holds {_json_kind(document)}, not records; {_fill_fix([file], text_field)}", 0)
        for index, record in enumerate(document):
            problem = _record_problem(record, text_field)
            if problem is not None:
                at = "line 1" if file.suffix.lower() == ".jsonl" or len(document) == 1 else f"record {index}"
                return f"{where} {at} {problem}", len(document)
        return None, len(document)
    records = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            return (
                f"{where} line {number} could not be read as json ({error.msg} at column {error.colno}); "
                f"fix or remove that line",
                records,
            )
        problem = _record_problem(record, text_field)
        if problem is not None:
            return f"{where} line {number} {problem}", records
        records += 1
    return None, records


NOT_AN_OBJECT = "not an object"


def _record_problem(record: object, text_field: str) -> str | None:
    fix = f"each document needs a {text_field!r} string (or set data.text_field), or {MESSAGES_FIELD!r}"
    if not isinstance(record, dict):
        return f"is {_json_kind(record)}, {NOT_AN_OBJECT}; {fix}"
    if MESSAGES_FIELD in record:
        return conversation_problem(record)
    if record.get(text_field) is None:
        keys = ", ".join(map(repr, list(record)[:8])) or "none"
        return f"has no {text_field!r} field (its fields: {keys}); {fix}"
    if not isinstance(record[text_field], str):
        return f"has a {text_field!r} that is {_json_kind(record[text_field])}, not a string; {fix}"
    return None


def _parquet_problem(files: list[Path], path: str) -> str | None:
    import pyarrow.parquet as pq

    rows = 0
    for file in files:
        try:
            rows += pq.read_metadata(file).num_rows
        except Exception as error:  # pyarrow raises ArrowInvalid, OSError, ...
            cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
            return f"{_where(path, file)} could not be read as parquet ({cause}); fix the file or convert it"
    if rows == 0:
        return f"data source {path!r} is empty (no documents); {_fill_fix(files, 'text')}"
    return None


def _check_text_column(ds: datasets.Dataset, files: list[Path], path: str, text_field: str) -> None:
    if text_field not in ds.column_names:
        raise UserError(
            f"data.text_field {text_field!r} is not a column of {path!r}; "
            f"available columns: {ds.column_names}; set data.text_field to one of them"
        )
    feature = ds.features[text_field]
    if not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
        # json: name the first record whose value is no string where strings and other values are mixed, or the
        # first that is no object (`datasets` reads a list of numbers as a column named `text`)
        problem = _first_problem(files, path, text_field) if files and _kind(files[0]) == "json" else None
        if problem is not None and (not isinstance(feature, datasets.Value) or NOT_AN_OBJECT in problem):
            raise UserError(problem)
        raise UserError(
            f"data.text_field {text_field!r} of {path!r} holds {feature}, not strings; "
            f"set data.text_field to a text column (columns: {ds.column_names})"
        )


def _check_text_values(ds: datasets.Dataset, files: list[Path], path: str, text_field: str) -> None:
    """Every document has a text (no nulls: a record without the field) and the json reader's strings are
    UTF-8 (pyarrow's json reader does not check; tokenisation would fail far from the file)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = ds.data.column(text_field)
    if column.null_count:
        problem = _first_problem(files, path, text_field) if files else None
        if problem is None:
            row = pc.index(pc.is_null(column), True).as_py()
            problem = (
                f"data source {path!r}: {column.null_count} of {len(column)} documents have no "
                f"{text_field!r} (the first is row {row}); drop them or fill them in"
            )
        raise UserError(problem)
    if files and _kind(files[0]) == "json":
        try:
            ds.data.table.validate(full=True)
        except pa.ArrowInvalid as error:
            problem = _first_problem(files, path, text_field)
            raise UserError(
                problem or f"data source {path!r} holds invalid text ({error}); re-encode it as UTF-8"
            ) from None
