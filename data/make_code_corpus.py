"""Build the corpus of the context-extension experiment (issue 22) from the Python source of this environment.

    python -m data.make_code_corpus --out runs/code_corpus    # from the repository root [--seed 0] [--max-mb 150]

Packages (data/code_packages.py): every top-level package and module of the running interpreter's standard
library and site-packages (`--source-root DIR`, repeatable, reads those instead). A package's .py files, sorted and
each headed by `# file: <package>/<path>`, make its repository-level text, cut at file boundaries into
documents of at most 1 MB; vendored copies (`_vendor`, ...) and files over --max-file-kb are left out.
Split: packages in the order of the sha256 of their names are held out until they hold --heldout-percent of
all the bytes (each package counted up to --max-package-mb): whole packages, the same ones for every seed, and
enough long ones to measure perplexity at the extended length. Training text comes only from the others.

Writes under --out:
  train_code.jsonl       training packages' documents, packages in a seeded order, up to the size cap
  retrieval_base.jsonl   retrieval documents (data/code_retrieval.py) of up to --base-context tokens: pretraining
  retrieval_long.jsonl   retrieval documents of --base-context to --long-context tokens: extension
  heldout/NNN_<pkg>.txt  held-out packages, longest first: `mtrain eval --pg19-dir` books and `--haystack-dir` text
  tokenizer/             byte-level BPE of --vocab-size (digits split, `<|endoftext|>` = eos = pad) trained on the
                         training code and retrieval text (the shipped 512-token one reads code at ~1.3 chars/token)
  manifest.json          options, sizes, approximate tokens, the split and the sha256 of the package list
--max-mb caps the three .jsonl files together (MB = 10^6 bytes). Deterministic: from the options and the
environment alone, two runs write the same bytes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

from data.code_packages import (
    Package,
    capped,
    discover,
    documents,
    held_out_names,
    package_list_sha256,
    read_all,
    source_roots,
)
from data.code_retrieval import HAYSTACK_KINDS, RetrievalWriter

MB = 10**6
EOS_TOKEN = "<|endoftext|>"
MODEL_MAX_LENGTH = 131072
# Qwen2's pre-tokenizer split (as data/make_corpus.py): digits one by one, so a pass key is read digit by digit.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class UsageError(Exception):
    """Bad command-line input: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def jsonl_line(text: str) -> bytes:
    return (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8")


def write_jsonl(path: Path, texts, budget: int, truncate_last: bool) -> tuple[int, int]:
    """Documents until `budget` bytes; the one that does not fit is cut at a line (truncate_last) or dropped.
    -> (documents, bytes)."""
    num_docs = size = 0
    with path.open("wb") as handle:
        for text in texts:
            line = jsonl_line(text)
            while len(line) > budget - size and truncate_last and text:
                text = text[: text.rfind("\n", 0, int(len(text) * (budget - size) / len(line) * 0.98)) + 1]
                line = jsonl_line(text)
            if len(line) > budget - size or not text:
                break
            handle.write(line)
            num_docs, size = num_docs + 1, size + len(line)
    return num_docs, size


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    """Byte-level BPE, Qwen-style pre-tokenizer; saved for transformers. -> the `tokenizers` object."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    ).save_pretrained(str(out_dir))
    return tokenizer


def token_counts(tokenizer, texts: list[str]) -> list[int]:
    """Token counts of `texts`: the ids alone (encode_batch_fast leaves out the offsets, half of encode_batch's
    time on code)."""
    return [len(encoding.ids) for encoding in tokenizer.encode_batch_fast(texts)]


def chars_per_token(tokenizer, texts: list[str]) -> float:
    num_tokens = sum(token_counts(tokenizer, texts))
    return sum(map(len, texts)) / num_tokens if num_tokens else 1.0


def head(texts: list[str], num_chars: int) -> list[str]:
    """The first texts (the last one cut) holding `num_chars` characters."""
    out, size = [], 0
    for text in texts:
        if size >= num_chars:
            break
        out.append(text[: num_chars - size])
        size += len(out[-1])
    return out


def retrieval_docs(
    writer: RetrievalWriter,
    tokenizer,
    rng: random.Random,
    tokens: tuple[int, int],
    families: list[str],
    full_share: float,
    batch: int = 256,
):
    """Retrieval documents of `tokens` (low, high) tokens by the corpus tokenizer, without end; their families
    appended to `families` in order. A share `full_share` of them is drawn from the top eighth of that range: eval
    asks for needles at depth 0-10% of prompts of the full context, ~a context away from their question, which
    lengths drawn evenly from the whole range rarely give (of a 4K base's needles, 1.6% lie over 85% of the
    context back; 6.2% with half of the documents full-length). A draft longer than `high` (its code tokenizes
    densely) is made again, smaller."""
    low, high = tokens
    full_low = high - (high - low) // 8
    while True:
        targets = [rng.randint(full_low if rng.random() < full_share else low, high) for _ in range(batch)]
        drafts = [writer.document(rng, target) for target in targets]
        lengths = token_counts(tokenizer, [text for _, text in drafts])
        for target, (family, text), length in zip(targets, drafts, lengths):
            while length > high:
                target = int(target * high / length * 0.95)
                family, text = writer.document(rng, target)
                (length,) = token_counts(tokenizer, [text])
            families.append(family)
            yield text


def write_heldout(directory: Path, held_out: list[Package], args: argparse.Namespace, not_utf8: Counter) -> list[str]:
    """NNN_<package>.txt, longest first (eval reads the first N as books), up to --max-heldout-mb (the longest is
    always written). -> the texts written."""
    directory.mkdir(exist_ok=True)
    for stale in directory.glob("*.txt"):
        stale.unlink()
    longest_first = sorted(
        (capped(p, int(args.max_package_mb * MB)) for p in held_out), key=lambda p: (-p.num_bytes, p.name)
    )
    texts, num_bytes = [], 0
    for package, text in zip(longest_first, read_all(longest_first, args.workers, not_utf8)):
        size = len(text.encode("utf-8"))
        if not text or (texts and num_bytes + size > args.max_heldout_mb * MB):
            continue
        (directory / f"{len(texts):03d}_{package.name}.txt").write_text(text, encoding="utf-8")
        texts.append(text)
        num_bytes += size
    return texts


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/code_corpus"), help="output directory")
    parser.add_argument("--seed", type=int, default=0, help="package order and retrieval documents")
    parser.add_argument("--max-mb", type=float, default=150.0, help="the three .jsonl files together, MB")
    parser.add_argument(
        "--retrieval-share",
        type=float,
        default=0.3,
        help="share of retrieval_base in train_code + retrieval_base (bytes)",
    )
    parser.add_argument(
        "--long-retrieval-share",
        type=float,
        default=0.25,
        help="share of retrieval_long in train_code + retrieval_long (bytes)",
    )
    parser.add_argument(
        "--full-context-share",
        type=float,
        default=0.5,
        help="share of retrieval documents in the top eighth of their length range (needles a context back)",
    )
    parser.add_argument("--base-context", type=int, default=2048, help="tokens: the base model's context")
    parser.add_argument("--long-context", type=int, default=32768, help="tokens: the extended context")
    parser.add_argument("--heldout-percent", type=float, default=5.0, help="share of bytes held out (whole packages)")
    parser.add_argument("--max-heldout-mb", type=float, default=6.0, help="held-out text written, MB")
    parser.add_argument("--max-package-mb", type=float, default=8.0, help="text read from one package, MB")
    parser.add_argument("--max-file-kb", type=float, default=512.0, help="larger .py files are left out")
    parser.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=16.0, help="code the tokenizer learns from")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="file-reading threads")
    parser.add_argument(
        "--source-root",
        action="append",
        default=[],
        metavar="DIR",
        help="read these directories' packages instead of this interpreter's stdlib + site-packages",
    )
    args = parser.parse_args(argv)
    positive = (
        "max_mb",
        "max_heldout_mb",
        "max_package_mb",
        "max_file_kb",
        "tokenizer_sample_mb",
        "workers",
        "base_context",
    )
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be > 0")
    for name in ("retrieval_share", "long_retrieval_share", "full_context_share"):
        if not 0 <= getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} {getattr(args, name)} must be in [0, 1)")
    if not 0 < args.heldout_percent < 50:
        raise UsageError(f"--heldout-percent {args.heldout_percent} must be in (0, 50)")
    if args.long_context <= args.base_context:
        raise UsageError(f"--long-context {args.long_context} must exceed --base-context {args.base_context}")
    if args.vocab_size < 300:
        raise UsageError(f"--vocab-size {args.vocab_size} must be >= 300 (256 bytes + merges + eos)")
    return args


def build(args: argparse.Namespace) -> dict:
    try:
        roots = source_roots(args.source_root)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    packages, too_large = discover(roots, int(args.max_file_kb * 1000))
    held_out_set = held_out_names(packages, args.heldout_percent, int(args.max_package_mb * MB))
    held_out = [p for p in packages if p.name in held_out_set]
    train = [p for p in packages if p.name not in held_out_set]
    if not held_out or not train:
        raise UsageError(
            f"--heldout-percent {args.heldout_percent} splits {len(packages)} packages into "
            f"{len(train)} train / {len(held_out)} held out; both must be non-empty"
        )
    rng = random.Random(f"code-corpus:{args.seed}:packages")
    order = list(train)
    rng.shuffle(order)
    # Bytes of the three files: code + base retrieval + long retrieval = --max-mb, shares as asked.
    base_ratio = args.retrieval_share / (1 - args.retrieval_share)
    long_ratio = args.long_retrieval_share / (1 - args.long_retrieval_share)
    code_budget = int(args.max_mb * MB / (1 + base_ratio + long_ratio))
    selected, total = [], 0
    for package in order:  # 10% over the budget: JSON escaping grows the text; the writer cuts to size
        if total >= 1.1 * code_budget:
            break
        selected.append(capped(package, int(min(args.max_package_mb * MB, 1.1 * code_budget - total))))
        total += selected[-1].num_bytes
    not_utf8 = Counter()
    code_docs = [doc for text in read_all(selected, args.workers, not_utf8) if text for doc in documents(text)]

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    retrieval_rng = random.Random(f"code-corpus:{args.seed}:retrieval")
    guess = RetrievalWriter(code_docs, {kind: 3.5 for kind in HAYSTACK_KINDS})
    retrieval_sample = [
        guess.document(retrieval_rng, retrieval_rng.randint(64, args.base_context))[1] for _ in range(200)
    ]
    tokenizer = train_tokenizer(
        head(code_docs, int(args.tokenizer_sample_mb * MB)) + retrieval_sample, args.vocab_size, out / "tokenizer"
    )
    haystacks = guess.sample_haystacks(retrieval_rng, 200_000)
    writer = RetrievalWriter(code_docs, {kind: chars_per_token(tokenizer, [text]) for kind, text in haystacks.items()})

    files, families = {}, {}
    files["train_code.jsonl"] = write_jsonl(out / "train_code.jsonl", code_docs, code_budget, truncate_last=True)
    code_bytes = files["train_code.jsonl"][1]  # less than the budget where the environment holds less code
    # up to the context less one token: the tokenizer appends <|endoftext|> when training packs the documents.
    # Base documents from a quarter of the context up: more needles far from their question. (What kept a 4K base
    # from them was packing that cut documents at row boundaries: the code recipes pack with data.packing best_fit.)
    for name, ratio, tokens in (
        ("retrieval_base.jsonl", base_ratio, (args.base_context // 4, args.base_context - 1)),
        ("retrieval_long.jsonl", long_ratio, (args.base_context, args.long_context - 1)),
    ):
        drawn: list[str] = []
        docs = retrieval_docs(writer, tokenizer, retrieval_rng, tokens, drawn, args.full_context_share)
        files[name] = write_jsonl(out / name, docs, int(ratio * code_bytes), truncate_last=False)
        families[name] = dict(sorted(Counter(drawn[: files[name][0]]).items()))

    heldout_texts = write_heldout(out / "heldout", held_out, args, not_utf8)
    code_cpt = chars_per_token(tokenizer, head(code_docs, 2 * MB))
    heldout_cpt = chars_per_token(tokenizer, head(heldout_texts, 2 * MB))
    heldout_bytes = sum(len(text.encode("utf-8")) for text in heldout_texts)
    summary = {"num_docs": {}, "bytes": {}, "approx_tokens": {}}
    for name, (num_docs, num_bytes) in files.items():
        with (out / name).open(encoding="utf-8") as handle:
            sample = [json.loads(line)["text"] for line in itertools.islice(handle, 200)]
        cpt = code_cpt if name == "train_code.jsonl" else chars_per_token(tokenizer, head(sample, 2 * MB))
        summary["num_docs"][name], summary["bytes"][name] = num_docs, num_bytes
        summary["approx_tokens"][name] = int(num_bytes / cpt)
    manifest = {
        "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("out", "workers")
        },
        "python": sys.version.split()[0],
        "source_roots": [f"{origin}: {path}" for origin, path in roots],
        "packages_sha256": package_list_sha256(packages),
        "num_packages": len(packages),
        "split": {
            "train": len(train),
            "held_out": len(held_out),
            "held_out_names": [p.name for p in held_out],
            "rule": f"first packages in sha256(name) order holding {args.heldout_percent:g}% of the bytes",
        },
        "train_packages_used": [p.name for p in selected],
        "files": summary,
        "retrieval_families": families,
        "heldout": {
            "files": len(heldout_texts),
            "bytes": heldout_bytes,
            "approx_tokens": int(heldout_bytes / heldout_cpt),
            "files_of_long_context": sum(len(t) / heldout_cpt >= args.long_context for t in heldout_texts),
        },
        "skipped_files": {"over_max_file_kb": too_large["files"], "not_utf8": not_utf8["files"]},
        "tokenizer": {
            "vocab_size": tokenizer.get_vocab_size(),
            "chars_per_token": {
                "train_code": round(code_cpt, 3),
                "heldout_code": round(heldout_cpt, 3),
                **{kind: round(value, 3) for kind, value in writer.chars_per_token.items()},
            },
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str]) -> int:
    started = time.perf_counter()
    try:
        args = parse_args(argv)
        manifest = build(args)
    except UsageError as exc:
        print(f"make_code_corpus.py: {exc}", file=sys.stderr)
        return 2
    m, split = manifest, manifest["split"]
    print(f"packages: {m['num_packages']} from {'; '.join(m['source_roots'])} (sha256 {m['packages_sha256'][:16]})")
    print(
        f"split: {split['train']} train ({len(m['train_packages_used'])} used under --max-mb), {split['held_out']} "
        f"held out ({split['rule']}): {', '.join(split['held_out_names'])}"
    )
    for name in m["files"]["bytes"]:
        print(
            f"{name}: {m['files']['num_docs'][name]:,} docs, {m['files']['bytes'][name] / MB:.1f} MB, "
            f"~{m['files']['approx_tokens'][name] / 1e6:.2f}M tokens"
        )
    h = m["heldout"]
    print(
        f"heldout/: {h['files']} files, {h['bytes'] / MB:.1f} MB, ~{h['approx_tokens'] / 1e6:.2f}M tokens, "
        f"{h['files_of_long_context']} of >= {args.long_context} tokens"
    )
    print(f"tokenizer/: {m['tokenizer']['vocab_size']} tokens; chars/token {m['tokenizer']['chars_per_token']}")
    print(f"wrote {args.out} in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
