"""Local QA corpora for RULER's QA tasks: SQuAD v2.0 json (qa_1) and HotpotQA json (qa_2), read into
documents and questions whose gold documents are indices into them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtrain_cli.errors import UserError
from mtrain_cli.eval.haystack import json_kind, read_utf8


@dataclass
class QaItem:
    question: str
    answers: list[str]
    gold: list[int]  # indices into QaCorpus.documents


@dataclass
class QaCorpus:
    source: str
    documents: list[str]
    items: list[QaItem]


SQUAD_SHAPE = '{"data": [{"paragraphs": [{"context": ..., "qas": [{"question": ..., "answers": [{"text": ...}]}]}]}]}'
HOTPOT_SHAPE = '[{"question": ..., "answer": ..., "context": [["title", ["sentence", ...]], ...]}]'
SQUAD_FIX = "pass the SQuAD v2.0 dev JSON (dev-v2.0.json)"
HOTPOT_FIX = "pass the HotpotQA dev JSON (hotpot_dev_distractor_v1.json)"


def _read_json(path: Path, option: str, fix: str):
    if not path.is_file():
        raise UserError(f"{option} {str(path)!r} is not a file; pass the local json file")
    text = read_utf8(path, f"{option} {str(path)!r}", fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{option} {str(path)!r} is not valid json ({exc.msg}, line {exc.lineno}, column {exc.colno}); {fix}"
        ) from None


class _Shape:
    """Reads fields of a parsed QA file; a missing field or one of the wrong JSON type is one line naming
    the file, where in it (e.g. data[3].paragraphs[0]), what is wrong and the layout expected."""

    def __init__(self, option: str, path: Path, name: str, shape: str, fix: str):
        self.option, self.path, self.name, self.shape, self.fix = option, path, name, shape, fix

    def fail(self, problem: str) -> None:
        raise UserError(f"{self.option} {str(self.path)!r}: {problem}: expected {self.name}'s {self.shape}; {self.fix}")

    def get(self, node, key: str, kind: type | tuple, where: str, default=None):
        """node[key], checked to be of `kind`; `default` (when not None) stands in for a missing key."""
        if not isinstance(node, dict):
            self.fail(f"{where} is {json_kind(node)}, not an object")
        if key not in node and default is not None:
            return default
        if key not in node:
            self.fail(f"{where} has no {key!r}")
        value = node[key]
        if not isinstance(value, kind):
            self.fail(f"{where}.{key} is {json_kind(value)}, not {_kind_name(kind)}")
        return value


def _kind_name(kind: type | tuple) -> str:
    return {list: "a list", str: "a string", dict: "an object"}.get(kind, "a string or number")


def load_squad(path: str | Path | None) -> QaCorpus | None:
    """SQuAD v2.0 layout: {"data": [{"paragraphs": [{"context", "qas": [{"question", "answers", ...}]}]}]}.
    Unanswerable questions are left out."""
    if path is None:
        return None
    path = Path(path).expanduser()
    raw = _read_json(path, "--squad-file", SQUAD_FIX)
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        holds = f" (the file holds {json_kind(raw)})" if not isinstance(raw, dict) else ""
        raise UserError(
            f"--squad-file {str(path)!r} has no 'data' list{holds}: expected a top-level 'data' list, "
            f"SQuAD v2.0's {SQUAD_SHAPE}; {SQUAD_FIX}"
        )
    shape = _Shape("--squad-file", path, "SQuAD v2.0", SQUAD_SHAPE, SQUAD_FIX)
    documents: list[str] = []
    items: list[QaItem] = []
    for a, article in enumerate(raw["data"]):
        for p, paragraph in enumerate(shape.get(article, "paragraphs", list, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            documents.append(shape.get(paragraph, "context", str, where))
            for q, qa in enumerate(shape.get(paragraph, "qas", list, where, default=[])):
                at = f"{where}.qas[{q}]"
                question = shape.get(qa, "question", str, at)
                answers = sorted(
                    {
                        shape.get(answer, "text", str, f"{at}.answers[{i}]")
                        for i, answer in enumerate(shape.get(qa, "answers", list, at, default=[]))
                    }
                )
                if answers and not qa.get("is_impossible", False):
                    items.append(QaItem(question, answers, [len(documents) - 1]))
    if not items:
        raise UserError(f"--squad-file {str(path)!r} has no answerable questions")
    return QaCorpus(f"SQuAD file {path}", documents, items)


def load_hotpot(path: str | Path | None) -> QaCorpus | None:
    """HotpotQA layout: [{"question", "answer", "context": [[title, [sentences]]], "supporting_facts"}].
    Gold paragraphs are those named in supporting_facts (all of the item's paragraphs if none are)."""
    if path is None:
        return None
    path = Path(path).expanduser()
    raw = _read_json(path, "--hotpot-file", HOTPOT_FIX)
    if not isinstance(raw, list):
        raise UserError(
            f"--hotpot-file {str(path)!r} is not HotpotQA json (the file holds {json_kind(raw)}, not a "
            f"list): expected HotpotQA's {HOTPOT_SHAPE}; {HOTPOT_FIX}"
        )
    shape = _Shape("--hotpot-file", path, "HotpotQA", HOTPOT_SHAPE, HOTPOT_FIX)
    index: dict[str, int] = {}
    items: list[QaItem] = []
    for e, entry in enumerate(raw):
        where = f"entry [{e}]"
        question = shape.get(entry, "question", str, where)
        answer = shape.get(entry, "answer", (str, int, float), where)
        supporting = set()
        for f, fact in enumerate(shape.get(entry, "supporting_facts", list, where, default=[])):
            if not (isinstance(fact, list) and fact and isinstance(fact[0], str)):
                shape.fail(f'{where}.supporting_facts[{f}] is not a ["title", sentence number] pair')
            supporting.add(fact[0])
        gold: list[int] = []
        for c, pair in enumerate(shape.get(entry, "context", list, where)):
            if not (
                isinstance(pair, list)
                and len(pair) == 2
                and isinstance(pair[0], str)
                and isinstance(pair[1], list)
                and all(isinstance(s, str) for s in pair[1])
            ):
                shape.fail(f'{where}.context[{c}] is not a ["title", ["sentence", ...]] pair')
            title, sentences = pair
            text = f"{title}\n{''.join(sentences)}"
            position = index.setdefault(text, len(index))
            if not supporting or title in supporting:
                gold.append(position)
        items.append(QaItem(question, [str(answer)], gold))
    if not items:
        raise UserError(f"--hotpot-file {str(path)!r} has no questions")
    return QaCorpus(f"HotpotQA file {path}", list(index), items)
