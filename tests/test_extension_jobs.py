"""bench/extension/handoff.py, what passes between the device jobs of the context-extension experiment: the base
export in bf16 cut into parts and joined back only when every part and the whole match their sha256; the corpus
check that stops a later job on other data; an earlier job's records and eval outputs restored into a new work
directory; which settings a later extension job may change."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.extension import handoff
from bench.extension.handoff import JobsError
from bench.extension.jobs import same_training
from bench.extension.phases import corpus_phase
from bench.extension.report import bundle


def fake_export(directory: Path) -> Path:
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    save_file(
        {
            "model.embed_tokens.weight": torch.randn(256, 64, generator=generator),
            "model.norm.weight": torch.ones(64),
            "step": torch.tensor([3], dtype=torch.int64),
        },
        directory / "model.safetensors",
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "dtype": "float32"}))
    (directory / "tokenizer.json").write_text("{}")
    return directory


@pytest.fixture
def parts(tmp_path) -> tuple[Path, Path, dict]:
    """(the bf16 export, its parts folder, export.json) of a ~33 KB export cut into 8 KiB parts."""
    bf16 = handoff.bf16_export(fake_export(tmp_path / "export"), tmp_path / "bf16")
    manifest = handoff.write_parts(bf16, tmp_path / "parts", 8 * 1024, {"scale": "test", "seed": 0})
    return bf16, tmp_path / "parts", manifest


def test_bf16_parts_join_back_to_the_same_files(parts, tmp_path):
    bf16, parts_dir, manifest = parts
    weights = load_file(bf16 / "model.safetensors")
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert weights["step"].dtype == torch.int64, "integer tensors keep their type"
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert len(manifest["parts"]) > 2 and all(p["bytes"] <= 8 * 1024 for p in manifest["parts"])
    assert manifest["xz_bytes"] < manifest["tar_bytes"], "the parts carry the compressed tar"
    assert sorted(p.name for p in parts_dir.iterdir()) == sorted(
        [*(p["name"] for p in manifest["parts"]), "export.json"]
    )
    joined = handoff.join_parts(parts_dir, tmp_path / "joined")
    assert joined["scale"] == "test"
    assert {p.name: p.read_bytes() for p in (tmp_path / "joined").iterdir()} == {
        p.name: p.read_bytes() for p in bf16.iterdir()
    }


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda d: (d / "export.tar.xz.01").write_bytes((d / "export.tar.xz.01").read_bytes()[:-1]),
            "export.tar.xz.01 has",
        ),
        (lambda d: (d / "export.tar.xz.00").unlink(), "export.tar.xz.00 is missing"),
        (lambda d: (d / "export.tar.xz.99").write_bytes(b"x"), "export.tar.xz.99 not in export.json"),
        (lambda d: (d / "export.json").unlink(), "no export.json"),
        (
            lambda d: (d / "export.json").write_text(
                json.dumps({**json.loads((d / "export.json").read_text()), "tar_sha256": "0" * 64})
            ),
            "decompressed tar's sha256",
        ),
    ],
)
def test_a_damaged_part_stops_the_join(parts, tmp_path, damage, message):
    _, parts_dir, _ = parts
    damage(parts_dir)
    with pytest.raises(JobsError, match=message):
        handoff.join_parts(parts_dir, tmp_path / "joined")


def test_an_export_over_the_limit_is_refused(tmp_path, monkeypatch):
    bf16 = handoff.bf16_export(fake_export(tmp_path / "export"), tmp_path / "bf16")
    monkeypatch.setattr(handoff, "MAX_EXPORT_BYTES", 16 * 1024)
    with pytest.raises(JobsError, match="train a smaller model"):
        handoff.write_parts(bf16, tmp_path / "parts", 8 * 1024, {})


def test_a_corpus_that_differs_stops_a_later_job(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "tokenizer").mkdir(parents=True)
    (corpus / "manifest.json").write_text(json.dumps({"packages_sha256": "a" * 64, "num_packages": 3}))
    (corpus / "train_code.jsonl").write_text('{"text": "x"}\n')
    (corpus / "tokenizer" / "tokenizer.json").write_text("{}")
    expected = handoff.corpus_fingerprint(corpus)
    handoff.check_corpus(expected, handoff.corpus_fingerprint(corpus))
    (corpus / "train_code.jsonl").write_text('{"text": "y"}\n')
    with pytest.raises(JobsError, match="differs from the base job's in 1 of 2 files \\(train_code.jsonl\\)"):
        handoff.check_corpus(expected, handoff.corpus_fingerprint(corpus))
    with pytest.raises(JobsError, match="read packages of sha256 bbbb"):
        handoff.check_corpus(expected, {**expected, "packages_sha256": "b" * 64})


def test_a_later_job_reuses_the_corpus_an_earlier_one_left_only_if_it_is_the_base_jobs(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps({"packages_sha256": "a" * 64, "num_packages": 3}))
    (corpus / "train_code.jsonl").write_text('{"text": "x"}\n')
    expected = handoff.corpus_fingerprint(corpus)
    builds, records = [], []

    def build(rec, cmd, timeout, env=None):  # stands in for data.make_code_corpus: the base job's files again
        builds.append(cmd)
        corpus.mkdir()  # the build starts from nothing
        (corpus / "manifest.json").write_text(json.dumps({"packages_sha256": "a" * 64, "num_packages": 3}))
        (corpus / "train_code.jsonl").write_text('{"text": "x"}\n')
        rec.status = "pass"
        return True

    job = SimpleNamespace(
        phase="sparse",
        work=tmp_path,
        start=0.0,
        args=SimpleNamespace(python="python", seed=0),
        scale=SimpleNamespace(corpus_args=[]),
        env={},
        run=build,
        add=records.append,
        left=lambda: 100.0,
    )
    assert corpus_phase(job, expected) and builds == []
    assert records[0].status == "pass" and records[0].reason.startswith("reused")
    (corpus / "train_code.jsonl").write_text('{"text": "cut short"}\n')
    assert corpus_phase(job, expected) and len(builds) == 1  # not the base job's: built again
    assert handoff.corpus_fingerprint(corpus) == expected


def test_records_and_eval_outputs_move_to_the_next_job(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "evals" / "eval-base-niah-s0" / "eval-x").mkdir(parents=True)
    (old / "evals" / "eval-base-niah-s0" / "eval-x" / "results.json").write_text("{}")
    (old / "corpus").mkdir()
    (old / "corpus" / "manifest.json").write_text("{}")  # rebuilt by every job: not restored
    (old / "logs").mkdir()
    (old / "logs" / "base.out").write_text("trained")
    record = {
        "name": "eval-base-niah-s0",
        "run_dir": str(old / "evals" / "eval-base-niah-s0"),
        "command": f"mtrain eval {old}/models/base",
    }
    handoff.save_state(old, {"notes": ["a note"]}, [record])
    bundle(old, tmp_path / "logs.tar.gz")
    new.mkdir()
    header, records = handoff.restore_state(tmp_path / "logs.tar.gz", new)
    assert header == {"notes": ["a note"]}
    assert records[0]["run_dir"] == str(new / "evals" / "eval-base-niah-s0")
    assert records[0]["command"] == f"mtrain eval {new}/models/base"
    assert (new / "evals" / "eval-base-niah-s0" / "eval-x" / "results.json").is_file()
    assert (new / "logs" / "base.out").read_text() == "trained"
    assert not (new / "corpus").exists()


def test_a_sparse_job_may_add_attention_settings_to_the_dense_runs():
    """A sparse variant (e.g. a larger cap) against the dense run of an earlier job: only attention settings that
    a dense run does not read may differ; anything else would train other runs."""

    def job(phase: str, *extend_set: str) -> SimpleNamespace:
        args = SimpleNamespace(extend_set=list(extend_set), extend_steps=None)
        return SimpleNamespace(phase=phase, args=args, header={"notes": []})

    earlier = {"extend_set": ["run.seed=1"], "extend_steps": 150}
    variant = job("sparse", "run.seed=1", "attention.cap=16384")
    same_training(variant, earlier)
    assert variant.header["sparse_extend_set"] == ["attention.cap=16384"]
    assert "adds attention.cap=16384" in variant.header["notes"][0]
    same_training(plain := job("sparse", "run.seed=1"), earlier)
    assert "sparse_extend_set" not in plain.header and not plain.header["notes"]
    for refused in (
        job("sparse", "attention.cap=16384"),  # drops the dense run's seed
        job("sparse", "run.seed=1", "train.lr=3e-4"),
        job("sparse", "run.seed=1", "attention.mode=dense"),
        job("dense", "run.seed=1", "attention.cap=16384"),
    ):
        with pytest.raises(JobsError, match="a sparse job may only add attention settings"):
            same_training(refused, earlier)
