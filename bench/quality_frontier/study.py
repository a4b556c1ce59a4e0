"""The study's models, sparse variants and floors, and the device calls that run them: each model pretrained,
extended dense once and sparse once per variant against that dense run, each job one `bench.extension` invocation
(bench/extension_experiment.sh) and each call a few jobs whose budgets fit CALL_S: the base, the dense run, then
the sparse variants as many a job as fit (`--variant`: one corpus build and base join for them all). Standard
library only: it runs on the device before anything is installed there.

Paths: a model's parts and the dense run's logs live under .exp/<model>/ (git-ignored), the jobs' reports under
RESULTS; a call after the first carries what earlier calls left there (`Call.carry`).
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_S = 530  # a call's jobs, their budgets summed: a device call of at most 9 minutes, pip and copies included
CHECK_EVERY = "attention.check_every=10"  # every sparse run: its last fifth (steps 121-150) holds 3 checks
# Every sparse run starts from these (code-extend.yaml's sparse settings when the study began), and its variant's
# settings come after them: a variant means the same in every row, whatever the recipe ships now; p90 is this alone
REFERENCE = ("attention.p=0.9", "attention.last_q=64", "attention.max_probe_rows=256")
RESULTS = ".exp/quality_frontier"  # every job's report JSON, markdown and logs, what `report` reads
MiB = 2**20
CARRY_LIMIT = 64 * MiB  # a device call's working tree and carried paths
MAX_VARIANTS = 3  # a sparse job's variants: bench.extension's (its OUT, 8 files, holds 2 a variant and 1 more)
# A sparse job's own time besides its variants': the base's parts joined and the corpus rebuilt (its runs started
# 52-68 s in at 128K, the 128K loop's runs, bench/extension/results), and the report's reserve at the end
SPARSE_START_S = 100


@dataclass(frozen=True)
class Floor:
    """The issue's bound on one figure of a model's runs: a perplexity gap (%, at most `bound`) at `length` (None:
    every length), or a sparse / dense tokens/s ratio (at least `bound`)."""

    figure: str  # "gap", "gap, second half", "speed, median" or "speed, all steps"
    bound: float
    length: int | None = None

    @property
    def is_gap(self) -> bool:
        return self.figure.startswith("gap")

    def describe(self) -> str:
        where = "" if not self.is_gap else " at every length" if self.length is None else f" at {self.length // 1024}K"
        return f"{self.figure}{where} {'≤ +' if self.is_gap else '≥ '}{self.bound:g}{'%' if self.is_gap else '×'}"


@dataclass(frozen=True)
class Model:
    name: str
    about: str
    scale: str  # bench.extension --scale
    scale_name: str  # the scale its reports name (Scale.name)
    base_args: tuple[str, ...]  # the base job's options: --base-set items, --base-step-s
    floors: tuple[Floor, ...]
    base_s: int = 420  # job budgets (--budget), seconds
    dense_s: int = 480
    variant_s: int = 200  # a variant in a sparse job: its run, its model's perplexity evals, its report
    sparse_s: int = 330  # a sparse job of one variant that hands its model on (the retrieval calls)
    dense_here_s: int = 250  # the dense run trained again in a sparse job, on its machine (--dense-here)

    @property
    def base_set(self) -> tuple[str, ...]:
        """Its --base-set items (a report's `base_set`)."""
        return tuple(item for flag, item in zip(self.base_args, self.base_args[1:]) if flag == "--base-set")


def base_sets(*items: str) -> tuple[str, ...]:
    return tuple(arg for item in items for arg in ("--base-set", item))


LLAMA3_ROPE = (
    "model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
    "original_max_position_embeddings: 128}"  # Llama-3.1's, over a sixteenth of the context as there (8K of 128K)
)
MODELS = {
    model.name: model
    for model in (
        Model(
            "strong128k",
            "the strong base of docs/results.md's one-GPU loop: a 28M Qwen2 (8 heads of 64) pretrained at 4K "
            "(recipes/code-base-4gpu.yaml, 2,600 steps of 32K tokens), YaRN 32x to 128K",
            "128k",
            "gpu-128k",
            ("--base-step-s", "0.07", *base_sets("train.num_steps=2600")),
            (
                Floor("gap", 0.3, 131072),
                Floor("gap, second half", 0.3, 131072),
                Floor("speed, median", 2.3),
                Floor("speed, all steps", 2.0),
            ),
            # its sparse jobs of one variant (the 128K loop's runs, bench/extension/results): runs
            # started 52-68 s in and took 121-183 s, their pg19 evals (sparse and sparse prefill side by side) 26-36
            # s more: 150-215 s a variant, 161 s p90's; an eval starts only with 1.25x its time left
            variant_s=200,
            sparse_s=330,
            dense_here_s=230,  # its dense jobs' dense phase, export included: 217 and 243 s
        ),
        Model(
            "llama3",
            "a 28M Llama (8 heads of 64, θ 5e5) with Llama-3.1's rope_type llama3 (factor 8, bands 1-4), pretrained at "
            "2K (recipes/code-base.yaml, 2,600 steps of 32K tokens), extended 32x to 64K by the default YaRN "
            "replacement (YaRN x512 over the 128 tokens llama3 started from, attention factor 1.62)",
            "64k",
            "gpu-64k",
            base_sets(
                "train.num_steps=2600",
                "model.architecture=llama",
                "model.num_attention_heads=8",
                "model.rope_theta=500000.0",
                LLAMA3_ROPE,
            ),
            (Floor("gap", 0.5),),
            # not measured: the 128K variant's 44 s of start-up, tokenisation and export, 150 steps of ~0.24 s (a
            # 64K dense step, 0.6 s in scales.py, x 0.4 as sparse / dense at 128K) and their compiles, 30 s of pg19
            variant_s=130,
            sparse_s=250,
            dense_here_s=130,  # its dense jobs' dense phase: 93 and 111 s
        ),
        Model(
            "qwen3",
            "a 27M Qwen3 (q/k RMSNorm, 8 heads of an explicit head_dim 128, twice hidden/heads as Qwen3's, MLP 1,024, "
            "θ 1e6), pretrained at 2K (recipes/code-base.yaml, 2,600 steps of 32K tokens), YaRN 32x to 64K",
            "64k",
            "gpu-64k",
            base_sets(
                "train.num_steps=2600",
                "model.architecture=qwen3",
                "model.num_attention_heads=8",
                "model.head_dim=128",
                "model.intermediate_size=1024",
                "model.rope_theta=1000000.0",
            ),
            (),  # the issue sets none: its frontier is read beside the others'
            variant_s=130,  # as llama3's
            sparse_s=250,
            dense_here_s=150,  # its dense job's dense phase: 126 s
        ),
    )
}


@dataclass(frozen=True)
class Variant:
    name: str
    sets: tuple[str, ...]  # attention settings the sparse run adds to the dense run's (after CHECK_EVERY, REFERENCE)
    about: str
    extra: float = 0.0  # time beyond the model's variant_s (or sparse_s), as a share of it: a denser run is slower


def probed(p: float, last_q: int, windows: int = 16) -> Variant:
    """Share p with `last_q` probe queries a document in `windows` windows (and 4 x as many probe rows a packed
    row, as p90's 64 and 256): p93lq (256), p93lq512, p93lq512w32."""
    name = f"p{round(p * 100)}lq{'' if last_q == 256 else last_q}{'' if windows == 16 else f'w{windows}'}"
    sets = (f"attention.p={p}", f"attention.last_q={last_q}", f"attention.max_probe_rows={4 * last_q}")
    if windows != 16:
        sets += (f"attention.probe_windows={windows}",)
    # lq256: 185 s against p90's 161 at 128K
    about = f"p {p}, last_q {last_q}" + ("" if windows == 16 else f" in {windows} windows")
    return Variant(name, sets, about, extra=0.1 if last_q <= 256 else 0.15)


# In the order the calls run them: what the issue needs first (the reference, a recall target, p 0.95), the run
# that may go near dense last
VARIANTS = {
    variant.name: variant
    for variant in (
        Variant("p90", (), "the reference: p 0.9, cap 4,096, last_q 64 (the shipped defaults when the study began)"),
        Variant("rt95", ("attention.recall_target=0.95",), "recall target 0.95"),
        Variant("p95", ("attention.p=0.95",), "p 0.95"),
        Variant("rt97", ("attention.recall_target=0.97",), "recall target 0.97", extra=0.1),
        Variant(
            "lq256",
            ("attention.last_q=256", "attention.max_probe_rows=1024"),
            "last_q 256 (1,024 probe rows a packed row)",
            extra=0.1,  # 185 s against p90's 161 at 128K
        ),
        Variant("dense0", ("attention.dense_layers=[0]",), "layer 0 dense"),
        Variant("rt99", ("attention.recall_target=0.99",), "recall target 0.99 (may run near dense)", extra=0.75),
        # every key gets a gradient now and then: the sparse model, read dense, trails the dense one by more than
        # its own sparse forward costs (docs/results.md, "What the gap is")
        Variant("de8", ("attention.dense_every=8",), "a dense step every 8", extra=0.2),
        # strong128k, one dense run: p 0.9 ran 2.59x (gap +0.48%), p 0.95 2.18x (+0.19%); the 2.3x floor lies between
        Variant("p93", ("attention.p=0.93",), "p 0.93"),
        # strong128k: p 0.93 held the gap at 128K and the speed floors on one seed but lost +0.52% over 128K's second
        # half, where queries sit away from the probe windows; 256 probe queries fit the pattern to more of them
        probed(0.93, 256),
        # strong128k, one dense run: p93lq held +0.19% at 128K (+0.37% second half) at 2.38x, against p93's +0.28%
        # (+0.52%) at 2.33x: more probe queries, a sparser and better plan
        probed(0.95, 256),
        probed(0.93, 512),
        # p95lq512 held both gaps (+0.15%, +0.29%) at 2.25x; p93lq512 +0.18% (+0.35%) at 2.40x: the floors lie between
        probed(0.94, 512),
        probed(0.95, 512),
        # p93lq512 missed only the second half (+0.35%, +0.33%): the same 512 queries in twice the windows, half as
        # long, sit nearer the second half's queries (p93lq512w32, seed 0: +0.18% (+0.33%), no better)
        probed(0.93, 512, windows=32),
        # llama3: p95lq512 held every length on seed 0 (+0.45% at 64K) but not on seed 1 (+0.62%); its layer 0 kept
        # recall 0.86 at density 0.57 while the others kept >= 0.986
        probed(0.97, 512),
        Variant(
            "p95lq512d0",
            (*probed(0.95, 512).sets, "attention.dense_layers=[0]"),
            "p 0.95, last_q 512, layer 0 dense",
            extra=0.15,
        ),
        # p97lq512 held llama3 on both seeds (+0.20%, +0.35%) but ran strong128k at 2.19x; p96lq512, between, held
        # every quality floor on both seeds of strong128k and llama3: the shipped defaults
        probed(0.96, 512),
    )
}


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
