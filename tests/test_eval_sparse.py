"""`mtrain eval --attention sparse` on a tiny random Qwen2: a full pattern reproduces dense attention (greedy
answers and PG-19 NLL), a sparse budget pattern records what ran (calls per path, recall, density), an
mtrain run's own sparse settings are used, a prefill that bypasses the hook fails loudly, and bad
--sparse-set values are one-line errors."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from fixtures.eval_corpus import (
    one_thread,  # noqa: F401  (autouse: this module runs on one thread)
    write_pg19,
    write_tiny_model,
)
from test_eval_cli import only_run_dir, run_main
from tiny_setup import SMALL_MODEL, save_weights

from mtrain_cli.attention.hook import ATTENTION_NAME
from mtrain_cli.attention.router import AttentionRouter
from mtrain_cli.config import AttentionConfig, load_config, to_yaml
from mtrain_cli.eval.loading import load_model
from mtrain_cli.eval.runner import Runner
from mtrain_cli.eval.sparse import SETTING_KEYS, attention_routing, sparse_request
from mtrain_cli.model import build_model, load_tokenizer

# p = 1 keeps every column and offset with probe mass: the full causal pattern, computed by the sparse path
FULL = ["p=1.0", "cap=1000000", "block_size=16", "dense_below=0", "last_q=16"]
# a handful of keys per query: far from dense, so the numbers must differ and the density must be low
BUDGET = [
    "pattern=budget",
    "num_vertical=4",
    "num_slash=4",
    "num_sink=1",
    "local_window=16",
    "block_size=16",
    "dense_below=0",
    "last_q=16",
]
LAYERS = 2  # write_tiny_model's


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """Initialised wide enough that its greedy answers depend on the prompt, so equal answers mean something."""
    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen2", initializer_range=0.2)


@pytest.fixture(scope="module")
def pg19_dir(tmp_path_factory) -> Path:
    return write_pg19(tmp_path_factory.mktemp("data") / "pg19")


def sparse_set(items: list[str]) -> list[str]:
    return [arg for item in items for arg in ("--sparse-set", item)]


def run_eval(monkeypatch, capsys, out: Path, *args: str) -> tuple[dict, Path]:
    code, stdout, err = run_main(monkeypatch, capsys, "eval", *args, "--out", str(out))
    assert code == 0, stdout + err
    run_dir = only_run_dir(out)
    return json.loads((run_dir / "results.json").read_text()), run_dir


def predictions(run_dir: Path) -> list[tuple[str, int, str]]:
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines()]
    return [(row["task"], row["meta"]["depth"], row["prediction"]) for row in rows]


def mean_nll(run_dir: Path) -> dict[str, float]:
    return {row["length"]: float(row["mean_nll"]) for row in csv.DictReader(open(run_dir / "pg19.csv"))}


def test_full_pattern_gives_the_dense_answers_and_perplexity(tiny_model, pg19_dir, tmp_path, monkeypatch, capsys):
    common = [
        str(tiny_model),
        "--suite",
        "niah,pg19",
        "--lengths",
        "512",
        "--samples",
        "1",
        "--pg19-dir",
        str(pg19_dir),
    ]
    dense, dense_dir = run_eval(monkeypatch, capsys, tmp_path / "dense", *common)
    sparse, sparse_dir = run_eval(
        monkeypatch, capsys, tmp_path / "sparse", *common, "--attention", "sparse", *sparse_set(FULL)
    )

    assert dense["attention"] == "dense" and dense["sparse"] is None
    assert sparse["attention"] == "sparse"
    assert len(predictions(dense_dir)) == 11  # one NIAH needle per depth
    assert len({answer for _, _, answer in predictions(dense_dir)}) > 5  # answers vary with the needle's depth
    assert predictions(sparse_dir) == predictions(dense_dir)  # greedy decoding after a sparse prefill
    assert mean_nll(sparse_dir) == pytest.approx(mean_nll(dense_dir), rel=1e-5)
    assert sparse["suites"]["pg19"]["rows"]["perplexity"]["512"] == pytest.approx(
        dense["suites"]["pg19"]["rows"]["perplexity"]["512"], rel=1e-5
    )
    # ...and it was the sparse path that computed it: every layer of 11 NIAH prompts and 1 book
    calls = sparse["sparse"]["attention_calls"]
    assert calls["sparse-reference"] == LAYERS * (11 + 1) and set(calls) == {"sparse-reference", "dense-decode"}
    assert sparse["sparse"]["prefills"] == sparse["sparse"]["prefills_probed"] == 12
    assert sparse["sparse"]["sparse_density"] == pytest.approx(1.0)
    assert sparse["sparse"]["sparse_recall"] == pytest.approx(1.0)


def test_budget_pattern_records_settings_calls_recall_and_density(tiny_model, pg19_dir, tmp_path, monkeypatch, capsys):
    common = [
        str(tiny_model),
        "--suite",
        "niah,pg19",
        "--lengths",
        "512",
        "--samples",
        "1",
        "--pg19-dir",
        str(pg19_dir),
    ]
    results, run_dir = run_eval(
        monkeypatch, capsys, tmp_path / "sparse", *common, "--attention", "sparse", *sparse_set(BUDGET)
    )
    dense, dense_dir = run_eval(monkeypatch, capsys, tmp_path / "dense", *common)

    sparse = results["sparse"]
    expected = {
        **{key: getattr(AttentionConfig(), key) for key in SETTING_KEYS},
        "dense_layers": [],
        "pattern": "budget",
        "num_vertical": 4,
        "num_slash": 4,
        "num_sink": 1,
        "local_window": 16,
        "block_size": 16,
        "dense_below": 0,
        "last_q": 16,
    }
    assert sparse["settings"] == expected and sparse["overrides"] == BUDGET
    assert sparse["settings_source"] == "AttentionConfig defaults with --sparse-set overrides"
    prefills = len(predictions(run_dir)) + 1  # NIAH prompts and one PG-19 book
    calls = sparse["attention_calls"]
    assert calls["sparse-reference"] == LAYERS * prefills  # every layer of every prefill ran sparse
    assert calls["dense-decode"] > 0 and calls["dense-decode"] % LAYERS == 0  # decoding on the cache
    assert set(calls) == {"sparse-reference", "dense-decode"}
    assert sparse["prefills"] == sparse["prefills_probed"] == prefills
    assert 0.0 < sparse["sparse_density"] < 0.5 and 0.0 < sparse["sparse_recall"] < 1.0
    # a pattern this sparse changes the numbers (the hook is not dense in disguise)
    assert predictions(run_dir) != predictions(dense_dir)
    assert results["suites"]["pg19"]["rows"]["perplexity"]["512"] != pytest.approx(
        dense["suites"]["pg19"]["rows"]["perplexity"]["512"], rel=1e-3
    )
    assert " ".join(sparse_set(BUDGET)) in results["command"] and "--attention sparse" in results["command"]
    assert not any("dense_below" in note for note in results["notes"])  # 0: no prompt runs dense inside it

    summary = (run_dir / "summary.md").read_text()
    assert "- attention: sparse," in summary
    assert "pattern budget, p 0.96, cap 4096, num_vertical 4, num_slash 4" in summary
    assert f"dense-decode {calls['dense-decode']}, sparse-reference {calls['sparse-reference']}" in summary
    assert f"mean recall {sparse['sparse_recall']:.3f}" in summary
    assert f"mean density {sparse['sparse_density']:.3f}" in summary


def _fake_run(run_dir: Path, *attention: str) -> Path:
    """An mtrain run directory (config.yaml) with one checkpoint, made with the trainer's own functions."""
    config = load_config("tiny", [*SMALL_MODEL, *attention])
    torch.manual_seed(5)
    model = build_model(config, load_tokenizer(config), torch.device("cpu"))
    checkpoint = run_dir / "checkpoints" / "step_000001"
    checkpoint.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    save_weights(model, checkpoint)
    return checkpoint


def test_a_sparse_runs_checkpoint_is_evaluated_with_its_own_settings(tmp_path, pg19_dir, monkeypatch, capsys):
    checkpoint = _fake_run(
        tmp_path / "tiny-run",
        "attention.mode=sparse",
        "attention.p=1.0",
        "attention.cap=100000",
        "attention.block_size=16",
        "attention.last_q=16",
        "attention.dense_below=64",
    )
    common = [str(checkpoint), "--suite", "pg19", "--lengths", "128,256", "--samples", "2", "--pg19-dir", str(pg19_dir)]
    sparse, _ = run_eval(
        monkeypatch, capsys, tmp_path / "sparse", *common, "--attention", "sparse", "--sparse-set", "dense_below=200"
    )
    dense, _ = run_eval(monkeypatch, capsys, tmp_path / "dense", *common)

    assert sparse["model"]["source"] == "checkpoint"
    source = sparse["sparse"]["settings_source"]
    assert source == f"attention section of {tmp_path / 'tiny-run' / 'config.yaml'} with --sparse-set overrides"
    settings = sparse["sparse"]["settings"]
    assert (settings["p"], settings["block_size"], settings["last_q"], settings["dense_below"]) == (1.0, 16, 16, 200)
    # 2 books × 2 lengths, no decoding: the 128-token prefills (below dense_below) run dense attention, unprobed;
    # recall is over the 256-token ones
    assert sparse["sparse"]["attention_calls"] == {"sparse-reference": LAYERS * 2, "dense-short-documents": LAYERS * 2}
    assert (sparse["sparse"]["prefills"], sparse["sparse"]["prefills_probed"]) == (4, 2)
    assert sparse["sparse"]["sparse_recall"] == pytest.approx(1.0)
    assert sparse["notes"] == [
        (
            "2 of 4 prompts were shorter than the sparse setting dense_below (200 tokens): the "
            "sparse path attended densely to them (no pattern estimated)"
        )
    ]
    for length in ("128", "256"):
        assert sparse["suites"]["pg19"]["rows"]["perplexity"][length] == pytest.approx(
            dense["suites"]["pg19"]["rows"]["perplexity"][length], rel=1e-5
        )
    # a layer the settings run dense is served by the sparse path as they ask, and counted apart
    named, _ = run_eval(
        monkeypatch,
        capsys,
        tmp_path / "named",
        *common,
        "--attention",
        "sparse",
        "--sparse-set",
        "dense_below=200",
        "--sparse-set",
        "dense_layers=[0]",
    )
    calls = named["sparse"]["attention_calls"]
    assert calls == {"dense-layer": 4, "sparse-reference": 2, "dense-short-documents": 2}


def test_settings_come_from_a_sparse_run_else_the_defaults(tmp_path, tiny_model, pg19_dir, monkeypatch, capsys):
    dense_run = _fake_run(tmp_path / "dense-run")
    request = sparse_request(dense_run, ["p=0.95"])
    assert request.config == AttentionConfig(mode="sparse", p=0.95)
    assert request.source == (
        f"AttentionConfig defaults ({tmp_path / 'dense-run' / 'config.yaml'} trained with "
        f"dense attention) with --sparse-set overrides"
    )
    assert sparse_request(tiny_model, []).config == AttentionConfig(mode="sparse")
    # later overrides win, values are parsed as YAML like recipe overrides
    assert sparse_request(tiny_model, ["cap=8", "cap=16", "pattern=budget"]).config.cap == 16

    # The defaults (block 128, dense_below 8192) run end to end; prompts that short run dense attention through
    # the sparse path, and the results say so.
    results, _ = run_eval(
        monkeypatch,
        capsys,
        tmp_path / "out",
        str(tiny_model),
        "--suite",
        "pg19",
        "--lengths",
        "512",
        "--samples",
        "1",
        "--pg19-dir",
        str(pg19_dir),
        "--attention",
        "sparse",
    )
    assert results["sparse"]["settings"]["dense_below"] == 8192 and results["sparse"]["overrides"] == []
    assert results["sparse"]["attention_calls"] == {"dense-short-documents": LAYERS}
    assert results["sparse"]["sparse_density"] == 1.0
    # nothing was probed, so there is no recall to report (rather than a mean of zeros)
    assert (results["sparse"]["prefills"], results["sparse"]["prefills_probed"]) == (1, 0)
    assert results["sparse"]["sparse_recall"] is None
    assert results["notes"] == [
        (
            "1 of 1 prompts were shorter than the sparse setting dense_below (8192 tokens): "
            "the sparse path attended densely to them (no pattern estimated)"
        )
    ]


def test_sparse_prefill_is_one_forward_whatever_the_chunk_size(tiny_model):
    """A prompt longer than prefill_chunk still prefills in one chunk (a second chunk would attend its cache
    densely); perplexity needs no cache and applies the LM head in chunks."""
    ids = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    with attention_routing(sparse_request(tiny_model, FULL)) as tracker:
        hooked = load_model(tiny_model, torch.device("cpu"), attn_implementation=ATTENTION_NAME)
        runner = Runner(hooked.model, hooked.tokenizer, prefill_chunk=64, head_chunk=37, sparse=tracker)
        nll_S1 = runner.token_nll(ids)
        assert tracker.report()["attention_calls"] == {"sparse-reference": LAYERS}  # one forward, no decoding
        runner.eos_ids = set()
        (answer,) = runner.generate([ids], [6])
        assert tracker.report()["attention_calls"] == {"sparse-reference": 2 * LAYERS, "dense-decode": 5 * LAYERS}
    sdpa = load_model(tiny_model, torch.device("cpu"))
    dense = Runner(sdpa.model, sdpa.tokenizer, prefill_chunk=64)
    dense.eos_ids = set()
    expected_S1 = dense.token_nll(ids)
    assert nll_S1.shape == expected_S1.shape == (299,)
    torch.testing.assert_close(nll_S1, expected_S1, rtol=1e-4, atol=1e-5)
    assert [answer] == dense.generate([ids], [6]) and answer


def test_batched_decoding_after_sparse_prefills_gives_the_batch_one_answers(tiny_model):
    """Each prompt is still prefilled alone through the sparse path (a budget pattern, far from dense); the batch
    decodes through the hook, which masks each row's left padding by document ids."""
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (n,), generator=generator).tolist() for n in (150, 97, 150, 40)]
    budgets = [12, 5, 1, 9]
    with attention_routing(sparse_request(tiny_model, BUDGET)) as tracker:
        hooked = load_model(tiny_model, torch.device("cpu"), attn_implementation=ATTENTION_NAME)
        runner = Runner(hooked.model, hooked.tokenizer, sparse=tracker)
        runner.eos_ids = set()
        alone = [runner.generate([ids], [budget])[0] for ids, budget in zip(prompts, budgets)]
        calls_alone = tracker.report()["attention_calls"]
        batched = runner.generate(prompts, budgets)
        calls = tracker.report()["attention_calls"]
    assert batched == alone and len(set(alone)) == len(alone)
    assert calls_alone == {"sparse-reference": 4 * LAYERS, "dense-decode": (11 + 4 + 0 + 8) * LAYERS}
    # every prompt prefilled sparse once more; the batch took 11 decoding steps (the longest answer's)
    assert calls == {"sparse-reference": 8 * LAYERS, "dense-decode": (23 + 11) * LAYERS}


def test_a_prefill_that_bypasses_the_sparse_path_fails_loudly(tiny_model):
    message = "sparse prefill of 40 tokens ran sparse attention in 0 of 2 layers"
    with attention_routing(sparse_request(tiny_model, FULL)) as tracker:
        sdpa = load_model(tiny_model, torch.device("cpu"))  # loaded with SDPA: the hook never runs
        with pytest.raises(RuntimeError, match=message):
            Runner(sdpa.model, sdpa.tokenizer, sparse=tracker).generate([list(range(40))], [4])
    # loaded with the hook, but run under another (dense) router than the tracker's
    hooked = load_model(tiny_model, torch.device("cpu"), attn_implementation=ATTENTION_NAME)
    with AttentionRouter(), pytest.raises(RuntimeError, match=message):
        Runner(hooked.model, hooked.tokenizer, sparse=tracker).token_nll(list(range(40)))
    # outside any router (after the eval run's scope) the hook refuses to guess
    with pytest.raises(RuntimeError, match="outside an attention router"):
        Runner(hooked.model, hooked.tokenizer, sparse=tracker).token_nll(list(range(40)))
    assert tracker.prefills == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sparse-set", "p=1.5"], "error: --sparse-set p=1.5: attention.p 1.5 must be in (0, 1]"),
        (
            ["--sparse-set", "block_size=48"],
            "error: --sparse-set block_size=48: attention.block_size 48 must be 16, 32",
        ),
        (["--sparse-set", "cap=many"], "error: --sparse-set cap=many: attention.cap 'many' must be an integer"),
        (
            ["--sparse-set", "pattern=dense"],
            "error: --sparse-set pattern=dense: attention.pattern 'dense' is not one of",
        ),
        (
            ["--sparse-set", "last-q=8"],
            ("error: --sparse-set last-q=8: 'last-q' is not a sparse attention setting; did you mean last_q?"),
        ),
        (["--sparse-set", "mode=dense"], "error: --sparse-set mode=dense: the mode is chosen by --attention"),
        (["--sparse-set", "p"], "error: --sparse-set 'p' must look like key=value, e.g. --sparse-set p=0.95"),
    ],
)
def test_bad_sparse_settings_are_one_line_errors(tmp_path, monkeypatch, capsys, args, message):
    """Checked before the model loads: MODEL need not even exist here."""
    code, _, err = run_main(
        monkeypatch,
        capsys,
        "eval",
        str(tmp_path / "no-model"),
        "--out",
        str(tmp_path / "out"),
        "--attention",
        "sparse",
        *args,
    )
    assert code == 2
    assert err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_sparse_settings_without_sparse_attention_are_an_error(tmp_path, monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, "eval", str(tmp_path / "no-model"), "--sparse-set", "p=0.95")
    assert code == 2
    assert err.startswith("error: --sparse-set p=0.95: sparse settings need --attention sparse (now dense)"), err
