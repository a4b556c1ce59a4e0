"""Fine-tuning flows beyond raw text: long chat SFT (conversations rendered with the model's chat template, the
loss on the answers), LoRA (sparse, at the long slot), and `mtrain eval` of a LoRA run's merged export and of an
adapter export."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable

from bench.gpu_e2e.checks import check_train, finish, only_subdir
from bench.gpu_e2e.data import CHARS_PER_TOKEN, stories
from bench.gpu_e2e.job import Flow, Job, Record
from bench.gpu_e2e.scales import Scale, length_label

# ChatML written as text (the pretrained base's tokenizer has no such special tokens): what model/tiny.py ships
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LORA = ("train.lora.rank=16", "train.lora.alpha=32", "train.lr=1e-3")


def chat_inputs(job: Job, length: int, num_conversations: int) -> tuple[str, str]:
    """(a tokenizer directory: the pretrained base's with a chat template, a jsonl of conversations: a story of
    length/8 to length/2 tokens with a pass key inside, the question, the key as the answer; every fifth one longer
    than `length`, so some are cut)."""
    tokenizer = job.work / "data" / "chat_tokenizer"
    shutil.rmtree(tokenizer, ignore_errors=True)
    tokenizer.mkdir(parents=True)
    export = job.state.models["pretrain"]
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (export / name).is_file():
            shutil.copy(export / name, tokenizer / name)
    config_file = tokenizer / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}, indent=2))
    rng, texts = random.Random(0), stories()
    lines = []
    for index in range(num_conversations):
        tokens = length * 3 // 2 if index % 5 == 4 else rng.randint(length // 8, length // 2)
        text = ""
        while len(text) < tokens * CHARS_PER_TOKEN:
            text += rng.choice(texts) + "\n\n"
        key = rng.randint(10000, 99999)
        at = rng.randint(0, len(text))
        text = text[:at] + f" The pass key is {key}. Remember it. " + text[at:]
        messages = [
            {"role": "system", "content": "You answer from the document."},
            {"role": "user", "content": f"{text}\nWhat is the pass key?"},
            {"role": "assistant", "content": f"The pass key is {key}."},
        ]
        lines.append(json.dumps({"messages": messages}))
    data = job.work / "data" / f"chat_{length_label(length)}.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return str(tokenizer), str(data)


def finetune_flow(slot: str, kind: str) -> Callable[[Job, Record], None]:
    """extend --model <pretrain export>, sparse, at the scale's `slot` length: `kind` "chat" (conversations, loss on
    the answers), "lora" (LoRA + embeddings and norms, merged export) or "adapter" (LoRA, the adapter exported alone,
    then evaluated by mtrain eval)."""

    def run(job: Job, rec: Record) -> None:
        s = job.scale
        length = s.short if slot == "short" else s.long
        runs = job.out_dir("runs", rec.name)
        sets = [
            f"run.name={rec.name}",
            f"data.seq_len={length}",
            f"context.factor={length // s.native}",
            "attention.mode=sparse",
            "attention.crossover=false",
            f"train.activation_checkpointing={'true' if slot == 'long' else 'false'}",
        ]
        if kind == "chat":
            tokenizer, data = chat_inputs(job, length, 4 * (s.extend_steps + 2))
            sets += [f"model.tokenizer={tokenizer}", "data.packing=best_fit", "data.chat_turns=last"]
        else:
            data = str(job.state.data[f"x1_{length}"])
            # the adapter files carry adapters only: embeddings and norms train in the merged case
            sets += [
                *LORA,
                "train.lora.export=adapter" if kind == "adapter" else "train.lora.train_embeddings_norms=true",
            ]
        cmd = job.mtrain(
            "extend",
            "--recipe",
            str(job.work / "e2e.yaml"),
            "--data",
            data,
            "--output-dir",
            str(runs),
            "--model",
            str(job.state.models["pretrain"]),
            *[arg for item in sets for arg in ("--set", item)],
        )
        job.run(rec, cmd, rec.timeout_s)
        run_dir = only_subdir(runs)
        if kind == "adapter":
            adapter_checks(job, rec, run_dir)
            return
        check_train(job, rec, run_dir, s.extend_steps, "sparse", length, None, "yarn")
        if rec.status != "pass":
            return
        summary = json.loads((run_dir / "summary.json").read_text())
        problems, checks = [], list(rec.checks)
        if kind == "chat":
            packing = summary["packing"]
            rec.metrics["chat"] = {k: packing.get(k) for k in packing if "conversation" in k or "loss" in k}
            if not packing.get("num_conversations") or not packing.get("num_conversations_cut"):
                problems.append(f"packing {rec.metrics['chat']}: no conversations, or none of the long ones cut")
            if not 0 < packing.get("num_loss_tokens", 0) < 0.1 * packing["num_input_tokens"]:
                problems.append(f"loss on {packing.get('num_loss_tokens')} tokens: expected the answers only")
            checks.append(f"conversations: {rec.metrics['chat']}")
        else:
            trainable, total = summary.get("num_trainable_params") or 0, summary.get("num_params") or 0
            rec.metrics["num_trainable_params"] = trainable
            if not 0 < trainable < total / 2:
                problems.append(f"num_trainable_params {trainable} of {total}: LoRA trains a small part")
            checks.append(f"LoRA: {trainable:,} of {total:,} parameters train; merged export checked")
        finish(rec, problems, checks)
        if rec.status == "pass":
            job.state.run_dirs[rec.name] = run_dir

    return run


def adapter_checks(job: Job, rec: Record, run_dir) -> None:
    """The adapter export (peft's files, the base's extended config) and `mtrain eval` of it on its base."""
    problems, checks = [], []
    export = run_dir / "export" if run_dir else None
    if rec.rc != 0 or export is None or not (export / "adapter_config.json").is_file():
        finish(rec, [f"exit code {rec.rc}; no adapter export"], [])
        return
    if (export / "config.json").is_file() or not (export / "base_config.json").is_file():
        problems.append("the adapter export must hold base_config.json and no config.json")
    evals = job.out_dir("evals", rec.name)
    cmd = job.mtrain(
        "eval", str(export), "--suite", "pg19", "--pg19-dir", str(job.state.data["pg19"]),
        "--lengths", job.scale.eval_lengths, "--samples", "1", "--out", str(evals),
    )  # fmt: skip
    job.run(rec, cmd, max(30.0, job.left() - 10), log_name=f"{rec.name}-eval")
    results = only_subdir(evals)
    results_file = results / "results.json" if results else None
    if rec.rc != 0 or results_file is None or not results_file.is_file():
        problems.append(f"mtrain eval of the adapter: exit code {rec.rc}, no results.json")
    else:
        rec.artifacts["results"] = str(results_file)
        checks.append("mtrain eval merged the adapter into its base and scored pg19")
    finish(rec, problems, checks)


def eval_lora_flow(job: Job, rec: Record) -> None:
    """mtrain eval of the LoRA run (its merged export): perplexity and passkey at the eval lengths, sparse."""
    evals = job.out_dir("evals", rec.name)
    d = job.state.data
    cmd = job.mtrain(
        "eval", str(job.state.run_dirs["lora-sparse"]), "--suite", "pg19,infinitebench", "--tasks", "pg19,passkey",
        "--lengths", job.scale.eval_lengths, "--samples", "1", "--attention", "sparse", "--out", str(evals),
        "--pg19-dir", str(d["pg19"]), "--infinitebench-dir", str(d["infinitebench"]),
        "--sparse-set", f"dense_below={job.scale.eval_dense_below}",
    )  # fmt: skip
    job.run(rec, cmd, rec.timeout_s)
    results = only_subdir(evals)
    results_file = results / "results.json" if results else None
    if rec.rc != 0 or results_file is None or not results_file.is_file():
        finish(rec, [f"exit code {rec.rc}; no results.json"], [])
        return
    rec.artifacts["results"] = str(results_file)
    suites = json.loads(results_file.read_text()).get("suites") or {}
    missing = [name for name in ("pg19", "infinitebench") if not (suites.get(name) or {}).get("rows")]
    finish(rec, [f"suites without scores: {missing}"] if missing else [], ["merged LoRA export: pg19 + passkey"])


def flows(scale: Scale) -> list[Flow]:
    short, long = length_label(scale.short), length_label(scale.long)
    return [
        Flow(
            "chat-sft-sparse",
            "extend_short",
            f"extend --model <pretrain export> on conversations (chat template, loss on the last answer), sparse, "
            f"{short}, best_fit packing, long ones cut",
            finetune_flow("short", "chat"),
            ("pretrain",),
            min_s=40,
        ),
        Flow(
            "lora-sparse",
            "extend_long",
            f"extend --model <pretrain export> with LoRA r16 + embeddings and norms, sparse, {long}, activation "
            f"checkpointing, merged export",
            finetune_flow("long", "lora"),
            ("pretrain",),
            min_s=45,
        ),
        Flow(
            "lora-export-eval",
            "eval",
            "mtrain eval of the LoRA run's merged export: pg19 + passkey, sparse",
            eval_lora_flow,
            ("lora-sparse",),
            min_s=30,
        ),
        Flow(
            "lora-adapter-eval",
            "extend_short",
            f"extend with LoRA, the adapter exported alone ({short}), then mtrain eval of it on its base (pg19)",
            finetune_flow("short", "adapter"),
            ("pretrain",),
            min_s=60,
        ),
    ]
