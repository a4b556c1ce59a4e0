"""The quality frontier study (bench/quality_frontier) on CPU: its device calls are valid bench.extension jobs that
fit a call, a call hands its outputs to the next job and back in at most 8 files, the frontier report reads the
reports bench/extension writes (made here by its own report code from fabricated runs and evals) into the right
numbers, and a sparse job of two variants (bench.extension's own job at the smoke scale, the corpus build and
mtrain's runs and evals standing in) writes the report of each that the frontier reads, or skips one that no
longer fits its budget and says so."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.extension import handoff, variants
from bench.extension import job as job_module
from bench.extension.__main__ import main
from bench.extension.evals import EvalTask
from bench.extension.job import Record
from bench.extension.jobs import sparse_only
from bench.extension.report import bundle
from bench.extension.report import write as write_extension_report
from bench.quality_frontier import device, schedule, study
from bench.quality_frontier.frontier import collect, kept_rows, which_variant
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
    calls = schedule.plan(study.MODELS[model]) + schedule.retrieval_plan(study.MODELS[model], study.VARIANTS["rt97"])
    calls += schedule.plan(study.MODELS[model], seed=1, variants=["p90"])
    for call in calls:
        assert call.budget_s <= schedule.CALL_S, call
        for job in call.jobs:
            args = parsed(job.script_args, monkeypatch)  # exits 2 on anything bench.extension refuses
            assert args.scale == study.MODELS[model].scale and args.budget == job.budget_s
    dense, *sparse = [job for call in schedule.plan(study.MODELS[model]) for job in call.jobs][1:]
    dense_sets = set(parsed(dense.script_args, monkeypatch).extend_set)
    tags = []
    for job in sparse:
        args = parsed(job.script_args, monkeypatch)
        assert 1 <= len(args.variants) <= schedule.MAX_VARIANTS, job
        for tag, sets in args.variants:
            added = set(args.extend_set + sets) - dense_sets
            assert study.CHECK_EVERY in added and sparse_only(added), job  # what bench.extension lets a variant add
            tags.append(tag)
    assert tags == [f"{model}-{name}" for name in study.VARIANTS]  # every variant once, in order
    calls = schedule.plan(study.MODELS[model])
    assert [call.jobs[0].name for call in calls[:2]] == ["base", "dense"] and len(calls) == 2 + len(sparse)
    assert all(len(call.jobs) == 1 for call in calls)


def fake_extension(cmd, cwd, env):
    """bench/extension_experiment.sh as far as OUT goes: the files each phase leaves (a 39 MiB export: 3 parts; a
    job of several variants: each one's report and one tarball of their logs)."""
    out, args = Path(env["OUT"]), cmd[2:]
    phase = args[args.index("--phase") + 1]
    tags = [args[i + 1] for i, arg in enumerate(args) if arg in ("--tag", "--variant")]
    needs = [args[args.index(flag) + 1] for flag in ("--base-parts", "--resume", "--model-parts") if flag in args]
    assert all((Path(cwd) / path).exists() for path in needs), needs
    if "--variant" in args:
        (out / f"extension_experiment_1gpu_64k_sparse_{'_'.join(tags)}_logs.tar").write_text(" ".join(tags))
    elif phase != "eval":
        parts = out / f"{phase}_parts"
        parts.mkdir(parents=True)
        for name in ("export.tar.xz.00", "export.tar.xz.01", "export.tar.xz.02", "export.json", "logs.tar.gz"):
            (parts / name).write_text(f"{tags[0]} {name}")
    for tag in tags:
        stem = f"extension_experiment_1gpu_64k{'' if phase == 'eval' else '_' + phase}_{tag}"
        if phase == "eval":
            (out / f"{stem}_logs.tar.gz").write_text(tag)
            (out / f"{stem}_ppl.png").write_text(tag)
        for ext in ("json", "md"):
            (out / f"{stem}.{ext}").write_text(json.dumps({"tag": tag}))
    return subprocess.CompletedProcess(cmd, 0)


def test_every_sparse_run_starts_from_the_reference_so_a_variant_names_the_same_settings_in_every_row():
    for model in study.MODELS.values():
        for call in schedule.plan(model, variants=list(study.VARIANTS)):
            for job in call.jobs:
                if "--phase" in job.args and job.args[job.args.index("--phase") + 1] == "sparse":
                    sets = [job.args[i + 1] for i, arg in enumerate(job.args) if arg == "--extend-set"]
                    assert sets[-len(study.REFERENCE) :] == list(study.REFERENCE)  # the variants' sets come after
    check = study.CHECK_EVERY
    # a run from before the reference was explicit (the recipe held it) and one after it are the same row
    assert which_variant([check]) == which_variant([check, *study.REFERENCE]) == "p90"
    assert which_variant([check, *study.REFERENCE, "attention.p=0.95"]) == "p95"
    p96 = study.VARIANTS["p96lq512"].sets
    assert which_variant([check, *study.REFERENCE, *p96]) == which_variant([check, *p96]) == "p96lq512"
    assert which_variant([check, "attention.p=0.9"]) == "p90"
    assert which_variant([check, "attention.cap=8"]) == "attention.cap=8"


def test_calls_hand_each_job_what_the_last_left_return_at_most_8_files_and_take_files_them(tmp_path):
    model = study.MODELS["llama3"]
    calls = schedule.plan(model)
    device_repo, here = tmp_path / "device", tmp_path / "here"
    device_repo.mkdir()
    for call in calls[:3]:  # base; dense; two sparse variants in one job, after the dense run trained again
        out = tmp_path / f"out{call.name}"
        for path in call.carry[1:]:  # what the plan says to carry: filed here by earlier takes
            device.place(here / path, device_repo / path)
        assert device.run_call(call, out, repo=device_repo, work=tmp_path / "work", runner=fake_extension) == 0
        assert len([p for p in out.rglob("*") if p.is_file()]) <= device.MAX_FILES
        lines = device.take(out, repo=here)
        assert all(": pass; filed" in line for line in lines), lines
    assert (here / ".exp/llama3/base_parts/export.json").read_text() == "llama3 export.json"
    assert (here / ".exp/llama3/dense_logs.tar.gz").read_text() == "llama3 logs.tar.gz"
    results = sorted(p.name for p in (here / schedule.RESULTS).iterdir())
    assert "extension_experiment_1gpu_64k_sparse_llama3-p90_llama3-rt95_logs.tar" in results
    for variant in ("p90", "rt95"):
        assert f"extension_experiment_1gpu_64k_sparse_llama3-{variant}.json" in results
        assert f"extension_experiment_1gpu_64k_sparse_llama3-{variant}.md" in results
    assert calls[2].jobs[0].name == "sparse p90, rt95" and len(calls) == 12
    assert "--dense-here" in calls[2].jobs[0].args  # the speed of each variant against one machine's dense run


def test_a_job_whose_inputs_were_not_carried_is_skipped_and_said_so(tmp_path):
    call = schedule.plan(study.MODELS["qwen3"])[1]  # the dense run: needs the base's parts
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
    tmp_path: Path,
    model: str,
    variant: str,
    seed: int,
    dense_ppl: dict,
    gap: dict,
    half_gap: dict,
    step_s,
    check,
    dense_here_s: float | None = None,
) -> Path:
    """A sparse job's report as bench/extension writes it: its sparse run against the dense run it resumed (and,
    with `dense_here_s`, against that run trained again on its machine at that many seconds a step)."""
    m, v = study.MODELS[model], study.VARIANTS[variant]
    tokens = TOKENS_128K if m.scale == "128k" else TOKENS_64K
    work = tmp_path / "work" / f"{model}-{variant}-{seed}"
    records = []
    runs = [
        ("dense", 1.2, None),
        *([("dense-here", dense_here_s, None)] if dense_here_s else []),
        ("sparse", step_s, check),
    ]
    for name, seconds, run_check in runs:
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
    extension_report(tmp_path, "strong128k", "p90", 0, PPL_128K, {**flat, 131072: 0.6}, {**flat, 131072: 0.8},
                     0.5, (0.006, 0.4))  # fmt: skip
    extension_report(tmp_path, "strong128k", "rt97", 0, PPL_128K, {**flat, 131072: 0.25}, {**flat, 131072: 0.28},
                     0.51, (0.002, 0.4))  # fmt: skip
    extension_report(tmp_path, "strong128k", "p95", 0, PPL_128K, {**flat, 131072: 0.35}, {**flat, 131072: 0.5},
                     0.50, (0.004, 0.4))  # fmt: skip
    gaps = {0: {2048: 0.0, 8192: 0.2, 32768: 0.3, 65536: 0.45}, 1: {2048: 0.1, 8192: 0.2, 32768: 0.4, 65536: 0.55}}
    for seed, gap in gaps.items():
        extension_report(tmp_path, "llama3", "p95", seed, PPL_64K, gap, gap, 0.3, (0.004, 0.1))
    md = (tmp_path / "results" / "extension_experiment_1gpu_128k_sparse_strong128k-p90-seed0.md").read_text()
    assert "Dense check of the sparse run (every 10 steps, 15 checks" in md  # bench/extension's own markdown

    result = {"command": "test", "frontier": collect(sorted((tmp_path / "results").glob("*.json")))}
    models = result["frontier"]["models"]
    assert set(models) == {"strong128k", "llama3"}
    rows = {r["variant"]: r for r in models["strong128k"]["rows"]}
    p90, rt97 = rows["p90"], rows["rt97"]
    assert p90["gap_pct"][131072] == pytest.approx(0.6) and p90["gap_pct"][4096] == pytest.approx(0.0)
    assert p90["gap_second_half_pct"][131072] == pytest.approx(0.8)
    assert p90["sparse_prefill_pct"][131072] == pytest.approx(0.4)
    # steps 6-150 (the first 5 compile): sparse 0.5 s, and 0.4 s more at each of the 15 checks (steps 10-150)
    assert p90["speed"]["median"] == pytest.approx(2.4) and p90["speed"]["all_steps"] == pytest.approx(2.4)
    assert p90["speed"]["all_steps_as_run"] == pytest.approx(145 * 1.2 / (145 * 0.5 + 15 * 0.4))
    assert p90["check"]["checks"] == 15 and p90["check"]["every"] == 10
    assert p90["check"]["last_fifth_pct"] == pytest.approx(100 * math.expm1(0.006))
    assert p90["check_minus_eval_pct"] == pytest.approx(100 * math.expm1(0.006) - 0.6)
    assert (p90["density"], p90["recall"], p90["layer0_recall"]) == pytest.approx((0.24, 0.95, 0.88))
    assert p90["dense_recall_share"] == pytest.approx(12 / 1200) and p90["dense_step_share"] == 0.0
    verdicts = p90["floors"]
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
    assert "| p90 | 0 | +0.00% (+0.00%) | +0.00% (+0.00%) | +0.00% (+0.00%) | +0.60% (+0.80%) | +0.40% |" in text
    assert "| 2.40× / 2.40× | 0.240 / 0.950 (0.880) | 1.0% / 0.0% | +0.60% (15) | +0.00% | ✗ ✗ ✓² ✓ |" in text
    assert "| p95 | pooled |" in text and "rank correlation 1.00" in text
    assert json.loads((tmp_path / "frontier.json").read_text())["frontier"]["models"]["llama3"]["rows"][2]["seed"] == (
        "pooled"
    )


def test_speeds_are_against_the_dense_run_trained_again_on_the_sparse_runs_machine_where_the_job_did(tmp_path):
    """--dense-here: this machine ran the dense steps in 1.15 s where the dense run's machine took 1.2 s. The row's
    speed and its floor are this machine's; the probe-cost fit keeps the ratio to the dense run the rows share."""
    flat = {n: 0.0 for n in PPL_128K}
    for seed in (0, 1):
        extension_report(tmp_path, "strong128k", "p96lq512", seed, PPL_128K, flat, flat, 0.5, (0.0, 0.4), 1.15)
    result = {"command": "test", "frontier": collect(sorted((tmp_path / "results").glob("*.json")))}
    rows = result["frontier"]["models"]["strong128k"]["rows"]
    assert [r["seed"] for r in rows] == [0, 1, "pooled"]
    for r in rows:
        assert r["speed"]["here"] and r["speed"]["median"] == pytest.approx(1.15 / 0.5)
        assert r["speed"]["median_against_dense_run"] == pytest.approx(1.2 / 0.5)
        assert r["floors"]["speed, median ≥ 2.3×"]["value"] == pytest.approx(2.3)
    report = json.loads(
        (tmp_path / "results" / "extension_experiment_1gpu_128k_sparse_strong128k-p96lq512-seed0.json").read_text()
    )
    assert report["same_machine"]["losses_equal"] == report["same_machine"]["losses_compared"] == 150
    write_frontier(result, tmp_path / "frontier")
    assert "| 2.30× / 2.30× here |" in (tmp_path / "frontier.md").read_text()


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


def test_a_report_keeps_the_rows_written_before_that_no_new_report_replaces(tmp_path):
    flat = {n: 0.0 for n in PPL_128K}
    for variant, gap in (("p90", 0.6), ("rt97", 0.25)):
        at_128k = {**flat, 131072: gap}
        extension_report(tmp_path / "before", "strong128k", variant, 0, PPL_128K, at_128k, at_128k, 0.5, (0.004, 0.4))
    gap = {n: 0.3 for n in PPL_64K}
    extension_report(tmp_path / "before", "llama3", "p95", 0, PPL_64K, gap, gap, 0.3, (0.004, 0.1))
    result = {"command": "before", "frontier": collect(sorted((tmp_path / "before" / "results").glob("*.json")))}
    write_frontier(result, tmp_path / "frontier")
    kept = kept_rows(json.loads((tmp_path / "frontier.json").read_text()))
    assert len(kept) == 3 and all(isinstance(n, int) for r in kept for n in r["gap_pct"])

    # a later checkout: the reports above are gone; rt97 ran again and llama3's p95 gained a second seed
    at_128k = {**flat, 131072: 0.1}
    extension_report(tmp_path / "after", "strong128k", "rt97", 0, PPL_128K, at_128k, at_128k, 0.5, (0.002, 0.4))
    gap = {n: 0.5 for n in PPL_64K}
    extension_report(tmp_path / "after", "llama3", "p95", 1, PPL_64K, gap, gap, 0.3, (0.004, 0.1))
    models = collect(sorted((tmp_path / "after" / "results").glob("*.json")), kept)["models"]
    strong = {r["variant"]: r for r in models["strong128k"]["rows"]}
    assert strong["p90"]["gap_pct"][131072] == pytest.approx(0.6)  # kept
    assert strong["rt97"]["gap_pct"][131072] == pytest.approx(0.1) and strong["rt97"]["dense_job"] == "2026-12-02T0"
    assert [v["holds"] for v in strong["p90"]["floors"].values()] == [False, False, True, True]
    llama3 = models["llama3"]["rows"]
    assert [r["seed"] for r in llama3] == [0, 1, "pooled"]
    assert llama3[2]["gap_pct"][65536] == pytest.approx(0.4)
    assert models["strong128k"]["agreement"]["runs"] == 2


# ---------------------------------------------------------------------------------------------------------
# A sparse job of two variants (bench.extension --variant) at the smoke scale, read by the frontier

SMOKE_LENGTHS = (256, 512)  # SMOKE_64K's
CORPUS_OPTIONS = {"max_file_kb": 512.0, "source_root": []}  # what the package list check reads


def stand_in_corpus(out: Path, packages: tuple[str, int]) -> None:
    """What data.make_code_corpus leaves, as far as the jobs read it: the same files every time."""
    (out / "heldout").mkdir(parents=True)
    (out / "heldout" / "a.py").write_text("print('held out')\n")
    (out / "train_code.jsonl").write_text('{"text": "x = 1"}\n')
    manifest = {
        "options": CORPUS_OPTIONS,
        "packages_sha256": packages[0],
        "num_packages": packages[1],
        "split": {"train": 1, "held_out": 1},
        "files": {"num_docs": {"train_code.jsonl": 1}, "approx_tokens": {"train_code.jsonl": 3}},
        "heldout": {"files": 1, "approx_tokens": 5, "files_of_long_context": 1},
        "tokenizer": {"vocab_size": 64, "chars_per_token": {"heldout_code": 2.0}},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))


class StandIn:
    """Job.launch with the corpus build, `mtrain extend` and `mtrain eval` standing in (their outputs as the report
    reads them; a trivial process in their place): the sparse run with attention.p=0.95 steps 0.6 s and loses
    0.2% of perplexity, any other 0.5 s and 0.6% (the dense run: 1.2 s, trained again here: 1.1 s); `clock` moves
    on by `train_s` a run."""

    def __init__(self, packages: tuple[str, int], train_s: float = 0.0):
        self.packages, self.train_s, self.clock = packages, train_s, [0.0]
        self.commands: list[list[str]] = []
        self.gap_pct = 0.0

    def time(self) -> float:
        return time.time() + self.clock[0]

    def launch(self, original):
        def launch(job, rec, cmd, env=None):
            self.commands.append(cmd)
            if "data.make_code_corpus" in cmd:
                stand_in_corpus(Path(cmd[cmd.index("--out") + 1]), self.packages)
            elif "extend" in cmd:
                sets = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "--set"]
                p95, dense = "attention.p=0.95" in sets, "attention.mode=dense" in sets
                self.gap_pct = 0.2 if p95 else 0.6
                folder = Path(cmd[cmd.index("--output-dir") + 1]) / "run-0"
                run = (
                    write_run(folder, 2048, 1.1, None)
                    if dense
                    else write_run(folder, 2048, 0.6 if p95 else 0.5, (0, 0))
                )
                (run / "config.yaml").write_text("attention:\n  dense_below: 512\n")
                self.clock[0] += self.train_s
            elif "eval" in cmd:
                ppl = {n: 10.0 * (1 + self.gap_pct / 100) for n in SMOKE_LENGTHS}
                write_eval(Path(cmd[cmd.index("--out") + 1]), {"perplexity": ppl})
            proc = original(job, rec, ["true"], env)
            rec.command = " ".join(cmd)
            return proc

        return launch


def dense_job_outputs(tmp_path: Path, packages: tuple[str, int]) -> tuple[Path, Path]:
    """(the base job's parts folder, the dense job's logs tarball): a base export's config, and a dense run of
    1.2 s steps with its pg19 eval, as bench.extension's own handoff and bundle write them."""
    corpus, export = tmp_path / "base_corpus", tmp_path / "base_export"
    stand_in_corpus(corpus, packages)
    export.mkdir()
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    (export / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 256,
                                                    "rope_parameters": rope}))  # fmt: skip
    record = {"model": "base", "scale": "smoke-64k", "seed": 0, "base_context": 256, "factor": 8, "base_set": []}
    record.update(corpus=handoff.corpus_fingerprint(corpus), corpus_options=CORPUS_OPTIONS)
    handoff.write_parts(export, tmp_path / "base_parts", 128 * 1024, record)
    work = tmp_path / "work_dense"
    run = write_run(work / "runs" / "dense" / "run-0", 2048, 1.2)
    evals = write_eval(work / "evals" / "eval-dense-pg19", {"perplexity": {n: 10.0 for n in SMOKE_LENGTHS}})
    meta = asdict(EvalTask("eval-dense-pg19", "dense", "pg19", SMOKE_LENGTHS))
    records = [
        asdict(Record("dense", status="pass", wall_s=60.0, run_dir=str(run), meta={"job": "dense"})),
        asdict(Record("eval-dense-pg19", status="pass", wall_s=20.0, run_dir=str(evals), meta=meta)),
    ]
    jobs = [{"phase": phase, "procs": 1, "gpu_name": "CPU", "date_utc": phase} for phase in ("base", "dense")]
    header = {"scale": "smoke-64k", "notes": [], "jobs": jobs, "base_set": [], "extend_set": [], "extend_steps": 4}
    handoff.save_state(work, header, records)
    bundle(work, tmp_path / "dense_logs.tar.gz")
    return tmp_path / "base_parts", tmp_path / "dense_logs.tar.gz"


def run_variants_job(tmp_path: Path, monkeypatch, stand_in: StandIn, *extra: str) -> tuple[int, Path]:
    """bench.extension's main, in this process: --phase sparse with two --variant groups at the smoke scale."""
    base_parts, dense_logs = dense_job_outputs(tmp_path, stand_in.packages)
    monkeypatch.setattr(job_module.Job, "launch", stand_in.launch(job_module.Job.launch))
    for module in (job_module, variants):
        monkeypatch.setattr(module, "time", stand_in)
    monkeypatch.setattr(signal, "signal", lambda *_args: None)  # pytest's own handlers stay
    out = tmp_path / "out"
    argv = ["bench.extension", "--smoke", "--scale", "64k", "--phase", "sparse", "--evals", "pg19"]
    argv += ["--base-parts", str(base_parts), "--resume", str(dense_logs), "--extend-set", study.CHECK_EVERY]
    argv += ["--variant", "smoke-p90", "--variant", "smoke-p95", "attention.p=0.95", *extra]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out), "--work", str(tmp_path / "work")])
    return main(), out


def packages_here() -> tuple[str, int]:
    return handoff.package_list_sha256(CORPUS_OPTIONS)


def test_a_sparse_job_of_two_variants_writes_each_ones_report_and_the_frontier_reads_both(tmp_path, monkeypatch):
    stand_in = StandIn(packages_here())
    rc, out = run_variants_job(tmp_path, monkeypatch, stand_in)
    assert rc == 0
    stem = "extension_experiment_1cpu_64k_sparse"
    logs = f"{stem}_smoke-p90_smoke-p95_logs.tar"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{stem}_smoke-{v}.{ext}" for v in ("p90", "p95") for ext in ("json", "md")] + [logs]
    )  # 5 files: a device call returns 8
    built = [cmd for cmd in stand_in.commands if "data.make_code_corpus" in cmd]
    trained = [" ".join(cmd) for cmd in stand_in.commands if "extend" in cmd]
    assert len(built) == 1 and len(trained) == 2  # the corpus once, a run a variant
    assert all(f"--set {study.CHECK_EVERY}" in cmd for cmd in trained)
    assert "attention.p=0.95" not in trained[0] and "--set attention.p=0.95" in trained[1]
    with tarfile.open(out / logs) as tar:  # each variant's logs, as a one-variant job leaves them
        assert tar.getnames() == [f"{stem}_smoke-{v}_logs.tar.gz" for v in ("p90", "p95")]
        tar.extractall(tmp_path / "logs", filter="data")
    header, _records = handoff.restore_state(tmp_path / "logs" / f"{stem}_smoke-p95_logs.tar.gz", tmp_path / "again")
    assert header["sparse_extend_set"] == [study.CHECK_EVERY, "attention.p=0.95"]

    models = collect(sorted(out.glob("*.json")))["models"]
    rows = {r["variant"]: r for r in models["smoke-64k"]["rows"]}
    assert set(rows) == {"p90", "p95"}
    assert rows["p90"]["gap_pct"] == pytest.approx({256: 0.6, 512: 0.6})
    assert rows["p95"]["gap_pct"] == pytest.approx({256: 0.2, 512: 0.2})
    assert rows["p90"]["speed"]["median"] == pytest.approx(2.4)
    assert rows["p95"]["speed"]["median"] == pytest.approx(2.0)


def test_a_job_of_two_variants_trains_the_dense_run_again_once_and_times_both_against_it(tmp_path, monkeypatch):
    stand_in = StandIn(packages_here())
    rc, out = run_variants_job(tmp_path, monkeypatch, stand_in, "--dense-here")
    assert rc == 0
    trained = [" ".join(cmd) for cmd in stand_in.commands if "extend" in cmd]
    assert len(trained) == 3 and "run.name=dense-here" in trained[0] and "attention.mode=dense" in trained[0]
    assert all("attention.mode=sparse" in cmd for cmd in trained[1:])
    for variant, sparse_s in (("smoke-p90", 0.5), ("smoke-p95", 0.6)):
        report = json.loads((out / f"extension_experiment_1cpu_64k_sparse_{variant}.json").read_text())
        assert report["same_machine"]["median"] == pytest.approx(1.1 / sparse_s)
        assert report["sparse_vs_dense_tokens_per_s_without_checks"] == pytest.approx(1.2 / sparse_s)


def test_a_variant_that_no_longer_fits_the_budget_is_skipped_and_its_report_says_so(tmp_path, monkeypatch):
    stand_in = StandIn(packages_here(), train_s=1000.0)  # of the smoke scale's 1,500 s: the second would not fit
    rc, out = run_variants_job(tmp_path, monkeypatch, stand_in)
    assert rc == 1
    assert len([cmd for cmd in stand_in.commands if "extend" in cmd]) == 1
    skipped = json.loads((out / "extension_experiment_1cpu_64k_sparse_smoke-p95.json").read_text())
    (note,) = [n for n in skipped["notes"] if "not trained" in n]
    assert note.startswith("variant smoke-p95: not trained: time budget: ~10") and "s left" in note
    assert [r["status"] for r in skipped["records"] if r["name"] == "sparse"] == ["skipped"]
    assert "not trained: time budget" in (out / "extension_experiment_1cpu_64k_sparse_smoke-p95.md").read_text()
    rows = collect(sorted(out.glob("*.json")))["models"]["smoke-64k"]["rows"]
    assert [r["variant"] for r in rows] == ["p90"]  # a report without a sparse run is no row


def returned_call(folder: Path, date: str) -> Path:
    """A call's returned folder as the device leaves it: call.json, and one job whose report is dated `date`."""
    folder.mkdir(parents=True)
    (folder / "r.json").write_text(json.dumps({"date_utc": date}))
    copies = [["r.json", ".exp/quality_frontier/r.json"]]
    record = {"model": "qwen3", "call": "3", "jobs": [{"job": "sparse", "status": "pass", "copies": copies}]}
    (folder / device.CALL_RECORD).write_text(json.dumps(record))
    return folder


def test_take_files_nothing_older_than_what_it_would_replace(tmp_path):
    here = tmp_path / "here"
    device.take(returned_call(tmp_path / "new", "2026-12-03T08:00:00+00:00"), repo=here)
    filed = here / ".exp/quality_frontier/r.json"
    with pytest.raises(device.StaleCall, match=r"older than .exp/quality_frontier/r.json \(2026-12-03T08"):
        device.take(returned_call(tmp_path / "old", "2026-12-02T08:00:00+00:00"), repo=here)
    assert json.loads(filed.read_text())["date_utc"].startswith("2026-12-03")
    # a copy made into a folder that held an earlier call: refused before anything is read
    outer = returned_call(tmp_path / "outer", "2026-12-04T08:00:00+00:00")
    returned_call(outer / "5", "2026-12-05T08:00:00+00:00")
    with pytest.raises(device.StaleCall, match="holds another call's files in 5/"):
        device.take(outer, repo=here)
    assert json.loads(filed.read_text())["date_utc"].startswith("2026-12-03")


def test_probe_cost_is_a_runs_share_of_step_above_the_default_probes_line():
    """Three runs of the default probe on the line t = 0.02 + 1.6 · density (t: sparse / dense step time) against
    one dense run; a run with 512 probe queries 10% above the line at its density costs 10% of its step, and runs of
    other settings, or of another dense run without three of the default probe, are not judged."""
    from bench.quality_frontier.frontier import probe_cost

    def run(variant, density, settings, dense="d0", extra=0.0):
        step = (0.02 + 1.6 * density) / (1 - extra)
        return {
            "variant": variant,
            "seed": 0,
            "settings": ["attention.check_every=10", *settings],
            "dense_job": dense,
            "density": density,
            "speed": {"median": 1 / step},
        }

    rows = [
        run("p90", 0.22, []),
        run("p93", 0.25, ["attention.p=0.93"]),
        run("p95", 0.27, ["attention.p=0.95"]),
        run("p95lq512", 0.24, ["attention.p=0.95", "attention.last_q=512", "attention.max_probe_rows=2048"], extra=0.1),
        run("dense0", 0.24, ["attention.dense_layers=[0]"], extra=0.3),
        run("p95lq512", 0.24, ["attention.last_q=512"], dense="d1", extra=0.2),
    ]
    (cost,) = probe_cost(rows)
    assert cost["variant"] == "p95lq512" and cost["fit_runs"] == 3
    assert cost["share_of_step"] == pytest.approx(0.1)
    assert cost["speed_on_the_line"] == pytest.approx(1 / (0.02 + 1.6 * 0.24))
    assert cost["fit_error"] == pytest.approx(0.0, abs=1e-12)
