"""Haystacks: the filler text needles hide in, sized in units (sentences or words), and needle insertion
at a depth given as a percentage of the haystack's sentences."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from mtrain_cli.errors import UserError
from mtrain_cli.eval.options import path_option
from mtrain_cli.eval.words import NOISE_SENTENCES

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass
class Haystack:
    """`sentences(n)`: the first n units as a list of sentences. A unit is a noise sentence or an essay
    word, at least one token either way, so a token budget is also an upper bound on units. Essay text
    starts over from the first file when a length needs more words than the essays hold."""

    kind: str  # "noise" | "essay"
    source: str  # where the text comes from, for results.json
    essay_words: list[str] | None = None

    def sentences(self, units: int) -> list[str]:
        if self.kind == "noise":
            return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(units)]
        words = self.essay_words
        repeated = words * (units // len(words) + 1) if units > len(words) else words
        return [sentence for sentence in _SENTENCE_END.split(" ".join(repeated[:units])) if sentence]


def read_utf8(path: Path, what: str, fix: str) -> str:
    """The text of a local eval input file; one line naming `what` (option and file), the problem and `fix`
    when it cannot be read or is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} is not UTF-8 text ({not_utf8(exc)}); {fix}") from None
    except OSError as exc:
        raise UserError(f"{what} could not be read ({exc.strerror or exc}); {fix}") from None


def utf8_lines(path: Path, what: str, fix: str):
    """(line number, text) of each line of a jsonl file, decoded one line at a time so that a byte that is
    not UTF-8 is reported with its line."""
    offset = 0
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                try:
                    yield number, raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UserError(
                        f"{what} line {number} is not UTF-8 text ({not_utf8(exc, offset)}); {fix}"
                    ) from None
                offset += len(raw)
    except OSError as exc:
        raise UserError(f"{what} could not be read ({exc.strerror or exc}); {fix}") from None


def not_utf8(exc: UnicodeDecodeError, offset: int = 0) -> str:
    """'byte 0xff at offset 12': where decoding failed, offset in the file (`offset`: where the decoded part began)."""
    return f"byte 0x{exc.object[exc.start]:02x} at offset {offset + exc.start}"


def json_kind(value: object) -> str:
    """'an object', 'a list', ... for messages about a JSON value of the wrong shape."""
    for kind, name in (
        (dict, "an object"),
        (list, "a list"),
        (str, "a string"),
        (bool, "true/false"),
        ((int, float), "a number"),
    ):
        if isinstance(value, kind):
            return name
    return "null"


HAYSTACK_DIR = path_option("haystack_dir", "--haystack-dir", "Essay .txt files for haystacks.")  # RULER and NIAH
NOISE_HAYSTACK = Haystack("noise", "synthetic noise haystack: 'The grass is green. The sky is blue. ...' repeated")


def essay_haystack(directory: str | Path | None) -> Haystack | None:
    """The essays under --haystack-dir (every .txt file, sorted by name), or None when not given."""
    if directory is None:
        return None
    path = Path(directory).expanduser()
    files = sorted(path.rglob("*.txt")) if path.is_dir() else []
    if not files:
        raise UserError(
            f"--haystack-dir {str(directory)!r} has no .txt files; pass a directory of essay "
            f"text files or leave it out for the synthetic noise haystack"
        )
    fix = "re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave --haystack-dir out for the noise haystack"
    words = " ".join(read_utf8(f, f"--haystack-dir: {f}", fix) for f in files).split()
    if not words:
        raise UserError(f"--haystack-dir {str(directory)!r}: the .txt files are empty")
    return Haystack(
        "essay",
        f"essays: {len(files)} .txt files ({len(words):,} words) in {path}, repeated "
        f"from the start when a length needs more",
        essay_words=words,
    )


def insert_at_depths(sentences: list[str], needles: list[str], depths: list[float]) -> str:
    """Place each needle before the sentence at `depth`% of the haystack (0 = first, 100 = after last).

    Needles at the same depth keep their given order (a variable-tracking chain must read in order).
    Inserting from the deepest (and, at equal depth, the last) needle first means no insertion moves a
    position that is still to be used.
    """
    placed = list(sentences)
    total = len(sentences)
    order = sorted(range(len(needles)), key=lambda i: (depths[i], i), reverse=True)
    for i in order:
        placed.insert(round(depths[i] / 100 * total), needles[i])
    return " ".join(placed)
