"""The training phases and the three kinds of job of the extension experiment: the corpus, pretraining (its export
kept in bf16), base+YaRN untrained, the dense and sparse extensions, and how --phase all, base, extend and eval chain
them (the parts and checks between jobs: handoff.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import yaml

from bench.extension import handoff
from bench.extension.job import Job, Record
from mtrain_cli.config import ContextConfig  # yaml and dataclasses only
from mtrain_cli.rope import apply_context_extension

REPO = Path(__file__).resolve().parents[2]


def only_subdir(parent: Path) -> Path | None:
    dirs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    return dirs[-1] if dirs else None


# ---------------------------------------------------------------------------------------------------------
# Training phases


def corpus_phase(job: Job, expected: dict | None = None) -> bool:
    """The corpus; in a later job (`expected`: the base job's fingerprint) checked to be the base job's."""
    name = "corpus" if job.phase in ("all", "base") else f"corpus-{job.phase}"
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
    # One process, most of its time in the tokenizer (encode_batch, BPE training): its own threads may run here
    # (the jobs' TOKENIZERS_PARALLELISM=false is for the forking tokenisation of mtrain extend). The same bytes
    # either way; 28.7 -> 17.8 s on 2 cores for a 20 MB corpus (the device's took 98-117 s on one thread).
    if not job.run(rec, cmd, min(300, job.left()), env=dict(job.env, TOKENIZERS_PARALLELISM="true")):
        return False
    if expected is not None:
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
    """mtrain extend (of `model`, else a fresh one) into WORK/runs/<name>; -> the run directory when it passed."""
    corpus, runs = job.work / "corpus", job.work / "runs" / name
    shutil.rmtree(runs, ignore_errors=True)
    cmd = job.mtrain(
        "extend",
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


def pretrain(job: Job, later_s: float) -> bool:
    """The base, stopped if it would leave less than `later_s` (what must still run in this job); its export in
    bf16 at WORK/models/base. -> passed."""
    s = job.scale
    sets = [
        *s.base_sets,
        f"model.max_position_embeddings={s.base_context}",
        f"data.seq_len={s.base_context}",
        *job.args.base_set,
    ]
    run = train_phase(
        job,
        "base",
        s.base_recipe,
        None,
        ["train_code.jsonl", "retrieval_base.jsonl"],
        sets,
        max(job.left() / 2, job.left() - later_s),
    )
    if run is None:
        return False
    handoff.bf16_export(run / "export", job.work / "models" / "base")
    return True


def extension_steps(job: Job) -> int:
    """--extend-steps, else the recipe's steps or fewer (the same for both runs) when the budget left cannot
    hold them."""
    s = job.scale
    if job.args.extend_steps:
        return job.args.extend_steps
    recipe = yaml.safe_load((REPO / "recipes" / "code-extend.yaml").read_text())
    steps = s.extend_steps or recipe["train"]["num_steps"]
    room = job.left() - s.eval_min_s - s.report_s - 2 * s.extend_overhead_s
    if 2 * steps * s.extend_step_s <= room:
        return steps
    fitted = max(2, min(steps, int(room / (2 * s.extend_step_s))))
    job.header["notes"].append(
        f"extension steps {steps} -> {fitted}: {job.left():.0f} s were left after "
        f"pretraining, at ~{s.extend_step_s} s a step"
    )
    return fitted


def extend_both(job: Job, models: dict[str, Path]) -> Path | None:
    """Dense and sparse extensions of models["base"], added to `models`. -> the sparse run's config.yaml.
    Timeouts keep half the planned evaluation time (without both extensions there is no comparison), but never
    take more than half of what is left from a run: they stop hangs, not slow runs."""
    s = job.scale
    reserve = s.eval_min_s / 2 + s.report_s
    steps = job.header["extend_steps"] = extension_steps(job)
    extend_sets = [
        *s.extend_sets,
        f"context.factor={s.factor}",
        f"data.seq_len={s.factor * s.base_context}",
        f"train.num_steps={steps}",
        f"train.eval_every={steps}",
        f"data.short_sources=[{job.work / 'corpus' / 'retrieval_base.jsonl'}]",
        *job.args.extend_set,
    ]
    for mode in ("dense", "sparse"):
        share = 2 if mode == "dense" else 1  # of what is left: the dense run leaves the sparse one as much
        timeout = max(job.left() / (2 * share), (job.left() - reserve) / share)
        run = train_phase(
            job,
            mode,
            "code-extend.yaml",
            models["base"],
            ["train_code.jsonl", "retrieval_long.jsonl"],
            [*extend_sets, f"attention.mode={mode}"],
            timeout,
        )
        if run is not None:
            models[mode] = run
        job.write()
    if "sparse" not in models:
        return None
    profile_step(job, models["sparse"])
    return models["sparse"] / "config.yaml"


def profile_step(job: Job, run: Path) -> None:
    """`mtrain profile step` of the sparse-extended model (its export, YaRN in its config; the run's data and
    settings) at the extended length: where a sparse step's time goes, the plan's share of it. Skipped when it
    would leave the evaluations less than their minimum."""
    s, rec = job.scale, Record("profile-sparse")
    out = job.work / "profile" / "sparse.json"
    rec.run_dir = str(out.parent)
    if job.left() < s.eval_min_s + s.profile_s:
        job.add(rec)
        rec.status, rec.reason = "skipped", f"time budget: ~{s.profile_s:.0f} s needed, {job.left():.0f} s left"
        return
    cmd = job.mtrain(
        "profile",
        "step",
        "--recipe",
        str(run / "config.yaml"),
        "--model",
        str(run / "export"),
        "--set",
        "context.method=none",
        "--warmup",
        "2",
        "--steps",
        "3",
        "--out",
        str(out),
    )
    job.run(rec, cmd, 2 * s.profile_s)
    job.write()


# ---------------------------------------------------------------------------------------------------------
# Jobs


def one_job(job: Job) -> tuple[dict[str, Path], Path | None]:
    """--phase all: corpus, base, both extensions. -> (model label -> what `mtrain eval` takes, the sparse run's
    config.yaml)."""
    s = job.scale
    if not corpus_phase(job) or not pretrain(
        job, s.eval_min_s / 2 + s.report_s + 2 * (s.extend_overhead_s + 20 * s.extend_step_s)
    ):
        return {}, None
    job.write()
    models = base_models(job)
    return models, extend_both(job, models)


def base_job(job: Job) -> dict[str, Path]:
    """--phase base: corpus, base, the export's parts and the logs so far in OUT/base_parts."""
    s = job.scale
    shutil.rmtree(job.out / "base_parts", ignore_errors=True)  # no parts of an earlier run beside this job's logs
    if not corpus_phase(job) or not pretrain(job, s.eval_min_s / 2 + s.report_s):
        return {}
    base = job.work / "models" / "base"
    record = {
        "scale": s.name,
        "seed": job.args.seed,
        "base_context": s.base_context,
        "factor": s.factor,
        "base_set": job.args.base_set,
        "corpus": handoff.corpus_fingerprint(job.work / "corpus"),
        "corpus_options": json.loads((job.work / "corpus" / "manifest.json").read_text())["options"],
    }
    try:
        manifest = handoff.write_parts(base, job.out / "base_parts", s.part_bytes, record)
    except handoff.JobsError as exc:
        job.fail(str(exc))
        return {}
    job.header["base_parts"] = {k: manifest[k] for k in ("tar_bytes", "tar_sha256", "xz_bytes", "parts")}
    job.write()  # the logs so far travel with the parts, should the job end before its evals do
    return base_models(job)


def later_job(job: Job) -> tuple[dict[str, Path], Path | None]:
    """--phase extend or eval: the earlier jobs' records restored, the base export joined from its parts, the
    corpus rebuilt and checked; extend also trains both extensions."""
    parts_dir = Path(job.args.base_parts).resolve()
    try:
        expected = handoff.read_parts_manifest(parts_dir)
        if (expected["scale"], expected["seed"]) != (job.scale.name, job.args.seed):
            raise handoff.JobsError(
                f"the base parts are of scale {expected['scale']} seed {expected['seed']}; this job is "
                f"{job.scale.name} seed {job.args.seed} (--smoke and --seed as in the base job)"
            )
        header, records = handoff.restore_state(Path(job.args.resume or parts_dir / "logs.tar.gz"), job.work)
        handoff.join_parts(parts_dir, job.work / "models" / "base")
        handoff.check_package_list(expected["corpus"], expected["corpus_options"])
    except handoff.JobsError as exc:
        job.fail(str(exc))
        return {}, None
    job.records = [Record(**r) for r in records]
    job.header["notes"] = [
        f"[{header['jobs'][-1]['phase']} job] {n}" if not n.startswith("[") else n for n in header["notes"]
    ] + job.header["notes"]
    job.header["jobs"] = header["jobs"]
    job.header.update({k: header[k] for k in ("base_parts", "extend_steps") if k in header})
    job.write()
    if not corpus_phase(job, expected["corpus"]):
        return {}, None
    models = base_models(job)
    if job.phase == "eval":
        return models, None
    return models, extend_both(job, models)
