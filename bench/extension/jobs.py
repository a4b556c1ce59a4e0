"""The kinds of job of the extension experiment and how they chain: --phase all runs every phase in one job; base
leaves the base's parts; extend, dense, sparse and eval join the earlier jobs' parts and records, check that their
settings compare, and go on (the parts and checks themselves: handoff.py)."""

from __future__ import annotations

from pathlib import Path

from bench.extension import handoff
from bench.extension.evals import pending_tasks
from bench.extension.job import Job, Record
from bench.extension.phases import PARTS_S, base_models, corpus_phase, extend, pretrain, write_model_parts

EXTENSIONS = {"all": ("dense", "sparse"), "extend": ("dense", "sparse"), "dense": ("dense",), "sparse": ("sparse",)}


def one_job(job: Job) -> tuple[dict[str, Path], bool]:
    """--phase all: corpus, base, both extensions. -> (model label -> what `mtrain eval` takes, both passed)."""
    s = job.scale
    if not corpus_phase(job) or not pretrain(
        job, s.eval_min_s / 2 + s.report_s + 2 * (s.extend_overhead_s + 20 * s.extend_step_s)
    ):
        return {}, False
    job.write()
    models = base_models(job)
    return models, extend(job, models, EXTENSIONS["all"])


def base_job(job: Job) -> dict[str, Path]:
    """--phase base: corpus, base, the export's parts and the logs so far in OUT/base_parts."""
    s = job.scale
    if not corpus_phase(job) or not pretrain(job, PARTS_S + s.report_s):  # later jobs run what evals this leaves
        return {}
    if not write_model_parts(job, "base", job.work / "models" / "base"):
        return {}
    return base_models(job)


def read_parts(job: Job) -> list[tuple[Path, dict]]:
    """(folder, export.json) of --base-parts, then of each --model-parts, checked to be of this scale and seed and
    of one corpus."""
    given = [(job.args.base_parts, True)] if job.args.base_parts else []
    found = []
    for folder, is_base in given + [(d, False) for d in job.args.model_parts]:
        folder = Path(folder).resolve()
        manifest = handoff.read_parts_manifest(folder)
        model = manifest.setdefault("model", "base")  # export.json named no model when only the base had parts
        if (model == "base") != is_base:
            raise handoff.JobsError(
                f"{folder} holds the {model} model's parts: pass a base's with --base-parts, an extended "
                "model's with --model-parts"
            )
        if (manifest["scale"], manifest["seed"]) != (job.scale.name, job.args.seed):
            raise handoff.JobsError(
                f"{folder}: the parts are of scale {manifest['scale']} seed {manifest['seed']}; this job is "
                f"{job.scale.name} seed {job.args.seed} (--scale, --smoke and --seed as in the job that made them)"
            )
        if found:
            handoff.check_corpus(found[0][1]["corpus"], manifest["corpus"])
        found.append((folder, manifest))
    return found


def sparse_only(items: set[str]) -> bool:
    """--extend-set items that a dense run does not read: attention settings other than the mode."""
    return all(item.startswith("attention.") and not item.startswith("attention.mode=") for item in items)


def added_settings(phase: str, extend_set: list[str], extend_steps: int | None, earlier: dict) -> list[str]:
    """The attention settings a sparse run with `extend_set` adds to the earlier extension's (a variant against
    the same dense run, e.g. attention.cap=16384); JobsError where the runs would not compare: any other setting
    differs, or the steps do."""
    added = set(extend_set) - set(earlier["extend_set"])
    variant = phase == "sparse" and set(earlier["extend_set"]) <= set(extend_set) and sparse_only(added)
    if extend_set != earlier["extend_set"] and not variant:
        raise handoff.JobsError(
            f"--extend-set {extend_set} differs from the earlier extension's {earlier['extend_set']}: the runs would "
            "not compare (a sparse job may only add attention settings)"
        )
    if extend_steps and extend_steps != earlier["extend_steps"]:
        raise handoff.JobsError(
            f"--extend-steps {extend_steps}: the earlier extension ran {earlier['extend_steps']} steps"
        )
    return sorted(added) if variant else []


def same_training(job: Job, earlier: dict) -> None:
    """A job that trains an extension after another one did: the same --extend-set and steps. A sparse job may
    add attention settings (a variant against the same dense run, e.g. attention.cap=16384 --tag cap16k)."""
    if job.phase not in EXTENSIONS or "extend_steps" not in earlier:
        return
    added = added_settings(job.phase, job.args.extend_set, job.args.extend_steps, earlier)
    if added:
        job.header["sparse_extend_set"] = added
        job.header["notes"].append(
            f"the sparse run adds {' '.join(added)} to the dense run's settings (the dense run reads no attention "
            "setting but the mode)"
        )


def join_earlier(job: Job, check=same_training) -> tuple[dict[str, Path], dict, dict] | None:
    """A later job's start (--phase extend, dense, sparse, eval): the earlier jobs' records restored, the base
    export (and, for eval, an extended model's) joined from its parts, the settings (`check`: JobsError where they
    differ from the earlier jobs' header) and the package list checked. -> (model label -> what `mtrain eval`
    takes, the base's export.json, the earlier jobs' header), or None: the job cannot go on (job.fail said why)."""
    try:
        parts = read_parts(job)
        expected = parts[0][1]
        header, records = handoff.restore_state(Path(job.args.resume or parts[0][0] / "logs.tar.gz"), job.work)
        check(job, header)
        job.records = [Record(**r) for r in records]
        models = {}
        for folder, manifest in parts:
            model = manifest["model"]
            if model == "base":
                handoff.join_parts(folder, job.work / "models" / "base")
                models.update(base_models(job))
                continue
            run = next((r for r in job.records if r.name == model and r.status == "pass" and r.run_dir), None)
            if run is None:
                raise handoff.JobsError(f"{folder}: the {model} run is not in the earlier jobs' records (--resume)")
            handoff.join_parts(folder, Path(run.run_dir) / "export")
            models[model] = Path(run.run_dir)
        handoff.check_package_list(expected["corpus"], expected["corpus_options"])
    except handoff.JobsError as exc:
        job.fail(str(exc))
        return None
    job.header["notes"] = [
        f"[{header['jobs'][-1]['phase']} job] {n}" if not n.startswith("[") else n for n in header["notes"]
    ] + job.header["notes"]
    job.header["jobs"] = header["jobs"]
    restored = ("base_set", "extend_steps", "extend_set") if "extend_steps" in header else ("base_set",)
    job.header.update({k: v for k, v in header.items() if k.endswith("_parts") or k in restored})
    job.write()
    return models, expected, header


def later_job(job: Job) -> tuple[dict[str, Path], bool]:
    """--phase extend, dense, sparse or eval: the earlier jobs joined (join_earlier), the corpus rebuilt and
    checked; extend, dense and sparse train their extensions. -> (model label -> what `mtrain eval` takes, every
    extension of this job passed)."""
    joined = join_earlier(job)
    if joined is None:
        return {}, False
    models, expected, _header = joined
    if job.phase == "eval" and not pending_tasks(job, models):
        job.header["notes"].append("every evaluation of the models given had passed: the corpus was not rebuilt")
        return models, True
    if not corpus_phase(job, expected["corpus"]):
        return {}, False
    if job.phase == "eval":
        return models, True
    return models, extend(job, models, EXTENSIONS[job.phase])
