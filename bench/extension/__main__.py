"""The context-extension experiment: a code model pretrained here, extended with YaRN once dense and once sparse
(same data, steps and seed), and the models evaluated with `mtrain eval`, inside one time budget per device job.

    OUT=/tmp/out bash bench/extension_experiment.sh                     # one H100 device call (10 minutes)
    OUT=/tmp/out bash bench/extension_experiment.sh --phase base        # the larger scale: job 1 of 2 (or 3)
    OUT=/tmp/out bash bench/extension_experiment.sh --phase extend --base-parts .exp/base/base_parts  # job 2
    OUT=/tmp/out bash bench/extension_experiment.sh --scale 256k --phase base  # every GPU, 256K: job 1 of 4
    OUT=/tmp/out bash bench/extension_experiment.sh --scale 128k --phase base  # the same on 2 GPUs, 128K
    .venv/bin/python -m bench.extension --out /tmp/x --smoke            # the whole pipeline on CPU, tiny sizes
    .venv/bin/python -m bench.extension --out /tmp/x --smoke --scale 256k --phase base  # 2 processes, gloo

(Python entry points run from the repository root, as `python -m bench.extension`.)

Phases, each a subprocess of the real commands (logs kept):
  corpus         python -m data.make_code_corpus: code + retrieval documents, held-out packages, tokenizer
  base           mtrain extend --recipe recipes/code-base.yaml (code-base-long.yaml at the larger scale,
                 code-base-4gpu.yaml at 256k, with --nproc N and parallel.dp=N): a fresh Qwen2 pretrained at the
                 base context; its export is kept in bf16 (WORK/models/base), what every later step reads
  dense, sparse  mtrain extend --recipe recipes/code-extend.yaml --model <base export> (256k: --nproc N,
                 parallel.cp=N), alone on the GPUs (their tokens/s compare); fewer steps, the same for both, when
                 pretraining left too little time
  profile        mtrain profile step of the sparse-extended model at the extended length (256k: under torchrun
                 over the same ring): the plan's share of a step
  eval           base (retrieval at its own context), base+YaRN untrained (the recipe's YaRN written into the base
                 export's config.json by mtrain's rope code), dense- and sparse-extended (256k: the sparse one
                 with sparse prefill as well): perplexity on held-out packages, NIAH and RULER's niah tasks in
                 held-out code, InfiniteBench's generated tasks (256k: passkey), and the sparse pattern per layer
                 (sparsity_by_layer.py), scheduled by evals.py within the budget, one GPU a process
  report         OUT/<stem>.json, .md, and at the end _ppl.png, _niah.png, _training.png, _layers.png and
                 _logs.tar.gz (report.py; json and md rewritten after every phase)

A tuned run beside the default: --extend-set attention.p=0.8 --tag p08 (the report's files end in _p08). At the
scales of several jobs a sparse job may add attention settings to the dense job's (--resume: the dense job's
logs), a variant against the same dense run: --phase sparse --extend-set attention.cap=16384 --tag cap16k; up to
three in one job, the corpus built and the base joined once: --variant cap16k attention.cap=16384 --variant p95
attention.p=0.95 (variants.py: each variant's report named as --tag would, their logs in one tarball).
--dense-here: the sparse job first trains the dense run again on its machine, timed only, and the report's speed
is then against it (`same_machine`; the dense run's own job ran on another machine, and machines differ by 1-2%).
A second training seed: --extend-set run.seed=1 --tag seed1 (same base and eval prompts); `python -m
bench.extension.seeds` then sets the runs side by side: sparse − dense pooled over seeds, and the seed-to-seed
training noise.
A fast loop over the perplexity gap: --evals pg19 (every model's perplexity; no retrieval suites, layer probes or
step profile). --scale 128k on one GPU runs the 128K experiment with cp 1: the sparse pattern is the ring's.
Recipe variants over one base (`--phase dense --extend-set ... --tag ...`, one job each): `python -m
bench.extension.search` sets each extended model against base+YaRN, paired by prompt.
--phase all (default) runs them all in one job (2K -> 32K). The larger scale (recipes/code-base-long.yaml: a 4K
base, 2.5x the pretraining, extended to 64K) spans jobs, each with its own budget, joined by handoff.py:
  --phase base    corpus, base, the base's evals while time lasts; the bf16 export as parts of at most 15 MiB
                  with their sha256 and the job's logs in OUT/base_parts/ (8 files in OUT in all)
  --phase extend  (--base-parts: that folder, carried back) the export joined and checked, the corpus rebuilt and
                  checked against the base job's, dense and sparse extensions, their evals first, then what the
                  base job left of base and base+YaRN; the report covers both jobs:
                  OUT/extension_experiment_<gpu>_multi.* (the base job's: ..._multi_base.*)
  --phase eval    only if evals still did not fit: base and base+YaRN evals left (--resume: the extend job's logs
                  tarball); the extended models are 2 x 56 MiB and cannot pass between jobs, so their evals all
                  run in the extend job

--scale 256k: a 4K base pretrained over every GPU present (dp), extended 64x to 262,144 tokens over them (cp),
four device calls of at most 9 minutes (--budget 540 each, a call's limit is 10), each on the same kind of
machine (4 x H100 or 4 x H200: the dense and sparse runs' tokens/s compare only there; the report says when they
differ). A job that trains a model (base, dense, sparse) hands it on as OUT/<model>_parts/ (bf16 export, xz,
parts of 15 MiB, ~39 MiB in all; export.json; logs.tar.gz: the records and eval outputs of every job so far).
A call carries at most 64 MiB of working tree and ignored paths: the base's parts (every later job needs them)
and one more model's never fit together, so each extended model is evaluated in the job that trained it, and
the report of every job is the last job's. .whl/ holds the wheels the device lacks (bench/run_train_gpu.sh);
.exp/ is git-ignored. After each call copy what it returned (files_at) as below:
  1 base    carry [".whl"]
            OUT=$OUT bash bench/extension_experiment.sh --scale 256k --phase base
            -> $OUT/base_parts/ (copy to .exp/base_parts/), extension_experiment_4gpu_256k_base.{json,md}
  2 dense   carry [".whl", ".exp/base_parts"]
            OUT=$OUT bash bench/extension_experiment.sh --scale 256k --phase dense --base-parts .exp/base_parts
            -> $OUT/dense_parts/ (copy its logs.tar.gz to .exp/logs.tar.gz), ..._dense.{json,md}
  3 sparse  carry [".whl", ".exp/base_parts", ".exp/logs.tar.gz"]
            OUT=$OUT bash bench/extension_experiment.sh --scale 256k --phase sparse --base-parts .exp/base_parts \
              --resume .exp/logs.tar.gz
            -> $OUT/sparse_parts/ (its logs.tar.gz to .exp/logs.tar.gz: it holds the dense job's too),
               ..._sparse.{json,md}
  4 eval    carry [".whl", ".exp/base_parts", ".exp/logs.tar.gz"]
            OUT=$OUT bash bench/extension_experiment.sh --scale 256k --phase eval --base-parts .exp/base_parts \
              --resume .exp/logs.tar.gz
            -> extension_experiment_4gpu_256k.{json,md}, _ppl.png, _niah.png, _training.png, _layers.png,
               _logs.tar.gz: the report of all four jobs (bench/extension/results keeps all but the logs)
  The eval job runs what the base and base+YaRN have left, then their further rounds while time lasts (--budget
  shortens it). Evals an extended model's job left: another eval call that carries that model's parts instead of
  the base's, e.g. carry [".whl", ".exp/dense_parts", ".exp/logs.tar.gz"] (call 2's dense_parts copied there,
  .exp/logs.tar.gz the latest job's) and --phase eval --model-parts .exp/dense_parts --resume .exp/logs.tar.gz.
--scale 128k: the same four jobs, 32x to 131,072 tokens, for 2 GPUs (nvidia-h100-x2 or nvidia-h200-x2), where no
4-GPU machine is lent: --scale 128k in place of 256k above; the report is extension_experiment_2gpu_128k.*.
--scale 64k: the same jobs on one GPU, a 2K base (recipes/code-base.yaml, its family and shape by --base-set, e.g.
model.architecture=qwen3 model.head_dim=128) extended 32x to 65,536 tokens; bench/quality_frontier runs it.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys

from bench.extension.evals import EVALS, eval_phase
from bench.extension.job import Job, environment, stop
from bench.extension.jobs import base_job, later_job, one_job
from bench.extension.scales import (
    GPU,
    GPU_64K,
    GPU_128K,
    GPU_256K,
    GPU_MULTI,
    SMOKE,
    SMOKE_64K,
    SMOKE_256K,
    SMOKE_MULTI,
    Scale,
)
from bench.extension.variants import variants_job

PHASES = ("all", "base", "extend", "dense", "sparse", "eval")
MAX_VARIANTS = 3  # OUT holds 8 files: each variant's report (json, md) and one logs tarball for all
LATER = ("extend", "dense", "sparse", "eval")  # phases that continue an earlier job's work


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        print(f"{self.prog.removeprefix('python -m ').split()[0]}: {message}", file=sys.stderr)
        sys.exit(2)


def module_parser(module: str, doc: str) -> Parser:
    """`python -m <module>`'s parser: its help the module's docstring, its errors one line (exit code 2)."""
    return Parser(
        prog=f"python -m {module}",
        description=doc.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=doc,
    )


def parse_args() -> argparse.Namespace:
    parser = module_parser("bench.extension", __doc__)
    parser.add_argument("--out", required=True, help="results directory ($OUT): at most 8 files")
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths, on CPU")
    parser.add_argument(
        "--scale",
        choices=("1gpu", "64k", "128k", "256k"),
        default="1gpu",
        help="1gpu: 2K -> 32K in one job, or 4K -> 64K in jobs; 256k: 4K -> 256K over every GPU, in jobs; 128k: "
        "the same to 128K, for 2 GPUs (--smoke: both run SMOKE_256K); 64k: one GPU, 2K -> 64K in jobs as at 128k, "
        "the base's family chosen by --base-set (--smoke: SMOKE_64K)",
    )
    parser.add_argument(
        "--phase",
        choices=PHASES,
        default="all",
        help="all: one job; base, extend, eval: the 1gpu scale's jobs; base, dense, sparse, eval: the 256k scale's",
    )
    parser.add_argument(
        "--base-parts",
        default=None,
        metavar="DIR",
        help="extend, dense, sparse, eval: the base job's OUT/base_parts (export parts, export.json, logs.tar.gz)",
    )
    parser.add_argument(
        "--model-parts",
        action="append",
        default=[],
        metavar="DIR",
        help="eval: a dense or sparse job's OUT/dense_parts or sparse_parts, to run that model's evals it left",
    )
    parser.add_argument(
        "--resume",
        default=None,
        metavar="TARBALL",
        help="the previous job's logs tarball (default: the logs.tar.gz beside the first parts given)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the job, counted from $EXP_START if set (gpu 560, 256k 540, smoke 1500)",
    )
    parser.add_argument("--seed", type=int, default=0, help="corpus and training seed (eval seeds are the rounds)")
    parser.add_argument(
        "--extend-steps",
        type=int,
        default=None,
        help="extension steps (default: the recipe's, fewer if pretraining left too little time)",
    )
    parser.add_argument(
        "--base-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--set for pretraining, e.g. train.num_steps=1200",
    )
    parser.add_argument(
        "--base-step-s",
        type=float,
        default=None,
        help="seconds a pretraining step, to fit the base's steps to the budget (default: the scale's, 0.19 at 256k "
        "and 128k, from 4 x H100; one H200 ran 0.043-0.065)",
    )
    parser.add_argument(
        "--extend-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--set for both extensions, e.g. attention.p=0.95 or attention.crossover=true",
    )
    parser.add_argument(
        "--tag",
        default="",
        help="appended to the report's file names: a run with other --extend-set beside the default, e.g. p08",
    )
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("TAG", "KEY=VALUE"),
        help=f"sparse: one of at most {MAX_VARIANTS} variants trained in turn after one corpus build, each with the "
        "--extend-set items and its own, its report's files named by TAG as --tag would (variants.py), e.g. "
        "--variant p95 attention.p=0.95 --variant rt95 attention.recall_target=0.95",
    )
    parser.add_argument(
        "--dense-here",
        action="store_true",
        help="sparse: train the dense run again on this machine first, for its step times alone (no evals, no "
        "export): the report's sparse / dense speed is then one machine's, not two (machines differ by 1-2%%)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="eval jobs side by side on each GPU (gpu 4, gpu-multi 6, 256k 4, smoke 2)",
    )
    parser.add_argument(
        "--evals",
        default=",".join(EVALS),
        help=f"what the job evaluates and profiles, comma-separated (default: all of {','.join(EVALS)}); a fast "
        "loop over a perplexity gap: --evals pg19",
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter for the subprocesses")
    parser.add_argument(
        "--work", default=None, help="scratch directory (default /tmp/extension_experiment_<scale>; wiped)"
    )
    args = parser.parse_args()
    for name in ("budget", "extend_steps", "concurrency", "base_step_s"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    later = args.phase in LATER
    if args.scale in ("64k", "128k", "256k") and args.phase in ("all", "extend"):
        parser.error(f"--scale {args.scale} --phase {args.phase}: that scale's jobs are base, dense, sparse and eval")
    if later and args.phase != "eval" and args.base_parts is None:
        parser.error(f"--phase {args.phase} needs --base-parts DIR (the base job's OUT/base_parts)")
    if args.phase == "eval" and args.base_parts is None and not args.model_parts:
        parser.error("--phase eval needs --base-parts DIR, --model-parts DIR or both")
    if not later and (args.base_parts or args.model_parts or args.resume):
        parser.error(f"--phase {args.phase} continues no earlier job: no --base-parts, --model-parts or --resume")
    if args.model_parts and args.phase != "eval":
        parser.error(f"--phase {args.phase} takes no --model-parts (an extended model's parts are for --phase eval)")
    if (args.base_set or args.base_step_s) and later:
        parser.error(f"--phase {args.phase} takes no --base-set or --base-step-s (the base job trained the base)")
    if args.dense_here and args.phase != "sparse":
        parser.error(f"--dense-here with --phase {args.phase}: it times a sparse job's dense run on its machine")
    args.variants = [(group[0], group[1:]) for group in args.variant]
    for tag in [args.tag] * bool(args.tag) + [tag for tag, _sets in args.variants]:
        if not tag.replace("-", "").isalnum():
            parser.error(f"--tag or --variant {tag!r} must be letters, digits and dashes (it names files)")
    if args.variants:
        tags = [tag for tag, _sets in args.variants]
        if args.phase != "sparse":
            parser.error(f"--phase {args.phase} takes no --variant (sparse variants against one dense run)")
        if args.tag:
            parser.error(f"--tag {args.tag} with --variant: each variant's TAG names its report's files")
        if len(tags) > MAX_VARIANTS:
            parser.error(f"--variant {' '.join(tags)}: at most {MAX_VARIANTS} a job (OUT holds 8 files)")
        if len(set(tags)) < len(tags):
            parser.error(f"--variant {' '.join(tags)}: each TAG once (it names the variant's files)")
        if bad := [item for _tag, sets in args.variants for item in sets if "=" not in item]:
            parser.error(f"--variant setting {bad[0]!r} is not KEY=VALUE, e.g. attention.p=0.95")
    args.evals = tuple(dict.fromkeys(name.strip() for name in args.evals.split(",") if name.strip()))
    if unknown := [name for name in args.evals if name not in EVALS]:
        parser.error(f"--evals {','.join(unknown)}: unknown; choose from {','.join(EVALS)}")
    if not args.evals:
        parser.error(f"--evals is empty; choose from {','.join(EVALS)}")
    if args.extend_set and args.phase in ("base", "eval"):
        parser.error(f"--phase {args.phase} trains no extension: no --extend-set")
    return args


def pick_scale(args: argparse.Namespace) -> Scale:
    if args.scale == "64k":
        return SMOKE_64K if args.smoke else GPU_64K
    if args.scale in ("128k", "256k"):
        return SMOKE_256K if args.smoke else {"128k": GPU_128K, "256k": GPU_256K}[args.scale]
    multi = args.phase != "all"
    return (SMOKE_MULTI if multi else SMOKE) if args.smoke else (GPU_MULTI if multi else GPU)


def main() -> int:
    args = parse_args()
    args.tag = args.tag or (args.variants[0][0] if args.variants else "")  # the report before the first variant's
    scale = pick_scale(args)
    args.work = args.work or f"/tmp/extension_experiment_{scale.name}"
    job = Job(args, scale)
    job.work.mkdir(parents=True, exist_ok=True)
    for stale in job.work.iterdir():  # an earlier job's files; its corpus a later phase may reuse (corpus_phase)
        if stale.name != "corpus":
            shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
    if job.parts_dir is not None:  # no parts of an earlier run beside this job's logs
        shutil.rmtree(job.parts_dir, ignore_errors=True)

    def on_signal(signum, _frame):
        for proc in list(job.running.values()):
            stop(proc)
        job.header["notes"].append(f"the job got signal {signum} and stopped")
        job.write()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    job.header.update(
        environment(args.python, scale.name),
        command=shlex.join(["python3", "-m", "bench.extension", *sys.argv[1:]]),
        seed=args.seed,
        base_context=scale.base_context,
        factor=scale.factor,
        lengths=list(scale.lengths),
        speed_target=scale.speed_target,
        ppl_target_pct=scale.ppl_target_pct,
        base_set=args.base_set,
        extend_set=args.extend_set,
    )
    if job.procs < 1:
        print(f"bench.extension: the {scale.name} scale trains over every GPU; nvidia-smi found none", file=sys.stderr)
        return 2
    job.header["procs"] = job.procs
    print(
        f"extension_experiment: {job.header['gpu']} · {scale.name} scale · phase {args.phase} · {job.left():.0f} s "
        f"budget · {job.procs} training process(es) · work {job.work}",
        flush=True,
    )
    job.write()
    if args.variants:
        return 0 if variants_job(job) else 1
    if args.phase == "all":
        models, trained = one_job(job)
    elif args.phase == "base":
        models = base_job(job)
        trained = bool(models)
    else:
        models, trained = later_job(job)
    if models:
        eval_phase(job, models)
    job.write(final=True)
    print((job.out / f"{job.stem}.md").read_text(), flush=True)
    return 0 if models and trained else 1


if __name__ == "__main__":
    sys.exit(main())
