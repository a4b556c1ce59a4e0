"""Issue 22's experiment in one command: a code model pretrained here, extended 16x with YaRN once dense and once
sparse (same data, steps and seed), and four models evaluated with `mtrain eval`, inside one time budget.

    OUT=/tmp/out bash bench/extension_experiment.sh                     # one H100 device call (10 minutes)
    .venv/bin/python bench/extension_experiment.py --out /tmp/x --smoke  # the whole pipeline on CPU, tiny sizes

Phases, each a subprocess of the real commands (logs kept):
  corpus         data/make_code_corpus.py: code + retrieval documents, held-out packages, tokenizer
  base           mtrain extend --recipe recipes/code-base.yaml: a fresh Qwen2 pretrained at the base context
  dense, sparse  mtrain extend --recipe recipes/code-extend.yaml --model <base export>, alone on the GPU (their
                 tokens/s compare); fewer steps, the same for both, when pretraining left too little time
  eval           base (retrieval at its own context), base+YaRN untrained (the recipe's YaRN written into the base
                 export's config.json by mtrain's rope code), dense- and sparse-extended: perplexity on held-out
                 packages, NIAH and RULER in held-out code, InfiniteBench's generated tasks, and the sparse pattern
                 per layer (bench/sparsity_by_layer.py). Jobs run side by side, most important first, then more
                 rounds (seeds) while the budget lasts; a job that cannot fit is skipped, one running at the
                 deadline stopped, both recorded.
  report         OUT/extension_experiment_<gpu>.json, .md, _ppl.png, _niah.png, _training.png, _logs.tar.gz
                 (bench/extension_report.py; json and md rewritten after every phase)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from mtrain_cli.config import ContextConfig  # noqa: E402  (yaml and dataclasses only)
from mtrain_cli.rope import apply_context_extension  # noqa: E402

import extension_report  # noqa: E402  (bench/, next to this file)
from extension_evals import Record, eval_phase, stop  # noqa: E402


@dataclass(frozen=True)
class Scale:
    name: str
    corpus_args: tuple[str, ...]  # data/make_code_corpus.py options
    base_sets: tuple[str, ...]  # --set items on recipes/code-base.yaml, besides the context below
    extend_sets: tuple[str, ...]  # --set items on recipes/code-extend.yaml, besides the context and steps
    base_context: int
    factor: int  # YaRN: extended context = factor x base_context
    lengths: tuple[int, ...]  # evaluation lengths (the base's retrieval suites: those <= base_context)
    books: int  # held-out packages per perplexity length
    ib_samples: int  # InfiniteBench samples per task and length in a round (needle depths 0..100% over them)
    rounds: int  # evaluation rounds (seeds) at most
    concurrency: int  # eval jobs side by side
    budget_s: float
    extend_step_s: float  # expected seconds per extension step (dense and sparse alike), for the time plan
    extend_overhead_s: float  # start, tokenisation, compilation, export of one extension
    eval_min_s: float  # evaluation time the plan keeps
    report_s: float
    suite_s: dict[str, float] = field(default_factory=dict)  # one eval job at every length, until measured
    extend_steps: int | None = None  # None: recipes/code-extend.yaml's train.num_steps


GPU = Scale("gpu", (), (), (), base_context=2048, factor=16, lengths=(2048, 4096, 8192, 16384, 32768), books=8,
            ib_samples=3, rounds=4, concurrency=4, budget_s=560, extend_step_s=0.2, extend_overhead_s=40,
            eval_min_s=100, report_s=20,
            suite_s={"pg19": 25, "niah": 45, "infinitebench": 45, "ruler": 70, "probe": 30})
SMOKE = Scale(
    "smoke",
    ("--max-mb", "4", "--max-heldout-mb", "1.5", "--vocab-size", "1024", "--base-context", "256",
     "--long-context", "2048", "--tokenizer-sample-mb", "2"),
    ("model.hidden_size=64", "model.intermediate_size=192", "model.num_hidden_layers=2",
     "model.num_attention_heads=2", "model.num_key_value_heads=1", "data.num_proc=1", "data.num_val_rows=2",
     "train.num_steps=30", "train.batch_size=4", "train.warmup_steps=3", "train.eval_every=30", "logging.every=10"),
    ("data.num_proc=1", "data.num_val_rows=1", "train.warmup_steps=1", "logging.every=1", "attention.block_size=32",
     "attention.dense_below=256", "attention.last_q=32", "attention.cap=256", "attention.local_window=64"),
    base_context=256, factor=8, lengths=(256, 512, 1024, 2048), books=2, ib_samples=2, rounds=2, concurrency=2,
    budget_s=1500, extend_step_s=3, extend_overhead_s=30, eval_min_s=200, report_s=30,
    suite_s={"pg19": 30, "niah": 60, "infinitebench": 60, "ruler": 120, "probe": 30}, extend_steps=4)


class Job:
    """Work directory, subprocess environment, deadline, records, and the report written after each phase."""

    def __init__(self, args: argparse.Namespace, scale: Scale):
        self.args, self.scale = args, scale
        self.out, self.work = Path(args.out).resolve(), Path(args.work).resolve()
        self.start = float(os.environ.get("EXP_START") or 0) or time.time()
        self.deadline = self.start + (args.budget or scale.budget_s)
        self.records: list[Record] = []
        self.running: dict[str, subprocess.Popen] = {}
        self.header: dict = {"scale": scale.name, "budget_s": args.budget or scale.budget_s, "notes": []}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
                        HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                        HF_DATASETS_CACHE=str(self.work / "datasets_cache"), MPLBACKEND="Agg", COLUMNS="200",
                        PYTHONPATH=os.pathsep.join([str(REPO / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]))
        if scale.name == "smoke":
            self.env["CUDA_VISIBLE_DEVICES"] = ""

    def left(self) -> float:
        return self.deadline - time.time()

    def mtrain(self, *args: str) -> list[str]:
        return [self.args.python, "-m", "mtrain_cli", *args]

    def launch(self, rec: Record, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        rec.command = shlex.join(cmd)
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"{rec.name}.out", "w") as out, open(logs / f"{rec.name}.err", "w") as err:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env or self.env, stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.running[rec.name] = proc
        rec.meta["started_s"] = round(time.time() - self.start, 1)
        print(f"[{rec.meta['started_s']:6.1f} s] {rec.name}: {rec.command}", flush=True)
        return proc

    def finish(self, rec: Record, rc: int | None, wall_s: float, stopped: str = "") -> None:
        self.running.pop(rec.name, None)
        rec.rc, rec.wall_s = rc, round(wall_s, 1)
        if stopped:
            rec.status, rec.reason = "skipped", stopped
        elif rc == 0:
            rec.status = "pass"
        else:
            err = (self.work / "logs" / f"{rec.name}.err").read_text(errors="replace").strip().splitlines()
            rec.status, rec.reason = "fail", f"exit code {rc}: " + (err[-1][:300] if err else "")
        print(f"[{time.time() - self.start:6.1f} s] {rec.name}: {rec.status} in {rec.wall_s} s {rec.reason}",
              flush=True)

    def run(self, rec: Record, cmd: list[str], timeout: float) -> bool:
        """Runs to the end or to `timeout` (then stopped and recorded as over the budget). -> passed."""
        self.records.append(rec)
        started = time.time()
        proc = self.launch(rec, cmd)
        try:
            self.finish(rec, proc.wait(timeout=max(1.0, timeout)), time.time() - started)
        except subprocess.TimeoutExpired:
            stop(proc)
            self.finish(rec, None, time.time() - started, f"stopped at the time budget after {timeout:.0f} s")
        return rec.status == "pass"

    def write(self, final: bool = False) -> None:
        self.header.update(elapsed_s=round(time.time() - self.start, 1), complete=final)
        extension_report.write(self.out, self.work, self.header, [asdict(r) for r in self.records], final)


def only_subdir(parent: Path) -> Path | None:
    dirs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    return dirs[-1] if dirs else None


# ---------------------------------------------------------------------------------------------------------
# Training phases


def corpus_phase(job: Job) -> bool:
    cmd = [job.args.python, str(REPO / "data" / "make_code_corpus.py"), "--out", str(job.work / "corpus"),
           "--seed", str(job.args.seed), *job.scale.corpus_args]
    return job.run(Record("corpus", run_dir=str(job.work / "corpus")), cmd, min(300, job.left()))


def train_phase(job: Job, name: str, recipe: str, model: Path | None, sources: list[str], sets: list[str],
                timeout: float) -> Path | None:
    """mtrain extend (of `model`, else a fresh one) into WORK/runs/<name>; -> the run directory when it passed."""
    corpus, runs = job.work / "corpus", job.work / "runs" / name
    shutil.rmtree(runs, ignore_errors=True)
    cmd = job.mtrain("extend", "--recipe", str(REPO / "recipes" / recipe), "--output-dir", str(runs),
                     *(["--model", str(model)] if model is not None else []),
                     *[arg for source in sources for arg in ("--data", str(corpus / source))],
                     "--set", f"run.name={name}", "--set", f"run.seed={job.args.seed}",
                     "--set", f"model.tokenizer={corpus / 'tokenizer'}",
                     *[arg for item in sets for arg in ("--set", item)])
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
    job.header["notes"].append(f"extension steps {steps} -> {fitted}: {job.left():.0f} s were left after "
                               f"pretraining, at ~{s.extend_step_s} s a step")
    return fitted


def train_all(job: Job) -> tuple[dict[str, Path], Path | None]:
    """Base, base+YaRN, dense and sparse extensions. -> (model label -> what `mtrain eval` takes, the sparse run's
    config.yaml). Timeouts keep half the planned evaluation time (without both extensions there is no comparison),
    but never take more than half of what is left from a run: they stop hangs, not slow runs."""
    s = job.scale
    job.write()
    reserve = s.eval_min_s / 2 + s.report_s
    base_sets = [*s.base_sets, f"model.max_position_embeddings={s.base_context}", f"data.seq_len={s.base_context}",
                 *job.args.base_set]
    base = train_phase(job, "base", "code-base.yaml", None, ["train_code.jsonl", "retrieval_base.jsonl"], base_sets,
                       max(job.left() / 2, job.left() - reserve - 2 * (s.extend_overhead_s + 20 * s.extend_step_s)))
    job.write()
    if base is None:
        return {}, None
    models = {"base": base, "base-yarn": yarn_untrained(base / "export", job.work / "models" / "base-yarn", s.factor)}
    steps = job.header["extend_steps"] = extension_steps(job)
    extend_sets = [*s.extend_sets, f"context.factor={s.factor}", f"data.seq_len={s.factor * s.base_context}",
                   f"train.num_steps={steps}", f"train.eval_every={steps}",
                   f"data.short_sources=[{job.work / 'corpus' / 'retrieval_base.jsonl'}]", *job.args.extend_set]
    for mode in ("dense", "sparse"):
        share = 2 if mode == "dense" else 1  # of what is left: the dense run leaves the sparse one as much
        timeout = max(job.left() / (2 * share), (job.left() - reserve) / share)
        run = train_phase(job, mode, "code-extend.yaml", base / "export", ["train_code.jsonl", "retrieval_long.jsonl"],
                          [*extend_sets, f"attention.mode={mode}"], timeout)
        if run is not None:
            models[mode] = run
        job.write()
    return models, models["sparse"] / "config.yaml" if "sparse" in models else None


# ---------------------------------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        print(f"extension_experiment.py: {message}", file=sys.stderr)
        sys.exit(2)


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                    epilog=__doc__)
    parser.add_argument("--out", required=True, help="results directory ($OUT): at most 6 files")
    parser.add_argument("--smoke", action="store_true", help="tiny model and lengths, on CPU")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole job, counted from $EXP_START if set (gpu 560, smoke 1500)")
    parser.add_argument("--seed", type=int, default=0, help="corpus and training seed (eval seeds are the rounds)")
    parser.add_argument("--extend-steps", type=int, default=None, help="extension steps (default: the recipe's, "
                                                                       "fewer if pretraining left too little time)")
    parser.add_argument("--base-set", action="append", default=[], metavar="KEY=VALUE",
                        help="--set for pretraining, e.g. train.num_steps=1200")
    parser.add_argument("--extend-set", action="append", default=[], metavar="KEY=VALUE",
                        help="--set for both extensions, e.g. attention.p=0.95 or attention.crossover=true")
    parser.add_argument("--concurrency", type=int, default=None, help="eval jobs side by side (gpu 4, smoke 2)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the subprocesses")
    parser.add_argument("--work", default=None, help="scratch directory (default /tmp/extension_experiment; wiped)")
    args = parser.parse_args()
    for name in ("budget", "extend_steps", "concurrency"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive")
    scale = SMOKE if args.smoke else GPU
    args.work = args.work or f"/tmp/extension_experiment_{scale.name}"
    job = Job(args, scale)
    shutil.rmtree(job.work, ignore_errors=True)
    job.work.mkdir(parents=True)

    def on_signal(signum, _frame):
        for proc in list(job.running.values()):
            stop(proc)
        job.header["notes"].append(f"the job got signal {signum} and stopped")
        job.write()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    job.header.update(extension_report.environment(args.python, scale.name), seed=args.seed,
                      base_context=scale.base_context, factor=scale.factor, lengths=list(scale.lengths),
                      base_set=args.base_set, extend_set=args.extend_set)
    print(f"extension_experiment: {job.header['gpu']} · {scale.name} scale · {job.left():.0f} s budget · work "
          f"{job.work}", flush=True)
    job.write()
    models, sparse_config = train_all(job) if corpus_phase(job) else ({}, None)
    if models:
        eval_phase(job, models, sparse_config)
    job.write(final=True)
    print((job.out / f"extension_experiment_{job.header['gpu']}.md").read_text(), flush=True)
    return 0 if models else 1


if __name__ == "__main__":
    sys.exit(main())
