"""The scales of the extension experiment: corpus, model and training sizes, evaluation lengths and rounds, and
the time plan of one device job (first guesses of each phase's wall time, replaced by measurements as they come).
GPU: one job, 2K -> 32K; GPU_MULTI: a 4K base and its 64K extension in jobs of their own; SMOKE(_MULTI): the same
pipelines on CPU at tiny sizes (tests/test_extension_experiment.py). Not run on its own.
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
    concurrency: int  # eval jobs side by side
    budget_s: float  # of one job
    extend_step_s: float  # expected seconds per extension step (dense and sparse alike), for the time plan
    extend_overhead_s: float  # start, tokenisation, compilation, export of one extension
    eval_min_s: float  # evaluation time the plan keeps
    report_s: float
    eval_startup_s: float  # of one `mtrain eval` process: imports, model load, haystacks
    profile_s: float  # `mtrain profile step` of the sparse-extended model: start, tokenisation, 5 steps
    suite_s: dict[str, float] = field(default_factory=dict)  # one eval job at every length, until measured
    extend_steps: int | None = None  # None: recipes/code-extend.yaml's train.num_steps
    base_recipe: str = "code-base.yaml"
    part_bytes: int = 15 * handoff.MiB  # the base export's parts (--phase base)


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
SMOKE_MULTI = replace(SMOKE, name="smoke-multi", base_recipe="code-base-long.yaml", part_bytes=128 * 1024)
