"""End-to-end check of every `mtrain` user flow through the real CLI, in one device call.

Each flow is a subprocess `PYTHON -m mtrain_cli ...` (never library internals) with its own timeout, inside
one time budget for the whole job. After every flow the results are rewritten, so a job that runs out of
time (or is killed) still leaves them:

    OUT/gpu_e2e_<gpu>.json         every flow: command, rc, pass/fail/skipped and why, wall time, and what
                                   its outputs say (tokens/s, peak memory, step time, sparse density/recall,
                                   eval scores), plus the machine, versions and date
    OUT/gpu_e2e_<gpu>.md           one row per flow
    OUT/gpu_e2e_<gpu>_logs.tar.gz  each flow's stdout/stderr, and the small files its run wrote (config.yaml,
                                   summary.json, metrics.jsonl, results.json, profile JSON/markdown, ...)

<gpu> is h100 / h200 (from nvidia-smi's name) or cpu. Flows, in order (a flow whose prerequisite did not pass
is skipped with the reason; one the budget cannot fit is skipped as such):

    pretrain                  base model at its native context (context.method=none), one document per row
    resume-interrupt          extend --model <pretrain export>, sparse, packed rows; Ctrl-C (SIGINT) after
                              the first logged step: expects exit 130, a checkpoint and the --resume command
    resume-continue           extend --resume RUN_DIR to the end: step numbers continue, export written
    export-check              the export loads with plain transformers (AutoModelForCausalLM) and runs a forward
    eval-dense, eval-sparse   eval RUN_DIR --suite ruler,niah,pg19,infinitebench with local data made here
    extend-model-{dense,sparse}-{16k,64k}   extend --model <pretrain export> with YaRN
    extend-fresh-{dense,sparse}-{16k,64k}   extend of a fresh model
    profile-step-{dense,sparse}             profile step
    profile-kernels                          profile kernels (CUDA only: on CPU the CLI's refusal is recorded
                                             as a skip)

`--scale cpu` runs the same flows at tiny sizes (the tiny recipe's model shape, 512/1024 tokens) to test
this script on a CPU machine. Usage (repository root):

    OUT=/tmp/out bash bench/gpu_e2e.sh                                  # on the GPU machine
    python3 bench/gpu_e2e.py --out /tmp/out --scale cpu --python .venv/bin/python
    python3 bench/gpu_e2e.py --out /tmp/out --flows eval-sparse,profile-kernels   # prerequisites are added
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from source_identity import source_identity  # noqa: E402  (bench/, next to this file)

CORPUS = REPO / "data" / "corpus" / "long.jsonl"
CHARS_PER_TOKEN = 2.9  # the shipped byte-level BPE on the shipped stories (measured: 2.89)
SUITES = ("ruler", "niah", "pg19", "infinitebench")


# ---------------------------------------------------------------------------------------------------------
# Sizes


@dataclass(frozen=True)
class Scale:
    name: str
    native: int  # the base model's pretrained context (max_position_embeddings)
    short: int  # the "16K" slot
    long: int  # the "64K" slot
    model: dict[str, Any]  # recipe model section (fresh models and the pretrained base)
    attention: dict[str, Any]  # recipe attention section (sparse settings)
    extend_steps: int
    pretrain_steps: int
    pretrain_batch: int
    pretrain_rows: int
    resume_len: int
    resume_steps: int
    eval_lengths: str
    eval_dense_below: int
    profile_warmup: int
    profile_steps: int
    kernels_args: tuple[str, ...]
    timeouts: dict[str, int]  # per flow kind, seconds
    budget_s: int
    sparse_path: str  # the attention_calls key the sparse path must show


GPU = Scale(
    name="gpu",
    native=2048,
    short=16384,
    long=65536,
    # ~25M parameters: 8 layers of hidden 512, head dim 128 (the kernels' Qwen2.5 head dim), GQA 2:1
    model=dict(
        architecture="qwen2",
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
    attention=dict(
        pattern="flex", p=0.9, cap=4096, last_q=64, block_size=64, num_sink=4, local_window=128, dense_below=2048
    ),
    extend_steps=4,
    pretrain_steps=200,
    pretrain_batch=8,
    pretrain_rows=120,
    resume_len=16384,
    resume_steps=12,
    eval_lengths="16k",
    eval_dense_below=4096,
    profile_warmup=1,
    profile_steps=2,
    kernels_args=(
        "--lengths",
        "32k",
        "--patterns",
        "planted",
        "--flex-lengths",
        "32k",
        "--repeats",
        "3",
        "--planted-slashes",
        "8",
    ),
    timeouts=dict(
        pretrain=150,
        extend_short=120,
        extend_long=170,
        interrupt=150,
        resume=120,
        export=60,
        eval=200,
        step=120,
        kernels=240,
    ),
    budget_s=540,
    sparse_path="sparse-triton",
)

CPU = Scale(
    name="cpu",
    native=256,
    short=512,
    long=1024,
    model=dict(
        architecture="qwen2",
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=10000.0,
    ),
    attention=dict(
        pattern="flex", p=0.9, cap=256, last_q=32, block_size=32, num_sink=4, local_window=64, dense_below=64
    ),
    extend_steps=3,
    pretrain_steps=10,
    pretrain_batch=2,
    pretrain_rows=24,
    resume_len=1024,
    resume_steps=8,
    eval_lengths="1k",
    eval_dense_below=256,
    profile_warmup=1,
    profile_steps=1,
    kernels_args=(
        "--lengths",
        "32k",
        "--patterns",
        "planted",
        "--flex-lengths",
        "32k",
        "--repeats",
        "3",
        "--planted-slashes",
        "8",
    ),
    timeouts=dict(
        pretrain=300,
        extend_short=300,
        extend_long=300,
        interrupt=300,
        resume=300,
        export=120,
        eval=600,
        step=300,
        kernels=120,
    ),
    budget_s=1800,
    sparse_path="sparse-reference",
)


def length_label(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 and n >= 1024 else str(n)


# ---------------------------------------------------------------------------------------------------------
# Records and output


@dataclass
class Record:
    name: str
    kind: str
    description: str
    command: str = ""
    rc: int | None = None
    status: str = "pending"  # pass | fail | skipped
    reason: str = ""  # why it failed or was skipped
    wall_s: float | None = None
    timeout_s: float | None = None
    timed_out: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)
    checks: list[str] = field(default_factory=list)  # what was verified (pass) or found wrong (fail)
    stderr_tail: str = ""
    logs: list[str] = field(default_factory=list)
    artifacts: dict[str, str] = field(default_factory=dict)  # run_dir, export, results ... (paths on the device)
    budget_skip: bool = False  # not run (or stopped) for lack of time, itself or a prerequisite: run it again


class Job:
    """Work directory, environment of the subprocesses, time budget, and the results on disk."""

    def __init__(self, args: argparse.Namespace, scale: Scale):
        self.args, self.scale = args, scale
        self.out = Path(args.out).resolve()
        self.work = Path(args.work or f"/tmp/gpu_e2e_{scale.name}").resolve()
        start = float(os.environ.get("E2E_START", "0") or 0) or time.time()
        self.start = start
        self.deadline = start + (args.budget if args.budget is not None else scale.budget_s)
        self.records: list[Record] = []
        self.header: dict[str, Any] = {}
        self.tag = "cpu"
        self.current: subprocess.Popen | None = None
        self.env = self._env()

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        parts = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        src = str(REPO / "src")
        if src not in parts:
            parts.append(src)
        env.update(
            PYTHONPATH=os.pathsep.join(parts),
            PYTHONUNBUFFERED="1",
            WANDB_MODE="disabled",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            COLUMNS="240",
            HF_DATASETS_CACHE=str(self.work / "datasets_cache"),
            TOKENIZERS_PARALLELISM="false",
        )
        if self.scale.name == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def left(self) -> float:
        return self.deadline - time.time()

    def mtrain(self, *args: str) -> list[str]:
        return [self.args.python, "-m", "mtrain_cli", *args]

    # -- running ---------------------------------------------------------------------------------------
    def run(
        self,
        rec: Record,
        cmd: list[str],
        timeout: float,
        log_name: str | None = None,
        on_start: Callable[[subprocess.Popen], None] | None = None,
    ) -> int | None:
        """Runs cmd in its own process group; stdout and stderr to logs/<name>.{out,err}. -> rc (None: killed)."""
        name = log_name or rec.name
        out_path, err_path = self.work / "logs" / f"{name}.out", self.work / "logs" / f"{name}.err"
        rec.command = (rec.command + "\n" if rec.command else "") + shlex.join(cmd)
        rec.logs += [str(out_path.relative_to(self.work)), str(err_path.relative_to(self.work))]
        rec.timeout_s = round(timeout, 1)
        t0 = time.time()
        with open(out_path, "w") as out_f, open(err_path, "w") as err_f:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                env=self.env,
                stdout=out_f,
                stderr=err_f,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.current = proc
            try:
                if on_start is not None:
                    on_start(proc)
                rc = proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
            except subprocess.TimeoutExpired:
                rec.timed_out = True
                kill_group(proc)
                rc = None
            finally:
                self.current = None
        rec.wall_s = round((rec.wall_s or 0.0) + time.time() - t0, 2)
        rec.rc = rc
        rec.stderr_tail = tail(err_path, 25) or tail(out_path, 25)
        return rc

    # -- results -----------------------------------------------------------------------------------------
    def write(self, final: bool = False) -> None:
        counts = {s: sum(r.status == s for r in self.records) for s in ("pass", "fail", "skipped", "pending")}
        rerun = [r.name for r in self.records if r.budget_skip]
        payload = {
            **self.header,
            "elapsed_s": round(time.time() - self.start, 1),
            "rerun_flows": rerun,
            "budget_s": round(self.deadline - self.start),
            "complete": final,
            "counts": counts,
            "flows": [asdict(r) for r in self.records],
        }
        self.out.mkdir(parents=True, exist_ok=True)
        stem = self.out / f"gpu_e2e_{self.tag}"
        atomic_write(stem.with_suffix(".json"), json.dumps(payload, indent=2, default=str) + "\n")
        atomic_write(stem.with_suffix(".md"), markdown(payload))
        self._bundle(self.out / f"gpu_e2e_{self.tag}_logs.tar.gz")

    def _bundle(self, path: Path) -> None:
        """Logs and the small files the runs wrote (no checkpoints, no weights), one tar.gz."""
        keep_names = {
            "config.yaml",
            "summary.json",
            "metrics.jsonl",
            "results.json",
            "summary.md",
            "config.json",
            "predictions.jsonl",
            "niah.csv",
            "pg19.csv",
            "generation_config.json",
        }
        files: list[Path] = []
        for sub in ("logs", "runs", "evals", "profile"):
            root = self.work / sub
            if not root.is_dir():
                continue
            for p in sorted(root.rglob("*")):
                if not p.is_file() or "checkpoints" in p.parts:
                    continue
                if sub in ("logs", "profile") or p.name in keep_names or p.suffix == ".csv":
                    if p.stat().st_size <= 8 * 2**20:
                        files.append(p)
        for extra in ("e2e.yaml", "data/manifest.json"):
            if (self.work / extra).is_file():
                files.append(self.work / extra)
        tmp = path.with_name(path.name + ".tmp")
        with tarfile.open(tmp, "w:gz") as tar:
            for p in files:
                tar.add(p, arcname=f"gpu_e2e_{self.tag}/{p.relative_to(self.work)}")
        os.replace(tmp, path)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this script started for `proc`."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def tail(path: Path, lines: int) -> str:
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").rstrip()
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------------------
# Environment


ENV_PROBE = r"""
import importlib, json, sys
out = {"python": sys.version.split()[0], "imports": {}}
for name in ("mtrain_cli.cli", "torch", "triton", "transformers", "datasets", "tokenizers", "safetensors",
             "typer", "rich", "yaml", "pyarrow", "matplotlib", "wandb"):
    try:
        module = importlib.import_module(name)
        out["imports"][name] = getattr(module, "__version__", "ok")
    except Exception as exc:
        out["imports"][name] = f"MISSING: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
try:
    import torch
    out["cuda_available"] = torch.cuda.is_available()
    out["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        out["device_name"] = torch.cuda.get_device_name(0)
        out["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    out["cpu_threads"] = torch.get_num_threads()
except Exception as exc:
    out["cuda_available"] = f"error: {exc}"
print(json.dumps(out))
"""

# What a missing import costs: the flows that need it (matplotlib: eval plots; wandb: logging.wandb only).
IMPORT_NEEDS = {
    "mtrain_cli.cli": "every flow",
    "torch": "every flow",
    "transformers": "every flow",
    "tokenizers": "every flow",
    "safetensors": "every flow",
    "typer": "every flow (the CLI)",
    "rich": "every flow (the CLI)",
    "datasets": "extend and profile step (tokenisation)",
    "yaml": "every flow (recipes)",
    "matplotlib": "eval (NIAH heatmap, PG-19 curve)",
    "pyarrow": "extend (datasets)",
    "wandb": "only logging.wandb=true, which these flows do not use",
    "triton": "sparse attention on GPU, profile kernels",
}


def environment(job: Job) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "scale": job.scale.name,
        "python_exe": job.args.python,
        "repo": str(REPO),
        "work_dir": str(job.work),
    }
    smi = shutil.which("nvidia-smi")
    if smi and job.scale.name != "cpu":
        try:
            line = (
                subprocess.run(
                    [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                .stdout.strip()
                .splitlines()[0]
            )
            name, driver, memory = [x.strip() for x in line.split(",")]
            info.update(
                gpu_name=name,
                driver=driver,
                gpu_memory=memory,
                gpu_count=len(
                    subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
                ),
            )
        except (subprocess.SubprocessError, IndexError, ValueError) as exc:
            info["nvidia_smi_error"] = str(exc)
    name = info.get("gpu_name", "")
    job.tag = (
        "cpu"
        if job.scale.name == "cpu"
        else "h100"
        if "H100" in name
        else "h200"
        if "H200" in name
        else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"
    )
    info["gpu"] = job.tag
    try:
        probe = subprocess.run(
            [job.args.python, "-c", ENV_PROBE], capture_output=True, text=True, timeout=180, env=job.env, cwd=REPO
        )
        info.update(json.loads(probe.stdout.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as exc:
        info["env_probe_error"] = f"{exc}; stderr: {getattr(exc, 'stderr', '') or ''}"[-2000:]
    missing = {k: v for k, v in info.get("imports", {}).items() if str(v).startswith("MISSING")}
    info["missing_imports"] = {k: f"{v} (needed by: {IMPORT_NEEDS.get(k, '?')})" for k, v in missing.items()}
    info["source"] = source_identity()
    return info


# ---------------------------------------------------------------------------------------------------------
# Local data (offline, deterministic): long documents, eval haystacks, PG-19 books, QA and InfiniteBench files


def stories() -> list[str]:
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]


def make_docs(job: Job, name: str, tokens_per_doc: int, num_docs: int) -> Path:
    """data/<name>.jsonl: bench/make_long_docs.py writes one long document (the shipped stories concatenated);
    for several documents it is cut into `num_docs` pieces of about `tokens_per_doc` tokens at spaces (the
    shipped stories are 1K-8K characters, so whole stories could not make short documents of an exact size)."""
    path = job.work / "data" / f"{name}.jsonl"
    chars = int(tokens_per_doc * CHARS_PER_TOKEN)
    cmd = [
        job.args.python,
        str(REPO / "bench" / "make_long_docs.py"),
        "--chars",
        str(chars * num_docs),
        "--num-docs",
        "1",
        "--out",
        str(path),
        "--seed",
        str(len(name)),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, env=job.env, timeout=120)
    if num_docs > 1:
        text = json.loads(path.read_text().splitlines()[0])["text"]
        docs, start = [], 0
        for _ in range(num_docs):
            end = text.find(" ", start + chars)
            end = len(text) if end < 0 else end
            docs.append(text[start:end].strip())
            start = end
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs if d))
    return path


def make_data(job: Job) -> dict[str, Any]:
    """Training data per slot: `x4` rows of about 4 documents (packed-document masking), `x1` one document cut
    into rows (one document per row; the padded last row is the held-out validation row)."""
    s = job.scale
    rows = s.extend_steps + 2  # training rows (>= steps) + the padded validation row
    data: dict[str, Any] = {}
    for length in (s.short, s.long):
        data[f"x4_{length}"] = make_docs(job, f"x4_{length_label(length)}", length // 4, 4 * rows)
        data[f"x1_{length}"] = make_docs(job, f"x1_{length_label(length)}", int(length * (rows - 0.5)), 1)
    data["pretrain"] = make_docs(job, f"x1_pretrain_{length_label(s.native)}", s.native * s.pretrain_rows, 1)
    data.update(eval_data(job))
    manifest = {k: str(v) for k, v in data.items()}
    (job.work / "data" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return data


def eval_data(job: Job) -> dict[str, Path]:
    """Essays (--haystack-dir), books (--pg19-dir: one .jsonl of two books and one .txt), a SQuAD v2.0 and a
    HotpotQA file, and InfiniteBench task files in the official format. All built from the shipped stories, each
    long enough to fill the eval length (InfiniteBench contexts longer, so middle truncation runs). The
    longbook_sum_eng (1,200) and math_calc (30,000 tokens) budgets would dominate the time: left without a
    file, which the eval reports as skipped."""
    rng = random.Random(0)
    texts = stories()
    root = job.work / "data" / "eval"
    eval_tokens = max(job.scale.short, parse_k(job.scale.eval_lengths))

    def long_text(tokens: int) -> str:
        parts, size = [], 0
        while size < tokens * CHARS_PER_TOKEN:
            parts.append(rng.choice(texts))
            size += len(parts[-1]) + 2
        return "\n\n".join(parts)

    haystack = root / "haystack"
    haystack.mkdir(parents=True, exist_ok=True)
    for i in range(3):  # three essays; the haystack repeats them when a length needs more
        (haystack / f"essay_{i}.txt").write_text(long_text(eval_tokens // 2))
    pg19 = root / "pg19"
    pg19.mkdir(exist_ok=True)
    with open(pg19 / "a_books.jsonl", "w") as f:
        for i in range(2):
            f.write(
                json.dumps({"short_book_title": f"Synthetic Book {i}", "text": long_text(eval_tokens * 5 // 4)}) + "\n"
            )
    (pg19 / "b_book.txt").write_text(long_text(eval_tokens * 5 // 4))

    sentences = [s.strip() + "." for t in texts for s in t.replace("\n", " ").split(".") if len(s.strip()) > 20]
    paragraphs = [" ".join(sentences[i : i + 4]) for i in range(0, min(len(sentences), 4 * 600), 4)]
    squad = {
        "version": "v2.0",
        "data": [
            {
                "title": "stories",
                "paragraphs": [
                    {
                        "context": p,
                        "qas": [
                            {
                                "id": f"q{i}",
                                "question": f"What is said in paragraph {i} first?",
                                "answers": [{"text": p.split(".")[0], "answer_start": 0}],
                                "is_impossible": False,
                            }
                        ],
                    }
                    for i, p in enumerate(paragraphs[:300])
                ],
            }
        ],
    }
    (root / "squad.json").write_text(json.dumps(squad))
    hotpot = [
        {
            "_id": f"h{i}",
            "question": f"Which story mentions '{paragraphs[2 * i][:30]}'?",
            "answer": f"story {i}",
            "supporting_facts": [[f"story {i}", 0]],
            "context": [[f"story {i}", [paragraphs[2 * i]]], [f"other {i}", [paragraphs[2 * i + 1]]]],
        }
        for i in range(150)
    ]
    (root / "hotpot.json").write_text(json.dumps(hotpot))

    ib = root / "infinitebench"
    ib.mkdir(exist_ok=True)
    context = long_text(eval_tokens * 5 // 4)
    names = ["Leo", "Ida", "Karin", "Yusuf"]
    functions = "\n\n".join(f"def func_{i}(x):\n    return x + {i % 7}" for i in range(eval_tokens // 12))
    records = {
        "longbook_choice_eng": {
            "id": 0,
            "context": context,
            "input": "Who walks to the farm?",
            "answer": ["Yusuf"],
            "options": names,
        },
        "longbook_qa_eng": {
            "id": 0,
            "context": context,
            "input": "Where does Karin walk?",
            "answer": ["the bridge"],
            "options": [],
        },
        "longbook_qa_chn": {
            "id": 0,
            "context": "这是一个关于猫的故事。" * (eval_tokens // 16),
            "input": "故事是关于什么的？",
            "answer": ["猫"],
            "options": [],
        },
        "longdialogue_qa_eng": {
            "id": 0,
            "context": context.replace("Karin", "$$MASK$$", 1),
            "input": "",
            "answer": ["Karin"],
            "options": [],
        },
        "code_run": {"id": 0, "context": functions, "input": "func_3(4)", "answer": 7, "options": []},
        "code_debug": {
            "id": 0,
            "context": functions.replace("return x + 2", "retrun x + 2", 1),
            "input": "",
            "answer": "func_2",
            "options": ["func_1", "func_2", "func_3", "func_4"],
        },
    }
    for task, record in records.items():
        (ib / f"{task}.jsonl").write_text(json.dumps(record, ensure_ascii=False) + "\n")
    return {
        "haystack": haystack,
        "pg19": pg19,
        "squad": root / "squad.json",
        "hotpot": root / "hotpot.json",
        "infinitebench": ib,
    }


def parse_k(text: str) -> int:
    first = text.split(",")[0].strip().lower()
    return int(first[:-1]) * 1024 if first.endswith("k") else int(first)


# ---------------------------------------------------------------------------------------------------------
# Reading what runs wrote


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def only_subdir(parent: Path) -> Path | None:
    dirs = sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []
    return dirs[-1] if dirs else None


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def as_int(value: Any) -> int | None:
    return round(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def rnd(value: Any, digits: int = 4) -> Any:
    return round(value, digits) if isinstance(value, float) and math.isfinite(value) else value


def train_metrics(run_dir: Path, after_step: int = 0) -> dict[str, Any]:
    """metrics.jsonl + summary.json of an extend run: steady-state numbers exclude the first step
    (compilation, autotuning, CUDA graph capture) when there are later ones. after_step: a resumed run's
    numbers come from its own steps (metrics.jsonl also holds those before the interruption)."""
    lines = read_jsonl(run_dir / "metrics.jsonl")
    all_steps = [m for m in lines if "tokens_per_s" in m]
    steps = [m for m in all_steps if m["step"] > after_step]
    steady = steps[1:] if len(steps) > 1 else steps
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
    packing, rope = summary.get("packing") or {}, summary.get("rope") or {}
    metrics = {
        "steps_logged": [m["step"] for m in all_steps],
        "first_step_s": rnd(steps[0]["step_s"], 3) if steps else None,
        "step_s": rnd(median([m["step_s"] for m in steady]), 4),
        "tokens_per_s": as_int(median([m["tokens_per_s"] for m in steady])),
        "tflops": rnd(median([m.get("tflops") for m in steady]), 2),
        "mfu": rnd(median([m.get("mfu") for m in steady]), 4),
        "peak_mem_gib": rnd(max((m["peak_mem_gib"] for m in steps), default=None), 3),
        "loss_first": rnd(steps[0]["loss"]) if steps else None,
        "loss_last": rnd(steps[-1]["loss"]) if steps else None,
        "sparse_density": rnd(mean([m.get("sparse_density") for m in steps])),
        "sparse_recall": rnd(mean([m.get("sparse_recall") for m in steps])),
        "val_loss": {str(m["step"]): rnd(m["val_loss"]) for m in lines if "val_loss" in m},
        "run_wall_s": summary.get("wall_s"),
        "attention_calls": summary.get("attention_calls"),
        "attention_layers": summary.get("attention_layers"),
        "num_params": summary.get("num_params"),
        "rope": {
            k: rope.get(k) for k in ("method", "factor", "original_context", "extended_context", "attention_factor")
        }
        if rope
        else None,
        "packing": {
            k: packing.get(k)
            for k in (
                "num_documents",
                "num_rows",
                "seq_len",
                "mean_documents_per_row",
                "num_documents_split",
                "num_train_rows",
                "num_val_rows",
            )
        }
        if packing
        else None,
        "summary_steps": summary.get("steps"),
        "warnings": summary.get("warnings"),
        "device": summary.get("device"),
    }
    return metrics


def check_export(
    export: Path, problems: list[str], checks: list[str], min_context: int | None, rope_type: str | None
) -> None:
    config_file = export / "config.json"
    weights = sorted(export.glob("*.safetensors"))
    if not config_file.is_file() or not weights:
        problems.append(f"export {export}: config.json present {config_file.is_file()}, safetensors {len(weights)}")
        return
    if not (export / "tokenizer.json").is_file() and not (export / "tokenizer_config.json").is_file():
        problems.append(f"export {export}: no tokenizer files")
    config = json.loads(config_file.read_text())
    mpe = config.get("max_position_embeddings")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if min_context and (mpe or 0) < min_context:
        problems.append(f"export max_position_embeddings {mpe} < {min_context}")
    if rope_type and rope.get("rope_type") != rope_type:
        problems.append(f"export rope_type {rope.get('rope_type')!r}, expected {rope_type!r}")
    if rope_type == "yarn" and mpe and rope.get("factor") and rope.get("original_max_position_embeddings"):
        if round(rope["factor"] * rope["original_max_position_embeddings"]) != mpe:
            problems.append(
                f"export max_position_embeddings {mpe} != factor {rope['factor']} × original "
                f"{rope['original_max_position_embeddings']}"
            )
    checks.append(
        f"export: config.json (max_position_embeddings {mpe}, rope {rope.get('rope_type')}) + "
        f"{len(weights)} safetensors"
    )


def check_train(
    job: Job,
    rec: Record,
    run_dir: Path | None,
    num_steps: int,
    mode: str,
    seq_len: int,
    packing: str | None,
    rope_type: str | None,
    start_step: int = 0,
) -> None:
    """rc 0, every step logged with finite loss, summary, export, the attention path that must have run."""
    problems, checks = [], []
    if run_dir is None or not run_dir.is_dir():
        finish(rec, [f"exit code {rec.rc}", "no run directory was created"], [])
        return
    rec.artifacts["run_dir"] = str(run_dir)
    m = train_metrics(run_dir, after_step=start_step)
    rec.metrics.update(m)
    steps = m["steps_logged"]
    if steps != list(range(1, num_steps + 1)):
        problems.append(f"metrics.jsonl steps {steps}, expected 1..{num_steps}")
    losses = [x["loss"] for x in read_jsonl(run_dir / "metrics.jsonl") if "loss" in x]
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"non-finite or missing losses: {losses[:8]}")
    if m["summary_steps"] != {"start": start_step, "end": num_steps}:
        problems.append(f"summary.json steps {m['summary_steps']}, expected start {start_step} end {num_steps}")
    calls = m["attention_calls"] or {}
    sparse_calls = {k: v for k, v in calls.items() if k.startswith("sparse")}
    if mode == "sparse":
        # every layer call ran the sparse kernels or, above the crossover, dense attention (counted as such)
        layers = m.get("attention_layers") or {}
        if not calls.get(job.scale.sparse_path) and not (
            calls.get("dense-crossover") and layers.get("dense_by_crossover")
        ):
            problems.append(
                f"attention_calls {calls}: neither {job.scale.sparse_path} nor counted dense-crossover calls"
            )
        if calls.get(job.scale.sparse_path) and (
            m["sparse_density"] is None or not 0 < m["sparse_density"] <= 1 or m["sparse_recall"] is None
        ):
            problems.append(
                f"sparse density {m['sparse_density']} / recall {m['sparse_recall']} missing or out of range"
            )
    elif sparse_calls or not calls.get("dense"):
        problems.append(f"dense run: attention_calls {calls}")
    pack = m["packing"] or {}
    per_row = pack.get("mean_documents_per_row")
    if packing == "x4" and not (per_row and per_row >= 2):
        problems.append(f"packed rows expected (several documents per row), mean_documents_per_row {per_row}")
    if packing == "x1" and not (per_row and per_row <= 1.05):
        problems.append(f"one document per row expected, mean_documents_per_row {per_row}")
    if pack.get("seq_len") not in (None, seq_len):
        problems.append(f"packed seq_len {pack.get('seq_len')} != {seq_len}")
    export = run_dir / "export"
    check_export(export, problems, checks, seq_len, rope_type)
    rec.artifacts["export"] = str(export)
    if rec.rc != 0:
        problems.insert(0, f"exit code {rec.rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
    checks.append(
        f"{len(steps)} steps logged, attention calls {calls}, rows of {seq_len} ({per_row} documents per row)"
    )
    finish(rec, problems, checks)


def finish(rec: Record, problems: list[str], checks: list[str]) -> None:
    if rec.timed_out and not any("timeout" in p for p in problems):
        problems.insert(0, f"killed at its timeout ({rec.timeout_s:.0f} s)")
    if problems:
        rec.status = "fail"
        rec.reason = "; ".join(problems)
        rec.checks = problems
    else:
        rec.status = "pass"
        rec.checks = checks
        rec.stderr_tail = ""  # the logs tar holds it


# ---------------------------------------------------------------------------------------------------------
# Flows


@dataclass
class Flow:
    name: str
    kind: str  # timeout key
    description: str
    run: Callable[[Job, Record], None]
    deps: tuple[str, ...] = ()
    min_s: float = 20.0  # skip when less than this is left of the budget


class State:
    """What later flows need from earlier ones (paths), filled as flows pass."""

    def __init__(self):
        self.data: dict[str, Any] = {}
        self.base_export: Path | None = None
        self.resume_dir: Path | None = None
        self.resume_interrupted_at: int | None = None


STATE = State()


def recipe(job: Job) -> Path:
    """The recipe every flow starts from (a YAML file, as a user writes one); flows override with --set."""
    s = job.scale
    text = {
        "run": {"name": "e2e", "description": f"bench/gpu_e2e.py recipe ({s.name} scale)", "seed": 0},
        "model": s.model,
        "context": {"method": "yarn", "factor": s.short // s.native},
        "data": {"seq_len": s.short, "num_val_rows": 1},
        "attention": {"mode": "dense", **s.attention},
        "train": {
            "num_steps": s.extend_steps,
            "batch_size": 1,
            "grad_accum": 1,
            "lr": 1.0e-4,
            "warmup_steps": 1,
            "schedule": "cosine",
            "eval_every": 1000,
        },
        "checkpoint": {"every": 1000, "keep_last": 1},
        "logging": {"every": 1},
    }
    path = job.work / "e2e.yaml"
    path.write_text(f"# bench/gpu_e2e.py: JSON is YAML\n{json.dumps(text, indent=2)}\n")
    return path


def out_dir(job: Job, group: str, name: str) -> Path:
    path = job.work / group / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def flow_pretrain(job: Job, rec: Record) -> None:
    s = job.scale
    runs = out_dir(job, "runs", rec.name)
    cmd = job.mtrain(
        "extend",
        "--recipe",
        str(job.work / "e2e.yaml"),
        "--data",
        str(STATE.data["pretrain"]),
        "--output-dir",
        str(runs),
        "--set",
        "run.name=pretrain",
        "--set",
        "context.method=none",
        "--set",
        f"data.seq_len={s.native}",
        "--set",
        f"train.num_steps={s.pretrain_steps}",
        "--set",
        f"train.batch_size={s.pretrain_batch}",
        "--set",
        "train.lr=1e-3",
        "--set",
        f"train.warmup_steps={max(1, s.pretrain_steps // 10)}",
        "--set",
        "data.num_val_rows=2",
        "--set",
        f"train.eval_every={s.pretrain_steps}",
        "--set",
        f"logging.every={max(1, s.pretrain_steps // 8)}",
    )
    job.run(rec, cmd, rec.timeout_s)
    run_dir = only_subdir(runs)
    check_train(job, rec, run_dir, s.pretrain_steps, "dense", s.native, "x1", None)
    if rec.status == "pass":
        rope = rec.metrics.get("rope") or {}
        if rope.get("method") == "yarn" or rope.get("extended_context") != s.native:
            finish(rec, [f"pretrain with context.method=none reports rope {rope}"], [])
        else:
            STATE.base_export = run_dir / "export"


def extend_flow(source: str, mode: str, slot: str) -> Callable[[Job, Record], None]:
    def run(job: Job, rec: Record) -> None:
        s = job.scale
        length = s.short if slot == "short" else s.long
        # packed rows (4 documents per row) and one document per row alternate over model source and length
        packing = "x4" if (source == "fresh") == (slot == "short") else "x1"
        runs = out_dir(job, "runs", rec.name)
        cmd = job.mtrain(
            "extend",
            "--recipe",
            str(job.work / "e2e.yaml"),
            "--data",
            str(STATE.data[f"{packing}_{length}"]),
            "--output-dir",
            str(runs),
        )
        if source == "model":
            cmd += ["--model", str(STATE.base_export)]
        cmd += [
            "--set",
            f"run.name={rec.name}",
            "--set",
            f"data.seq_len={length}",
            "--set",
            f"context.factor={length // s.native}",
            "--set",
            f"attention.mode={mode}",
            "--set",
            f"train.activation_checkpointing={'true' if slot == 'long' else 'false'}",
        ]
        if mode == "sparse":  # the sparse kernels themselves; the resume flows run the default crossover rule
            cmd += ["--set", "attention.crossover=false"]
        job.run(rec, cmd, rec.timeout_s)
        rec.metrics["packing_kind"] = packing
        check_train(job, rec, only_subdir(runs), s.extend_steps, mode, length, packing, "yarn")

    return run


def flow_interrupt(job: Job, rec: Record) -> None:
    """extend (sparse, --model, packed rows); SIGINT once metrics.jsonl shows a step; expect 130 + checkpoint."""
    s = job.scale
    runs = out_dir(job, "runs", rec.name)
    cmd = job.mtrain(
        "extend",
        "--recipe",
        str(job.work / "e2e.yaml"),
        "--model",
        str(STATE.base_export),
        "--data",
        str(STATE.data[f"x4_{s.resume_len}"]),
        "--output-dir",
        str(runs),
        "--set",
        "run.name=resume",
        "--set",
        f"data.seq_len={s.resume_len}",
        "--set",
        f"context.factor={s.resume_len // s.native}",
        "--set",
        "attention.mode=sparse",
        "--set",
        f"train.num_steps={s.resume_steps}",
        "--set",
        "train.warmup_steps=2",
    )
    sent: dict[str, Any] = {}

    def interrupt(proc: subprocess.Popen) -> None:
        deadline = time.time() + rec.timeout_s - 15
        while time.time() < deadline and proc.poll() is None:
            run_dir = only_subdir(runs)
            steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m] if run_dir else []
            if steps:
                proc.send_signal(signal.SIGINT)  # Ctrl-C
                sent.update(after_step=steps[-1]["step"], at_s=round(time.time() - t0, 2))
                return
            time.sleep(0.02)

    t0 = time.time()
    rc = job.run(rec, cmd, rec.timeout_s, on_start=interrupt)
    rec.metrics["sigint"] = sent or None
    problems, checks = [], []
    run_dir = only_subdir(runs)
    out_text = (job.work / "logs" / f"{rec.name}.out").read_text(errors="replace")
    found = re.search(r"Continue with: mtrain extend --resume (\S+)", out_text)
    if not sent:
        problems.append("the run ended before a step was logged: SIGINT was not sent")
    if rc != 130:
        problems.append(f"exit code {rc}, expected 130 after Ctrl-C" + (" (timeout)" if rec.timed_out else ""))
    if not found:
        problems.append("no 'Continue with: mtrain extend --resume RUN_DIR' line on stdout")
    elif run_dir is not None and Path(found.group(1)).resolve() != run_dir.resolve():
        problems.append(f"--resume names {found.group(1)}, the run directory is {run_dir}")
    ckpts = sorted((run_dir / "checkpoints").glob("step_*")) if run_dir else []
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m] if run_dir else []
    if not ckpts:
        problems.append("no checkpoint was saved")
    elif steps and not ckpts[-1].name.endswith(f"{steps[-1]:06d}") and str(steps[-1]) not in ckpts[-1].name:
        problems.append(f"last checkpoint {ckpts[-1].name} but the last logged step is {steps[-1]}")
    if steps and steps[-1] >= s.resume_steps:
        problems.append(f"the run reached its last step ({steps[-1]}) before stopping: nothing left to resume")
    if run_dir is not None:
        rec.artifacts["run_dir"] = str(run_dir)
        rec.metrics.update(
            {
                k: v
                for k, v in train_metrics(run_dir).items()
                if k
                in (
                    "steps_logged",
                    "first_step_s",
                    "step_s",
                    "tokens_per_s",
                    "peak_mem_gib",
                    "sparse_density",
                    "sparse_recall",
                    "attention_calls",
                )
            }
        )
    checks.append(
        f"SIGINT after step {sent.get('after_step')}: exit 130, checkpoint "
        f"{ckpts[-1].name if ckpts else None}, resume command printed"
    )
    finish(rec, problems, checks)
    if rec.status == "pass":
        STATE.resume_dir, STATE.resume_interrupted_at = run_dir, steps[-1]


def flow_resume(job: Job, rec: Record) -> None:
    s = job.scale
    cmd = job.mtrain("extend", "--resume", str(STATE.resume_dir))
    job.run(rec, cmd, rec.timeout_s)
    out_text = (job.work / "logs" / f"{rec.name}.out").read_text(errors="replace")
    check_train(
        job,
        rec,
        STATE.resume_dir,
        s.resume_steps,
        "sparse",
        s.resume_len,
        "x4",
        "yarn",
        start_step=STATE.resume_interrupted_at or 0,
    )
    if "resumed from" not in out_text:
        rec.status, rec.reason = "fail", (rec.reason + "; " if rec.reason else "") + "no 'resumed from' line"
    rec.metrics["resumed_at_step"] = STATE.resume_interrupted_at


EXPORT_PROBE = r"""
import json, sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device).eval()
ids = tokenizer("The pass key is 71432. Remember it. " * 40, return_tensors="pt").input_ids[:, :256].to(device)
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({"class": type(model).__name__, "attn_implementation": model.config._attn_implementation,
                  "parameters": sum(p.numel() for p in model.parameters()),
                  "max_position_embeddings": model.config.max_position_embeddings,
                  "rope_parameters": getattr(model.config, "rope_parameters", None),
                  "logits_shape": list(logits.shape), "logits_finite": bool(torch.isfinite(logits).all())},
                 default=str))
"""


def flow_export_check(job: Job, rec: Record) -> None:
    export = STATE.resume_dir / "export"
    cmd = [job.args.python, "-c", EXPORT_PROBE, str(export)]
    rc = job.run(rec, cmd, rec.timeout_s)
    rec.command = (
        f"{job.args.python} -c '<EXPORT_PROBE in bench/gpu_e2e.py: AutoModelForCausalLM.from_pretrained, "
        f"forward 256 tokens>' {export}"
    )
    problems, checks = [], []
    check_export(export, problems, checks, job.scale.resume_len, "yarn")
    out = tail(job.work / "logs" / f"{rec.name}.out", 1)
    try:
        loaded = json.loads(out)
        rec.metrics.update(loaded)
        if not loaded.get("logits_finite"):
            problems.append("non-finite logits")
        checks.append(f"loaded as {loaded.get('class')} ({loaded.get('parameters'):,} parameters), forward finite")
    except (json.JSONDecodeError, TypeError):
        problems.append("the load script printed no result")
    if rc != 0:
        problems.insert(0, f"exit code {rc}")
    rec.artifacts["export"] = str(export)
    finish(rec, problems, checks)


EVAL_BATCH = 4  # prompts decoded together: the batched path (left padding masked) as a user runs it


def eval_flow(attention: str) -> Callable[[Job, Record], None]:
    def run(job: Job, rec: Record) -> None:
        s, d = job.scale, STATE.data
        evals = out_dir(job, "evals", rec.name)
        cmd = job.mtrain(
            "eval",
            str(STATE.resume_dir),
            "--suite",
            ",".join(SUITES),
            "--lengths",
            s.eval_lengths,
            "--samples",
            "1",
            "--batch-size",
            str(EVAL_BATCH),
            "--attention",
            attention,
            "--out",
            str(evals),
            "--haystack-dir",
            str(d["haystack"]),
            "--pg19-dir",
            str(d["pg19"]),
            "--squad-file",
            str(d["squad"]),
            "--hotpot-file",
            str(d["hotpot"]),
            "--infinitebench-dir",
            str(d["infinitebench"]),
        )
        if attention == "sparse":
            cmd += ["--sparse-set", f"dense_below={s.eval_dense_below}"]
        job.run(rec, cmd, rec.timeout_s)
        problems, checks = [], []
        run_dir = only_subdir(evals)
        results_file = run_dir / "results.json" if run_dir else None
        if results_file is None or not results_file.is_file():
            problems.append("no results.json")
            results = {}
        else:
            rec.artifacts["results"] = str(results_file)
            results = json.loads(results_file.read_text())
        suites = results.get("suites") or {}
        summary: dict[str, Any] = {}
        for name in SUITES:
            suite = suites.get(name)
            if suite is None:
                if results:
                    problems.append(f"suite {name} missing from results.json")
                continue
            rows = suite.get("rows") or {}
            cells = [v for row, cellmap in rows.items() if row != "mean" for v in cellmap.values()]
            headline = list((rows.get("mean") or rows.get("perplexity") or {}).values())
            summary[name] = {
                "cells": len(cells),
                "headline": rnd(mean(headline) if headline else mean(cells), 3),
                "metric": suite.get("metric"),
                "skipped": len(suite.get("skipped") or []),
            }
            if not cells:
                problems.append(f"suite {name}: no scores ({len(suite.get('skipped') or [])} skipped)")
        rec.metrics["suites"] = summary
        rec.metrics["eval_wall_s"] = results.get("wall_time_s")
        rec.metrics["batch_size"] = results.get("batch_size")
        if results and results.get("batch_size") != EVAL_BATCH:
            problems.append(f"results.json says batch_size {results.get('batch_size')}, the command asked {EVAL_BATCH}")
        rec.metrics["skipped"] = [
            f"{x['suite']}/{x['task']}" + (f"@{x['length']}" if x.get("length") else "") + f": {x['reason'][:90]}"
            for x in results.get("skipped") or []
        ]
        rec.metrics["notes"] = results.get("notes")
        rec.metrics["device"] = results.get("device")
        sparse = results.get("sparse")
        if attention == "sparse":
            if not sparse:
                problems.append("results.json has no sparse section")
            else:
                rec.metrics.update(
                    sparse_density=rnd(sparse.get("sparse_density")),
                    sparse_recall=rnd(sparse.get("sparse_recall")),
                    attention_calls=sparse.get("attention_calls"),
                    prefills=sparse.get("prefills"),
                    prefills_probed=sparse.get("prefills_probed"),
                    settings_source=sparse.get("settings_source"),
                )
                if not (sparse.get("attention_calls") or {}).get(s.sparse_path):
                    problems.append(
                        f"sparse eval: attention_calls {sparse.get('attention_calls')} lack {s.sparse_path}"
                    )
                if not sparse.get("prefills_probed") or sparse.get("sparse_recall") is None:
                    problems.append(
                        f"sparse eval: {sparse.get('prefills_probed')} of {sparse.get('prefills')} "
                        f"prefills "
                        f"probed, recall {sparse.get('sparse_recall')}"
                    )
        elif sparse:
            problems.append("dense eval reports a sparse section")
        if rec.rc != 0:
            problems.insert(0, f"exit code {rec.rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
        checks.append(
            "suites " + ", ".join(f"{k}: {v['cells']} cells, {v['skipped']} skipped" for k, v in summary.items())
        )
        finish(rec, problems, checks)

    return run


def step_flow(mode: str) -> Callable[[Job, Record], None]:
    def run(job: Job, rec: Record) -> None:
        s = job.scale
        out = out_dir(job, "profile", rec.name) / "step.json"
        cmd = job.mtrain(
            "profile",
            "step",
            "--recipe",
            str(job.work / "e2e.yaml"),
            "--data",
            str(STATE.data[f"x4_{s.short}"]),
            "--warmup",
            str(s.profile_warmup),
            "--steps",
            str(s.profile_steps),
            "--out",
            str(out),
            "--set",
            f"attention.mode={mode}",
        )
        job.run(rec, cmd, rec.timeout_s)
        problems, checks = [], []
        if not out.is_file():
            problems.append("no profile JSON written")
        else:
            r = json.loads(out.read_text())
            meanr = r.get("mean") or {}
            rec.metrics.update(
                step_s=rnd(meanr.get("step_ms", 0) / 1e3, 4),
                tokens_per_s=as_int(r.get("tokens_per_s_per_rank")),
                tflops=rnd(r.get("tflops_per_rank"), 2),
                mfu=rnd(r.get("mfu")),
                peak_mem_gib=rnd(r.get("peak_mem_gib"), 3),
                sparse_density=rnd(r.get("sparse_density")),
                sparse_recall=rnd(r.get("sparse_recall")),
                sparse_layers=r.get("sparse_layers"),
                dense_layers=r.get("dense_layers"),
                phases_ms={
                    k: rnd(meanr.get(k), 2) for k in ("attention", "matmul", "communication", "optimizer", "other")
                },
                device=r.get("device"),
                seq_len=r.get("seq_len"),
            )
            if not meanr.get("step_ms"):
                problems.append("no step time")
            if mode == "sparse" and r.get("sparse_density") is None and not r.get("dense_layers"):
                problems.append("sparse profile: no sparse density and no layer counted dense by the crossover")
            if mode == "dense" and r.get("sparse_density") is not None:
                problems.append("dense profile reports a sparse density")
            checks.append(f"phases {rec.metrics['phases_ms']}")
        if rec.rc != 0:
            problems.insert(0, f"exit code {rec.rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
        finish(rec, problems, checks)

    return run


def flow_kernels(job: Job, rec: Record) -> None:
    out = out_dir(job, "profile", rec.name) / "kernels.json"
    cmd = job.mtrain("profile", "kernels", *job.scale.kernels_args, "--out", str(out))
    rc = job.run(rec, cmd, rec.timeout_s)
    err = tail(job.work / "logs" / f"{rec.name}.err", 5)
    if job.scale.name == "cpu":
        if rc == 2 and "needs a CUDA GPU" in err:
            rec.status = "skipped"
            rec.reason = f"needs CUDA (the CLI checked the arguments, then refused with exit 2: {err.strip()})"
        else:
            finish(rec, [f"on CPU expected exit 2 'needs a CUDA GPU', got rc {rc}: {err[-300:]}"], [])
        return
    problems, checks = [], []
    result = json.loads(out.read_text()) if out.is_file() else {}
    rows = result.get("rows") or []
    if not rows:
        problems.append("no rows in the kernels JSON")
    for r in rows[:1]:
        rec.metrics.update(
            seq_len=r.get("seq_len"),
            pattern=f"{r.get('pattern')} ({r.get('planted_slashes')})",
            sparse_density=rnd(r.get("density")),
            sparse_recall=rnd(r.get("recall")),
            sparse_fwd_ms=rnd(r.get("sparse_fwd_ms"), 2),
            sparse_bwd_ms=rnd(r.get("sparse_bwd_ms"), 2),
            sparse_fwd_bwd_ms=rnd(r.get("sparse_fwd_bwd_ms"), 2),
            dense_cudnn_fwd_bwd_ms=rnd(r.get("dense_cudnn_fwd_bwd_ms"), 2),
            dense_flash_fwd_bwd_ms=rnd(r.get("dense_flash_fwd_bwd_ms"), 2),
            flex_exact_fwd_bwd_ms=rnd(r.get("flex_exact_fwd_bwd_ms"), 2),
            peak_mem_gib=rnd(r.get("sparse_peak_gib"), 3),
            accuracy_vs_fp32=result.get("accuracy_vs_fp32"),
        )
        checks.append(f"{len(rows)} row(s)")
    if rc != 0:
        problems.insert(0, f"exit code {rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
    finish(rec, problems, checks)


def flows(scale: Scale) -> list[Flow]:
    sl, ll = length_label(scale.short), length_label(scale.long)
    base = ("pretrain",)
    fl = [
        Flow(
            "pretrain",
            "pretrain",
            f"base model at its native {scale.native} context (context.method=none), one document per row",
            flow_pretrain,
            min_s=40,
        ),
        Flow(
            "resume-interrupt",
            "interrupt",
            f"extend --model, sparse, {length_label(scale.resume_len)} packed rows; Ctrl-C after a step",
            flow_interrupt,
            base,
            min_s=40,
        ),
        Flow("resume-continue", "resume", "extend --resume RUN_DIR to the end", flow_resume, ("resume-interrupt",)),
        Flow(
            "export-check",
            "export",
            "the resumed run's export/ loads with AutoModelForCausalLM and runs",
            flow_export_check,
            ("resume-continue",),
            min_s=15,
        ),
        Flow(
            "eval-dense",
            "eval",
            f"eval RUN_DIR, 4 suites, {scale.eval_lengths}, dense",
            eval_flow("dense"),
            ("resume-continue",),
            min_s=50,
        ),
        Flow(
            "eval-sparse",
            "eval",
            f"eval RUN_DIR, 4 suites, {scale.eval_lengths}, sparse",
            eval_flow("sparse"),
            ("resume-continue",),
            min_s=50,
        ),
    ]
    for source in ("model", "fresh"):
        for slot, label in (("short", sl), ("long", ll)):
            for mode in ("dense", "sparse"):
                packing = "x4" if (source == "fresh") == (slot == "short") else "x1"
                rows = "4 documents per row" if packing == "x4" else "one document per row"
                what = "--model <pretrain export>" if source == "model" else "fresh model"
                fl.append(
                    Flow(
                        f"extend-{source}-{mode}-{label}",
                        f"extend_{slot}",
                        f"extend {what}, {mode}, {label}, {rows}"
                        + (", activation checkpointing" if slot == "long" else ""),
                        extend_flow(source, mode, slot),
                        base if source == "model" else (),
                        min_s=45 if slot == "long" else 30,
                    )
                )
    fl += [
        Flow("profile-step-dense", "step", f"profile step, fresh model, dense, {sl} packed rows", step_flow("dense")),
        Flow(
            "profile-step-sparse", "step", f"profile step, fresh model, sparse, {sl} packed rows", step_flow("sparse")
        ),
        Flow(
            "profile-kernels",
            "kernels",
            "profile kernels " + " ".join(scale.kernels_args),
            flow_kernels,
            min_s=10 if scale.name == "cpu" else 120,
        ),
    ]
    return fl


def select(all_flows: list[Flow], spec: str | None) -> list[Flow]:
    """--flows a,b,...: those flows and, transitively, their prerequisites, in the canonical order."""
    if not spec or spec == "all":
        return all_flows
    by_name = {f.name: f for f in all_flows}
    wanted: set[str] = set()
    stack = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        matches = [n for n in by_name if n == item or re.fullmatch(item.replace("*", ".*"), n)]
        if not matches:
            raise SystemExit(f"--flows: no flow matches {item!r}; flows: {', '.join(by_name)}")
        stack += matches
    while stack:
        name = stack.pop()
        if name not in wanted:
            wanted.add(name)
            stack += list(by_name[name].deps)
    return [f for f in all_flows if f.name in wanted]


# ---------------------------------------------------------------------------------------------------------
# Markdown


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    if isinstance(value, int) and abs(value) >= 1000:
        return f"{value:,}"
    return str(value)


def note(r: dict[str, Any]) -> str:
    m = r.get("metrics") or {}
    if r["status"] != "pass":
        return (r.get("reason") or "")[:300].replace("|", "/").replace("\n", " ")
    if "suites" in m:
        parts = [f"{k} {fmt(v['headline'], 1)} ({v['cells']} cells)" for k, v in m["suites"].items()]
        extra = f" · {m.get('prefills_probed')}/{m.get('prefills')} prefills probed" if m.get("prefills") else ""
        return "; ".join(parts) + f" · {len(m.get('skipped') or [])} skipped" + extra
    if "phases_ms" in m:
        return "ms/step: " + ", ".join(f"{k} {fmt(v, 1)}" for k, v in m["phases_ms"].items() if v)
    if "sparse_fwd_bwd_ms" in m:
        return (
            f"{m.get('seq_len')} {m.get('pattern')}: ours fwd+bwd {fmt(m.get('sparse_fwd_bwd_ms'))} ms, "
            f"cuDNN {fmt(m.get('dense_cudnn_fwd_bwd_ms'))}, flex {fmt(m.get('flex_exact_fwd_bwd_ms'))}"
        )
    if "logits_finite" in m:
        return f"{m.get('class')}, attn {m.get('attn_implementation')}, max_pos {m.get('max_position_embeddings')}"
    parts = []
    if m.get("sigint"):
        parts.append(f"SIGINT after step {m['sigint'].get('after_step')}")
    if m.get("resumed_at_step") is not None:
        parts.append(f"resumed at step {m['resumed_at_step']}")
    if m.get("first_step_s") is not None:
        parts.append(f"first step {fmt(m['first_step_s'])} s")
    if m.get("loss_last") is not None:
        parts.append(f"loss {fmt(m.get('loss_first'), 3)}→{fmt(m.get('loss_last'), 3)}")
    pack = m.get("packing") or {}
    if pack.get("mean_documents_per_row"):
        parts.append(f"{pack['mean_documents_per_row']:.2f} docs/row")
    rope = m.get("rope") or {}
    if rope.get("extended_context"):
        parts.append(f"ctx {rope.get('original_context')}→{rope['extended_context']}")
    return " · ".join(parts)


def markdown(payload: dict[str, Any]) -> str:
    env = payload
    source = env.get("source") or {}
    imports = env.get("imports") or {}
    versions = ", ".join(
        f"{k} {imports.get(k)}" for k in ("torch", "triton", "transformers", "datasets") if k in imports
    )
    lines = [
        f"# mtrain end-to-end flows ({env.get('scale')} scale): {env.get('gpu_name') or 'CPU'}",
        "",
        f"- date {env.get('date_utc')} · driver {env.get('driver', '–')} · {versions} · python {env.get('python')}",
        f"- source {source.get('git_commit') or '–'} (src sha256 {source.get('src_sha256')}, "
        f"dirty files {len(source.get('git_dirty') or [])})",
        f"- {env['counts']['pass']} passed, {env['counts']['fail']} failed, {env['counts']['skipped']} skipped"
        f"{', ' + str(env['counts']['pending']) + ' pending' if env['counts']['pending'] else ''} · "
        f"{env['elapsed_s']:.0f} s of a {env['budget_s']} s budget · "
        f"{'complete' if env['complete'] else 'PARTIAL (written after each flow)'}",
    ]
    if env.get("missing_imports"):
        lines.append("- **missing imports:** " + "; ".join(f"{k}: {v}" for k, v in env["missing_imports"].items()))
    lines += [
        "",
        "| flow | result | wall s | tokens/s | peak GiB | step s | density / recall | note |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in env["flows"]:
        m = r.get("metrics") or {}
        dr = (
            f"{fmt(m.get('sparse_density'), 3)} / {fmt(m.get('sparse_recall'), 3)}"
            if m.get("sparse_density") is not None or m.get("sparse_recall") is not None
            else "–"
        )
        lines.append(
            f"| {r['name']} | {r['status'].upper() if r['status'] == 'fail' else r['status']} | "
            f"{fmt(r.get('wall_s'), 1)} | {fmt(m.get('tokens_per_s'))} | {fmt(m.get('peak_mem_gib'))} | "
            f"{fmt(m.get('step_s'), 3)} | {dr} | {note(r)} |"
        )
    lines += [
        "",
        "Tokens/s and step s: median over the steps after the first (the first compiles); peak GiB: "
        "max_memory_allocated on GPU, peak RSS on CPU; density / recall: mean over the steps (eval: over "
        "the prefills). Commands, logs and the runs' small files: the JSON and the logs tar.gz.",
        "The `extend-*-sparse-*` flows set `attention.crossover=false` so that every layer runs the sparse "
        "kernels (they check the kernels, not the speed: a 25M model with 4 heads, whose steps are mostly "
        "host time); the resume and profile-step flows run the default rule. Sparse against dense speed "
        "with the rule: train_speed_<gpu>.md.",
        "",
    ]
    if env.get("rerun_flows"):
        lines += [
            f"Skipped for the time budget; run them in another call: `OUT=... bash bench/gpu_e2e.sh --flows "
            f"{','.join(env['rerun_flows'])}` (prerequisites are added).",
            "",
        ]
    failed = [r for r in env["flows"] if r["status"] == "fail"]
    for r in failed:
        lines += [
            f"## {r['name']} failed",
            "",
            f"`{r['command'].splitlines()[-1] if r['command'] else ''}`",
            "",
            r.get("reason", ""),
            "",
            "```",
            (r.get("stderr_tail") or "")[-2500:],
            "```",
            "",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------


def merge(paths: list[Path], out: Path) -> None:
    """One results file from parts of the job run in separate calls (one call is limited to 10 minutes):
    every flow's latest record, tagged with the part it ran in; each part's environment kept under `parts`."""
    parts = [json.loads(p.read_text()) for p in paths]
    flows_by_name: dict[str, dict[str, Any]] = {}
    for index, part in enumerate(parts):
        for record in part["flows"]:
            if record["status"] != "skipped" or record["name"] not in flows_by_name:
                flows_by_name[record["name"]] = {**record, "part": index}
    merged = {
        **parts[-1],
        "flows": list(flows_by_name.values()),
        "parts": [{k: v for k, v in part.items() if k != "flows"} for part in parts],
        "elapsed_s": sum(part["elapsed_s"] for part in parts),
        "budget_s": sum(part["budget_s"] for part in parts),
        "complete": all(part["complete"] for part in parts),
        "rerun_flows": [],
    }
    merged["counts"] = {
        status: sum(r["status"] == status for r in merged["flows"]) for status in ("pass", "fail", "skipped", "pending")
    }
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu_e2e_{merged['gpu']}"
    atomic_write(out / f"{name}.json", json.dumps(merged, indent=2))
    atomic_write(
        out / f"{name}.md",
        markdown(merged).replace(
            "\n\n| flow |",
            f"\n- run as {len(parts)} device calls (one is limited to 10 minutes): "
            + "; ".join(f"part {i}: {', '.join(p['flows_selected'])} ({p['date_utc']})" for i, p in enumerate(parts))
            + "\n\n| flow |",
            1,
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--out", required=True, help="results directory ($OUT)")
    parser.add_argument("--scale", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--python", default="python3", help="interpreter that runs `-m mtrain_cli`")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole job, counted from $E2E_START if set (gpu 540, cpu 1800)",
    )
    parser.add_argument("--flows", default=None, help="comma-separated flow names or globs (prerequisites added)")
    parser.add_argument("--work", default=None, help="scratch directory (default /tmp/gpu_e2e_<scale>; wiped)")
    parser.add_argument("--list", action="store_true", help="print the flows and exit")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="instead of running: merge these results JSONs (parts run in separate device calls; a "
        "flow's latest record wins) into --out",
    )
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, Path(args.out))
        return
    scale = GPU if args.scale == "gpu" else CPU
    chosen = select(flows(scale), args.flows)
    if args.list:
        for f in chosen:
            print(f"{f.name:24s} {f.description}" + (f"  [after {', '.join(f.deps)}]" if f.deps else ""))
        return
    job = Job(args, scale)
    shutil.rmtree(job.work, ignore_errors=True)
    for sub in ("logs", "data", "runs", "evals", "profile"):
        (job.work / sub).mkdir(parents=True, exist_ok=True)
    job.records = [Record(f.name, f.kind, f.description) for f in chosen]

    def on_signal(signum, _frame):
        if job.current is not None:
            kill_group(job.current)
        for r in job.records:
            if r.status == "pending":
                r.status, r.reason = "skipped", f"the job got signal {signum} before this flow ran"
        job.write(final=False)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    job.header = environment(job)
    job.header.update(
        flows_selected=[f.name for f in chosen],
        sizes={
            "native": scale.native,
            "short": scale.short,
            "long": scale.long,
            "model": scale.model,
            "attention": scale.attention,
            "extend_steps": scale.extend_steps,
            "pretrain_steps": scale.pretrain_steps,
            "pretrain_batch": scale.pretrain_batch,
            "resume_steps": scale.resume_steps,
            "eval_lengths": scale.eval_lengths,
        },
    )
    print(f"gpu_e2e: {job.tag} · {len(chosen)} flows · {job.left():.0f} s left · work {job.work}", flush=True)
    if job.header.get("missing_imports"):
        print(f"gpu_e2e: MISSING imports: {job.header['missing_imports']}", flush=True)
    job.write()
    t0 = time.time()
    try:
        STATE.data = make_data(job)
        recipe(job)
        job.header["data_prep_s"] = round(time.time() - t0, 1)
    except Exception as exc:
        for r in job.records:
            r.status, r.reason = "skipped", f"data preparation failed: {exc!r}"
        job.write(final=True)
        raise
    records = {r.name: r for r in job.records}
    for f in chosen:
        rec = records[f.name]
        bad = [d for d in f.deps if d in records and records[d].status != "pass"]
        left = job.left() - 10  # keep time to write the results
        if bad:
            rec.status = "skipped"
            rec.reason = "prerequisite " + ", ".join(f"{d} {records[d].status}" for d in bad)
            rec.budget_skip = all(records[d].budget_skip for d in bad)
        elif left < f.min_s:
            rec.status, rec.budget_skip = "skipped", True
            rec.reason = f"time budget: {max(0, left):.0f} s left, this flow needs at least {f.min_s:.0f} s"
        else:
            rec.timeout_s = min(scale.timeouts[f.kind], left)
            print(f"gpu_e2e: {f.name} (timeout {rec.timeout_s:.0f} s) ...", flush=True)
            try:
                f.run(job, rec)
            except Exception as exc:
                rec.status = "fail"
                rec.reason = f"driver error: {exc!r}"
                import traceback

                rec.stderr_tail = traceback.format_exc()[-3000:]
            if rec.timed_out and rec.timeout_s < scale.timeouts[f.kind]:  # the budget, not the flow, ran out
                rec.status, rec.budget_skip = "skipped", True
                rec.reason = (
                    f"time budget: stopped after {rec.wall_s:.0f} s at the job's end (its own timeout is "
                    f"{scale.timeouts[f.kind]} s); " + rec.reason
                )
        print(f"gpu_e2e: {f.name}: {rec.status} {rec.wall_s or 0:.1f} s {rec.reason[:300]}", flush=True)
        job.write()
    job.write(final=True)
    counts = {s: sum(r.status == s for r in job.records) for s in ("pass", "fail", "skipped")}
    print(f"gpu_e2e: done in {time.time() - job.start:.0f} s: {counts} -> {job.out}/gpu_e2e_{job.tag}.md", flush=True)
    print((job.out / f"gpu_e2e_{job.tag}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
