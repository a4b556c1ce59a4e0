"""bench/step_pairs.py: variants of `mtrain extend` back to back, paired step by step (on CPU, the tiny model)."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from bench import step_pairs

REPO = Path(__file__).resolve().parents[1]


def test_variant_specs():
    assert step_pairs.parse_variant("main:") == step_pairs.Variant("main", None, ())
    assert step_pairs.parse_variant("w1:attention.probe_windows=1; attention.p=0.8").sets == (
        "attention.probe_windows=1",
        "attention.p=0.8",
    )
    assert step_pairs.parse_variant(f"old@{REPO / 'src'}:a=1").src == REPO / "src"
    for bad in ("main", ":a=1", "w:probe_windows", f"old@{REPO}:"):  # no colon, no name, no value, not a src tree
        with pytest.raises(ValueError, match="--variant"):
            step_pairs.parse_variant(bad)


def test_compare_pairs_steps_and_leaves_out_builds():
    def run(times, built=()):
        return {i + 1: {"step_s": t, "kernels_built": int(i + 1 in built)} for i, t in enumerate(times)}

    runs = {
        "a": run([9.0, 1.0, 2.0, 4.0, 1.0]),
        "b": run([9.0, 0.5, 1.0, 8.0, 0.9], built=(4,)),  # step 4 built a kernel: no run's step 4 is compared
        "c": run([9.0, 1.0, 2.0]),  # stopped early: only the steps every run has
    }
    result = step_pairs.compare(runs, skip=2)
    assert result["steps"] == [2, 3]
    assert result["variants"]["a"]["paired_ratio"] == 1.0
    assert result["variants"]["b"]["paired_ratio"] == pytest.approx(0.5)
    assert result["variants"]["b"]["median_step_s"] == pytest.approx(0.75)
    assert result["variants"]["c"]["total_s"] == pytest.approx(3.0)


def test_variants_run_from_their_own_source_trees(tmp_path):
    """A variant with @SRC runs that tree's mtrain (a marked copy here); the first variant runs again last."""
    copy = tmp_path / "copy" / "src"
    shutil.copytree(REPO / "src", copy, ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "mtrain_cli" / "__init__.py"
    init.write_text(init.read_text() + "\nprint('MTRAIN FROM THE COPY')\n")
    out = tmp_path / "out"
    step_pairs.main(
        [
            *("--out", str(out), "--work", str(tmp_path / "work"), "--model", "data/tiny-base"),
            *("--recipe", "recipes/tiny.yaml"),  # a file: a copied src tree has no shipped recipes beside it
            *("--data", "data/corpus/long.jsonl", "--steps", "3", "--skip", "2"),
            *("--set", "data.seq_len=512", "--set", "train.warmup_steps=1", "--set", "attention.dense_below=256"),
            *("--variant", f"copy@{copy}:attention.mode=sparse", "--variant", "dense:attention.mode=dense"),
        ]
    )
    result = json.loads((out / "step_pairs.json").read_text())
    assert [r["name"] for r in result["rows"]] == ["copy", "dense", "copy-again"]
    assert all(r["rc"] == 0 for r in result["rows"]), result["rows"]
    # each tree is named by its src digest (a device's .git may be older than the files it runs)
    assert result["rows"][0]["src_sha256"] not in (None, result["source"]["src_sha256"])
    compared = result["comparison"]
    assert compared["steps"] and min(compared["steps"]) >= 2
    assert compared["variants"]["copy"]["paired_ratio"] == 1.0
    assert compared["variants"]["copy"]["density"] is not None and compared["variants"]["dense"]["density"] is None
    with tarfile.open(out / "step_pairs_logs.tar.gz") as tar:
        logs = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    assert "MTRAIN FROM THE COPY" in logs["copy.log"] and "MTRAIN FROM THE COPY" in logs["copy-again.log"]
    assert "MTRAIN FROM THE COPY" not in logs["dense.log"]
    assert "| dense | this tree | attention.mode=dense | 0 |" in (out / "step_pairs.md").read_text()


def test_without_a_model_every_variant_trains_a_fresh_one(tmp_path):
    """Neither --model nor --model-parts: each variant trains a fresh model of the recipe's shape."""
    out = tmp_path / "out"
    step_pairs.main(
        [
            *("--out", str(out), "--work", str(tmp_path / "work"), "--recipe", "recipes/tiny.yaml"),
            *("--data", "data/corpus/long.jsonl", "--steps", "2", "--skip", "1"),
            *("--set", "data.seq_len=512", "--set", "train.warmup_steps=1", "--variant", "main:"),
        ]
    )
    rows = json.loads((out / "step_pairs.json").read_text())["rows"]
    assert [r["rc"] for r in rows] == [0, 0], rows
    assert all("--model" not in r["command"].split() and "model.tokenizer" not in r["command"] for r in rows)
    with pytest.raises(SystemExit):  # a model given twice
        step_pairs.main(["--out", str(out), "--model", "m", "--model-parts", "p", "--data", "d", "--variant", "a:"])
