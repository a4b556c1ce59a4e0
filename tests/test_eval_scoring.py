"""Every `mtrain eval` scorer on hand-written answers, near misses included."""

from __future__ import annotations

import pytest

from mtrain_cli.eval.rouge import rouge_lsum
from mtrain_cli.eval.scoring import METRICS, score

# (metric, prediction, references, expected score)
CASES = [
    # RULER: every value must be there (case-insensitive); a multi-value needle with 3 of 4 values is 0.75.
    ("string_match_all", "The numbers are 1234567, 7654321.", ["1234567", "7654321"], 1.0),
    ("string_match_all", "They are 1234567 and 7654320.", ["1234567", "7654321"], 0.5),
    ("string_match_all", "a: 11, b: 22, c: 33", ["11", "22", "33", "44"], 0.75),
    ("string_match_all", "VAR ABCDE, VAR QWERT", ["abcde", "qwert"], 1.0),
    ("string_match_all", "", ["1"], 0.0),
    # RULER QA: any one reference found is enough.
    ("string_match_part", "He lived in Paris.", ["London", "Paris"], 1.0),
    ("string_match_part", "He lived in Pari.", ["London", "Paris"], 0.0),
    # NIAH: the needle's value as an exact substring.
    ("contains_value", "the code is 4839201.", ["4839201"], 1.0),
    ("contains_value", "the code is 4839202.", ["4839201"], 0.0),
    # InfiniteBench passkey / number_string: the FIRST integer decides, a later correct one does not count.
    ("first_integer", "31415 is the pass key", ["31415"], 1.0),
    ("first_integer", "It is 2 times: 31415", ["31415"], 0.0),
    ("first_integer", "314159", ["31415"], 0.0),
    ("first_integer", "key=31415.", ["31415"], 1.0),
    ("first_integer", "no digits", ["31415"], 0.0),
    # kv_retrieval: the value as a whole word after splitting on punctuation; a longer string is a miss.
    ("kv_retrieval", '"a1b2-c3": "d4e5-f6".', ["d4e5-f6"], 1.0),
    ("kv_retrieval", "d4e5-f6g", ["d4e5-f6"], 0.0),
    # longdialogue: the name as a whole word, case-insensitive.
    ("dialogue_name", "It is probably Hamlet.", ["HAMLET"], 1.0),
    ("dialogue_name", "It is probably Hamlets.", ["HAMLET"], 0.0),
    # math_find: the first number, compared as a number.
    ("math_find", "The largest is 9934, then 12", ["9934"], 1.0),
    ("math_find", "12 is not 9934", ["9934"], 0.0),
    ("math_find", "3.50", [3.5], 1.0),
    # code_run: the last word must be the integer.
    ("code_run", "The value of func(3) is 42", [42], 1.0),
    ("code_run", "42 is what I think", [42], 0.0),
    ("code_run", "`-7`.", [-7], 1.0),
    # math_calc: intermediate values matched in order up to the first mistake.
    ("math_calc", "1, 4, 8, 3", [1, 4, 8, 11], 0.75),
    ("math_calc", "2, 4, 8, 11", [1, 4, 8, 11], 0.0),
    # longbook_choice_eng: a leading letter decides alone, even when the text after it is right.
    ("choice", "B. The harbor", ["The harbor", "B"], 1.0),
    ("choice", "C. The harbor", ["The harbor", "B"], 0.0),
    ("choice", "The harbor", ["The harbor", "B"], 1.0),
    ("choice", "I think the answer is B", ["The harbor", "B"], 1.0),
    ("choice", "I think the answer is C, not B", ["The harbor", "B"], 0.0),
    ("choice", "probably option D or B", ["The harbor", "B"], 0.0),
    ("choice", "probably (no idea) B", ["The harbor", "B"], 1.0),
    # code_debug: 'B.' first, or what follows 'is:' / 'answer:'; a bare letter (our prefix ends in 'is:').
    ("code_debug", "B. func_b", ["func_b", "B"], 1.0),
    ("code_debug", "B", ["func_b", "B"], 1.0),
    ("code_debug", "The answer is: func_b", ["func_b", "B"], 1.0),
    ("code_debug", "The answer is: A", ["func_b", "B"], 0.0),
    ("code_debug", "I would say B", ["func_b", "B"], 0.0),
    # QA F1 on normalised tokens (articles and punctuation dropped), best over references.
    ("token_f1", "The golden lantern!", ["a golden lantern"], 1.0),
    ("token_f1", "golden lamp", ["golden lantern", "x"], 0.5),
    ("char_f1", "北京。", ["北京"], 1.0),
    ("char_f1", "北方", ["北京"], 0.5),
]


@pytest.mark.parametrize("metric, prediction, references, expected", CASES)
def test_scorer(metric, prediction, references, expected):
    assert score(metric, prediction, references) == pytest.approx(expected)


def test_every_metric_has_cases():
    assert {case[0] for case in CASES} | {"rouge_lsum"} == set(METRICS)


def test_rouge_lsum_by_hand():
    # One sentence each: LCS of "the cat sat on the mat" and "the cat lay on a mat" is "the cat on mat" (4);
    # precision 4/6, recall 4/6 -> F 2/3.
    assert rouge_lsum("the cat lay on a mat", "the cat sat on the mat") == pytest.approx(2 / 3)
    # Summary level: union LCS over candidate sentences, each token matched at most once.
    reference = "police kill the gunman\nthe gunman was shot"
    candidate = "police killed the gunman\nthe gunman shot"
    # ref s1 ∩ union: police, the, gunman (3); ref s2: the, gunman, shot (3) -> hits 6 of ref 8, cand 7.
    assert rouge_lsum(candidate, reference) == pytest.approx(2 * (6 / 7) * (6 / 8) / (6 / 7 + 6 / 8))
    assert rouge_lsum("", reference) == 0.0
    assert rouge_lsum("Police, KILL!", "police kill") == pytest.approx(1.0)
    assert score("rouge_lsum", "police kill", ["nothing here", "police kill"]) == pytest.approx(1.0)
