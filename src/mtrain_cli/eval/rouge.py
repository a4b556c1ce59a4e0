"""ROUGE-L-sum (summary-level LCS, Lin 2004), the way the `rouge_score` package computes `rougeLsum`:
sentences are lines, tokens are lowercase alphanumeric runs, no stemming; union-LCS hits are clipped
by token counts so no token is matched twice. Returns the F-measure in [0, 1]."""

from __future__ import annotations

import re
from collections import Counter

_NON_ALPHANUMERIC = re.compile(r"[^a-z0-9]+")


def tokenize(text: str) -> list[str]:
    return [token for token in _NON_ALPHANUMERIC.sub(" ", text.lower()).split() if token]


def _lcs_indices(reference: list[str], candidate: list[str]) -> set[int]:
    """Indices into `reference` of one longest common subsequence with `candidate`."""
    rows, cols = len(reference), len(candidate)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        for j in range(1, cols + 1):
            if reference[i - 1] == candidate[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    indices: set[int] = set()
    i, j = rows, cols
    while i > 0 and j > 0:
        if reference[i - 1] == candidate[j - 1]:
            indices.add(i - 1)
            i, j = i - 1, j - 1
        elif table[i - 1][j] >= table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return indices


def rouge_lsum(prediction: str, reference: str) -> float:
    reference_sentences = [tokenize(line) for line in reference.split("\n")]
    candidate_sentences = [tokenize(line) for line in prediction.split("\n")]
    reference_sentences = [s for s in reference_sentences if s]
    candidate_sentences = [s for s in candidate_sentences if s]
    reference_total = sum(map(len, reference_sentences))
    candidate_total = sum(map(len, candidate_sentences))
    if reference_total == 0 or candidate_total == 0:
        return 0.0
    reference_counts = Counter(token for sentence in reference_sentences for token in sentence)
    candidate_counts = Counter(token for sentence in candidate_sentences for token in sentence)
    hits = 0
    for sentence in reference_sentences:
        union = set().union(*(_lcs_indices(sentence, candidate) for candidate in candidate_sentences))
        for token in (sentence[i] for i in sorted(union)):
            if reference_counts[token] > 0 and candidate_counts[token] > 0:
                hits += 1
                reference_counts[token] -= 1
                candidate_counts[token] -= 1
    if hits == 0:
        return 0.0
    precision, recall = hits / candidate_total, hits / reference_total
    return 2 * precision * recall / (precision + recall)
