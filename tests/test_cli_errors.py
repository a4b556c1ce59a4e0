"""First run and faults (issue 21): usage and config errors are one line on stderr with exit code 2 (no
traceback), answered before torch & co. are imported; --version; readable help; the dry run's parameter
caveat; eval's up-front warning for lengths beyond the model's context."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_setup import cli_env, write_documents

import mtrain_cli
from mtrain_cli.cli import app, main

HEAVY = ("torch", "transformers", "datasets", "matplotlib")


def run_cli(*args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, list[str], set[str]]:
    """`python -m mtrain_cli ARGS` under -X importtime: (result, stderr lines without the import report,
    the top-level packages it imported)."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mtrain_cli", *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        cwd=cwd,
        timeout=120,
    )
    lines, imported = [], set()
    for line in result.stderr.splitlines():
        if line.startswith("import time:"):
            imported.add(line.rsplit("|", 1)[-1].strip().split(".")[0])
        elif line.strip():
            lines.append(line)
    return result, lines, imported


def assert_one_line_error(result, lines: list[str], imported: set[str], *expected: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    for text in expected:
        assert text in lines[0], lines[0]
    assert not imported & set(HEAVY), f"imported before the error: {sorted(imported & set(HEAVY))}"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["foo"], ["no such command 'foo'", "extend", "see mtrain --help"]),
        (["extend", "--bogus"], ["no such option --bogus", "see mtrain extend --help"]),
        (["extend", "--dry-ru"], ["no such option --dry-ru (did you mean --dry-run?)"]),
        (["extend", "--recipe"], ["'--recipe' requires an argument", "see mtrain extend --help"]),
        (["extend", "--dry-run", "true"], ["--dry-run is a flag and takes no value: drop 'true'"]),
        (["extend", "--nproc", "x"], ["--nproc 'x': ", "integer", "see mtrain extend --help"]),
        (["eval"], ["missing argument 'MODEL_DIR'", "see mtrain eval --help"]),
        (["eval", "some-model", "--samples", "abc"], ["--samples 'abc': ", "integer", "see mtrain eval --help"]),
        (["profile", "ring", "--heads", "many"], ["--heads 'many': ", "see mtrain profile ring --help"]),
    ],
)
def test_usage_errors_are_one_line_with_exit_code_2(args, expected):
    assert_one_line_error(*run_cli(*args), *expected)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["extend", "--set", "train.lr=-1"], ["train.lr -1.0 must be > 0"]),
        (["extend", "--recipe", "qwen2.5-3b-512k", "--set", "data.seq_len=1000"], ["data.seq_len 1000"]),
        (["extend", "--nproc", "2"], ["--nproc 2: parallel.dp 1 × parallel.cp 1 = 1"]),
        (["profile", "step", "--set", "train.lrr=1"], ["unknown config key 'train.lrr'"]),
        (["profile", "step", "--trace-dir", "/dev/null/traces"], ["--trace-dir /dev/null/traces", "Not a directory"]),
        (["profile", "kernels", "--lengths", "128q"], ["--lengths '128q'"]),
        (["profile", "crossover", "--head-dims", "80"], ["--head-dims '80' must list 64 and/or 128"]),
        (["eval", "MODEL", "--lengths", "4k,8q"], ["--lengths '4k,8q': '8q' is not a length"]),
        (["eval", "MODEL", "--samples", "0"], ["--samples 0: must be at least 1"]),
        (["eval", "MODEL", "--attention", "flash"], ["--attention 'flash' is not a mode"]),
        (
            ["eval", "MODEL", "--attention", "sparse", "--sparse-set", "bogus=1"],
            ["'bogus' is not a sparse attention setting"],
        ),
        (["eval", "/nonexistent/model", "--lengths", "1k"], ["MODEL /nonexistent/model does not exist"]),
        (["extend", "--model", "/nonexistent/model"], ["--model /nonexistent/model does not exist"]),
        (["extend", "--model", "."], ["--model . is not a Hugging Face model directory", "no config.json"]),
        (["extend", "--data", "missing.jsonl"], ["data source 'missing.jsonl' does not exist"]),
        (
            ["extend", "--set", "data.short_fraction=0.1", "--set", "data.short_sources=[gone.jsonl]"],
            ["data source", "gone.jsonl' does not exist"],
        ),
    ],
)
def test_config_and_argument_errors_come_before_heavy_imports(args, expected, tmp_path):
    assert_one_line_error(*run_cli(*args, cwd=tmp_path), *expected)


@pytest.mark.parametrize(
    "args, commands", [([], ["extend", "eval", "profile"]), (["profile"], ["kernels", "crossover", "ring", "step"])]
)
def test_a_group_without_its_command_prints_the_help_and_exits_2(args, commands):
    """As click >= 8.2 does for a missing command: the help (stdout), one line naming the problem (stderr)."""
    result, lines, _ = run_cli(*args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "Usage: mtrain" in result.stdout and all(command in result.stdout for command in commands)
    assert len(lines) == 1 and lines[0].startswith("error: missing command; choose one of "), lines
    assert all(command in lines[0] for command in commands)


def test_version():
    result = subprocess.run(
        [sys.executable, "-m", "mtrain_cli", "--version"], capture_output=True, text=True, env=cli_env(), timeout=120
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, f"mtrain {mtrain_cli.__version__}\n", "")


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The console entry point in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["mtrain", *args])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def all_commands() -> list[list[str]]:
    import typer

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    return list(walk(typer.main.get_command(app), []))


def test_help_shows_flags_and_readable_placeholders(monkeypatch, capsys):
    commands = all_commands()
    assert len(commands) == 11  # mtrain, its 6 commands (profile among them), profile's 4
    for path, _ in commands:
        code, out, err = run_main(monkeypatch, capsys, *path, "--help")
        assert code == 0 and "Usage: mtrain" in out and not err, (path, err)
        for bad in ("<bool>", "list[", "{"):
            assert bad not in out, f"mtrain {' '.join(path)} --help shows {bad!r}:\n{out}"
    _, out, _ = run_main(monkeypatch, capsys, "eval", "--help")
    assert "mtrain eval [OPTIONS] MODEL_DIR" in out
    _, out, _ = run_main(monkeypatch, capsys, "extend", "--help")
    assert "KEY=VALUE" in out and "--dry-run " in out


def test_every_option_has_help():
    for path, command in all_commands():
        for param in command.params:
            assert param.help, f"mtrain {' '.join(path)}: {param.name} has no help"


def test_dry_run_of_a_big_recipe_without_a_model_says_its_count_is_the_demo_vocabulary(monkeypatch, capsys, tmp_path):
    data = write_documents(tmp_path / "docs.jsonl")
    short = ["--set", "data.seq_len=4096", "--set", "data.num_val_rows=1"]  # rows the documents fill
    code, out, err = run_main(
        monkeypatch, capsys, "extend", "--recipe", "qwen2.5-3b-512k", "--data", str(data), *short, "--dry-run"
    )
    assert code == 0, err
    (row,) = [line for line in out.splitlines() if "parameters" in line]
    assert "2.78B = " in row and "fresh model with the shipped 512-token vocabulary" in out.replace("│", "")


def test_eval_warns_up_front_when_lengths_exceed_the_model_context(tmp_path, monkeypatch, capsys):
    from fixtures.eval_corpus import write_tiny_model  # max_position_embeddings 1024

    model = write_tiny_model(tmp_path / "tiny-qwen2")
    capsys.readouterr()
    code, out, err = run_main(
        monkeypatch,
        capsys,
        "eval",
        str(model),
        "--suite",
        "pg19",
        "--lengths",
        "512,2k",
        "--samples",
        "1",
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 2 and "error: nothing was measured" in err, err  # no --pg19-dir: every cell skipped
    warning = "warning: lengths 2048 exceed the model's max_position_embeddings (1024)"
    assert out.count(warning) == 1 and out.index(warning) < out.index("skipped pg19"), out
    (run_dir,) = (tmp_path / "out").iterdir()
    notes = json.loads((run_dir / "results.json").read_text())["notes"]
    assert any(note.startswith("lengths 2048 exceed") for note in notes)
