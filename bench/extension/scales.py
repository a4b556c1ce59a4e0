"""The scales of the extension experiment: corpus, model and training sizes, evaluation lengths and rounds, and
the time plan of one device job (first guesses of each phase's wall time, replaced by measurements as they come).
GPU: one job, 2K -> 32K; GPU_MULTI: a 4K base and its 64K extension in jobs of their own; GPU_256K: a 4K base
pretrained over every GPU present and extended 64x to 256K under context parallelism, a job each for the base, the
dense and the sparse extension, and the evaluations (GPU_128K: the same, 32x to 128K, for 2 GPUs; GPU_64K: one GPU,
a 2K base of the family --base-set chooses, 32x to 64K); SMOKE(_MULTI, _256K, _64K): the same pipelines on CPU at
tiny sizes (SMOKE_256K: tests/test_extension_experiment.py).
Not run on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from bench.extension import handoff


@dataclass(frozen=True)
class Scale:
    name: str
    corpus_args: tuple[str, ...]  # data/make_code_corpus.py options
    base_sets: tuple[str, ...]  # --set items on the base recipe, besides the context below
    extend_sets: tuple[str, ...]  # --set items on recipes/code-extend.yaml, besides the context and steps
    base_context: int
    factor: int  # YaRN: extended context = factor x base_context
    lengths: tuple[int, ...]  # evaluation lengths (the base's retrieval suites: those <= base_context)
    books: int  # held-out packages per perplexity length
    ib_samples: int  # InfiniteBench samples per task and length in a round (needle depths 0..100% over them)
    ruler_samples: int  # RULER samples per task and length in a round
    niah_samples: int  # NIAH samples per (length, depth) cell in a round
    eval_batch: int  # `mtrain eval --batch-size`: prompts decoded together
    rounds: int  # evaluation rounds (seeds) at most
    concurrency: int  # eval jobs side by side on each GPU
    budget_s: float  # of one job
    extend_step_s: float  # expected seconds per extension step (dense and sparse alike), for the time plan
    extend_overhead_s: float  # start, tokenisation, compilation, export of one extension
    eval_min_s: float  # evaluation time the plan keeps
    report_s: float
    eval_startup_s: float  # of one `mtrain eval` process: imports, model load, haystacks
    profile_s: float  # `mtrain profile step` of the sparse-extended model: start, tokenisation, its steps
    suite_s: dict[str, float] = field(default_factory=dict)  # one eval job at every length, until measured
    extend_steps: int | None = None  # None: recipes/code-extend.yaml's train.num_steps
    base_step_s: float | None = None  # seconds a pretraining step, measured: the base's steps fit the job's budget
    base_start_s: float = 0.0  # the base run's start-up and export, with base_step_s
    base_recipe: str = "code-base.yaml"
    part_bytes: int = 15 * handoff.MiB  # a trained model's export parts (--phase base, dense, sparse)
    stem: str = "extension_experiment_{gpu}"  # the report's files; {gpu}: h100, ...; {procs}{device}: 4gpu, 2cpu
    procs: int = 1  # training processes (torchrun): the base's dp, the extensions' cp; 0: one per GPU present
    sparse_prefill: tuple[str, ...] = ()  # suites the sparse-extended model also runs with sparse prefill
    ib_tasks: str | None = None  # InfiniteBench tasks (`mtrain eval --tasks`); None: every generated one
    suites_together: bool = False  # one eval process per model, lengths and round runs all its suites
    alone_from: int | None = None  # NIAH and RULER lengths from this one up: an eval process each
    guess_by_tokens: bool = False  # a first guess (suite_s) is shared among lengths by their tokens, not equally
    profile_warmup: int = 2  # `mtrain profile step --warmup` of the sparse-extended model
    profile_steps: int = 3  # and its --steps
    speed_target: float = 2.0  # sparse / dense training tokens/s to reach at the longest length
    ppl_target_pct: float = 2.0  # sparse / dense perplexity - 1 to stay within, at every length


# suite_s: measured on the first H100 run (4 jobs side by side), RULER guessed from its 2K job (over 30 s for 11
# prompts: answers of up to 128 tokens are generated token by token)
GPU = Scale(
    "gpu",
    (),
    (),
    (),
    base_context=2048,
    factor=16,
    lengths=(2048, 4096, 8192, 16384, 32768),
    books=8,
    ib_samples=3,
    ruler_samples=1,
    niah_samples=1,
    eval_batch=1,
    rounds=4,
    concurrency=4,
    budget_s=560,
    extend_step_s=0.2,
    extend_overhead_s=40,
    eval_min_s=100,
    report_s=20,
    eval_startup_s=15,
    profile_s=45,
    suite_s={"pg19": 25, "niah": 52, "infinitebench": 50, "ruler": 130, "probe": 30},
)
# Jobs of their own: a base at 4K trained twice as long, extended 16x to 64K, where attention sets the step's time
# (at 32K this model's steps were host-bound); the extensions tokenise the code afresh (no cache from pretraining
# in their job). 200 steps of 64K: 13M tokens, more than the one-job scale's 300 of 32K.
GPU_MULTI = replace(
    GPU,
    name="gpu-multi",
    stem="extension_experiment_{gpu}_multi",
    corpus_args=("--base-context", "4096", "--long-context", "65536", "--retrieval-share", "0.4"),
    base_recipe="code-base-long.yaml",
    base_context=4096,
    lengths=(4096, 8192, 16384, 32768, 65536),
    extend_steps=200,
    extend_step_s=0.3,
    extend_overhead_s=60,
    eval_min_s=120,
    concurrency=6,  # the 64K evals of a 29M model, 16 CPU cores: more side by side (not yet measured at 6)
    # Decoding a 29M model is bound by the host, not the GPU, so a batch of 8 should take little longer than one
    # prompt (bench/bench_eval_decode.py: 2.8x the tokens/s even on 2 CPU cores). It holds 8 KV caches (8 KiB a
    # token: 512 MiB at 64K), 24 GiB for 6 jobs side by side. 4 RULER prompts per task and length and 4 NIAH
    # prompts per cell (44 a length, answers of at most 32 tokens): with 1, one prompt moved a RULER mean 6-12
    # points and NIAH's paired half-width at 64K was 5.9 over 33 prompts (ib_samples 3 stays).
    ruler_samples=4,
    niah_samples=4,
    eval_batch=8,
    # A round at every length on one H100, 6 side by side: pg19 ~21 s, NIAH 142-150, InfiniteBench 46-54, RULER
    # 240-290 s with every task; its niah tasks alone are 8 of its 11 tasks' prompts and the shortest answers
    suite_s={"pg19": 40, "niah": 150, "infinitebench": 80, "ruler": 180, "probe": 45},
)
SMOKE = Scale(
    "smoke",
    (
        "--max-mb",
        "4",
        "--max-heldout-mb",
        "1.5",
        "--vocab-size",
        "1024",
        "--base-context",
        "256",
        "--long-context",
        "2048",
        "--tokenizer-sample-mb",
        "2",
    ),
    (
        "model.hidden_size=64",
        "model.intermediate_size=192",
        "model.num_hidden_layers=2",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        "data.num_proc=1",
        "data.num_val_rows=2",
        "train.num_steps=30",
        "train.batch_size=4",
        "train.warmup_steps=3",
        "train.eval_every=30",
        "logging.every=10",
    ),
    (
        "data.num_proc=1",
        "data.num_val_rows=1",
        "train.warmup_steps=1",
        "logging.every=1",
        "attention.block_size=32",
        "attention.dense_below=256",
        "attention.last_q=32",
        "attention.cap=256",
        "attention.local_window=64",
    ),
    base_context=256,
    factor=8,
    lengths=(256, 512, 1024, 2048),
    books=2,
    ib_samples=2,
    ruler_samples=1,
    niah_samples=1,
    eval_batch=3,  # the batched decoding path, on CPU
    rounds=1,  # later rounds are planned (test_extension_experiment), not run: each eval is a process start-up
    concurrency=2,
    budget_s=1500,
    extend_step_s=3,
    extend_overhead_s=30,
    eval_min_s=200,
    report_s=30,
    eval_startup_s=5,
    profile_s=60,
    suite_s={"pg19": 30, "niah": 60, "infinitebench": 60, "ruler": 120, "probe": 30},
    extend_steps=4,
)
# the multi-job path on CPU: parts of 128 KiB, so that the tiny export (~330 KB) is cut into several
SMOKE_MULTI = replace(
    SMOKE,
    name="smoke-multi",
    stem="extension_experiment_{gpu}_multi",
    base_recipe="code-base-long.yaml",
    part_bytes=128 * 1024,
)
# Four GPUs (any number: the jobs train over every GPU present): the base pretrained with dp over them
# (recipes/code-base-4gpu.yaml), extended 64x with YaRN to 256K under cp over them, a device job each for the base,
# the dense and the sparse extension (each model is evaluated in the job that made it: only one model's parts fit
# beside the working tree in a later job), and the evaluations that were left. A first time plan, from the one-GPU
# runs except the base job (measured on 4 x H100: below) (extension_experiment_h100_multi.json: corpus 36 s at 150 MB,
# a 64K step 0.28 s dense, 0.14 s sparse, ~60 s of start-up, tokenisation and compilation an extension), the
# 3B shape at 256K on 4 H200s (train_4gpu_h200.md: 24.3 s a dense step) and eval_prefill_h100.md:
# - base job (4 x H100, 2026-11-28): corpus 58-81 s (200 MB); pretraining ~60 s of start-up, then its steps, as
#   many as fit (base_step_s); parts 16 s; the base's and base+YaRN's evals in what is left (a 256K prompt's
#   process held 66 GiB of a GPU: evals.gpu_slots).
# - extension jobs: corpus ~45 s, parts joined ~5 s; start-up, tokenisation of ~200 MB, the first steps, the
#   validation, the export and its parts ~110 s; a dense step ~1.2 s: the 3B step's attention (~22 of its 24.3 s,
#   with activation checkpointing) over 18x the layers x heads x head dim, head dim 64 running below 128's rate;
#   or, from 64K on one GPU, each rank's 64K tokens (~0.08 s of matmuls) and a quarter of 16x the causal attention
#   (4 x ~0.2 s) on a ring ~1.3x the ideal (ring_4gpu_h200.md). 150 steps: ~180 s dense, ~70 s sparse (density
#   ~0.15 at 256K, plan included), then the sparse job's step profile (~90 s); the model's evals in the rest
#   (~190 s dense, ~250 s sparse).
# - evals: a prompt at 256K is ~1.2 s of prompt building (~220K tokens/s on CPU, eval_prompts_cpu.md) and ~2.6 s
#   of chunked dense prefill (the 3B shape's 128K prefill, 11.8 s, scaled by layers x heads x dim and length^2),
#   so NIAH and RULER run 2 prompts a cell a round, a process per long length, 4 processes a GPU (16 KV caches of
#   up to 8 x 256K x 4 KiB = 8 GiB on 4 x 80 GB; 64 CPU cores).
GPU_256K = replace(
    GPU_MULTI,
    name="gpu-256k",
    stem="extension_experiment_{procs}{device}_256k",
    procs=0,
    corpus_args=(
        "--base-context",
        "4096",
        "--long-context",
        "262144",
        "--retrieval-share",
        "0.4",
        "--max-mb",
        "200",
        "--max-heldout-mb",
        "16",  # the longest held-out packages, whole: perplexity at 256K needs books of 256K tokens (~900 KB)
    ),
    base_recipe="code-base-4gpu.yaml",
    factor=64,
    lengths=(4096, 16384, 65536, 131072, 262144),
    extend_steps=150,  # the least; fewer only if the job's start ran long
    # 4 x H100, 2026-11-28, 4 rows of 4K a GPU: 0.117 s a step (mean, 1,400 steps) on a warm machine, 0.169 s on
    # one just freed by another job; ~60 s from launch to the first step. 8 rows (the recipe now) add the
    # compute of 16K tokens, ~10% of a step bound by the host (MFU 4-5%): 0.19 s, an estimate
    base_step_s=0.19,
    base_start_s=70,
    extend_step_s=1.2,
    extend_overhead_s=110,
    # The run first: a model's evals left by its job can follow in a call of their own (bench.extension's
    # docstring), a run stopped at the budget cannot; 40 s covers its parts. A dense step may take 1.9 s, not 1.6
    eval_min_s=40,
    budget_s=540,
    report_s=40,  # the report, its logs and (the last job) the figures
    profile_s=90,
    concurrency=4,
    niah_samples=2,
    ruler_samples=2,
    # A round at 128K and 256K is ~390 s of eval processes a model (4 x H200: NIAH 100 + 220 s, RULER 90 + 170 s,
    # half of it building prompts before they were fitted on threads); 4 rounds (88 NIAH prompts a length) let
    # the three extended evaluations finish in about three calls
    rounds=4,
    sparse_prefill=("pg19", "niah", "infinitebench", "ruler"),
    ib_tasks="passkey",
    alone_from=131072,
    guess_by_tokens=True,
    speed_target=3.0,
    ppl_target_pct=1.0,
    eval_startup_s=20,
    suite_s={"pg19": 60, "niah": 230, "infinitebench": 50, "ruler": 170, "probe": 45},
)
# The same experiment a size down, for 2 GPUs (the stand-in while no 4-GPU machine is lent): 4K -> 128K,
# 32x, cp 2. A rank holds 64K tokens, as at 256K over 4 GPUs, and half the attention pairs: a dense step ~0.7 s
# against ~1.2 s (a guess, not measured). A 128K prompt's prefill is about a quarter of a 256K one's.
GPU_128K = replace(
    GPU_256K,
    name="gpu-128k",
    stem="extension_experiment_{procs}{device}_128k",
    corpus_args=(
        *GPU_256K.corpus_args[:2],
        *("--long-context", "131072"),
        *GPU_256K.corpus_args[4:],
    ),
    factor=32,
    lengths=(4096, 16384, 65536, 131072),
    extend_step_s=0.7,
)
# GPU_256K's pipeline on CPU: 2 processes under gloo (the base dp 2, the extensions cp 2), 4 heads of 16, one eval
# process per model and round for all its suites at both lengths (each is mostly start-up here)
SMOKE_256K = replace(
    SMOKE,
    name="smoke-256k",
    stem=GPU_256K.stem,
    procs=2,
    corpus_args=(  # SMOKE's with less text: each job builds the corpus again, each rank tokenises it
        *("--max-mb", "0.5", "--max-heldout-mb", "0.5", "--max-package-mb", "0.5", "--vocab-size", "1024"),
        *("--base-context", "256", "--long-context", "2048", "--tokenizer-sample-mb", "0.25"),
    ),
    # sparse prefill (4x a dense one here) only where it differs from dense attention: from dense_below up
    extend_sets=(
        *(s for s in SMOKE.extend_sets if not s.startswith("attention.dense_below=")),
        "attention.dense_below=512",
    ),
    base_recipe=GPU_256K.base_recipe,
    base_sets=(
        *(s for s in SMOKE.base_sets if not s.startswith(("model.num_attention_heads=", "train.batch_size="))),
        "model.num_attention_heads=4",
        "train.batch_size=2",
    ),
    lengths=(256, 512),  # beyond the base's context, from the extensions' dense_below up: sparse prefill runs
    books=1,
    ib_samples=1,
    part_bytes=128 * 1024,
    sparse_prefill=("niah",),  # 4x a dense prefill's time here: the one suite shows the path works
    ib_tasks="passkey",
    suites_together=True,
    concurrency=3,  # mostly start-up (imports): the 2 cores stay busy
    profile_warmup=1,  # a sparse step at 2K is ~1 s per rank under the Triton interpreter: one of each shows it
    profile_steps=1,
)
# One GPU, 2K -> 64K (32x, YaRN over a 2K base): the quality frontier's models of other families
# (bench/quality_frontier), chosen by --base-set on recipes/code-base.yaml (e.g. model.architecture=llama with
# Llama-3.1's llama3 rope_scaling, or model.architecture=qwen3 with an explicit model.head_dim), in the jobs of the
# 128k scale. First guesses, not measured: a base step of 16 rows of 2K like the 128k base's 8 of 4K on one H200
# (0.043-0.065 s); a dense 64K step ~0.6 s for 8 heads of 128 (the 128K step of 8 heads of 64 took 1.22 s: a
# quarter of its attention, half of the rest, twice the head dim).
GPU_64K = replace(
    GPU_128K,
    name="gpu-64k",
    stem="extension_experiment_{procs}{device}_64k",
    procs=1,
    corpus_args=(
        *("--base-context", "2048", "--long-context", "65536", "--retrieval-share", "0.4"),
        *GPU_256K.corpus_args[6:],
    ),
    base_recipe="code-base.yaml",
    base_context=2048,
    factor=32,
    lengths=(2048, 8192, 32768, 65536),
    base_step_s=0.07,
    extend_step_s=0.6,
    report_s=20,  # the report without figures took under a second at 128k (pg19 only); the last job draws them
)
# GPU_64K's jobs on CPU in one process: SMOKE_256K's sizes, no ring
SMOKE_64K = replace(SMOKE_256K, name="smoke-64k", stem=GPU_64K.stem, procs=1)
