"""CPU throughput of RULER prompt generation (prompt tokens per second), as `mtrain eval` builds prompts.

For each target length and each synthetic RULER task, `--samples` samples are built with `build_sample`
(draw the sample, then search the haystack size so prompt + answer budget fits the length, tokenising
each candidate prompt with the model's tokenizer). Reported: prompt tokens produced per wall second, the
tokenisations per sample the size search needed, and the tokens those tokenisations processed per second.
The two QA tasks need local SQuAD/HotpotQA files and are left out; the essay-haystack tasks use the
synthetic noise haystack unless --haystack-dir is given. Writes bench/results/eval_prompts_cpu.json + .md.

    .venv/bin/python bench/bench_eval_prompts.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import tokenizers
import transformers

from mtrain_cli.eval import NOISE_HAYSTACK, PromptFormat, essay_haystack
from mtrain_cli.eval.ruler import RULER_TASKS, TaskData, build_sample
from mtrain_cli.lengths import parse_lengths
from mtrain_cli.resources import shipped_path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


class CountingFormat(PromptFormat):
    """Counts the tokenisations and the tokens they produce, to separate search cost from tokenizer speed."""

    calls = 0
    tokens = 0

    def encode(self, prompt: str, answer_prefix: str) -> list[int]:
        ids = super().encode(prompt, answer_prefix)
        self.calls += 1
        self.tokens += len(ids)
        return ids


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4k,32k,128k", help="target lengths, e.g. 4k,32k,128k")
    parser.add_argument("--samples", type=int, default=2, help="samples per task and length")
    parser.add_argument("--tokenizer", default=str(shipped_path("data/tokenizer")), help="local tokenizer directory")
    parser.add_argument("--haystack-dir", default=None, help="essay .txt files (default: synthetic noise haystack)")
    args = parser.parse_args()

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    fmt = CountingFormat(tokenizer, chat_template=False)
    data = TaskData(NOISE_HAYSTACK, essay_haystack(args.haystack_dir), None, None)
    tasks = [task for task in RULER_TASKS if task.unavailable(data) is None]
    cases = []
    for length in parse_lengths(args.lengths):
        for task in tasks:
            fmt.calls = fmt.tokens = 0
            start = time.perf_counter()
            samples = [build_sample(task, data, fmt, length, index, seed=0) for index in range(args.samples)]
            seconds = time.perf_counter() - start
            prompt_tokens = sum(len(sample.input_ids) for sample in samples)
            cases.append(
                {
                    "length": length,
                    "task": task.name,
                    "samples": args.samples,
                    "seconds": round(seconds, 4),
                    "prompt_tokens": prompt_tokens,
                    "prompt_tokens_per_s": round(prompt_tokens / seconds),
                    "tokenisations_per_sample": round(fmt.calls / args.samples, 1),
                    "tokenised_tokens_per_s": round(fmt.tokens / seconds),
                }
            )
            print(
                f"{length:>7} {task.name:<16} {prompt_tokens / seconds / 1e3:8.1f} K prompt tokens/s  "
                f"({fmt.calls / args.samples:.1f} tokenisations/sample, {seconds / args.samples:.3f} s/sample)",
                flush=True,
            )

    totals = {}
    for length in sorted({case["length"] for case in cases}):
        at_length = [case for case in cases if case["length"] == length]
        seconds = sum(case["seconds"] for case in at_length)
        totals[str(length)] = {
            "seconds_per_sample_all_tasks": round(seconds / args.samples, 3),
            "prompt_tokens_per_s": round(sum(c["prompt_tokens"] for c in at_length) / seconds),
        }
    result = {
        "benchmark": "RULER prompt generation on CPU (prompt tokens / wall second, size search included)",
        "command": " ".join([os.path.basename(sys.executable), "bench/bench_eval_prompts.py", *sys.argv[1:]]),
        "machine": {
            "cpu": cpu_name(),
            "num_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "versions": {
            "python": platform.python_version(),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "tokenizer": f"{args.tokenizer} ({type(tokenizer).__name__}, {len(tokenizer)} tokens)",
        "haystack": data.essay.source if data.essay else NOISE_HAYSTACK.source,
        "totals": totals,
        "cases": cases,
    }
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "eval_prompts_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS_DIR / "eval_prompts_cpu.md").write_text(markdown(result))


def markdown(result: dict) -> str:
    machine, versions = result["machine"], result["versions"]
    lengths = list(result["totals"])
    tasks = list(dict.fromkeys(case["task"] for case in result["cases"]))
    by_cell = {(str(case["length"]), case["task"]): case for case in result["cases"]}
    lines = [
        "# RULER prompt generation on CPU",
        "",
        "Prompt tokens produced per wall second by `build_sample` (sample drawn, haystack size searched so prompt "
        "+ answer budget fits the target length, every candidate tokenised with the model's tokenizer). "
        "In brackets: tokenisations per sample that the size search needed.",
        "",
        f"- machine: {machine['cpu']}, {machine['num_cpus']} CPUs, {machine['platform']}; load average at the end "
        f"{machine['load_average_at_end']} (other work shared the machine while it ran)",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- tokenizer: {result['tokenizer']}",
        f"- haystack: {result['haystack']}; QA tasks left out (they need local SQuAD/HotpotQA files)",
        f"- command: `{result['command']}`",
        "",
        "| task | " + " | ".join(f"{int(length) // 1024}K" for length in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for task in tasks:
        cells = [by_cell.get((length, task)) for length in lengths]
        lines.append(
            f"| {task} | "
            + " | ".join(
                f"{c['prompt_tokens_per_s'] / 1e3:.0f}K ({c['tokenisations_per_sample']:g})" if c else "-"
                for c in cells
            )
            + " |"
        )
    lines.append(
        "| **all tasks** | "
        + " | ".join(
            f"**{result['totals'][length]['prompt_tokens_per_s'] / 1e3:.0f}K** "
            f"({result['totals'][length]['seconds_per_sample_all_tasks']:.2f} s per sample of every task)"
            for length in lengths
        )
        + " |"
    )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
