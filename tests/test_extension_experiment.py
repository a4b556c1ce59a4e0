"""The extension experiment (`python -m bench.extension`) end to end on CPU at its smoke scale of several processes,
split into jobs as on the device: --phase base (corpus, a tiny base pretrained with dp 2 under gloo, its export as
xz-compressed parts, the base's evals), --phase dense and --phase sparse from those parts (corpus rebuilt and
checked, one extension each under cp 2, that model's evals, its parts), then --phase eval (what was left, one
report with the figures)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from tiny_setup import set_args, small_run, step_losses

from bench.extension import evals, search
from bench.extension.evals import EVALS, LAUNCH_MARGIN, EvalTask, estimate_s, eval_command, eval_phase, eval_tasks
from bench.extension.job import Job, Record
from bench.extension.markdown import WARMUP_STEPS, compiled_note
from bench.extension.phases import BASE_MARGIN, finish_stopped_run, only_subdir, pretraining_steps
from bench.extension.report import paired_differences
from bench.extension.scales import GPU_64K, GPU_128K, GPU_256K, GPU_MULTI, SMOKE, SMOKE_64K, SMOKE_256K
from bench.extension.seeds import compare, markdown
from bench.extension.training import throughput_over_steps

REPO = Path(__file__).resolve().parents[1]
MODELS = {name: Path(name) for name in ("base", "base-yarn", "dense", "sparse", "sparse-prefill")}


def run_phase(out: Path, work: Path, *args: str) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "bench.extension", "--smoke", "--scale", "256k", "--out", str(out)]
    done = subprocess.run(
        [*command, "--work", str(work), *args], env=env, capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len([p for p in out.rglob("*") if p.is_file()]) <= 8, "a device call returns at most 8 files"
    return json.loads(next(out.glob("extension_experiment_*.json")).read_text())


def run_config(work: Path, name: str) -> dict:
    (config,) = (work / "runs" / name).glob("*/config.yaml")
    return yaml.safe_load(config.read_text())


@pytest.mark.slow
def test_base_dense_sparse_and_eval_jobs_of_two_processes_make_one_complete_report(tmp_path):
    base = run_phase(tmp_path / "base_out", tmp_path / "work_base", "--phase", "base")
    parts = tmp_path / "base_out" / "base_parts"
    manifest = json.loads((parts / "export.json").read_text())
    assert manifest["xz_bytes"] < manifest["tar_bytes"] and manifest["model"] == "base"
    assert sorted(p.name for p in parts.glob("export.tar.xz.*")) == [p["name"] for p in manifest["parts"]]
    assert base["eval_jobs"]["fail"] == 0 and base["procs"] == 2
    assert run_config(tmp_path / "work_base", "base")["parallel"]["dp"] == 2

    dense = run_phase(tmp_path / "dense_out", tmp_path / "work_dense", "--phase", "dense", "--base-parts", str(parts))
    assert dense["eval_jobs"]["fail"] == 0 and set(dense["training"]) == {"base", "dense"}
    parallel = run_config(tmp_path / "work_dense", "dense")["parallel"]
    assert (parallel["cp"], parallel["dp"], parallel["layout"]) == (2, 1, "zigzag")
    assert json.loads((tmp_path / "dense_out" / "dense_parts" / "export.json").read_text())["model"] == "dense"

    sparse_parts = tmp_path / "sparse_out" / "sparse_parts"
    dense_logs = tmp_path / "dense_out" / "dense_parts" / "logs.tar.gz"
    (tmp_path / "work_dense" / "corpus" / "stale.txt").write_text("x")  # a corpus not the base job's: built again
    sparse = run_phase(
        tmp_path / "sparse_out",
        tmp_path / "work_dense",  # on the dense job's machine
        *("--phase", "sparse", "--base-parts", str(parts), "--resume", str(dense_logs), "--dense-here"),
    )
    here = sparse["same_machine"]  # the dense run trained again on this machine: the same training, timed here
    assert here["losses_compared"] > 0 and here["losses_equal"] == here["losses_compared"]
    assert here["median"] > 0 and here["dense_step_s"] > 0 and "dense-here" in sparse["training"]
    sparse_md = next((tmp_path / "sparse_out").glob("extension_experiment_*.md")).read_text()
    assert "On this machine, against the dense run trained again here" in sparse_md
    parallel = run_config(tmp_path / "work_dense", "sparse")["parallel"]
    assert (parallel["cp"], parallel["dp"], parallel["layout"]) == (2, 1, "stripe")
    corpus = {r["name"]: r for r in sparse["records"]}["corpus-sparse"]
    assert (
        corpus["status"] == "pass"
        and corpus["rc"] == 0
        and not (tmp_path / "work_dense" / "corpus" / "stale.txt").exists()
    )

    report = run_phase(  # the sparse model's parts too: its evals had all passed, so nothing is left to run
        tmp_path / "eval_out",
        tmp_path / "work_eval",
        *("--phase", "eval", "--base-parts", str(parts), "--model-parts", str(sparse_parts)),
        *("--resume", str(sparse_parts / "logs.tar.gz")),
    )
    assert report["complete"] and report["eval_jobs"] == {"pass": 7, "fail": 0, "skipped": 0}
    assert [job["phase"] for job in report["jobs"]] == ["base", "dense", "sparse", "eval"]
    assert report["base_parts"]["tar_sha256"] == manifest["tar_sha256"]
    assert set(report["training"]) == {"base", "dense", "dense-here", "sparse"}
    assert report["trained_on"] == {"dense": "2 × CPU", "sparse": "2 × CPU"}
    assert (tmp_path / "work_eval" / "models" / "base" / "config.json").is_file()
    assert list((tmp_path / "work_eval" / "runs" / "sparse").glob("*/export/config.json"))
    for model in ("base", "base-yarn", "dense", "sparse"):
        assert report["quality"]["table"][model]["perplexity"], model
        assert report["quality"]["table"][model]["perplexity, second half"].keys() == (
            report["quality"]["table"][model]["perplexity"].keys()
        ), model
    assert set(report["quality"]["table"]["sparse-prefill"]) == {"niah"}  # the scale's one suite
    profile = report["sparse_step_profile"]  # mtrain profile step of the sparse-extended model, over cp 2
    assert profile["attention"] == "sparse" and profile["seq_len"] == 2048 and profile["mean"]["plan"] > 0
    assert profile["cp"] == 2
    md = next((tmp_path / "eval_out").glob("extension_experiment_*.md")).read_text()
    assert "Where the sparse step's time goes" in md and "GPU idle" not in md  # a CPU profile has no GPU timeline
    assert "| its second half |" in md and "**perplexity, second half**" in md
    assert len(list((tmp_path / "eval_out").glob("*.png"))) == 4
    names = {name for scores in report["quality"]["table"].values() for name in scores}
    ruler = {name for name in names if name.startswith("ruler/")}
    assert ruler and all(name.startswith("ruler/niah_") for name in ruler)  # RULER's niah tasks, no others
    assert {name for name in names if name.startswith("infinitebench/")} == {"infinitebench/passkey"}
    paired = report["quality"]["paired"]["niah"]  # the same NIAH prompts, answered by both extended models
    assert set(paired) == {"256", "512"} and all(c["prompts"] == 11 for c in paired.values())
    assert set(report["quality"]["paired_sparse_prefill"]["niah"]) == {"512"}  # from dense_below (512) up


SPARSE = ("--phase", "sparse", "--base-parts", "b")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scale", "256k"], "--scale 256k --phase all: that scale's jobs are base, dense, sparse and eval"),
        (["--scale", "128k", "--phase", "extend"], "--scale 128k --phase extend: that scale's jobs are base, dense"),
        (["--scale", "64k"], "--scale 64k --phase all: that scale's jobs are base, dense, sparse and eval"),
        (["--phase", "sparse"], "--phase sparse needs --base-parts DIR"),
        (["--phase", "eval"], "--phase eval needs --base-parts DIR, --model-parts DIR or both"),
        (["--phase", "dense", "--base-parts", "b", "--model-parts", "m"], "--phase dense takes no --model-parts"),
        (["--phase", "base", "--resume", "logs.tar.gz"], "--phase base continues no earlier job"),
        (["--phase", "sparse", "--base-parts", "b", "--base-step-s", "0.07"], "--phase sparse takes no --base-set or"),
        (["--evals", "pg19,mmlu"], "--evals mmlu: unknown; choose from pg19,niah,infinitebench,ruler,probe,profile"),
        (["--phase", "dense", "--base-parts", "b", "--variant", "a"], "--phase dense takes no --variant"),
        (["--phase", "dense", "--base-parts", "b", "--dense-here"], "--dense-here with --phase dense: it times"),
        ([*SPARSE, "--tag", "x", "--variant", "a"], "--tag x with --variant: each variant's TAG names its report's"),
        ([*SPARSE, *(arg for t in "abcd" for arg in ("--variant", t))], "--variant a b c d: at most 3 a job"),
        ([*SPARSE, "--variant", "a", "--variant", "a", "attention.p=0.95"], "--variant a a: each TAG once"),
        ([*SPARSE, "--variant", "a", "attention.p"], "--variant setting 'attention.p' is not KEY=VALUE"),
        ([*SPARSE, "--variant", "a/b"], "--tag or --variant 'a/b' must be letters, digits and dashes"),
    ],
)
def test_bad_job_arguments_are_one_line_and_exit_2(args, message, monkeypatch, capsys):
    from bench.extension.__main__ import parse_args

    monkeypatch.setattr(sys, "argv", ["bench.extension", "--out", "o", *args])
    with pytest.raises(SystemExit) as stopped:
        parse_args()
    assert stopped.value.code == 2 and capsys.readouterr().err.startswith(f"bench.extension: {message}")


def test_paired_differences_pair_the_prompts_both_models_answered():
    def prompt(suite, task, index, length=4096, seed=0, depth=None):
        return (suite, seed, task, length, index, depth)

    dense = {prompt("ruler", "niah_single_1", i): 1.0 for i in range(4)}
    dense[prompt("ruler", "vt", 0)] = 0.0
    dense[prompt("niah", "niah", 0, depth=50)] = 1.0
    sparse = {prompt("ruler", "niah_single_1", i): [1.0, 0.0, 1.0, 0.5][i] for i in range(4)}
    sparse[prompt("ruler", "vt", 0)] = 1.0
    sparse[prompt("ruler", "niah_single_1", 9)] = 0.0  # dense did not answer it: not a pair
    got = paired_differences(sparse, dense)
    assert set(got) == {"ruler niah tasks"}  # no NIAH prompt of both; vt is no niah task
    niah_tasks = got["ruler niah tasks"][4096]  # differences 0, -100, 0, -50: mean -37.5, sd 47.87
    assert niah_tasks["prompts"] == 4 and niah_tasks["mean"] == -37.5
    assert niah_tasks["ci95"] == pytest.approx(1.96 * 47.871355 / 2)


def test_speed_over_steps_leaves_out_warm_up_and_steps_where_a_run_compiled(tmp_path):
    def run(name: str, step_s: dict[int, float], built: dict[int, int] | None = None) -> Path:
        (tmp_path / name).mkdir()
        lines = [{"step": s, "tokens": 1000, "tokens_per_s": 1000 / t, "step_s": t} for s, t in step_s.items()]
        for line in lines if built is not None else []:  # runs that record what each step built
            line["kernels_built"] = built.get(line["step"], 0)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return tmp_path / name

    steps = range(1, 15)
    # step 2 compiles both (warm-up); step 9 is a cheap row that the sparse run's first dense call compiles (no
    # record: over 10x its median); at step 12 the sparse run built 3 kernels in 3x its median
    dense = run("dense", {s: 3.0 if s == 2 else 0.05 if s == 9 else 0.2 for s in steps})
    sparse_s = {s: 4.0 if s == 2 else 5.0 if s == 9 else 0.3 if s == 12 else 0.1 for s in steps}
    sparse = run("sparse", sparse_s, built={1: 40, 12: 3})
    got = throughput_over_steps(dense, sparse)
    assert got["first_step"] == WARMUP_STEPS + 1 and got["num_steps"] == 14 - WARMUP_STEPS - 2
    assert got["compiled"] == {"9": {"dense": 0.05, "sparse": 5.0}, "12": {"dense": 0.2, "sparse": 0.3}}
    assert got["ratio"] == pytest.approx(2.0)
    assert "2 later steps in both runs where one compiled (step 9: dense 0.05 s, sparse 5.00 s; step 12:" in (
        compiled_note(got)
    )


def test_speed_without_the_dense_checks_takes_their_seconds_out_of_the_steps_that_ran_one(tmp_path):
    for name, check_s in (("dense", 0.0), ("sparse", 0.3)):
        (tmp_path / name).mkdir()
        lines = []
        for step in range(1, 21):
            step_s = (1.0 if name == "dense" else 0.4) + (check_s if step % 10 == 0 else 0.0)
            line = {"step": step, "tokens": 1000, "tokens_per_s": 1000 / step_s, "step_s": step_s}
            lines.append({**line, "dense_check_s": check_s} if check_s and step % 10 == 0 else line)
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    got = throughput_over_steps(tmp_path / "dense", tmp_path / "sparse")  # steps 6-20: checks at 10 and 20
    assert got["check_s"] == {"dense": 0.0, "sparse": pytest.approx(0.6)}
    assert got["ratio"] == pytest.approx(1.0 * 15 / (0.4 * 15 + 0.6))
    assert got["ratio_without_checks"] == pytest.approx(2.5)


def test_64k_scale_is_one_gpu_a_2k_base_extended_32x_with_its_own_smoke_scale(monkeypatch):
    from bench.extension.__main__ import parse_args, pick_scale

    for smoke, scale in (([], GPU_64K), (["--smoke"], SMOKE_64K)):
        monkeypatch.setattr(sys, "argv", ["bench.extension", "--out", "o", "--scale", "64k", "--phase", "base", *smoke])
        assert pick_scale(parse_args()) is scale and scale.procs == 1
    long_context = int(GPU_64K.corpus_args[GPU_64K.corpus_args.index("--long-context") + 1])
    assert long_context == GPU_64K.base_context * GPU_64K.factor == max(GPU_64K.lengths) == 65536
    assert GPU_64K.base_recipe == "code-base.yaml" and GPU_64K.stem.endswith("_64k")


def test_256k_jobs_run_each_long_length_of_niah_and_ruler_alone_and_sparse_prefill_where_it_is_sparse():
    tasks = eval_tasks(GPU_256K, MODELS, "sparse", sparse_from=8192)
    assert len({t.name for t in tasks}) == len(tasks)
    ruler = [t for t in tasks if t.model == "dense" and t.kind == "ruler" and t.seed == 0]
    assert [t.lengths for t in ruler] == [(262144,), (131072,), (4096, 16384, 65536)]  # longest first
    assert [t.name for t in ruler] == [f"eval-dense-ruler-s0-{n}" for n in ("256K", "128K", "4K-16K-64K")]
    whole = {t.lengths for t in tasks if t.kind in ("pg19", "infinitebench") and t.model == "dense" and not t.seed}
    assert whole == {GPU_256K.lengths}  # few prompts: one process at every length
    assert {n for t in tasks if t.model == "sparse-prefill" for n in t.lengths} == {16384, 65536, 131072, 262144}
    later = {t.lengths for t in tasks if t.seed > 0 and t.model in ("dense", "sparse", "base-yarn")}
    assert later == {(131072,), (262144,), (131072, 262144)}  # NIAH and RULER each alone, InfiniteBench together
    assert max(t.seed for t in tasks) == GPU_256K.rounds - 1
    assert {t.lengths for t in tasks if t.model == "base" and t.kind != "pg19"} == {(4096,)}
    # perplexity past its context only as far as `mtrain eval` runs without --force-lengths (8x: 32K)
    assert {t.lengths for t in tasks if t.model == "base" and t.kind == "pg19"} == {(4096, 16384)}


def test_256k_extension_jobs_start_niah_first_the_longest_suite_there():
    """At 256K NIAH (the floors' suite) is the longest eval: behind RULER it did not fit either extension job."""
    tasks = eval_tasks(GPU_256K, MODELS, "sparse", sparse_from=8192)
    extended = ("dense", "sparse", "sparse-prefill")
    kinds = [t.kind for t in tasks if t.model in extended and t.seed == 0 and t.kind not in ("pg19", "probe")]
    assert kinds[0] == "niah" and kinds == sorted(kinds, key=("niah", "ruler", "infinitebench").index)
    assert set(kinds) == {"niah", "ruler", "infinitebench"}


@pytest.mark.parametrize("name, scale", [("128k", GPU_128K), ("256k", GPU_256K)])
def test_scales_of_several_gpus_build_the_corpus_for_the_length_they_extend_to(name, scale, monkeypatch):
    from bench.extension.__main__ import parse_args, pick_scale

    monkeypatch.setattr(sys, "argv", ["bench.extension", "--out", "o", "--scale", name, "--phase", "base"])
    assert pick_scale(parse_args()) is scale
    long_context = int(scale.corpus_args[scale.corpus_args.index("--long-context") + 1])
    assert long_context == scale.base_context * scale.factor == max(scale.lengths) == int(name[:-1]) * 1024
    assert scale.stem.endswith(f"_{name}") and scale.procs == 0  # every GPU present


def test_eval_commands_choose_tasks_attention_and_suites():
    from types import SimpleNamespace

    def command(scale, task: EvalTask) -> list[str]:
        job = SimpleNamespace(scale=scale, work=Path("/w"), args=SimpleNamespace(python="python"))
        job.mtrain = lambda *args: ["mtrain", *args]
        return eval_command(job, task, MODELS, None)

    passkey = command(GPU_256K, EvalTask("e", "sparse-prefill", "infinitebench", (262144,)))
    assert passkey[passkey.index("--tasks") + 1] == "passkey" and passkey[-2:] == ["--attention", "sparse"]
    assert "--tasks" not in command(GPU_MULTI, EvalTask("e", "dense", "infinitebench", (4096,)))
    (together,) = [t for t in eval_tasks(SMOKE_256K, MODELS, "eval") if t.model == "sparse" and t.kind != "probe"]
    assert (
        together.kind == "pg19,ruler,niah,infinitebench"
        and together.name == "eval-sparse-pg19-ruler-niah-infinitebench-s0"
    )
    every = command(SMOKE_256K, together)
    assert every[every.index("--suite") + 1] == together.kind and "--pg19-dir" in every and "--haystack-dir" in every
    tasks = every[every.index("--tasks") + 1].split(",")  # every suite keeps a task: pg19 and niah their one
    assert (
        {"pg19", "niah", "passkey", "niah_single_1"} <= set(tasks) and "vt" not in tasks and "kv_retrieval" not in tasks
    )
    base = [t for t in eval_tasks(SMOKE_256K, MODELS, "eval") if t.model == "base"]
    assert [(t.kind, t.lengths) for t in base] == [("pg19,niah,infinitebench,ruler", (256, 512))]


def test_evals_keep_only_the_chosen_suites_in_their_order():
    """--evals pg19: a fast loop over the perplexity gap runs every model's perplexity and nothing else."""
    every = eval_tasks(GPU_256K, MODELS, "sparse", sparse_from=8192)
    only = eval_tasks(GPU_256K, MODELS, "sparse", sparse_from=8192, evals=("pg19",))
    assert only == [t for t in every if t.kind == "pg19"]
    assert {t.model for t in only} == {"base", "base-yarn", "dense", "sparse", "sparse-prefill"}
    some = eval_tasks(GPU_256K, MODELS, "sparse", sparse_from=8192, evals=("probe", "niah"))
    assert some == [t for t in every if t.kind in ("probe", "niah")] and {t.kind for t in some} == {"probe", "niah"}
    (together,) = [t for t in eval_tasks(SMOKE_256K, MODELS, "eval", evals=("pg19", "ruler")) if t.model == "sparse"]
    assert together.kind == "pg19,ruler"


def test_extend_job_evaluates_the_extended_models_first_ruler_before_shorter_suites():
    """The eval plan of the 64K extend job: the extended models' perplexity, then RULER (the longest job, started
    while there is time for it), then NIAH, InfiniteBench and the layer probes; the base's retrieval only at its
    own context."""
    models = {name: Path(name) for name in ("base", "base-yarn", "dense", "sparse")}
    tasks = eval_tasks(GPU_MULTI, models, "extend")
    first = [(t.model, t.kind) for t in tasks[:10]]
    assert first == [
        (model, kind) for kind in ("pg19", "ruler", "niah", "infinitebench") for model in ("dense", "sparse")
    ] + [("sparse", "probe"), ("dense", "probe")]
    assert {t.lengths for t in tasks if t.model == "base" and t.kind != "pg19"} == {(4096,)}
    assert tasks[2].kind == "ruler" and tasks[2].lengths == GPU_MULTI.lengths == (4096, 8192, 16384, 32768, 65536)


def fake_run(root: Path, name: str, seed: int, niah: dict[str, list[float]], ppl: dict[str, float]) -> Path:
    """A report JSON and its logs tarball, as the extension experiment writes them: the extensions' config and
    one NIAH eval job per model (`niah`: model -> score per prompt, prompts at 4096 and depth 50 by index)."""
    import tarfile

    logs = root / name / "extension_experiment"
    records = []
    for mode in ("dense", "sparse"):
        run = logs / "runs" / mode / f"{mode}-1"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(f"run:\n  seed: {seed}\n")
    for model, scores in niah.items():
        rec = f"eval-{model}-niah-s0"
        run = logs / "evals" / rec / "eval-1"
        run.mkdir(parents=True)
        lines = [
            {"task": "niah", "length": 4096, "index": i, "score": s, "meta": {"depth": 50}}
            for i, s in enumerate(scores)
        ]
        (run / "predictions.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (run / "results.json").write_text("{}")  # what marks a finished eval run
        records.append({"name": rec, "status": "pass", "meta": {"model": model, "kind": "niah", "seed": 0}})
    with tarfile.open(root / f"{name}_logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="extension_experiment")
    report = {
        "records": records,
        "date_utc": "2026-11-26",
        "src_sha256": "0" * 16,
        "sparse_vs_dense_tokens_per_s": 1.5,
        "quality": {"table": {m: {"perplexity": {"4096": v}} for m, v in ppl.items()}},
    }
    path = root / f"{name}.json"
    path.write_text(json.dumps(report))
    return path


def test_extension_seeds_pairs_prompts_within_and_across_runs(tmp_path):
    first = fake_run(tmp_path, "a", 0, {"dense": [1, 1, 0, 1], "sparse": [1, 0, 0, 1]}, {"dense": 10.0, "sparse": 10.1})
    second = fake_run(tmp_path, "b", 1, {"dense": [1, 1, 1, 1], "sparse": [1, 1, 1]}, {"dense": 9.5, "sparse": 9.5})
    got = compare([first, second])
    assert [run["training_seed"] for run in got["runs"]] == [0, 1]
    assert got["runs"][0]["ppl_sparse_vs_dense_pct"][4096] == pytest.approx(1.0)
    assert got["runs"][0]["sparse_minus_dense"]["niah"][4096]["mean"] == -25.0  # 0, -100, 0, 0
    assert got["runs"][1]["sparse_minus_dense"]["niah"][4096]["prompts"] == 3  # sparse answered 3
    pooled = got["pooled_sparse_minus_dense"]["niah"][4096]  # the 4 + 3 pairs of both runs
    assert pooled["prompts"] == 7 and pooled["mean"] == pytest.approx(-100 / 7)
    noise = got["training_noise"]["dense"]  # seed 1 − seed 0, the same prompts: 0, 0, +100, 0
    assert noise["ppl_pct"][4096] == pytest.approx(-5.0) and noise["retrieval"]["niah"][4096]["mean"] == 25.0
    text = markdown({"command": "python3 -m bench.extension.seeds ...", **got})
    assert "| **niah, pooled** | -14.3 ± " in text and "| niah, dense | +25.0 ± 49.0 (4) |" in text


def test_extension_recipes_are_judged_against_base_yarn_prompt_by_prompt(tmp_path):
    niah = {"base-yarn": [1, 1, 1, 1], "dense": [1, 1, 0, 1], "sparse": [1, 1, 1, 1]}
    within_noise = fake_run(tmp_path, "a", 0, niah, {"base-yarn": 10.0, "dense": 9.0, "sparse": 9.1})
    misses = {"base-yarn": [1, 1, 1, 1], "dense": [0, 0, 0, 0]}
    below = fake_run(tmp_path, "b", 0, misses, {"base-yarn": 10.0, "dense": 9.0})
    report = json.loads(within_noise.read_text())
    report["extend_steps"] = 200
    report["training"] = {"dense": {"val_loss": {"0": 1.28, "200": 1.2066}}}
    within_noise.write_text(json.dumps(report))
    first, second = search.compare([within_noise, below])
    dense = first["models"]["dense"]
    assert dense["minus_base_yarn"]["niah"][4096] == {"mean": -25.0, "ci95": pytest.approx(49.0), "prompts": 4}
    assert dense["verdict"] == "matches" and first["models"]["sparse"]["verdict"] == "beats"
    assert dense["ppl_vs_base_yarn_pct"][4096] == pytest.approx(-10.0)
    assert second["models"]["dense"]["verdict"] == "below: niah 4K" and "sparse" not in second["models"]
    assert second["models"]["dense"]["minus_first"]["niah"][4096]["mean"] == -75.0  # 0 − (1, 1, 0, 1)
    assert second["base_yarn_same_answers_as_first"] == [4, 4]
    text = search.markdown({"command": "python3 -m bench.extension.search ...", "variants": [first, second]})
    assert "| | | niah | -25.0 ± 49.0 (4) | |" in text
    assert "| (recipe defaults) | dense | ppl | -10.00% | matches |" in text
    assert "- `(recipe defaults)`, dense, 200 steps: val loss 1.280 -> 1.207; matches" in text
    assert "- `(recipe defaults)`, sparse, 200 steps: val loss –; beats" in text
    assert "base+YaRN, evaluated in each job, answered 4 of 4 shared prompts alike" in text
    assert "| (recipe defaults) | dense | ppl | +0.00% |" in text  # b's dense perplexity is a's


def run_eval_phase(tmp_path: Path, seconds_left: float, concurrency: int, num_gpus: int = 0, scale=SMOKE) -> list:
    """bench.extension.evals.eval_phase on a stand-in job with `seconds_left` before its evals' deadline (the
    caller monkeypatches which tasks, their estimates and commands); -> the job's records."""
    import time
    from types import SimpleNamespace

    job = SimpleNamespace(
        deadline=time.time() + scale.report_s + seconds_left,
        scale=scale,
        num_gpus=num_gpus,
        phase="extend",
        args=SimpleNamespace(concurrency=concurrency, evals=EVALS),
        env=dict(os.environ),
        work=tmp_path,
        start=time.time(),
        records=[],
        running={},
        write=lambda: None,
    )
    for method in ("add", "launch", "finish"):
        setattr(job, method, getattr(Job, method).__get__(job))
    eval_phase(job, {"dense": tmp_path / "model"})
    return job.records


@pytest.mark.parametrize("wrote_results", [True, False])
def test_an_eval_stopped_at_the_deadline_counts_if_it_had_written_its_results(tmp_path, monkeypatch, wrote_results):
    """An eval that wrote summary.md (its last file) but had not exited when the budget ended passes; one that
    had not written it is skipped."""
    task = EvalTask("eval-dense-niah-s0", "dense", "niah", (256,), 0, 1)
    write = f"import pathlib; d = pathlib.Path({str(tmp_path / 'evals' / task.name / 'eval-dense-1')!r}); "
    write += "d.mkdir(parents=True); (d / 'summary.md').write_text('done'); " if wrote_results else ""
    monkeypatch.setattr(evals, "eval_tasks", lambda *args: [task])
    monkeypatch.setattr(evals, "estimate_s", lambda *args: 0.0)  # launched whatever the plan says
    monkeypatch.setattr(
        evals, "eval_command", lambda *args: [sys.executable, "-c", write + "import time; time.sleep(60)"]
    )
    (rec,) = run_eval_phase(tmp_path, seconds_left=3, concurrency=1)
    assert (rec.status, rec.rc) == (("pass", None) if wrote_results else ("skipped", None))
    assert rec.reason.startswith("stopped at the time budget's end")


def test_an_eval_starts_only_with_a_margin_before_the_deadline(tmp_path, monkeypatch):
    """Estimates run short when jobs share the GPU: a job whose estimate fits the time left, but not with the
    margin, is skipped rather than started and stopped at the deadline."""
    tasks = [EvalTask(f"eval-dense-niah-s{seed}", "dense", "niah", (256,), seed, 1) for seed in (0, 1)]
    left = 100.0
    fits = left / LAUNCH_MARGIN - 1  # s0 fits with the margin; s1 fits the time left, not the margin
    monkeypatch.setattr(evals, "eval_tasks", lambda *args: tasks)
    monkeypatch.setattr(evals, "estimate_s", lambda job, task, done: fits if task.seed == 0 else left - 1)
    monkeypatch.setattr(evals, "eval_command", lambda *args: [sys.executable, "-c", "pass"])
    records = run_eval_phase(tmp_path, seconds_left=left, concurrency=2)
    assert [(r.name, r.status) for r in records] == [("eval-dense-niah-s0", "pass"), ("eval-dense-niah-s1", "skipped")]
    assert records[1].reason.startswith("time budget: ~99 s needed")


def test_eval_processes_see_one_gpu_each_the_least_busy(tmp_path, monkeypatch):
    tasks = [EvalTask(f"eval-dense-niah-s{seed}", "dense", "niah", (256,), seed, 1) for seed in range(3)]
    saw = "import os, pathlib, sys; pathlib.Path(sys.argv[1]).write_text(os.environ['CUDA_VISIBLE_DEVICES'])"
    monkeypatch.setattr(evals, "eval_tasks", lambda *args: tasks)
    monkeypatch.setattr(evals, "estimate_s", lambda *args: 0.0)
    monkeypatch.setattr(
        evals, "eval_command", lambda job, task, *rest: [sys.executable, "-c", saw, str(tmp_path / task.name)]
    )
    records = run_eval_phase(tmp_path, seconds_left=60, concurrency=1, num_gpus=2)  # one process a GPU
    assert all(r.status == "pass" for r in records)
    assert [(tmp_path / r.name).read_text() for r in records] == [str(r.meta["gpu"]) for r in records]
    assert [r.meta["gpu"] for r in records[:2]] == [0, 1]  # both idle at the start: one process each


def test_an_eval_holding_the_longest_prompts_has_its_gpu_to_itself(tmp_path, monkeypatch):
    """At a scale with alone_from, a process takes a GPU's share by its longest prompt: the 1024-token one fills a
    GPU of 2 places, so both shorter ones share the other GPU, and none starts beside it."""
    scale = replace(SMOKE, lengths=(256, 1024), alone_from=1024)
    tasks = [
        EvalTask("eval-dense-niah-s0-1K", "dense", "niah", (1024,), 0, 1),
        *(EvalTask(f"eval-dense-niah-s{seed}-256", "dense", "niah", (256,), seed, 1) for seed in (1, 2, 3)),
    ]
    spans = tmp_path / "spans"
    spans.mkdir()
    log = "import pathlib, sys, time; t = time.time(); time.sleep(1.5); "
    log += "pathlib.Path(sys.argv[1]).write_text(f'{t} {time.time()}')"
    monkeypatch.setattr(evals, "eval_tasks", lambda *args: tasks)
    monkeypatch.setattr(evals, "estimate_s", lambda *args: 0.0)
    monkeypatch.setattr(
        evals, "eval_command", lambda job, task, *rest: [sys.executable, "-c", log, str(spans / task.name)]
    )
    records = run_eval_phase(tmp_path, seconds_left=60, concurrency=2, num_gpus=2, scale=scale)
    assert all(r.status == "pass" for r in records)
    assert [(r.meta["gpu"], r.meta["gpu_slots"]) for r in records[:3]] == [(0, 2), (1, 1), (1, 1)]
    span = {r.name: tuple(map(float, (spans / r.name).read_text().split())) for r in records}
    long_end = span["eval-dense-niah-s0-1K"][1]
    beside = [r.name for r in records[1:] if r.meta["gpu"] == 0 and span[r.name][0] < long_end]
    assert beside == []  # s3 waited for a place, and was on GPU 0 only after the long one had ended


def test_eval_time_estimate_scales_a_larger_measurement_down_by_tokens_never_a_smaller_one_up():
    from types import SimpleNamespace

    job = SimpleNamespace(scale=GPU_MULTI)  # eval start-up 15 s; lengths 4K..64K (124K tokens in all)
    every = EvalTask("eval-dense-ruler-s0", "dense", "ruler", GPU_MULTI.lengths, 0, 4)
    long = EvalTask("eval-dense-ruler-s1", "dense", "ruler", (32768, 65536), 1, 4)
    short = EvalTask("eval-base-ruler-s0", "base", "ruler", (4096,), 0, 4)
    first_guess = GPU_MULTI.suite_s["ruler"]
    assert estimate_s(job, every, []) == pytest.approx(first_guess)
    assert estimate_s(job, long, []) == pytest.approx(15 + (first_guess - 15) * 2 / 5)
    assert estimate_s(job, long, [(every, 240.0)]) == pytest.approx(15 + 225 * 96 / 124)
    assert estimate_s(job, long, [(every, 240.0), (long, 150.0)]) == 150.0  # measured at its own lengths
    # The base's 4K round (35 s) says little of a round at every length: the first guess stands
    assert estimate_s(job, every, [(short, 35.0)]) == pytest.approx(first_guess)
    assert estimate_s(job, short, [(every, 240.0)]) == pytest.approx(15 + 225 * 4 / 124)
    # At 256K a first guess is shared by tokens: the 256K prompts are most of a round
    job = SimpleNamespace(scale=GPU_256K)
    longest = EvalTask("eval-dense-niah-s0-256K", "dense", "niah", (262144,), 0, 2)
    share = 262144 / sum(GPU_256K.lengths)
    assert estimate_s(job, longest, []) == pytest.approx(20 + (GPU_256K.suite_s["niah"] - 20) * share)


def test_a_base_job_plans_the_pretraining_steps_that_fit_its_budget():
    """A base stopped at the budget exports nothing: where the scale knows its step time, the job asks for the
    steps that fit (with the margin), and says so; with time to spare, the recipe's (or --base-set's) stand."""
    from types import SimpleNamespace

    recipe_steps = yaml.safe_load(Path("recipes", GPU_256K.base_recipe).read_text())["train"]["num_steps"]

    def job(left_s: float, base_step_s: float | None = None):
        args = SimpleNamespace(base_step_s=base_step_s)
        return SimpleNamespace(scale=GPU_256K, left=lambda: left_s, header={"notes": []}, args=args)

    later_s, step_s = 60.0, GPU_256K.base_step_s * BASE_MARGIN
    short = job(later_s + GPU_256K.base_start_s + 1000.5 * step_s)
    assert pretraining_steps(short, [], later_s) == 1000
    assert short.header["notes"] == [
        f"pretraining steps {recipe_steps} -> 1000: {short.left():.0f} s were left, ~{GPU_256K.base_start_s:.0f} s "
        f"of start-up and ~{GPU_256K.base_step_s} s a step"
    ]
    roomy = job(later_s + GPU_256K.base_start_s + recipe_steps * step_s + 1)
    assert pretraining_steps(roomy, [], later_s) is None and roomy.header["notes"] == []
    assert pretraining_steps(short, ["train.num_steps=900"], later_s) is None  # asked for fewer than fit
    assert pretraining_steps(job(1e6), [], later_s) is None
    multi = SimpleNamespace(scale=GPU_MULTI, args=SimpleNamespace(base_step_s=None))
    assert pretraining_steps(multi, [], later_s) is None  # its step time not known
    # --base-step-s: the machine's own step time (one H200 ran 0.065 s) fits more steps in the same budget
    fast = job(short.left(), base_step_s=GPU_256K.base_step_s / 2)
    assert pretraining_steps(fast, [], later_s) is None  # the recipe's 1,500 fit
    assert pretraining_steps(fast, ["train.num_steps=3000"], later_s) in (2000, 2001)  # twice the 1,000 above
    assert fast.header["notes"][0].endswith(f"~{GPU_256K.base_step_s / 2} s a step")


def test_a_base_stopped_at_the_budget_is_exported_at_the_step_it_reached(tmp_path, monkeypatch):
    """The job stops a run at its timeout with SIGTERM; mtrain saves a checkpoint on the way out, and
    finish_stopped_run exports it: `--resume` at that step writes the export and summary, training no more."""
    args = argparse.Namespace(
        phase="base", out=tmp_path / "out", work=tmp_path / "work", budget=600, python=sys.executable
    )
    job = Job(args, SMOKE)
    runs = job.work / "runs" / "base"
    cmd = job.mtrain("extend", "--recipe", "tiny", *set_args(small_run(100_000, runs)))
    launch = job.launch

    def launch_until_training(rec, cmd, env=None):
        """The run once it has trained 2 steps: the timeout counts from there, not from a start-up that takes
        5-15 s by the machine's load."""
        proc = launch(rec, cmd, env)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            run_dir = only_subdir(runs)
            if run_dir and (run_dir / "metrics.jsonl").is_file() and len(step_losses(run_dir)) >= 2:
                break
            time.sleep(0.05)
        return proc

    monkeypatch.setattr(job, "launch", launch_until_training)
    rec = Record("base")
    assert not job.run(rec, cmd, timeout=1)
    assert rec.reason.startswith("stopped at the time budget")

    run_dir = finish_stopped_run(job, "base", timeout=180)
    assert run_dir is not None
    (saved,) = (run_dir / "checkpoints").iterdir()
    trained = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert saved.name == f"step_{trained[-1]:06d}" and summary["steps"]["end"] == trained[-1] > 1
    assert (run_dir / "export" / "config.json").is_file()
    assert job.header["notes"] == [
        f"base: stopped at the time budget; its checkpoint at step {trained[-1]} (saved on the stop) is exported"
    ]
