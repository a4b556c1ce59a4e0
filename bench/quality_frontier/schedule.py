"""The device calls that run the study (study.py): each job one `bench.extension` invocation
(bench/extension_experiment.sh) and each call a few jobs whose budgets fit CALL_S: the base, the dense run, then
the sparse variants as many a job as fit (`--variant`: one corpus build and base join for them all). Standard
library only: it runs on the device before anything is installed there.

Paths: a model's parts and the dense run's logs live under .exp/<model>/ (git-ignored), the jobs' reports under
RESULTS; a call after the first carries what earlier calls left there (`Call.carry`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.quality_frontier.study import CHECK_EVERY, REFERENCE, VARIANTS, Model, Variant

CALL_S = 530  # a call's jobs, their budgets summed: a device call of at most 9 minutes, pip and copies included
RESULTS = ".exp/quality_frontier"  # every job's report JSON, markdown and logs, what `report` reads
MAX_VARIANTS = 3  # a sparse job's variants: bench.extension's (its OUT, 8 files, holds 2 a variant and 1 more)
# A sparse job's own time besides its variants': the base's parts joined and the corpus rebuilt (its runs started
# 52-68 s in at 128K, the 128K loop's runs, bench/extension/results), and the report's reserve at the end
SPARSE_START_S = 100


def variant_s(model: Model, variant: Variant) -> int:
    """A variant's time in a sparse job of several."""
    return round(model.variant_s * (1 + variant.extra))


@dataclass(frozen=True)
class Output:
    """What a job leaves: `source` in its OUT (a glob: every file it names, e.g. each variant's report), returned
    as `returned` in the call's $OUT and put at `dest` (under the repository) for later jobs, on the device and, by
    `take`, here. In `returned` and `dest`, {name} is the file's name and {stem} the job's report's (its JSON's name
    without .json)."""

    source: str
    returned: str
    dest: str


@dataclass(frozen=True)
class Job:
    name: str
    args: tuple[str, ...]  # bench/extension_experiment.sh's options but the budget (OUT: the job's own folder)
    budget_s: int
    outputs: tuple[Output, ...]
    needs: tuple[str, ...]  # paths (under the repository) it reads: what earlier jobs left

    @property
    def script_args(self) -> tuple[str, ...]:
        return (*self.args, "--budget", str(self.budget_s))


@dataclass(frozen=True)
class Call:
    model: str
    name: str  # the call's name on `call MODEL NAME`: 1, 2, ... or r1, r2, r3
    jobs: tuple[Job, ...]
    options: tuple[str, ...] = ()  # what `call` needs besides MODEL NAME to plan the same calls again

    @property
    def budget_s(self) -> int:
        return sum(job.budget_s for job in self.jobs)

    @property
    def carry(self) -> tuple[str, ...]:
        """.whl (datasets for the device), then what its jobs read that no earlier job of the call leaves."""
        made = {output.dest for job in self.jobs for output in job.outputs}
        return (".whl", *dict.fromkeys(path for job in self.jobs for path in job.needs if path not in made))

    @property
    def command(self) -> str:
        """The device command: the call's jobs one after the other, what they leave copied to $OUT."""
        return " ".join(("PYTHONPATH=src python3 -m bench.quality_frontier call", self.model, self.name, *self.options))


def seed_dir(model: str, seed: int) -> str:
    """Where a training seed's dense run leaves its parts and logs (seed 0: the model's folder)."""
    return f".exp/{model}" + (f"/seed{seed}" if seed else "")


def report_outputs() -> tuple[Output, ...]:
    """A finished job's report (its JSON and markdown), kept for `report`."""
    return tuple(Output(f"*.{ext}", "{name}", f"{RESULTS}/{{name}}") for ext in ("json", "md"))


def variant_tag(model: Model, variant: Variant, seed: int) -> str:
    """The name a variant's report's files end in."""
    return f"{model.name}-{variant.name}" + (f"-seed{seed}" if seed else "")


def retrieval_job(model: Model, variant: Variant, resume: str) -> Job:
    """One sparse run of `variant` (seed 0) against the dense run whose logs are `resume`, evaluated on pg19 then
    NIAH, its model handed on in parts (for an eval job of what NIAH it left)."""
    args = (
        *("--scale", model.scale, "--phase", "sparse", "--evals", "pg19,niah"),
        *("--base-parts", f".exp/{model.name}/base_parts", "--resume", resume),
        *(arg for item in (CHECK_EVERY, *REFERENCE, *variant.sets) for arg in ("--extend-set", item)),
        *("--tag", f"{variant_tag(model, variant, 0)}-niah"),
    )
    outputs = (
        Output("sparse_parts", "sparse_parts", f".exp/{model.name}/sparse_parts"),
        Output("sparse_parts/logs.tar.gz", "sparse_parts/logs.tar.gz", f"{RESULTS}/{{stem}}_logs.tar.gz"),
        *report_outputs(),
    )
    budget = min(CALL_S, round(model.sparse_s * (1 + variant.extra)) + 200)
    return Job(f"sparse {variant.name}", args, budget, outputs, (f".exp/{model.name}/base_parts", resume))


def variants_job(model: Model, variants: list[Variant], seed: int) -> Job:
    """The sparse runs of `variants` in one job (bench.extension --variant), one after the other against the dense
    run of `seed`, each evaluated on pg19: every variant's report, and one tarball of their logs. The job trains
    that dense run again first (--dense-here): their speed is one machine's."""
    resume, seed_sets = f"{seed_dir(model.name, seed)}/dense_logs.tar.gz", (f"run.seed={seed}",) if seed else ()
    args = (
        *("--scale", model.scale, "--phase", "sparse", "--evals", "pg19", "--dense-here"),
        *("--base-parts", f".exp/{model.name}/base_parts", "--resume", resume),
        *(arg for item in (*seed_sets, CHECK_EVERY, *REFERENCE) for arg in ("--extend-set", item)),
        *(arg for v in variants for arg in ("--variant", variant_tag(model, v, seed), *v.sets)),
    )
    outputs = (*report_outputs(), Output("*_logs.tar", "{name}", f"{RESULTS}/{{name}}"))
    budget = min(CALL_S, variants_s(model, variants))
    name = "sparse " + ", ".join(v.name for v in variants)
    return Job(name, args, budget, outputs, (f".exp/{model.name}/base_parts", resume))


def variants_s(model: Model, variants: list[Variant]) -> int:
    """A sparse job's time for `variants`: its start, the dense run trained again, each variant's."""
    return SPARSE_START_S + model.dense_here_s + sum(variant_s(model, v) for v in variants)


def variant_groups(model: Model, variants: list[Variant]) -> list[list[Variant]]:
    """Consecutive variants, as many a sparse job as fit CALL_S (and MAX_VARIANTS)."""
    groups: list[list[Variant]] = []
    for variant in variants:
        last = groups[-1] if groups else []
        if last and len(last) < MAX_VARIANTS and variants_s(model, [*last, variant]) <= CALL_S:
            last.append(variant)
        else:
            groups.append([variant])
    return groups


def training_jobs(model: Model, seed: int, variants: list[Variant]) -> list[Job]:
    """Base (seed 0 only: another training seed extends the same base), dense, then the variants' sparse runs, as
    many a job as fit a call."""
    where, base_parts = seed_dir(model.name, seed), f".exp/{model.name}/base_parts"
    jobs = []
    if seed == 0:
        jobs.append(
            Job(
                "base",
                (
                    "--scale",
                    model.scale,
                    "--phase",
                    "base",
                    "--evals",
                    "pg19,niah",
                    *model.base_args,
                    "--tag",
                    model.name,
                ),
                model.base_s,
                (Output("base_parts", "base_parts", base_parts), *report_outputs()),
                (),
            )
        )
    dense_tag = model.name + (f"-seed{seed}" if seed else "")
    jobs.append(
        Job(
            "dense",
            (
                *("--scale", model.scale, "--phase", "dense", "--evals", "pg19", "--base-parts", base_parts),
                *(("--extend-set", f"run.seed={seed}") if seed else ()),
                "--tag",
                dense_tag,
            ),
            model.dense_s,
            (
                Output("dense_parts", "dense_parts", f"{where}/dense_parts"),
                Output("dense_parts/logs.tar.gz", "dense_parts/logs.tar.gz", f"{where}/dense_logs.tar.gz"),
                *report_outputs(),
            ),
            (base_parts,),
        )
    )
    return jobs + [variants_job(model, group, seed) for group in variant_groups(model, variants)]


def plan(model: Model, seed: int = 0, variants: list[str] | None = None) -> list[Call]:
    """The model's training calls for a training seed, in order, a job each: base (seed 0), dense, the variants
    (default: every one, in VARIANTS' order) as many a job as fit a call."""
    names = variants or list(VARIANTS)
    options = (("--seed", str(seed)) if seed else ()) + (("--variants", ",".join(names)) if variants else ())
    jobs = training_jobs(model, seed, [VARIANTS[name] for name in names])
    return [Call(model.name, str(number), (job,), options) for number, job in enumerate(jobs, 1)]


def retrieval_plan(model: Model, variant: Variant) -> list[Call]:
    """NIAH of the dense and of one sparse model, paired by prompt (seed 0), after the frontier chose `variant`:
    r1 the dense model's NIAH (its parts, an eval job); r2 the variant trained again (same seed and data as its
    frontier run) and evaluated on pg19 then NIAH, resuming r1's records so that the report pairs the two; r3 what
    NIAH r2 left (its model's parts, an eval job), needed only where r2's report lists skipped NIAH evals."""
    where = seed_dir(model.name, 0)
    dense_niah = f"{where}/dense_niah_logs.tar.gz"
    r1 = Job(
        "dense niah",
        (
            *("--scale", model.scale, "--phase", "eval", "--evals", "niah"),
            *("--model-parts", f"{where}/dense_parts", "--resume", f"{where}/dense_logs.tar.gz"),
            *("--tag", f"{model.name}-dense-niah"),
        ),
        CALL_S,
        (*report_outputs(), Output("*_logs.tar.gz", "{name}", dense_niah)),
        (f"{where}/dense_parts", f"{where}/dense_logs.tar.gz"),
    )
    r2 = retrieval_job(model, variant, dense_niah)
    sparse_parts = f".exp/{model.name}/sparse_parts"
    r3 = Job(
        "sparse niah",
        (
            *("--scale", model.scale, "--phase", "eval", "--evals", "niah"),
            *("--model-parts", sparse_parts, "--resume", f"{sparse_parts}/logs.tar.gz"),
            *("--tag", f"{model.name}-{variant.name}-niah-rest"),
        ),
        CALL_S,
        (*report_outputs(), Output("*_logs.tar.gz", "{name}", f"{RESULTS}/{{name}}")),
        (sparse_parts,),
    )
    options = ("--variant", variant.name)
    return [Call(model.name, name, (job,), options) for name, job in (("r1", r1), ("r2", r2), ("r3", r3))]
