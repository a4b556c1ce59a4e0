"""Issue 21: bad input files are one line naming the option or field, the file, what is wrong and the fix
(exit code 2, no traceback): non-UTF-8 or wrongly shaped eval files, a missing or empty --model directory,
empty or broken data sources, YAML errors with their line and column."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_setup import error_line, run_cli

from mtrain_cli.config import load_config
from mtrain_cli.data import load_text_dataset
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.resources import shipped_path

NOT_UTF8 = b'{"text": "caf\xe9"}'  # latin-1 e-acute: byte 0xe9 at offset 13


def user_error(function, *args, **kwargs) -> str:
    with pytest.raises(UserError) as excinfo:
        function(*args, **kwargs)
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# -- 1. mtrain eval: data files that are not UTF-8 or not in the expected layout -------------------------------
# Data files are read before the model loads, so MODEL need not exist for these.


def _squad(tmp_path: Path, content: bytes | object) -> tuple[list[str], Path]:
    path = tmp_path / "squad.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return ["--suite", "ruler", "--squad-file", str(path)], path


def _hotpot(tmp_path: Path, content: bytes | object) -> tuple[list[str], Path]:
    path = tmp_path / "hotpot.json"
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return ["--suite", "ruler", "--hotpot-file", str(path)], path


def _pg19_txt(tmp_path: Path) -> tuple[list[str], Path]:
    (tmp_path / "pg19").mkdir()
    path = tmp_path / "pg19" / "book.txt"
    path.write_bytes(b"It was a dark and stormy night; the caf\xe9 was shut.")
    return ["--suite", "pg19", "--pg19-dir", str(tmp_path / "pg19")], path


def _pg19_jsonl(tmp_path: Path) -> tuple[list[str], Path]:
    path = tmp_path / "books.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + NOT_UTF8 + b"\n")
    return ["--suite", "pg19", "--pg19-dir", str(path)], path


def _haystack(tmp_path: Path) -> tuple[list[str], Path]:
    (tmp_path / "essays").mkdir()
    path = tmp_path / "essays" / "essay.txt"
    path.write_bytes(b"An essay about the caf\xe9.")
    return ["--suite", "niah", "--haystack-dir", str(tmp_path / "essays")], path


def _infinitebench(tmp_path: Path, line: bytes) -> tuple[list[str], Path]:
    (tmp_path / "ib").mkdir()
    path = tmp_path / "ib" / "longbook_qa_eng.jsonl"
    path.write_bytes(b'{"id": 0, "context": "c", "input": "q", "answer": ["a"]}\n' + line + b"\n")
    return ["--suite", "infinitebench", "--infinitebench-dir", str(tmp_path / "ib")], path


EVAL_CASES = {
    "squad not utf-8": (
        lambda t: _squad(t, b'{"data": []}  \xff'),
        ["--squad-file '{path}' is not UTF-8 text (byte 0xff at offset 14)", "pass the SQuAD v2.0 dev JSON"],
    ),
    "squad is a list": (
        lambda t: _squad(t, [{"paragraphs": []}]),
        [
            "--squad-file '{path}' has no 'data' list (the file holds a list)",
            'SQuAD v2.0\'s {"data": [{"paragraphs": ',
            "pass the SQuAD v2.0 dev JSON",
        ],
    ),
    "squad without context": (
        lambda t: _squad(t, {"data": [{"paragraphs": [{"qas": []}]}]}),
        [
            "--squad-file '{path}': data[0].paragraphs[0] has no 'context'",
            "expected SQuAD v2.0's",
            "pass the SQuAD v2.0 dev JSON",
        ],
    ),
    "squad article not an object": (
        lambda t: _squad(t, {"data": [1]}),
        ["--squad-file '{path}': data[0] is a number, not an object"],
    ),
    "squad broken json": (
        lambda t: _squad(t, b'{"data": [\n  {"paragraphs": }\n]}'),
        ["--squad-file '{path}' is not valid json (Expecting value, line 2, column 18)"],
    ),
    "hotpot not utf-8": (
        lambda t: _hotpot(t, b"[\xff]"),
        ["--hotpot-file '{path}' is not UTF-8 text (byte 0xff at offset 1)", "pass the HotpotQA dev JSON"],
    ),
    "hotpot is an object": (
        lambda t: _hotpot(t, {"data": []}),
        [
            "--hotpot-file '{path}' is not HotpotQA json (the file holds an object, not a list)",
            "pass the HotpotQA dev JSON",
        ],
    ),
    "hotpot without answer": (
        lambda t: _hotpot(t, [{"question": "q", "context": []}]),
        ["--hotpot-file '{path}': entry [0] has no 'answer'", "expected HotpotQA's"],
    ),
    "pg19 txt not utf-8": (
        _pg19_txt,
        ["--pg19-dir: {path} is not UTF-8 text (byte 0xe9 at offset 39)", "UTF-8 .txt files"],
    ),
    "pg19 jsonl not utf-8": (_pg19_jsonl, ["--pg19-dir: {path} line 2 is not UTF-8 text (byte 0xe9 at offset 30)"]),
    "haystack not utf-8": (
        _haystack,
        ["--haystack-dir: {path} is not UTF-8 text (byte 0xe9 at offset 22)", "re-encode it as UTF-8"],
    ),
    "infinitebench not utf-8": (
        lambda t: _infinitebench(t, NOT_UTF8),
        [
            "--infinitebench-dir: {path} line 2 is not UTF-8 text (byte 0xe9 at offset 70)",
            "pass the official <task>.jsonl files",
        ],
    ),
    "infinitebench line not an object": (
        lambda t: _infinitebench(t, b'["a list"]'),
        ["--infinitebench-dir: {path} line 2 is a list, not an object"],
    ),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_data_files_that_are_not_utf8_or_misshapen_are_one_line(case, tmp_path):
    write, expected = EVAL_CASES[case]
    args, path = write(tmp_path)
    line = error_line(run_cli("eval", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"), *args))
    for part in expected:
        assert part.replace("{path}", str(path)) in line, line
    assert not (tmp_path / "out").exists()


# -- 2. --model: missing, empty, or lacking files -----------------------------------------------------------------


def test_extend_missing_model_directory(tmp_path):
    line = error_line(run_cli("extend", "--model", str(tmp_path / "nope"), "--dry-run"))
    assert line == (
        f"error: --model {tmp_path / 'nope'} does not exist; pass a local Hugging Face model directory "
        f"(what save_pretrained writes: config.json, *.safetensors weights and the tokenizer files)"
    )


def test_extend_empty_model_directory_names_the_missing_files(tmp_path):
    (tmp_path / "empty").mkdir()
    line = error_line(run_cli("extend", "--model", str(tmp_path / "empty"), "--dry-run"))
    assert line.startswith(
        f"error: --model {tmp_path / 'empty'} is not a Hugging Face model directory: it has no "
        f"config.json (it is empty); pass a local Hugging Face model directory (what save_pretrained writes"
    )
    assert "model.tokenizer" not in line and "Couldn't instantiate" not in line


def _model_dir(tmp_path: Path, config: bool, tokenizer: bool) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    if config:
        from transformers import Qwen2Config

        Qwen2Config(
            vocab_size=512,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=256,
        ).save_pretrained(directory)
    if tokenizer:
        for file in shipped_path("data/tokenizer").iterdir():
            shutil.copy(file, directory)
    return directory


@pytest.mark.parametrize(
    "config, tokenizer, missing",
    [
        (True, False, "it has no tokenizer.json / tokenizer_config.json (it holds config.json)"),
        (False, True, "it has no config.json (it holds tokenizer.json, tokenizer_config.json)"),
    ],
)
def test_model_directory_without_config_or_tokenizer_is_named_before_the_tokenizer_loads(
    tmp_path, config, tokenizer, missing
):
    directory = _model_dir(tmp_path, config, tokenizer)
    message = user_error(load_tokenizer, load_config("tiny", [f"model.path={directory}"]))
    assert message.startswith(
        f"--model {directory} is not a Hugging Face model directory: {missing}; pass a local "
        f"Hugging Face model directory"
    ), message


def test_model_directory_without_weights_is_named_before_from_pretrained(tmp_path):
    directory = _model_dir(tmp_path, config=True, tokenizer=True)
    config = load_config("tiny", [f"model.path={directory}"])
    tokenizer = load_tokenizer(config)
    message = user_error(build_model, config, tokenizer, torch.device("cpu"))
    assert message.startswith(
        f"--model {directory} is not a Hugging Face model directory: it has no weights "
        f"(*.safetensors) (it holds config.json, "
    ), message


def test_eval_missing_or_empty_model_directory(tmp_path):
    line = error_line(run_cli("eval", str(tmp_path / "nope"), "--suite", "pg19", "--out", str(tmp_path / "out")))
    assert line.startswith(
        f"error: MODEL {tmp_path / 'nope'} does not exist; pass a local Hugging Face model directory"
    ), line
    (tmp_path / "empty").mkdir()
    line = error_line(run_cli("eval", str(tmp_path / "empty"), "--suite", "pg19", "--out", str(tmp_path / "out")))
    assert "it has no config.json" in line and "(it is empty)" in line, line


# -- 3. data sources: empty files, missing text, bad lines, every format ------------------------------------------


def _write(path: Path, content: bytes | str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def _parquet(path: Path, table: pa.Table) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


DATA_CASES = {
    "empty jsonl": (
        lambda t: _write(t / "x.jsonl", ""),
        "data source '{path}' is empty (no documents); add documents (one JSON object per line with a "
        "'text' string) or remove it from data.sources",
    ),
    "blank-line jsonl": (lambda t: _write(t / "x.jsonl", "\n\n  \n"), "data source '{path}' is empty (no documents)"),
    "empty json": (
        lambda t: _write(t / "x.json", ""),
        "data source '{path}' is empty (no documents); add documents (a JSON list of objects",
    ),
    "empty json list": (lambda t: _write(t / "x.json", "[]"), "data source '{path}' is empty (no documents)"),
    "empty parquet": (
        lambda t: _parquet(t / "x.parquet", pa.table({"text": pa.array([], pa.string())})),
        "data source '{path}' is empty (no documents); add documents (rows with a 'text' string column)",
    ),
    "broken parquet": (
        lambda t: _write(t / "x.parquet", b"PAR1 not really"),
        "data source '{path}' could not be read as parquet (Parquet magic bytes not found",
    ),
    "empty txt": (
        lambda t: _write(t / "x.txt", ""),
        "data source '{path}' is empty (no text); add documents (UTF-8 text) or remove it from data.sources",
    ),
    "directory of empty jsonl": (
        lambda t: _write(t / "d" / "a.jsonl", "").parent,
        "data source '{path}' is empty (no documents)",
    ),
    "directory without data files": (
        lambda t: _write(t / "d" / "notes.md", "x").parent,
        "data source '{path}' is a directory with no .jsonl/.json/.parquet/.txt files",
    ),
    "jsonl without the text field": (
        lambda t: _write(t / "x.jsonl", '{"body": "a"}\n'),
        "data.text_field 'text' is not a column of '{path}'; available columns: "
        "['body']; set data.text_field to one of them",
    ),
    "jsonl with one record lacking text": (
        lambda t: _write(t / "x.jsonl", '{"text": "a"}\n\n{"body": "b"}\n'),
        "data source '{path}' line 3 has no 'text' field (its fields: 'body'); "
        "each document needs a 'text' string (or set data.text_field)",
    ),
    "jsonl with a bad line": (
        lambda t: _write(t / "x.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": \n'),
        "data source '{path}' line 3 could not be read as json (Expecting value at column 10); fix or remove that line",
    ),
    "jsonl with a list line": (
        lambda t: _write(t / "x.jsonl", '{"text": "a"}\n["b"]\n'),
        "data source '{path}' line 2 is a list, not an object",
    ),
    "jsonl with a number text": (
        lambda t: _write(t / "x.jsonl", '{"text": "a"}\n{"text": 5}\n'),
        "data source '{path}' line 2 has a 'text' that is a number, not a string",
    ),
    "jsonl not utf-8": (
        lambda t: _write(t / "x.jsonl", b'{"text": "a"}\n' + NOT_UTF8 + b"\n"),
        "data source '{path}' line 2 is not UTF-8 text (byte 0xe9 at offset 27); re-encode the file as UTF-8",
    ),
    "txt not utf-8": (
        lambda t: _write(t / "x.txt", b"caf\xe9"),
        "data source '{path}' is not UTF-8 text (byte 0xe9 at offset 3); re-encode it as UTF-8",
    ),
    "parquet with a null text": (
        lambda t: _parquet(t / "x.parquet", pa.table({"text": ["a", None]})),
        "data source '{path}': 1 of 2 documents have no 'text' (the first is row 1)",
    ),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_data_source_problems_name_the_file_the_line_and_the_fix(case, tmp_path):
    write, expected = DATA_CASES[case]
    path = str(write(tmp_path))
    message = user_error(load_text_dataset, path)
    assert expected.replace("{path}", path) in message, message


def test_extend_with_an_empty_jsonl_is_one_line(tmp_path):
    data = _write(tmp_path / "x.jsonl", "")
    line = error_line(run_cli("extend", "--data", str(data), "--output-dir", str(tmp_path / "runs")))
    assert line == (
        f"error: data source '{data}' is empty (no documents); add documents (one JSON object per line "
        f"with a 'text' string) or remove it from data.sources"
    )


# -- 4. YAML errors keep their line and column -------------------------------------------------------------------


def test_recipe_yaml_error_names_line_and_column(tmp_path):
    recipe = _write(tmp_path / "x.yaml", "run:\n  name: x\n  tags: [a, b\ntrain:\n  lr: 1.0e-4\n")
    line = error_line(run_cli("extend", "--recipe", str(recipe), "--dry-run"))
    assert line.startswith(
        f"error: recipe {recipe} line 4, column 6: expected ',' or ']', but got ':' (while "
        f"parsing a flow sequence started at line 3, column 9); fix the YAML there"
    ), line


@pytest.mark.parametrize(
    "text, expected",
    [
        ("run:\n  name: x\n\tseed: 1\n", "line 3, column 1: found character '\\t' that cannot start any token"),
        (
            "run:\n  name: 'x\n",
            "line 3, column 1: found unexpected end of stream (while scanning a quoted scalar "
            "started at line 2, column 9)",
        ),
        ('run:\n  name: "a\x01"\n', "line 2, column 11: character #x01: special characters are not allowed"),
    ],
)
def test_recipe_yaml_problems(text, expected, tmp_path):
    recipe = _write(tmp_path / "x.yaml", text)
    assert f"recipe {recipe} {expected}" in user_error(load_config, str(recipe))


def test_recipe_that_is_not_utf8(tmp_path):
    recipe = _write(tmp_path / "x.yaml", b"run:\n  name: caf\xe9\n")
    assert user_error(load_config, str(recipe)) == (
        f"recipe {recipe} is not UTF-8 text (byte 0xe9 at offset 16); save it as UTF-8"
    )


def test_set_value_yaml_error_names_the_column():
    assert user_error(load_config, None, ["data.sources=[a.jsonl, b.jsonl"]) == (
        "--set data.sources: the value '[a.jsonl, b.jsonl' is not valid YAML at column 18: expected ',' or ']', but "
        "got '<stream end>' (while parsing a flow sequence started at column 1); write a list as "
        "--set data.sources='[a, b]'"
    )
    assert load_config("tiny", ["run.description=note: a: b"]).run.description == "note: a: b"  # plain text stays text


def test_set_value_yaml_error_through_the_cli():
    line = error_line(run_cli("extend", "--set", "run.name='unclosed", "--dry-run"))
    assert line == (
        'error: --set run.name: the value "\'unclosed" is not valid YAML at column 10: found unexpected '
        "end of stream (while scanning a quoted scalar started at column 1); close the quotes"
    )


def test_set_list_yaml_error_through_the_cli_keeps_the_brackets():
    """The value's brackets reach the terminal as typed (cli/main.py escapes rich markup in error lines)."""
    line = error_line(run_cli("extend", "--set", "data.sources=[a.jsonl, b.jsonl", "--dry-run"))
    assert line == (
        "error: --set data.sources: the value '[a.jsonl, b.jsonl' is not valid YAML at column 18: expected "
        "',' or ']', but got '<stream end>' (while parsing a flow sequence started at column 1); write a "
        "list as --set data.sources='[a, b]'"
    )
