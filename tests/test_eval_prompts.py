"""Prompt generation for `mtrain eval`: fitted to the target length with two different tokenizers,
deterministic per seed, needles at the requested depths, local data files read (or refused) correctly."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from fixtures.eval_corpus import (
    prose,
    second_tokenizer,
    shipped_tokenizer,
    write_essays,
    write_hotpot,
    write_infinitebench,
    write_squad,
)

from mtrain_cli.errors import UserError
from mtrain_cli.eval import prompts
from mtrain_cli.eval.haystack import NOISE_HAYSTACK, essay_haystack, insert_at_depths
from mtrain_cli.eval.infinitebench.generators import GENERATORS
from mtrain_cli.eval.infinitebench.suite import (
    budget_for,
    fit_generated,
    generated_sample,
    load_infinitebench,
    prepare_infinitebench,
)
from mtrain_cli.eval.infinitebench.tasks import render
from mtrain_cli.eval.niah import NIAH_MAX_NEW_TOKENS, build_niah_sample, prepare_niah
from mtrain_cli.eval.prompts import PromptDoesNotFit, PromptFormat, fit_largest, middle_truncate
from mtrain_cli.eval.ruler.qa_data import load_hotpot, load_squad
from mtrain_cli.eval.ruler.suite import RULER_TASKS, TASK_NAMES, build_sample, fit_draft, prepare_ruler
from mtrain_cli.eval.ruler.task import TaskData
from mtrain_cli.eval.words import KEY_SPACE, NOUNS, distinct_keys

TOKENIZERS = {"byte-level BPE (shipped)": shipped_tokenizer, "Metaspace BPE (trained here)": second_tokenizer}
# Tasks whose haystack unit is a sentence, word or list entry: the prompt lands within a few tokens of the
# budget. The others grow by a whole distractor needle (UUIDs: ~80 byte-level tokens) or document.
FINE_GRAINED = {
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
}
FEW_TOKENS = 16


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def fmt(request) -> PromptFormat:
    return PromptFormat(TOKENIZERS[request.param](), chat_template=False)


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> TaskData:
    root = tmp_path_factory.mktemp("corpus")
    return TaskData(
        NOISE_HAYSTACK,
        essay_haystack(write_essays(root / "essays")),
        load_squad(write_squad(root / "squad.json")),
        load_hotpot(write_hotpot(root / "hotpot.json")),
    )


def test_fit_largest_is_the_largest_size_that_fits():
    def build(n: int) -> list[int]:  # 10 fixed tokens, 3 per unit, one more every 7 units
        return [0] * (10 + 3 * n + n // 7)

    for budget in [10, 11, 13, 100, 101, 997, 5000]:
        units, ids = fit_largest(build, budget, upper=10_000)
        assert len(ids) <= budget < len(build(units + 1)), budget
    assert fit_largest(build, 10_000, upper=50)[0] == 50  # capped by the units there are
    with pytest.raises(PromptDoesNotFit, match="minimum prompt is 10 tokens, budget 9"):
        fit_largest(build, 9, upper=100)


@pytest.mark.parametrize(
    "tokens",
    [
        lambda n: 10 + 3 * n + n // 7,  # almost linear, as prompts are
        lambda n: 10 + (n * 7919) % 5 + 2 * n,  # jittery: 2 to 6 tokens a unit, length still grows
        lambda n: 10 + n * n // 50,  # strongly convex
        lambda n: 10 + 4 * min(n, 300) + max(0, n - 300) // 40,  # dense text, then units of almost no tokens
    ],
    ids=["linear", "jitter", "convex", "plateau"],
)
def test_fit_largest_finds_the_boundary_in_few_builds(tokens):
    """The search's cost is its number of builds (each tokenises a whole prompt): it aims by tokens per unit
    and falls back to bisection, so even lengths far from linear in n take a logarithmic number."""
    lengths = [tokens(n) for n in range(20_001)]
    assert all(a <= b for a, b in itertools.pairwise(lengths))  # the search's assumption holds
    for budget in [11, 100, 997, 4_000, 30_001]:
        built: list[int] = []

        def build(n: int) -> list[int]:
            built.append(n)
            return [0] * lengths[n]

        units, ids = fit_largest(build, budget, upper=20_000)
        assert len(ids) == lengths[units] <= budget
        assert units == 20_000 or lengths[units + 1] > budget, budget
        assert len(built) <= 40, (budget, built)


@pytest.mark.parametrize("length", [1024, 2048])
def test_ruler_prompts_fill_the_target_length(fmt, task_data, length):
    assert len(RULER_TASKS) == 13
    for task in RULER_TASKS:
        draft, units, ids = fit_draft(task, task_data, fmt, length, index=0, seed=0)
        budget = length - task.max_new_tokens
        assert len(ids) <= budget, task.name
        assert units < draft.max_units, f"{task.name}: the fixture corpus ran out"
        assert len(fmt.encode(draft.render(units + 1), draft.answer_prefix)) > budget, task.name  # maximal
        if task.name in FINE_GRAINED:
            assert budget - len(ids) <= FEW_TOKENS, (task.name, budget - len(ids))


def test_ruler_samples_are_deterministic_per_seed(task_data):
    fmt = PromptFormat(shipped_tokenizer(), chat_template=False)
    for task in RULER_TASKS:
        first = build_sample(task, task_data, fmt, 1024, index=0, seed=0)
        again = build_sample(task, task_data, fmt, 1024, index=0, seed=0)
        other = build_sample(task, task_data, fmt, 1024, index=0, seed=1)
        assert first.input_ids == again.input_ids and first.references == again.references, task.name
        assert first.input_ids != other.input_ids, task.name


def _relative_positions(text: str, start_marker: str, end_marker: str, needles: list[str]) -> list[float]:
    """Where each needle starts, as a fraction of the haystack between the two markers (in characters)."""
    start, end = text.index(start_marker) + len(start_marker), text.rindex(end_marker)
    return [(text.index(needle) - start) / (end - start) for needle in needles]


def test_prompts_built_on_several_threads_are_those_of_one(task_data, monkeypatch):
    """The suites fit their prompts on a pool of threads; a cell that cannot fit is skipped whole, the others
    are kept, and every sample (ids, meta, order) is what one thread builds."""
    fmt = PromptFormat(shipped_tokenizer(), chat_template=False)
    lengths = [64, 512, 1024]  # 64: below the smallest NIAH prompt and most RULER prompts

    def build(threads: int):
        monkeypatch.setattr(prompts, "prompt_threads", lambda: threads)
        done = []
        niah = prepare_niah(fmt, task_data.essay, lengths, [0, 50, 100], 2, 3, done.append)
        ruler = prepare_ruler(fmt, task_data, lengths, 2, 3, ["niah_single_1", "vt", "qa_1"], done.append)
        return niah, ruler, sum(done)

    (niah, niah_skips), (ruler, ruler_skips, _), num_done = build(1)
    assert num_done == 3 * 3 * 2 + 3 * 3 * 2  # every prompt counted once, the skipped ones too
    assert [s.length for s in niah_skips] == [64] and {s.length for s in ruler_skips} == {64}
    assert {s.length for s in niah} == {512, 1024} and {s.length for s in ruler} == {512, 1024}
    (niah_4, niah_skips_4), (ruler_4, ruler_skips_4, _), _ = build(4)
    assert niah_skips_4 == niah_skips and ruler_skips_4 == ruler_skips
    for one, many in [(niah, niah_4), (ruler, ruler_4)]:
        assert [(s.task, s.length, s.index, s.input_ids, s.meta) for s in one] == [
            (s.task, s.length, s.index, s.input_ids, s.meta) for s in many
        ]


@pytest.mark.parametrize("depth", [0, 10, 50, 90, 100])
def test_niah_needle_sits_at_the_requested_depth(fmt, depth):
    sample = build_niah_sample(fmt, NOISE_HAYSTACK, 2048, depth, index=0, seed=0)
    assert 2048 - NIAH_MAX_NEW_TOKENS - FEW_TOKENS <= len(sample.input_ids) <= 2048 - NIAH_MAX_NEW_TOKENS
    text = fmt.tokenizer.decode(sample.input_ids)
    (value,) = sample.references
    (position,) = _relative_positions(text, "remember it.\n\n", "\n\nWhat is the secret code", [value])
    assert position == pytest.approx(depth / 100, abs=0.03)


def test_ruler_needles_sit_at_their_depths(task_data):
    fmt = PromptFormat(shipped_tokenizer(), chat_template=False)
    task = next(task for task in RULER_TASKS if task.name == "niah_multivalue")
    sample = build_sample(task, task_data, fmt, 2048, index=3, seed=0)
    text = fmt.tokenizer.decode(sample.input_ids)
    positions = _relative_positions(text, "afterwards.\n", "\nWhat are all", sample.references)
    # Depths count sentences; the other three needles' own text shifts a position by up to ~4% here.
    assert sorted(positions) == pytest.approx(sorted(d / 100 for d in sample.meta["depths"]), abs=0.05)


def test_variable_tracking_chain_stays_in_order_at_equal_depths():
    text = insert_at_depths(
        ["s0.", "s1.", "s2.", "s3."], ["VAR A = 1.", "VAR B = VAR A.", "VAR C = VAR B."], [50, 50, 100]
    )
    assert text == "s0. s1. VAR A = 1. VAR B = VAR A. s2. s3. VAR C = VAR B."
    assert insert_at_depths(["s0.", "s1."], ["N."], [0]) == "N. s0. s1."


def test_needle_keys_are_distinct_and_bounded():
    assert len(set(KEY_SPACE)) == len(KEY_SPACE) > 10_000
    keys = distinct_keys(random.Random(0), 5000)
    assert len(set(keys)) == 5000
    with pytest.raises(ValueError):  # asking for more keys than exist fails instead of looping forever
        distinct_keys(random.Random(0), len(KEY_SPACE) + 1)


@pytest.mark.parametrize("task", sorted(GENERATORS))
def test_infinitebench_generated_prompts_fit_and_place_the_answer(fmt, task):
    length = 2048
    first = generated_sample(fmt, task, length, index=0, samples=3, seed=0)
    last = generated_sample(fmt, task, length, index=2, samples=3, seed=0)
    assert first.input_ids == generated_sample(fmt, task, length, index=0, samples=3, seed=0).input_ids
    assert (first.meta["depth"], last.meta["depth"]) == (0.0, 100.0)
    budget = length - budget_for(task, length)
    for index in (0, 2):
        example, _, units, ids = fit_generated(fmt, task, length, index, samples=3, seed=0)
        assert len(ids) <= budget < len(fmt.encode(*render(task, example.context(units + 1), example.input, [])))
        if task != "kv_retrieval":  # one more filler unit is a sentence or a number; for kv a UUID pair
            assert budget - len(ids) <= FEW_TOKENS, (task, budget - len(ids))
    # The answer sits at the start of the filler for depth 0 and at its end for depth 100.
    for sample, low, high in ((first, 0.0, 0.2), (last, 0.7, 1.0)):
        text = fmt.tokenizer.decode(sample.input_ids)
        position = re.search(rf"\b{sample.references[0]}\b", text).start() / len(text)
        assert low <= position <= high, (task, sample.meta["depth"], position)


def test_infinitebench_files_are_middle_truncated_and_win_over_generators(fmt, tmp_path):
    inputs, skipped = load_infinitebench(write_infinitebench(tmp_path / "ib"), samples=5, seed=0)
    assert inputs["passkey"].records is not None and "passkey.jsonl" in inputs["passkey"].source
    assert inputs["kv_retrieval"].records is None  # no file: generated
    assert len(inputs["longbook_qa_eng"].records) == 2
    assert {skip.task for skip in skipped} == {
        "longbook_sum_eng",
        "longbook_qa_chn",
        "longdialogue_qa_eng",
        "math_calc",
        "code_run",
        "code_debug",
    }
    assert all("no offline generator" in skip.reason for skip in skipped)
    samples, cell_skips = prepare_infinitebench(fmt, inputs, [512], samples=2, seed=0)
    assert cell_skips == []
    for sample in samples:
        assert len(sample.input_ids) <= 512 - sample.max_new_tokens
    choice = next(s for s in samples if s.task == "longbook_choice_eng")
    assert choice.meta["truncated"] and choice.references == ["The harbor", "B"]
    text = fmt.tokenizer.decode(choice.input_ids)
    assert "Who carries the lantern?" in text and "B. The harbor" in text  # question and options survive


def test_middle_truncate_keeps_head_and_tail():
    tokenizer = shipped_tokenizer()
    text = "START " + prose(1, 200) + " END"
    cut = middle_truncate(tokenizer, text, 60)
    assert cut.startswith("START") and cut.endswith("END")
    assert abs(len(tokenizer(cut, add_special_tokens=False).input_ids) - 60) <= 2
    assert middle_truncate(tokenizer, "short", 60) == "short"


def test_infinitebench_bad_records_are_one_line_errors(tmp_path):
    folder = tmp_path / "ib"
    folder.mkdir()
    (folder / "longbook_choice_eng.jsonl").write_text(
        json.dumps({"id": 1, "context": "c", "input": "q", "answer": ["E"], "options": ["A1", "B1"]}) + "\n"
    )
    with pytest.raises(UserError, match="needs 2-4 options, one of them the answer 'E'"):
        load_infinitebench(folder, samples=1, seed=0)
    (folder / "longbook_choice_eng.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="line 1 is not json"):
        load_infinitebench(folder, samples=1, seed=0)
    with pytest.raises(UserError, match="--infinitebench-dir .* is not a directory"):
        load_infinitebench(tmp_path / "missing", samples=1, seed=0)


def test_qa_files_are_read_and_bad_ones_refused(task_data, tmp_path):
    squad, hotpot = task_data.squad, task_data.hotpot
    assert len(squad.items) == 40 and all(item.question != "What is unanswerable here?" for item in squad.items)
    gold_titles = {hotpot.documents[g].split("\n")[0] for g in hotpot.items[0].gold}
    assert gold_titles == {NOUNS[40].capitalize(), NOUNS[41].capitalize()}  # the supporting facts' paragraphs
    assert len(hotpot.documents) == 16 * 4
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2")
    with pytest.raises(UserError, match="--squad-file .* is not valid json"):
        load_squad(bad)
    bad.write_text(json.dumps({"no": "data"}))
    with pytest.raises(UserError, match="expected a top-level 'data' list"):
        load_squad(bad)
    with pytest.raises(UserError, match="--hotpot-file .* is not a file"):
        load_hotpot(tmp_path / "missing.json")


def test_essay_haystack_repeats_only_when_needed_and_refuses_empty_dirs(tmp_path):
    haystack = essay_haystack(write_essays(tmp_path / "essays"))
    words = len(haystack.essay_words)
    assert " ".join(haystack.sentences(50)).split() == haystack.essay_words[:50]
    assert len(" ".join(haystack.sentences(words + 10)).split()) == words + 10
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="--haystack-dir .* has no .txt files"):
        essay_haystack(tmp_path / "empty")


def test_task_names_are_rulers_thirteen():
    assert TASK_NAMES == [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    ]


def test_chat_template_puts_the_answer_prefix_inside_the_assistant_turn():
    tokenizer = shipped_tokenizer()
    with pytest.raises(UserError, match="--chat-template: the model's tokenizer has no chat template"):
        PromptFormat(tokenizer, chat_template=True)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    chat, plain = PromptFormat(tokenizer, chat_template=True), PromptFormat(tokenizer, chat_template=False)
    assert chat.text("Find the code.", "The code is") == "<|user|>Find the code.\n<|assistant|>The code is"
    assert plain.text("Find the code.", "The code is") == "Find the code.\nThe code is"
    assert (
        chat.encode("Find the code.", "The code is")
        == tokenizer(chat.text("Find the code.", "The code is"), add_special_tokens=False).input_ids
    )
