"""data.make_code_corpus on a small fake site-packages: the same seed writes the same bytes (with the tokenizer's
threads or without), held-out packages never reach the training files, the size cap holds, and the retrieval
documents use eval's prompt formats but never a needle eval can ask (checked against eval's own generators)."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from data import code_retrieval, make_code_corpus
from mtrain_cli.eval.haystack import NOISE_HAYSTACK
from mtrain_cli.eval.infinitebench.suite import fit_generated
from mtrain_cli.eval.niah import build_niah_sample
from mtrain_cli.eval.prompts import PromptFormat
from mtrain_cli.eval.ruler.niah_tasks import niah_tasks
from mtrain_cli.eval.ruler.suite import build_sample
from mtrain_cli.eval.ruler.task import TaskData
from mtrain_cli.eval.words import ADJECTIVES, KEY_SPACE, NOUNS

REPO = Path(__file__).resolve().parents[1]
BUILD = [sys.executable, "-m", "data.make_code_corpus"]  # run from the repository root
TRAIN_FILES = ("train_code.jsonl", "retrieval_base.jsonl", "retrieval_long.jsonl")
RETRIEVAL_FILES = TRAIN_FILES[1:]
MAX_MB = 0.4
NUM_PACKAGES = 30


def fake_site(root: Path) -> Path:
    """pkg_00..pkg_29 of generated Python, each line of it marked with its package; plus what must be left out:
    a vendored copy, a file over --max-file-kb and one that is not UTF-8."""
    rng = random.Random(0)
    for i in range(NUM_PACKAGES):
        package = root / f"pkg_{i:02d}"
        (package / "sub").mkdir(parents=True)
        for j in range(3):
            functions = [
                f'def f_{j}_{k}(x):\n    """MARKER_pkg_{i:02d}: scale x."""\n    return x * '
                f"{rng.randint(1, 999)} + {k}\n"
                for k in range(40)
            ]
            (package / ("sub" if j else ".") / f"m{j}.py").write_text("\n".join(functions))
    (root / "pkg_00" / "_vendor").mkdir()
    (root / "pkg_00" / "_vendor" / "copy.py").write_text("VENDORED_MARKER = 1\n")
    (root / "pkg_01" / "big.py").write_text("BIG_MARKER = 1\n" + "#" * 30_000)
    (root / "pkg_02" / "latin1.py").write_bytes(b"LATIN1_MARKER = '\xe9'\n")
    (root / "pkg_03.dist-info").mkdir()
    return root


def build(site: Path, out: Path, seed: int, tokenizer_threads: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, TOKENIZERS_PARALLELISM=str(tokenizer_threads).lower())
    return subprocess.run(
        [
            *BUILD,
            "--out",
            str(out),
            "--source-root",
            str(site),
            "--seed",
            str(seed),
            "--max-mb",
            str(MAX_MB),
            "--heldout-percent",
            "20",
            "--max-heldout-mb",
            "0.1",
            "--max-file-kb",
            "20",
            "--vocab-size",
            "400",
            "--base-context",
            "256",
            "--long-context",
            "1024",
            "--workers",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("code_corpus")
    site = fake_site(root / "site")
    outs = {"a": root / "a", "b": root / "b", "seed1": root / "seed1"}
    for name, out in outs.items():
        # "b" without the tokenizer's threads: bench/extension/phases.py builds with them, and the extend job's
        # corpus must match the base job's byte for byte
        result = build(site, out, seed=1 if name == "seed1" else 0, tokenizer_threads=name != "b")
        assert result.returncode == 0, result.stderr
    return outs


def texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_same_split(corpora):
    assert files(corpora["a"]) == files(corpora["b"])
    other = files(corpora["seed1"])
    assert other["retrieval_base.jsonl"] != files(corpora["a"])["retrieval_base.jsonl"]
    manifests = [json.loads((corpora[name] / "manifest.json").read_text()) for name in ("a", "seed1")]
    assert manifests[0]["split"] == manifests[1]["split"], "the held-out packages do not depend on the seed"
    assert manifests[0]["packages_sha256"] == manifests[1]["packages_sha256"]


def test_held_out_packages_never_reach_training(corpora):
    out = corpora["a"]
    manifest = json.loads((out / "manifest.json").read_text())
    held_out = set(manifest["split"]["held_out_names"])
    assert held_out and len(held_out) < NUM_PACKAGES
    train_text = "".join((out / name).read_text() for name in TRAIN_FILES)
    heldout_text = "".join(p.read_text() for p in (out / "heldout").glob("*.txt"))
    for name in held_out:
        assert f"MARKER_{name}" not in train_text
    assert any(f"MARKER_{name}" in heldout_text for name in held_out)
    headers = set(re.findall(r"# file: (pkg_\d\d)/", "".join(texts(out / "train_code.jsonl"))))
    assert headers and not headers & held_out
    assert {marker.removeprefix("MARKER_") for marker in re.findall(r"MARKER_pkg_\d\d", heldout_text)} <= held_out
    for left_out in ("VENDORED_MARKER", "BIG_MARKER", "LATIN1_MARKER"):
        assert left_out not in train_text + heldout_text


def test_size_cap_holds(corpora):
    out = corpora["a"]
    sizes = {name: (out / name).stat().st_size for name in TRAIN_FILES}
    assert 0.8 * MAX_MB * 1e6 < sum(sizes.values()) <= MAX_MB * 1e6, sizes
    assert all(sizes.values())
    heldout = [p.stat().st_size for p in (out / "heldout").glob("*.txt")]
    assert heldout and (sum(heldout) <= 0.1e6 or len(heldout) == 1), "--max-heldout-mb (the longest always written)"


class CapturingTokenizer:
    """One token per word; keeps the last text, so eval's rendered prompt can be read back."""

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = False):
        self.text = text
        return SimpleNamespace(input_ids=text.split())


def eval_prompts_and_answers() -> tuple[dict[str, list[str]], set[str]]:
    """Eval's own samples (NIAH, RULER's niah tasks, InfiniteBench's generated retrieval tasks), a few seeds and
    lengths: their rendered prompts by family, and every answer they expect."""
    tokenizer = CapturingTokenizer()
    fmt = PromptFormat(tokenizer, chat_template=False)
    data = TaskData(NOISE_HAYSTACK, None, None, None)
    prompts: dict[str, list[str]] = {}
    answers: set[str] = set()
    for seed in range(3):
        for length in (300, 900):
            for depth in (0, 50, 100):
                sample = build_niah_sample(fmt, NOISE_HAYSTACK, length, depth, 0, seed)
                prompts.setdefault("niah", []).append(tokenizer.text)
                answers.update(sample.references)
            for task in niah_tasks():
                sample = build_sample(task, data, fmt, length, 0, seed)
                prompts.setdefault("ruler_niah", []).append(tokenizer.text)
                answers.update(sample.references)
            for task in ("passkey", "number_string", "kv_retrieval"):
                for index in range(3):
                    example, _, _, _ = fit_generated(fmt, task, length, index, 3, seed)
                    prompts.setdefault(task, []).append(tokenizer.text)
                    answers.update(example.answer)
    return prompts, answers


# One pattern per family matches eval's prompt (up to its answer prefix) and our documents (prompt + answer).
FORMATS = {
    "niah": r"A secret code is hidden somewhere in the following text\. Find it and remember it\.\n\n.*\n\n"
    r"What is the secret code of the (\S+)\?\nThe secret code of the \1 is",
    "ruler_niah": r"Some special magic (numbers|uuids) are hidden within the following text\. Make sure to memorize "
    r"it\. I will quiz you about the \1 afterwards\.\n.*\nWhat are all the special magic \1 for (.+) "
    r"mentioned in the provided text\?\nThe special magic \1 for \2 mentioned in the provided text are",
    "passkey": r"There is an important info hidden inside a lot of irrelevant text\. Find it and memorize it\. I will "
    r"quiz you about the important information there\.\n\n.*\n\nWhat is the pass key\?\nThe pass key is",
    "number_string": r"There is an important info hidden inside a lot of irrelevant text\. .*\n\nWhat is the sequence "
    r"of digits\?\nThe sequence of digits is",
    "kv_retrieval": r"Extract the value corresponding to the specified key in the JSON object below\.\n\n\{.*\}\n\n"
    r"Key: \"(\S+)\"\nThe value associated with the specified key is:",
}


def test_retrieval_documents_use_eval_formats_never_eval_needles(corpora):
    docs = [text for name in RETRIEVAL_FILES for text in texts(corpora["a"] / name)]
    prompts, answers = eval_prompts_and_answers()
    for family, pattern in FORMATS.items():
        assert all(re.fullmatch(pattern, prompt, re.DOTALL) for prompt in prompts[family]), family
        assert any(re.match(pattern, doc, re.DOTALL) for doc in docs), f"no training document of {family}"
    joined = "\n".join(docs)
    found = [answer for answer in answers if re.search(rf"(?<![\w-]){re.escape(answer)}(?![\w-])", joined)]
    assert not found, f"eval answers inside training documents: {found[:5]}"
    # and by construction: needle spaces disjoint from eval's (mtrain_cli/eval/words.py, uuid4 variants)
    assert not set(code_retrieval.ADJECTIVES + code_retrieval.NOUNS) & set(ADJECTIVES + NOUNS)
    assert not set(code_retrieval.KEYS) & set(KEY_SPACE)
    assert len(re.findall(r"The pass key is (\d+)\.", joined)) > 0
    assert {len(key) for key in re.findall(r"The pass key is (\d+)\.", joined)} <= {3, 4, 6, 7}
    assert {len(d) for d in re.findall(r"The sequence of digits is (\d+)\.", joined)} <= {8, 9, 11, 12}
    values = re.findall(r"(?:secret code of the \S+ is|magic numbers for \S+ is:) (\d+)\.", joined)
    assert {len(v) for v in values} <= {5, 6, 8, 9} and len({len(v) for v in values}) > 2, "several lengths"
    variants = set(re.findall(r"\b[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-([0-9a-f])[0-9a-f]{3}-[0-9a-f]{12}\b", joined))
    assert variants and variants <= {"c", "d"}


def test_bad_option_is_one_line_with_exit_code_2(tmp_path):
    result = subprocess.run(
        [*BUILD, "--out", str(tmp_path), "--max-mb", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "--max-mb" in result.stderr


def test_full_context_share_draws_documents_near_the_full_length():
    """retrieval_docs with a stub writer (one token a word) and tokenizer: a share of the documents comes from the
    top eighth of the length range (needles a full context from their question, as eval's depth-0 prompts)."""
    writer = SimpleNamespace(document=lambda rng, num_tokens: ("passkey", " ".join(["w"] * num_tokens)))
    tokenizer = SimpleNamespace(encode_batch_fast=lambda texts: [SimpleNamespace(ids=t.split()) for t in texts])
    low, high = 64, 255
    full_low = high - (high - low) // 8

    def top_share(full_share: float) -> float:
        docs = make_code_corpus.retrieval_docs(writer, tokenizer, random.Random(0), (low, high), [], full_share)
        lengths = [len(next(docs).split()) for _ in range(2000)]
        assert low <= min(lengths) and max(lengths) <= high
        return sum(length >= full_low for length in lengths) / len(lengths)

    assert top_share(1.0) == 1.0
    assert 0.08 < top_share(0.0) < 0.18  # 24 of 192 lengths: 12.5%
    assert 0.5 < top_share(0.5) < 0.62  # half drawn there, and an eighth of the other half: 56%


def test_needles_are_planted_at_the_ends_as_eval_asks():
    """Eval's grids ask depth 0% (the needle first) and 100% as often as any other depth; a uniform draw almost
    never plants a needle first, so a share of training depths is an end."""
    rng = random.Random(0)
    depths = [code_retrieval.needle_depth(rng) for _ in range(20_000)]
    half = code_retrieval.END_DEPTH_SHARE / 2
    assert abs(depths.count(0.0) / len(depths) - half) < 0.01
    assert abs(depths.count(100.0) / len(depths) - half) < 0.01
    assert all(0 <= d <= 100 for d in depths)
    units = [f"unit {i}." for i in range(200)]
    assert code_retrieval.plant(units, ["NEEDLE"], [0.0])[0] == "NEEDLE"
    assert code_retrieval.plant(units, ["NEEDLE"], [100.0])[-1] == "NEEDLE"
