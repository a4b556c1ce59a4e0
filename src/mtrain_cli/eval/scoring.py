"""Every per-sample metric, by name: a prediction and its references -> a score in [0, 1].

RULER: `string_match_all` (the share of references found in the prediction, case-insensitive: a
multi-value needle scores 1 only when every value is there) and `string_match_part` (1 if any
reference is found). NIAH: the needle's value as a substring. InfiniteBench: each task's own scorer,
following the official `compute_scores.py` rules (first integer, last word, option letter, F1 ...).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from mtrain_cli.eval.rouge import rouge_lsum


def string_match_all(prediction: str, references: list[str]) -> float:
    found = [reference.lower() in prediction.lower() for reference in references]
    return sum(found) / len(found)


def string_match_part(prediction: str, references: list[str]) -> float:
    return float(any(reference.lower() in prediction.lower() for reference in references))


def contains_value(prediction: str, references: list[str]) -> float:
    return float(references[0] in prediction)


def first_integer(text: str) -> str:
    """The first run of digits, as InfiniteBench's passkey/number_string scorer reads it."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else ""


def first_integer_match(prediction: str, references: list[str]) -> float:
    return float(first_integer(prediction) == str(references[0]))


def _words(prediction: str, separators: str) -> list[str]:
    for char in separators:
        prediction = prediction.replace(char, " ")
    return prediction.split()


def kv_retrieval_match(prediction: str, references: list[str]) -> float:
    return float(str(references[0]) in _words(prediction, "\n:\"'.,?!{}"))


def dialogue_name_match(prediction: str, references: list[str]) -> float:
    words = [word.upper() for word in _words(prediction, "\n:\"'.,?!{}")]
    return float(any(str(reference).upper() in words for reference in references))


def _first_number(text: str) -> float | None:
    match = re.search(r"-?\d+\.\d+|-?\d+", text)
    return float(match.group(0)) if match else None


def math_find_match(prediction: str, references: list[Any]) -> float:
    number = _first_number(prediction)
    return float(number is not None and number == float(references[0]))


def code_run_match(prediction: str, references: list[Any]) -> float:
    """The official rule: the last word (after dropping newlines, dots, quotes, colons) must be the integer."""
    words = _words(prediction.strip(), "\n.`'\":")
    try:
        return float(bool(words) and int(words[-1]) == int(references[0]))
    except ValueError:
        return 0.0


def math_calc_prefix(prediction: str, references: list[Any]) -> float:
    """The share of the expected intermediate values matched in order before the first mistake."""
    predicted = [int(item) for item in re.split(r"[^0-9]", prediction) if item]
    correct = 0
    for expected, got in zip(references, predicted):
        if int(expected) != got:
            break
        correct += 1
    return correct / len(references)


def _after_prefix(text: str, prefixes: tuple[str, ...]) -> str | None:
    """What follows the first of `prefixes` found (in this order) and one more character, or None."""
    for prefix in prefixes:
        index = text.find(prefix)
        if index != -1:
            return text[index + len(prefix) + 1 :]
    return None


def choice_match(prediction: str, references: list[str]) -> float:
    """longbook_choice_eng, official rules; references = [correct option text, its letter]. A leading
    A-D decides alone; else the whole answer equal to the text or letter; else what follows 'answer is:',
    'answer:', 'answer is' or 'option is'; else the first standalone A-D word."""
    letter = str(references[1])
    text = prediction.strip()
    if not text:
        return 0.0
    if text[0] in "ABCD":
        return float(text[0] == letter)
    if text in (str(references[0]), letter):
        return 1.0
    text = " ".join(_words(text, "\n\"'.,?!{}"))
    after = _after_prefix(text, ("answer is:", "answer:", "answer is", "option is"))
    if after is not None:
        return float(any(after.startswith(str(reference)) for reference in references))
    for word in text.split():
        if word in ("A", "B", "C", "D"):
            return float(word == letter)
    return 0.0


def code_debug_match(prediction: str, references: list[str]) -> float:
    """code_debug, official rules; references = [function name, its letter]: 'B.'/'B:' first, else what
    follows 'answer is:', 'is:' or 'answer:' must start with the letter or the function name. One
    addition: an answer that is only the letter counts, since our answer prefix ends in 'is:' already."""
    function, letter = str(references[0]), str(references[1])
    text = prediction.strip()
    if text[:2] in (f"{letter}.", f"{letter}:") or text == letter:
        return 1.0
    for token in ("\n", "`", "'", '"', "-", "*", "Option", "option"):
        text = text.replace(token, " ")
    after = _after_prefix(" ".join(text.split()), ("answer is:", "is:", "answer:"))
    return float(after is not None and (after.startswith(letter) or after.startswith(function)))


def _normalize_english(text: str) -> list[str]:
    text = "".join(char for char in text.lower() if char not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


_CHINESE_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: E501


def _normalize_chinese(text: str) -> list[str]:
    dropped = set(string.punctuation) | set(_CHINESE_PUNCTUATION) | set(string.whitespace)
    return [char for char in text.lower() if char not in dropped]


def _f1(predicted: list[str], reference: list[str]) -> float:
    common = sum((Counter(predicted) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, references: list[str]) -> float:
    return max(_f1(_normalize_english(prediction), _normalize_english(str(r))) for r in references)


def char_f1(prediction: str, references: list[str]) -> float:
    return max(_f1(_normalize_chinese(prediction), _normalize_chinese(str(r))) for r in references)


def rouge_lsum_best(prediction: str, references: list[str]) -> float:
    return max(rouge_lsum(prediction, str(reference)) for reference in references)


METRICS: dict[str, Callable[[str, list[Any]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "contains_value": contains_value,
    "first_integer": first_integer_match,
    "kv_retrieval": kv_retrieval_match,
    "dialogue_name": dialogue_name_match,
    "math_find": math_find_match,
    "code_run": code_run_match,
    "math_calc": math_calc_prefix,
    "choice": choice_match,
    "code_debug": code_debug_match,
    "token_f1": token_f1,
    "char_f1": char_f1,
    "rouge_lsum": rouge_lsum_best,
}


def score(metric: str, prediction: str, references: list[Any]) -> float:
    return METRICS[metric](prediction, references)
