"""Local inputs of the flows, offline and deterministic: the recipe every flow starts from, long documents for
training (packed several to a row, or one cut into rows), and eval files (haystacks, PG-19 books, SQuAD and HotpotQA
files, InfiniteBench tasks), all made from the shipped stories."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

from bench.gpu_e2e.job import REPO, Job
from bench.gpu_e2e.scales import length_label

CORPUS = REPO / "data" / "corpus" / "long.jsonl"
CHARS_PER_TOKEN = 2.9  # the shipped byte-level BPE on the shipped stories (measured: 2.89)


def recipe(job: Job) -> Path:
    """The recipe every flow starts from (a YAML file, as a user writes one); flows override with --set."""
    s = job.scale
    text = {
        "run": {"name": "e2e", "description": f"bench.gpu_e2e recipe ({s.name} scale)", "seed": 0},
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
    path.write_text(f"# bench.gpu_e2e: JSON is YAML\n{json.dumps(text, indent=2)}\n")
    return path


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
