"""Local QA corpora for RULER's QA tasks: SQuAD v2.0 json (qa_1) and HotpotQA json (qa_2), read into
documents and questions whose gold documents are indices into them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mtrain_cli.errors import UserError


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


def _read_json(path: Path, option: str):
    if not path.is_file():
        raise UserError(f"{option} {str(path)!r} is not a file; pass the local json file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{option} {str(path)!r} is not valid json ({exc.msg}, line {exc.lineno})") from None


def load_squad(path: str | Path | None) -> QaCorpus | None:
    """SQuAD v2.0 layout: {"data": [{"paragraphs": [{"context", "qas": [{"question", "answers", ...}]}]}]}.
    Unanswerable questions are left out."""
    if path is None:
        return None
    path = Path(path).expanduser()
    raw = _read_json(path, "--squad-file")
    if not isinstance(raw, dict) or not isinstance(raw.get("data"), list):
        raise UserError(f"--squad-file {str(path)!r} is not SQuAD json (expected a top-level 'data' list)")
    documents: list[str] = []
    items: list[QaItem] = []
    for article in raw["data"]:
        for paragraph in article.get("paragraphs", []):
            documents.append(paragraph["context"])
            for qa in paragraph.get("qas", []):
                answers = sorted({answer["text"] for answer in qa.get("answers", [])})
                if answers and not qa.get("is_impossible", False):
                    items.append(QaItem(qa["question"], answers, [len(documents) - 1]))
    if not items:
        raise UserError(f"--squad-file {str(path)!r} has no answerable questions")
    return QaCorpus(f"SQuAD file {path}", documents, items)


def load_hotpot(path: str | Path | None) -> QaCorpus | None:
    """HotpotQA layout: [{"question", "answer", "context": [[title, [sentences]]], "supporting_facts"}].
    Gold paragraphs are those named in supporting_facts (all of the item's paragraphs if none are)."""
    if path is None:
        return None
    path = Path(path).expanduser()
    raw = _read_json(path, "--hotpot-file")
    if not isinstance(raw, list):
        raise UserError(f"--hotpot-file {str(path)!r} is not HotpotQA json (expected a top-level list)")
    index: dict[str, int] = {}
    items: list[QaItem] = []
    for entry in raw:
        supporting = {title for title, _ in entry.get("supporting_facts", [])}
        gold: list[int] = []
        for title, sentences in entry["context"]:
            text = f"{title}\n{''.join(sentences)}"
            position = index.setdefault(text, len(index))
            if not supporting or title in supporting:
                gold.append(position)
        items.append(QaItem(entry["question"], [str(entry["answer"])], gold))
    if not items:
        raise UserError(f"--hotpot-file {str(path)!r} has no questions")
    return QaCorpus(f"HotpotQA file {path}", list(index), items)
