"""The training phases of the extension experiment: the corpus, pretraining (its export kept in bf16), base+YaRN
untrained, the dense and sparse extensions (under torchrun over the scale's processes: the base with dp, the
extensions with cp), and the parts a later job takes (how the kinds of job chain them: jobs.py)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

from bench.extension import handoff
from bench.extension.job import Job, Record
from bench.extension.markdown import DENSE_HERE, label
from mtrain_cli.config import ContextConfig  # yaml and dataclasses only
from mtrain_cli.model import apply_context_extension

REPO = Path(__file__).resolve().parents[2]
# The steps a base job plans for fit the time left this many times over: its step time varied 1.5x between two
# jobs on the same kind of machine; one that still runs long is stopped and exported where it got to (FINISH_S)
BASE_MARGIN = 1.1
PARTS_S = 20  # an export's xz parts and the base+YaRN config (16 s for the 256k base on 4 x H100)
FINISH_S = 45  # a base stopped at the budget: mtrain's start-up, its checkpoint read, the export (finish_stopped_run)


def only_subdir(parent: Path) -> Path | None:
    dirs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    return dirs[-1] if dirs else None


# ---------------------------------------------------------------------------------------------------------
# Training phases


def corpus_phase(job: Job, expected: dict | None = None) -> bool:
    """The corpus; in a later job (`expected`: the base job's fingerprint) checked to be the base job's. A later job
    on a machine where an earlier one left the corpus (in the work directory) reuses it if every file is the base
    job's, byte for byte: the build takes 35-40 s a device call at 128K."""
    name = "corpus" if job.phase in ("all", "base") else f"corpus-{job.phase}"
    corpus = job.work / "corpus"
    if expected is not None and (corpus / "manifest.json").is_file():
        started = time.time()
        try:
            handoff.check_corpus(expected, handoff.corpus_fingerprint(corpus))
        except handoff.JobsError:
            pass  # built for another base or cut short: built again below
        else:
            reason = "reused: the corpus an earlier job left here, every file the base job's (sha256)"
            job.add(
                Record(name, status="pass", reason=reason, wall_s=round(time.time() - started, 1), run_dir=str(corpus))
            )
            print(f"[{time.time() - job.start:6.1f} s] {name}: {reason}", flush=True)
            return True
    shutil.rmtree(corpus, ignore_errors=True)
    cmd = [
        job.args.python,
        "-m",
        "data.make_code_corpus",
        "--out",
        str(job.work / "corpus"),
        "--seed",
        str(job.args.seed),
        *job.scale.corpus_args,
    ]
    rec = Record(name, run_dir=str(job.work / "corpus"))
    # One process, most of its time in the tokenizer (encoding, BPE training): its own threads may run here
    # (the jobs' TOKENIZERS_PARALLELISM=false is for the forking tokenisation of mtrain extend). The same bytes
    # either way; 28.7 -> 17.8 s on 2 cores for a 20 MB corpus (the device's took 98-117 s on one thread).
    if not job.run(rec, cmd, min(300, job.left()), env=dict(job.env, TOKENIZERS_PARALLELISM="true")):
        return False
    if expected is None:
        heldout = json.loads((job.work / "corpus" / "manifest.json").read_text())["heldout"]
        if heldout["files_of_long_context"] < job.scale.books:
            job.header["notes"].append(
                f"perplexity at {label(job.scale.lengths[-1])}: {heldout['files_of_long_context']} of the "
                f"{job.scale.books} held-out packages asked have that many tokens"
            )
    else:
        try:
            handoff.check_corpus(expected, handoff.corpus_fingerprint(job.work / "corpus"))
        except handoff.JobsError as exc:
            rec.status, rec.reason = "fail", str(exc)
            job.fail(str(exc))
            return False
    return True


def train_phase(
    job: Job, name: str, recipe: str, model: Path | None, sources: list[str], sets: list[str], timeout: float
) -> Path | None:
    """mtrain extend (of `model`, else a fresh one) into WORK/runs/<name>, over the job's training processes;
    -> the run directory when it passed."""
    corpus, runs = job.work / "corpus", job.work / "runs" / name
    shutil.rmtree(runs, ignore_errors=True)
    cmd = job.mtrain(
        "extend",
        *(["--nproc", str(job.procs)] if job.procs > 1 else []),
        "--recipe",
        str(REPO / "recipes" / recipe),
        "--output-dir",
        str(runs),
        *(["--model", str(model)] if model is not None else []),
        *[arg for source in sources for arg in ("--data", str(corpus / source))],
        "--set",
        f"run.name={name}",
        "--set",
        f"run.seed={job.args.seed}",
        "--set",
        f"model.tokenizer={corpus / 'tokenizer'}",
        *[arg for item in sets for arg in ("--set", item)],
    )
    rec = Record(name)
    passed = job.run(rec, cmd, timeout)
    rec.run_dir = str(only_subdir(runs)) if only_subdir(runs) else None
    return Path(rec.run_dir) if passed and rec.run_dir else None


def finish_stopped_run(job: Job, name: str, timeout: float) -> Path | None:
    """A run stopped at the budget saved a checkpoint on its way out (mtrain's SIGTERM); `--resume` with
    train.num_steps at that step finishes it: the export and summary of what it trained, and no more steps.
    -> its run directory, or None (no checkpoint, or the finish failed)."""
    run_dir = only_subdir(job.work / "runs" / name)
    saved = [p.name.removeprefix("step_") for p in run_dir.glob("checkpoints/step_*")] if run_dir else []
    steps = sorted(int(step) for step in saved if step.isdigit())  # step_NNNNNN.tmp: a save cut short
    if not steps:
        return None
    cmd = job.mtrain(
        "extend",
        *(["--nproc", str(job.procs)] if job.procs > 1 else []),
        "--resume",
        str(run_dir),
        "--set",
        f"train.num_steps={steps[-1]}",
    )
    if not job.run(Record(f"{name}-finish"), cmd, timeout):
        return None
    job.header["notes"].append(
        f"{name}: stopped at the time budget; its checkpoint at step {steps[-1]} (saved on the stop) is exported"
    )
    return run_dir


def yarn_untrained(base_export: Path, out_dir: Path, factor: int) -> Path:
    """The base export with YaRN xfactor in its config.json (mtrain's own rope code), weights linked, no training."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    config = SimpleNamespace(**json.loads((base_export / "config.json").read_text()))
    apply_context_extension(config, ContextConfig(method="yarn", factor=float(factor)))
    for source in base_export.iterdir():
        if source.name == "config.json":
            (out_dir / source.name).write_text(json.dumps(vars(config), indent=2) + "\n")
        elif source.name == "tokenizer_config.json":  # as mtrain's export: the tokenizer's length = the context
            tokenizer_config = json.loads(source.read_text())
            tokenizer_config["model_max_length"] = config.max_position_embeddings
            (out_dir / source.name).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        else:
            (out_dir / source.name).symlink_to(source.resolve())
    return out_dir


def base_models(job: Job) -> dict[str, Path]:
    """base (the bf16 export in WORK/models/base) and base+YaRN untrained."""
    base = job.work / "models" / "base"
    return {"base": base, "base-yarn": yarn_untrained(base, job.work / "models" / "base-yarn", job.scale.factor)}


def pretraining_steps(job: Job, sets: list[str], later_s: float) -> int | None:
    """Fewer steps than `sets` or the base recipe ask for, where the step time (--base-step-s, else the scale's
    measured one) says they would not end before only `later_s` is left (a base stopped at the budget keeps the
    steps it reached, its schedule cut short); None: as asked."""
    s = job.scale
    step_s = job.args.base_step_s or s.base_step_s
    if step_s is None:
        return None
    given = dict(item.split("=", 1) for item in sets)
    recipe = yaml.safe_load((REPO / "recipes" / s.base_recipe).read_text())
    steps = int(given.get("train.num_steps", recipe["train"]["num_steps"]))
    fitted = int((job.left() - later_s - s.base_start_s) / (step_s * BASE_MARGIN))
    if fitted >= steps:
        return None
    fitted = max(1, fitted)
    job.header["notes"].append(
        f"pretraining steps {steps} -> {fitted}: {job.left():.0f} s were left, ~{s.base_start_s:.0f} s of start-up "
        f"and ~{step_s} s a step"
    )
    return fitted


def pretrain(job: Job, later_s: float) -> bool:
    """The base, with as many steps as fit before only `later_s` is left (what must still run in this job); if
    it runs past that, stopped and exported at the step it reached. Its export in bf16 at WORK/models/base.
    -> passed."""
    s = job.scale
    sets = [
        *s.base_sets,
        f"model.max_position_embeddings={s.base_context}",
        f"data.seq_len={s.base_context}",
        f"parallel.dp={job.procs}",
        *job.args.base_set,
    ]
    if (steps := pretraining_steps(job, sets, later_s + FINISH_S)) is not None:  # in place of --base-set's
        sets = [item for item in sets if not item.startswith("train.num_steps=")] + [f"train.num_steps={steps}"]
    run = train_phase(
        job,
        "base",
        s.base_recipe,
        None,
        ["train_code.jsonl", "retrieval_base.jsonl"],
        sets,
        max(job.left() / 2, job.left() - later_s - FINISH_S),
    )
    if run is None:  # stopped at the budget: what it trained is kept
        run = finish_stopped_run(job, "base", max(1.0, job.left() - later_s / 2))
    if run is None:
        return False
    handoff.bf16_export(run / "export", job.work / "models" / "base")
    return True


def extension_steps(job: Job, num_runs: int) -> int:
    """An earlier job's extension steps (the runs compare only at the same steps), else --extend-steps, else the
    recipe's steps or fewer (the same for every run) when the budget left cannot hold `num_runs` runs of them."""
    s = job.scale
    if "extend_steps" in job.header:
        return job.header["extend_steps"]
    if job.args.extend_steps:
        return job.args.extend_steps
    recipe = yaml.safe_load((REPO / "recipes" / "code-extend.yaml").read_text())
    steps = s.extend_steps or recipe["train"]["num_steps"]
    room = job.left() - s.eval_min_s - s.report_s - num_runs * s.extend_overhead_s
    if num_runs * steps * s.extend_step_s <= room:
        return steps
    fitted = max(2, min(steps, int(room / (num_runs * s.extend_step_s))))
    job.header["notes"].append(
        f"extension steps {steps} -> {fitted}: {job.left():.0f} s were left for {num_runs} run(s) at "
        f"~{s.extend_step_s} s a step"
    )
    return fitted


def extend(job: Job, models: dict[str, Path], modes: tuple[str, ...]) -> bool:
    """The extensions of models["base"] in `modes` (dense, sparse: the same data, seed and steps), added to
    `models`; in a job of one extension, its export's parts in OUT; the sparse run's step profiled. With
    --dense-here a sparse job first trains the dense run again (DENSE_HERE, once a job), for its step times on
    this machine. -> all passed.
    Timeouts keep half the planned evaluation time, but never take more than a run's share of what is left: they
    stop hangs, not slow runs."""
    s = job.scale
    reserve = s.eval_min_s / 2 + s.report_s
    steps = job.header["extend_steps"] = extension_steps(job, len(modes))
    extend_sets = [
        *s.extend_sets,
        f"context.factor={s.factor}",
        f"data.seq_len={s.factor * s.base_context}",
        f"train.num_steps={steps}",
        f"train.eval_every={steps}",
        f"data.short_sources=[{job.work / 'corpus' / 'retrieval_base.jsonl'}]",
        f"parallel.cp={job.procs}",
        *job.args.extend_set,
    ]
    runs = [(mode, mode) for mode in modes]  # (run name, attention mode)
    if job.args.dense_here and "sparse" in modes and not any(r.name == DENSE_HERE for r in job.records):
        runs.insert(0, (DENSE_HERE, "dense"))  # once a job: every variant's speed against it
    for index, (name, mode) in enumerate(runs):
        share = len(runs) - index  # of what is left: the dense run leaves the sparse one as much
        timeout = max(job.left() / (2 * share), (job.left() - reserve) / share)
        run = train_phase(
            job,
            name,
            "code-extend.yaml",
            models["base"],
            ["train_code.jsonl", "retrieval_long.jsonl"],
            [*extend_sets, f"attention.mode={mode}"],
            timeout,
        )
        if run is not None and name in modes:  # the dense run trained here is timed, not evaluated
            models[mode] = run
        job.write()
    if job.parts_dir is not None and job.phase in models:  # a job of one extension: its model for later jobs
        bf16 = handoff.bf16_export(models[job.phase] / "export", job.work / "models" / job.phase)
        if not write_model_parts(job, job.phase, bf16):
            return False
    if "sparse" in modes and "sparse" in models and "profile" in job.args.evals:
        profile_step(job, models["sparse"])
    return all(mode in models for mode in modes)


def profile_step(job: Job, run: Path) -> None:
    """`mtrain profile step` of the sparse-extended model (its export, YaRN in its config; the run's data and
    settings, over as many processes) at the extended length: where a sparse step's time goes, the plan's share
    of it. Skipped when it would leave the evaluations less than their minimum."""
    s, rec = job.scale, Record("profile-sparse")
    out = job.work / "profile" / "sparse.json"
    rec.run_dir = str(out.parent)
    if job.left() < s.eval_min_s + s.profile_s:
        job.add(rec)
        rec.status, rec.reason = "skipped", f"time budget: ~{s.profile_s:.0f} s needed, {job.left():.0f} s left"
        return
    cmd = job.torchrun(
        "profile",
        "step",
        "--recipe",
        str(run / "config.yaml"),
        "--model",
        str(run / "export"),
        "--set",
        "context.method=none",
        "--warmup",
        str(s.profile_warmup),
        "--steps",
        str(s.profile_steps),
        "--out",
        str(out),
    )
    job.run(rec, cmd, 2 * s.profile_s)
    job.write()


def write_model_parts(job: Job, name: str, bf16: Path) -> bool:
    """The bf16 export `bf16` of model `name` (base, dense or sparse) as parts in OUT/<name>_parts, with
    export.json: what a later job takes (--base-parts, --model-parts). -> written."""
    s, corpus = job.scale, job.work / "corpus"
    record = {
        "model": name,
        "scale": s.name,
        "seed": job.args.seed,
        "base_context": s.base_context,
        "factor": s.factor,
        "base_set": job.header["base_set"],
        **({"extend_set": job.args.extend_set, "extend_steps": job.header["extend_steps"]} if name != "base" else {}),
        "corpus": handoff.corpus_fingerprint(corpus),
        "corpus_options": json.loads((corpus / "manifest.json").read_text())["options"],
    }
    try:
        manifest = handoff.write_parts(bf16, job.out / f"{name}_parts", s.part_bytes, record)
    except handoff.JobsError as exc:
        job.fail(str(exc))
        return False
    job.header[f"{name}_parts"] = {k: manifest[k] for k in ("tar_bytes", "tar_sha256", "xz_bytes", "parts")}
    job.write()  # the logs so far travel with the parts, should the job end before its evals do
    return True
