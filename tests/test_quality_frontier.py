"""The quality frontier study (bench/quality_frontier) on CPU: its device calls are valid bench.extension jobs that
fit a call, a call hands its outputs to the next job and back in at most 8 files, and the frontier report reads
the reports bench/extension writes (made here by its own report code from fabricated runs and evals) into the
right numbers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.extension.job import Record
from bench.extension.phases import sparse_only
from bench.extension.report import write as write_extension_report
from bench.quality_frontier import device, study
from bench.quality_frontier.frontier import collect
from bench.quality_frontier.report import write as write_frontier
from mtrain_cli.train.dense_check import DenseCheck

STEPS, TOKENS_128K, TOKENS_64K = 150, 131072, 65536


# ---------------------------------------------------------------------------------------------------------
# The plan and the calls


def parsed(args: tuple[str, ...], monkeypatch):
    from bench.extension.__main__ import parse_args

    monkeypatch.setattr(sys, "argv", ["bench.extension", "--out", "o", *args])
    return parse_args()


@pytest.mark.parametrize("model", list(study.MODELS))
def test_every_call_is_valid_extension_jobs_within_a_call_and_variants_only_add_attention(model, monkeypatch):
    calls = study.plan(study.MODELS[model]) + study.retrieval_plan(study.MODELS[model], study.VARIANTS["rt97"])
    calls += study.plan(study.MODELS[model], seed=1, variants=["defaults"])
    for call in calls:
        assert call.budget_s <= study.CALL_S, call
        for job in call.jobs:
            args = parsed(job.script_args, monkeypatch)  # exits 2 on anything bench.extension refuses
            assert args.scale == study.MODELS[model].scale and args.budget == job.budget_s
    dense, *sparse = [job for call in study.plan(study.MODELS[model]) for job in call.jobs][1:]
    dense_sets = set(parsed(dense.script_args, monkeypatch).extend_set)
    for job in sparse:
        added = set(parsed(job.script_args, monkeypatch).extend_set) - dense_sets
        assert study.CHECK_EVERY in added and sparse_only(added), job  # what bench.extension lets a variant add
    assert [job.name for call in study.plan(study.MODELS[model]) for job in call.jobs] == [
        "base",
        "dense",
        *(f"sparse {name}" for name in study.VARIANTS),
    ]


def fake_extension(cmd, cwd, env):
    """bench/extension_experiment.sh as far as OUT goes: the files each phase leaves (a 39 MiB export: 3 parts)."""
    out, args = Path(env["OUT"]), cmd[2:]
    phase, tag = args[args.index("--phase") + 1], args[args.index("--tag") + 1]
    stem = f"extension_experiment_1gpu_64k{'' if phase == 'eval' else '_' + phase}_{tag}"
    needs = [args[args.index(flag) + 1] for flag in ("--base-parts", "--resume", "--model-parts") if flag in args]
    assert all((Path(cwd) / path).exists() for path in needs), needs
    if phase != "eval":
        parts = out / f"{phase}_parts"
        parts.mkdir(parents=True)
        for name in ("export.tar.xz.00", "export.tar.xz.01", "export.tar.xz.02", "export.json", "logs.tar.gz"):
            (parts / name).write_text(f"{tag} {name}")
    else:
        (out / f"{stem}_logs.tar.gz").write_text(tag)
        (out / f"{stem}_ppl.png").write_text(tag)
    for ext in ("json", "md"):
        (out / f"{stem}.{ext}").write_text(json.dumps({"tag": tag}))
    return subprocess.CompletedProcess(cmd, 0)


def test_calls_hand_each_job_what_the_last_left_return_at_most_8_files_and_take_files_them(tmp_path):
    model = study.MODELS["llama3"]
    calls = study.plan(model)
    device_repo, here = tmp_path / "device", tmp_path / "here"
    device_repo.mkdir()
    for call in calls[:3]:  # base; dense; two sparse variants in one call
        out = tmp_path / f"out{call.name}"
        for path in call.carry[1:]:  # what the plan says to carry: filed here by earlier takes
            device.place(here / path, device_repo / path)
        assert device.run_call(call, out, repo=device_repo, work=tmp_path / "work", runner=fake_extension) == 0
        assert len([p for p in out.rglob("*") if p.is_file()]) <= device.MAX_FILES
        lines = device.take(out, repo=here)
        assert all(": pass; filed" in line for line in lines), lines
    assert (here / ".exp/llama3/base_parts/export.json").read_text() == "llama3 export.json"
    assert (here / ".exp/llama3/dense_logs.tar.gz").read_text() == "llama3 logs.tar.gz"
    results = sorted(p.name for p in (here / study.RESULTS).iterdir())
    assert "extension_experiment_1gpu_64k_sparse_llama3-p95_logs.tar.gz" in results
    assert "extension_experiment_1gpu_64k_sparse_llama3-defaults.json" in results
    assert len(calls[2].jobs) == 2 and len(calls) == 6


def test_a_job_whose_inputs_were_not_carried_is_skipped_and_said_so(tmp_path):
    call = study.plan(study.MODELS["qwen3"])[1]  # the dense run: needs the base's parts
    (tmp_path / "repo").mkdir()
    assert device.run_call(call, tmp_path / "out", repo=tmp_path / "repo", runner=fake_extension) == 1
    (record,) = json.loads((tmp_path / "out" / device.CALL_RECORD).read_text())["jobs"]
    assert record["status"] == "skipped" and record["reason"].startswith("missing .exp/qwen3/base_parts")


# ---------------------------------------------------------------------------------------------------------
# The frontier, from reports that bench/extension's report code writes


def write_run(folder: Path, tokens: int, step_s: float, check=None) -> Path:
    """metrics.jsonl and summary.json of a 150-step run; check: (gap in nats, seconds a check) every 10 steps,
    recorded and summarised by mtrain's own DenseCheck."""
    folder.mkdir(parents=True)
    dense_check = DenseCheck(every=10, warn_gap=0.01, pc=None) if check else None
    lines = []
    for step in range(1, STEPS + 1):
        seconds = step_s * (8 if step == 1 else 1)  # the first step compiles
        line = {"step": step, "loss": 2.0, "tokens": tokens, "step_s": seconds, "peak_mem_gib": 19.0}
        if check and dense_check.due(step):
            metrics, _warning = dense_check.record(step, 2.0 + check[0], 2.0, check[1])
            line.update(metrics, step_s=seconds + check[1])
        if check:  # layer 0 keeps less than the others, as measured
            line.update(sparse_density=0.24, sparse_recall=0.95, sparse_by_layer={"0": [0.88, 0.48], "1": [0.96, 0.06]})
        lines.append({**line, "tokens_per_s": tokens / line["step_s"]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {"val_loss": {"0": 2.5, str(STEPS): 2.0}, "wall_s": sum(m["step_s"] for m in lines), "num_params": 28}
    if check:
        summary["dense_check"] = dense_check.summary(STEPS, summary["wall_s"])
        summary["attention_layers"] = {"sparse": 1100, "dense-short-documents": 88, "dense-recall": 12}
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def write_eval(folder: Path, rows: dict[str, dict[int, float]]) -> Path:
    run = folder / "eval-0"
    run.mkdir(parents=True)
    rows = {name: {str(n): v for n, v in cells.items()} for name, cells in rows.items()}
    (run / "results.json").write_text(json.dumps({"suites": {"pg19": {"rows": rows}}}))
    return folder


def extension_report(
    tmp_path: Path, model: str, variant: str, seed: int, dense_ppl: dict, gap: dict, half_gap: dict, step_s, check
) -> Path:
    """A sparse job's report as bench/extension writes it: its sparse run against the dense run it resumed."""
    m, v = study.MODELS[model], study.VARIANTS[variant]
    tokens = TOKENS_128K if m.scale == "128k" else TOKENS_64K
    work = tmp_path / "work" / f"{model}-{variant}-{seed}"
    records = []
    for name, seconds, run_check in (("dense", 1.2, None), ("sparse", step_s, check)):
        folder = write_run(work / "runs" / name / "run-0", tokens, seconds, run_check)
        records.append(asdict(Record(name, status="pass", wall_s=200.0, run_dir=str(folder), meta={"job": name})))
    half = {n: 0.92 * p for n, p in dense_ppl.items()}
    tables = {
        "dense": {"perplexity": dense_ppl, "perplexity, second half": half},
        "sparse": {
            "perplexity": {n: p * (1 + gap[n] / 100) for n, p in dense_ppl.items()},
            "perplexity, second half": {n: p * (1 + half_gap[n] / 100) for n, p in half.items()},
        },
    }
    longest = max(dense_ppl)
    tables["sparse-prefill"] = {"perplexity": {longest: 1.004 * tables["sparse"]["perplexity"][longest]}}
    for name, rows in tables.items():
        folder = write_eval(work / "evals" / f"eval-{name}-pg19", rows)
        meta = {"model": name, "kind": "pg19", "seed": 0, "lengths": sorted(dense_ppl)}
        records.append(asdict(Record(f"eval-{name}-pg19", status="pass", wall_s=30.0, run_dir=str(folder), meta=meta)))
    seed_set = [f"run.seed={seed}"] if seed else []
    header = {
        "scale": m.scale_name,
        "budget_s": 330,
        "notes": [],
        "jobs": [
            {"phase": p, "procs": 1, "gpu_name": "NVIDIA H200", "date_utc": f"2026-12-0{day}T{seed}"}
            for day, p in enumerate(("base", "dense", "sparse"), 1)
        ],
        "command": f"python3 -m bench.extension --scale {m.scale} --phase sparse --evals pg19 --tag {model}-{variant}",
        "gpu_name": "NVIDIA H200",
        "base_set": list(m.base_set),
        "extend_set": [*seed_set, study.CHECK_EVERY, *v.sets],
        "sparse_extend_set": sorted([study.CHECK_EVERY, *v.sets]),
        "extend_steps": STEPS,
        "base_context": min(dense_ppl),
        "lengths": sorted(dense_ppl),
    }
    out = tmp_path / "results"
    stem = f"extension_experiment_1gpu_{m.scale}_sparse_{model}-{variant}-seed{seed}"
    write_extension_report(out, work, stem, header, records, final=False, figures=False)
    return out / f"{stem}.json"


PPL_128K = {4096: 10.0, 16384: 9.0, 65536: 8.9, 131072: 8.0}
PPL_64K = {2048: 12.0, 8192: 10.0, 32768: 9.5, 65536: 9.0}


def test_the_frontier_reads_gaps_speeds_checks_and_floors_off_the_extension_reports(tmp_path):
    flat = {n: 0.0 for n in PPL_128K}
    extension_report(tmp_path, "strong128k", "defaults", 0, PPL_128K, {**flat, 131072: 0.6}, {**flat, 131072: 0.8},
                     0.5, (0.006, 0.4))  # fmt: skip
    extension_report(tmp_path, "strong128k", "rt97", 0, PPL_128K, {**flat, 131072: 0.25}, {**flat, 131072: 0.28},
                     0.51, (0.002, 0.4))  # fmt: skip
    extension_report(tmp_path, "strong128k", "p95", 0, PPL_128K, {**flat, 131072: 0.35}, {**flat, 131072: 0.5},
                     0.50, (0.004, 0.4))  # fmt: skip
    gaps = {0: {2048: 0.0, 8192: 0.2, 32768: 0.3, 65536: 0.45}, 1: {2048: 0.1, 8192: 0.2, 32768: 0.4, 65536: 0.55}}
    for seed, gap in gaps.items():
        extension_report(tmp_path, "llama3", "p95", seed, PPL_64K, gap, gap, 0.3, (0.004, 0.1))
    md = (tmp_path / "results" / "extension_experiment_1gpu_128k_sparse_strong128k-defaults-seed0.md").read_text()
    assert "Dense check of the sparse run (every 10 steps, 15 checks" in md  # bench/extension's own markdown

    result = {"command": "test", "frontier": collect(sorted((tmp_path / "results").glob("*.json")))}
    models = result["frontier"]["models"]
    assert set(models) == {"strong128k", "llama3"}
    rows = {r["variant"]: r for r in models["strong128k"]["rows"]}
    defaults, rt97 = rows["defaults"], rows["rt97"]
    assert defaults["gap_pct"][131072] == pytest.approx(0.6) and defaults["gap_pct"][4096] == pytest.approx(0.0)
    assert defaults["gap_second_half_pct"][131072] == pytest.approx(0.8)
    assert defaults["sparse_prefill_pct"][131072] == pytest.approx(0.4)
    # steps 6-150 (the first 5 compile): sparse 0.5 s, and 0.4 s more at each of the 15 checks (steps 10-150)
    assert defaults["speed"]["median"] == pytest.approx(2.4) and defaults["speed"]["all_steps"] == pytest.approx(2.4)
    assert defaults["speed"]["all_steps_as_run"] == pytest.approx(145 * 1.2 / (145 * 0.5 + 15 * 0.4))
    assert defaults["check"]["checks"] == 15 and defaults["check"]["every"] == 10
    assert defaults["check"]["last_fifth_pct"] == pytest.approx(100 * math.expm1(0.006))
    assert defaults["check_minus_eval_pct"] == pytest.approx(100 * math.expm1(0.006) - 0.6)
    assert (defaults["density"], defaults["recall"], defaults["layer0_recall"]) == pytest.approx((0.24, 0.95, 0.88))
    assert defaults["dense_recall_share"] == pytest.approx(12 / 1200)
    verdicts = defaults["floors"]
    assert verdicts["gap at 128K ≤ +0.3%"] == {"value": pytest.approx(0.6), "holds": False, "second_seed_due": False}
    assert verdicts["gap, second half at 128K ≤ +0.3%"]["holds"] is False
    assert verdicts["speed, median ≥ 2.3×"] == {"value": pytest.approx(2.4), "holds": True, "second_seed_due": True}
    assert [v["holds"] for v in rt97["floors"].values()] == [True, True, True, True]
    assert rt97["speed"]["median"] == pytest.approx(1.2 / 0.51)
    assert rt97["floors"]["gap at 128K ≤ +0.3%"]["second_seed_due"]  # +0.25%: within 0.2 of the floor
    agreement = models["strong128k"]["agreement"]
    assert agreement["runs"] == 3 and agreement["spearman_check_eval"] == pytest.approx(1.0)
    checks = [100 * math.expm1(g) for g in (0.006, 0.002, 0.004)]
    assert agreement["mean_abs_check_minus_eval"] == pytest.approx(
        sum(abs(c - e) for c, e in zip(checks, (0.6, 0.25, 0.35), strict=True)) / 3
    )

    llama3 = models["llama3"]["rows"]
    assert [r["seed"] for r in llama3] == [0, 1, "pooled"]
    assert llama3[2]["gap_pct"][65536] == pytest.approx(0.5) and llama3[2]["gap_pct"][2048] == pytest.approx(0.05)
    assert llama3[0]["floors"]["gap at every length ≤ +0.5%"] == {
        "value": pytest.approx(0.45),
        "holds": True,
        "second_seed_due": False,  # two seeds ran
    }
    assert llama3[1]["floors"]["gap at every length ≤ +0.5%"]["holds"] is False

    files = write_frontier(result, tmp_path / "frontier")
    assert [f.name for f in files] == ["frontier.json", "frontier.png", "frontier.md"]
    assert (tmp_path / "frontier.png").stat().st_size > 10_000
    text = (tmp_path / "frontier.md").read_text()
    assert "| defaults | 0 | +0.00% (+0.00%) | +0.00% (+0.00%) | +0.00% (+0.00%) | +0.60% (+0.80%) | +0.40% |" in text
    assert "| 2.40× / 2.40× | 0.240 / 0.950 (0.880) | 1.0% | +0.60% (15) | +0.00% | ✗ ✗ ✓² ✓ |" in text
    assert "| p95 | pooled |" in text and "rank correlation 1.00" in text
    assert json.loads((tmp_path / "frontier.json").read_text())["frontier"]["models"]["llama3"]["rows"][2]["seed"] == (
        "pooled"
    )


def test_a_retrieval_run_is_a_row_of_its_own_and_its_eval_jobs_report_stands_for_it(tmp_path):
    flat = {n: 0.1 for n in PPL_128K}
    first = extension_report(tmp_path, "strong128k", "rt97", 0, PPL_128K, flat, flat, 0.5, (0.002, 0.4))
    report = json.loads(first.read_text())
    niah_run = {**report, "command": "python3 -m bench.extension --phase sparse --evals pg19,niah --tag x-niah"}
    rest = {  # r3: the eval job of what NIAH r2 left, resuming r2's records
        **niah_run,
        "command": "python3 -m bench.extension --phase eval --evals niah --tag x-niah-rest",
        "jobs": [*report["jobs"], {"phase": "eval", "date_utc": "later"}],
        "quality": {**report["quality"], "paired": {"niah": {"131072": {"mean": -1.5, "ci95": 5.2, "prompts": 66}}}},
    }
    for name, content in (("r2.json", niah_run), ("r3.json", rest)):
        (tmp_path / "results" / name).write_text(json.dumps(content))
    rows = collect(sorted((tmp_path / "results").glob("*.json")))["models"]["strong128k"]["rows"]
    assert [(r["variant"], r["file"]) for r in rows] == [("rt97", first.name), ("rt97, NIAH run", "r3.json")]
    assert rows[1]["niah_sparse_minus_dense"]["131072"]["prompts"] == 66
