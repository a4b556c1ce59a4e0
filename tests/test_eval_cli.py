"""`mtrain eval` through its command line: every suite end to end on a tiny random Qwen2, skipped entries
for missing data, and one-line errors (exit code 2) for bad options."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from fixtures.eval_corpus import (
    one_thread,  # noqa: F401  (autouse: this module runs on one thread)
    write_essays,
    write_hotpot,
    write_infinitebench,
    write_pg19,
    write_squad,
    write_tiny_model,
)
from spawned_ranks import run_forked_cli
from tiny_setup import cli_env

from mtrain_cli.cli import main
from mtrain_cli.eval.ruler.suite import TASK_NAMES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2")


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """The console entry point in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["mtrain", *args])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def only_run_dir(parent: Path) -> Path:
    (run_dir,) = [p for p in parent.iterdir() if p.is_dir()]
    return run_dir


def test_every_suite_end_to_end(tiny_model, tmp_path):
    data = tmp_path / "data"
    args = [
        "eval",
        str(tiny_model),
        "--suite",
        "ruler,niah,pg19,infinitebench",
        "--lengths",
        "512,1k",
        "--samples",
        "1",
        "--seed",
        "3",
        "--out",
        str(tmp_path / "out"),
        "--pg19-dir",
        str(write_pg19(data / "pg19")),
        "--haystack-dir",
        str(write_essays(data / "essays")),
        "--squad-file",
        str(write_squad(data / "squad.json")),
        "--hotpot-file",
        str(write_hotpot(data / "hp.json")),
        "--infinitebench-dir",
        str(write_infinitebench(data / "ib")),
    ]
    result = run_forked_cli(*args, env={**cli_env(), "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr + result.stdout
    run_dir = only_run_dir(tmp_path / "out")
    assert run_dir.name.startswith("eval-tiny-qwen2-")
    results = json.loads((run_dir / "results.json").read_text())

    assert results["lengths"] == [512, 1024] and results["samples"] == 1 and results["seed"] == 3
    assert results["attention"] == "dense" and results["model"]["source"] == "hf" and results["wall_time_s"] > 0
    assert results["notes"] == []  # essays were given, lengths are within max_position_embeddings
    assert results["command"].startswith(
        f"mtrain eval {tiny_model} --suite ruler,niah,pg19,infinitebench "
        f"--lengths 512,1024 --samples 1 --seed 3 --attention dense"
    )
    suites = results["suites"]
    assert list(suites) == ["ruler", "niah", "pg19", "infinitebench"]

    ruler = suites["ruler"]
    assert list(ruler["rows"]) == [*TASK_NAMES, "mean"]  # all 13 tasks ran at 1K
    assert all(0 <= v <= 100 for row in ruler["rows"].values() for v in row.values())
    assert "essays: 3 .txt files" in ruler["sources"]["niah_single_2"]
    assert "SQuAD file" in ruler["sources"]["qa_1"] and "HotpotQA file" in ruler["sources"]["qa_2"]
    ruler_skips = {(s["task"], s["length"]) for s in results["skipped"] if s["suite"] == "ruler"}
    assert ruler_skips and all(length == 512 for _, length in ruler_skips)  # too long for 512, fine at 1K

    niah = suites["niah"]
    assert list(niah["rows"]) == [f"depth {d}%" for d in range(0, 101, 10)] + ["mean"]
    assert niah["files"] == ["niah.csv", "niah_heatmap.png"]
    assert len((run_dir / "niah.csv").read_text().splitlines()) == 1 + 2 * 11

    pg19 = suites["pg19"]
    perplexity = pg19["rows"]["perplexity"]
    assert set(perplexity) == {"512", "1024"} and all(1 < v < 2 * 512 for v in perplexity.values())
    assert pg19["details"]["books"] == {"512": 1, "1024": 1} and pg19["skipped"] == []  # --samples 1: one book
    assert pg19["files"] == ["pg19.csv", "pg19_perplexity.png"]

    ib = suites["infinitebench"]
    assert ib["sources"]["passkey"].startswith("file ") and ib["sources"]["kv_retrieval"].startswith("generated")
    assert set(ib["rows"]) == {
        "passkey",
        "number_string",
        "kv_retrieval",
        "longbook_choice_eng",
        "longbook_qa_eng",
        "math_find",
        "mean",
    }
    ib_skips = {s["task"]: s["reason"] for s in results["skipped"] if s["suite"] == "infinitebench"}
    assert ib_skips["code_run"].startswith("no code_run.jsonl in") and "no offline generator" in ib_skips["code_run"]

    for png in ("niah_heatmap.png", "pg19_perplexity.png"):
        assert (run_dir / png).read_bytes()[:8] == PNG_MAGIC
    summary = (run_dir / "summary.md").read_text()
    for heading in ("## ruler", "## niah", "## pg19", "## infinitebench", "## Skipped"):
        assert heading in summary
    assert "![niah_heatmap.png](niah_heatmap.png)" in summary and "| niah_single_1 |" in summary
    predictions = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    generated_cells = (
        sum(
            len(row)
            for suite in ("ruler", "infinitebench")
            for name, row in suites[suite]["rows"].items()
            if name != "mean"
        )
        + 2 * 11
    )
    assert len(predictions) == generated_cells  # --samples 1: one sample (or record) per cell
    assert all(p["prompt_tokens"] + p["max_new_tokens"] <= p["length"] for p in predictions)
    assert "results:" in result.stdout and "ruler: score (%)" in result.stdout


def test_missing_data_is_reported_as_skipped(tiny_model, tmp_path, monkeypatch, capsys):
    code, out, _ = run_main(
        monkeypatch,
        capsys,
        "eval",
        str(tiny_model),
        "--suite",
        "pg19,infinitebench",
        "--lengths",
        "512,2k",
        "--samples",
        "1",
        "--out",
        str(tmp_path),
    )
    assert code == 0, out
    results = json.loads((only_run_dir(tmp_path) / "results.json").read_text())
    skipped = {(s["suite"], s["task"]): s["reason"] for s in results["skipped"]}
    assert skipped[("pg19", "pg19")].startswith("no --pg19-dir given")
    assert results["suites"]["pg19"]["rows"] == {}
    no_generator = {task for (suite, task), reason in skipped.items() if suite == "infinitebench"}
    assert no_generator == {
        "longbook_sum_eng",
        "longbook_choice_eng",
        "longbook_qa_eng",
        "longbook_qa_chn",
        "longdialogue_qa_eng",
        "math_calc",
        "code_run",
        "code_debug",
    }
    assert all(
        skipped[("infinitebench", task)] == "no --infinitebench-dir given, and this task has no offline generator"
        for task in no_generator
    )
    assert set(results["suites"]["infinitebench"]["rows"]) == {
        "passkey",
        "number_string",
        "kv_retrieval",
        "math_find",
        "mean",
    }
    assert "skipped pg19/pg19: no --pg19-dir given" in out
    assert results["notes"] == [
        "lengths 2048 exceed the model's max_position_embeddings (1024): scores there measure extrapolation"
    ]


def test_without_essays_or_qa_files_ruler_labels_and_skips(tiny_model, tmp_path, monkeypatch, capsys):
    code, out, _ = run_main(
        monkeypatch,
        capsys,
        "eval",
        str(tiny_model),
        "--suite",
        "ruler",
        "--lengths",
        "1k",
        "--samples",
        "1",
        "--out",
        str(tmp_path),
    )
    assert code == 0, out
    results = json.loads((only_run_dir(tmp_path) / "results.json").read_text())
    ruler = results["suites"]["ruler"]
    assert "qa_1" not in ruler["rows"] and "qa_2" not in ruler["rows"] and len(ruler["rows"]) == 11 + 1
    skipped = {s["task"]: s["reason"] for s in results["skipped"]}
    assert skipped == {
        "qa_1": "no --squad-file given (qa_1 reads a local SQuAD v2.0 json file)",
        "qa_2": "no --hotpot-file given (qa_2 reads a local HotpotQA json file)",
    }
    assert ruler["sources"]["niah_single_2"].startswith("no --haystack-dir given, so not essays but the synthetic")
    assert any("no --haystack-dir" in note for note in results["notes"])


def test_yarn_and_tasks_evaluate_one_task_of_an_untrained_extension(tiny_model, tmp_path, monkeypatch, capsys):
    """--yarn 2 turns the 1K model into a 2K one at load (as `mtrain extend` would write it, no training);
    --tasks passkey runs that task alone."""
    code, out, _ = run_main(
        monkeypatch,
        capsys,
        "eval",
        str(tiny_model),
        "--suite",
        "infinitebench",
        "--tasks",
        "passkey",
        "--yarn",
        "2",
        "--lengths",
        "2k",
        "--samples",
        "1",
        "--out",
        str(tmp_path),
    )
    assert code == 0, out
    results = json.loads((only_run_dir(tmp_path) / "results.json").read_text())
    rope = results["model"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2 and rope["original_max_position_embeddings"] == 1024
    assert results["model"]["max_position_embeddings"] == 2048 and results["notes"] == []  # 2K is within 2 x 1K
    assert results["yarn"] == {"factor": 2, "note": "YaRN ×2 applied at load, no training: context 1,024 -> 2,048"}
    assert results["tasks"] == ["passkey"] and results["skipped"] == []
    assert set(results["suites"]["infinitebench"]["rows"]) == {"passkey", "mean"}
    assert "--tasks passkey --yarn 2" in results["command"] and "YaRN ×2 applied at load" in " ".join(out.split())
    assert "- YaRN ×2 applied at load" in (only_run_dir(tmp_path) / "summary.md").read_text()


def test_batches_of_prompts_give_the_answers_of_one_at_a_time(tmp_path, monkeypatch, capsys):
    """--batch-size 4: the same predictions as one prompt at a time, and the batch size in the results. Wide
    weights, so that answers depend on the prompt (and on any padding a batch failed to mask)."""
    model = write_tiny_model(tmp_path / "tiny-qwen2", initializer_range=0.2)
    runs = {}
    for batch_size in (1, 4):
        out = tmp_path / f"b{batch_size}"
        args = ["--suite", "ruler,niah", "--tasks", "niah_single_1,vt,cwe,niah", "--lengths", "512,1k"]
        args += ["--samples", "2", "--batch-size", str(batch_size), "--out", str(out)]
        code, stdout, _ = run_main(monkeypatch, capsys, "eval", str(model), *args)
        assert code == 0, stdout
        runs[batch_size] = only_run_dir(out)
    results = json.loads((runs[4] / "results.json").read_text())
    assert results["batch_size"] == 4 and "--batch-size 4" in results["command"]
    assert "decoded in batches of 4" in (runs[4] / "summary.md").read_text()
    predictions = {
        b: [
            (p["task"], p["length"], p["index"], p["prediction"])
            for p in map(json.loads, (d / "predictions.jsonl").read_text().splitlines())
        ]
        for b, d in runs.items()
    }
    skipped = {(s["task"], s["length"]) for s in results["skipped"]}
    assert skipped == {("cwe", 512)}  # its smallest prompt does not fit 512 tokens
    assert len(predictions[1]) == 2 * (2 * 3 - 1) + 2 * 2 * 11 and predictions[4] == predictions[1]
    assert len({p[-1] for p in predictions[1]}) > len(predictions[1]) // 2


def test_batches_refuse_a_model_with_sliding_window_layers(tmp_path, monkeypatch, capsys):
    model = write_tiny_model(tmp_path / "sliding", use_sliding_window=True, sliding_window=32, max_window_layers=1)
    args = [
        "--suite",
        "niah",
        "--lengths",
        "512",
        "--samples",
        "1",
        "--batch-size",
        "2",
        "--out",
        str(tmp_path / "out"),
    ]
    code, _, err = run_main(monkeypatch, capsys, "eval", str(model), *args)
    (error,) = [line for line in err.splitlines() if "error" in line.lower()]  # after transformers' loading bar
    assert code == 2 and "Traceback" not in err, err
    assert error.startswith(
        "error: --batch-size 2: Qwen2ForCausalLM has sliding-window attention layers, whose caches cannot be "
        "batched with padding; use --batch-size 1"
    )
    assert not (tmp_path / "out").exists()


def test_yarn_on_a_scaled_model_extends_its_scaling_and_other_scalings_are_one_line():
    from transformers import LlamaConfig, Qwen2Config

    from mtrain_cli.errors import UserError
    from mtrain_cli.eval.loading import apply_yarn

    config = Qwen2Config(max_position_embeddings=256)
    apply_yarn(config, 8)
    assert config.rope_parameters["rope_type"] == "yarn" and config.max_position_embeddings == 2048
    apply_yarn(config, 4)  # a YaRN model: its factor grows, over the same pretraining context
    assert config.rope_parameters["factor"] == 32 and config.rope_parameters["original_max_position_embeddings"] == 256
    assert config.max_position_embeddings == 8192
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = LlamaConfig(
        max_position_embeddings=2048, rope_parameters={**llama3, "original_max_position_embeddings": 128}
    )
    apply_yarn(config, 2)  # Llama 3.x: YaRN over the pretraining context with llama3's bands
    assert config.rope_parameters == {
        "rope_type": "yarn",
        "rope_theta": 5e5,
        "factor": 32.0,
        "original_max_position_embeddings": 128,
        "beta_fast": 4.0,
        "beta_slow": 1.0,
    }
    linear = Qwen2Config(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(UserError, match=r"^--yarn 4: the model uses rope_type 'linear'; mtrain extends models"):
        apply_yarn(linear, 4)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--yarn", "1"], "error: --yarn 1: the factor must be > 1"),
        (["--tasks", "passkey,nope"], "error: --tasks 'passkey,nope': nope is not a task of --suite ruler,niah,pg19,"),
        (
            ["--suite", "ruler,infinitebench", "--tasks", "passkey"],
            "error: --tasks 'passkey' names no task of suite ruler; drop ruler from --suite or name one of its tasks",
        ),
        (["--attention", "flash"], "error: --attention 'flash' is not a mode; use one of: dense, sparse"),
        (["--lengths", "4k,8q"], "error: --lengths '4k,8q': '8q' is not a length; use positive token counts"),
        (["--suite", "ruler,longbench"], "error: --suite 'ruler,longbench': unknown suite longbench; use a"),
        (["--samples", "0"], "error: --samples 0: must be at least 1"),
        (["--batch-size", "0"], "error: --batch-size 0: must be at least 1 (prompts decoded together)"),
        (["--pg19-dir", "/nonexistent/pg19"], "error: --pg19-dir '/nonexistent/pg19' does not exist"),
        (["--squad-file", "/nonexistent/squad.json"], "error: --squad-file '/nonexistent/squad.json' is not a file"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, monkeypatch, capsys, args, message):
    """Options and data files are checked before the model loads: MODEL need not even exist here."""
    code, _out, err = run_main(
        monkeypatch, capsys, "eval", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"), *args
    )
    assert code == 2
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
