"""InfiniteBench's 12 tasks: prompt template, answer prefix, generation budget and metric of each, and
turning an official jsonl record (`id, context, input, answer, options`) into references."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtrain_cli.errors import UserError

LETTERS = "ABCD"
CHOICE_METRICS = ("choice", "code_debug")  # scored against [correct option, its letter]


@dataclass(frozen=True)
class InfiniteBenchTask:
    name: str
    template: str  # with {context}, {input} and (choice tasks) {options}
    answer_prefix: str
    max_new_tokens: int  # the official budget; capped at a quarter of the target length
    metric: str  # a name in scoring.METRICS


_FIND = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n{context}\n\n{input}"
)
_CHOICE = (
    "\n\nOnly one of the following options is correct, tell me the answer using one single letter "
    "(A, B, C, or D). Don't say anything else.\n{options}"
)

TASKS: dict[str, InfiniteBenchTask] = {
    task.name: task
    for task in [
        InfiniteBenchTask("passkey", _FIND, "The pass key is", 6, "first_integer"),
        InfiniteBenchTask("number_string", _FIND, "The sequence of digits is", 12, "first_integer"),
        InfiniteBenchTask(
            "kv_retrieval",
            "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}",
            "The value associated with the specified key is:",
            50,
            "kv_retrieval",
        ),
        InfiniteBenchTask(
            "longbook_sum_eng", "Summarize the following book.\n\n{context}", "Summary:", 1200, "rouge_lsum"
        ),
        InfiniteBenchTask(
            "longbook_choice_eng",
            "Read the book and answer the question.\n\n{context}\n\nQuestion: {input}" + _CHOICE,
            "The letter of the correct answer is",
            40,
            "choice",
        ),
        InfiniteBenchTask(
            "longbook_qa_eng",
            "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\nQuestion: {input}",
            "Answer:",
            40,
            "token_f1",
        ),
        InfiniteBenchTask(
            "longbook_qa_chn",
            "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{input}\n请尽量简短地回答。",
            "答案：",
            40,
            "char_f1",
        ),
        InfiniteBenchTask(
            "longdialogue_qa_eng",
            "Below is a dialogue script where one random occurrence of a "
            'character name is replaced with "$$MASK$$", and you should try to guess who that '
            "character is.\n\n{context}\n\n{input}",
            "The name that has been replaced with $$MASK$$ is likely",
            40,
            "dialogue_name",
        ),
        InfiniteBenchTask(
            "math_find",
            "Answer the question about the list of numbers below.\n\n{context}\n\n{input}",
            "The answer is",
            3,
            "math_find",
        ),
        InfiniteBenchTask(
            "math_calc",
            "Compute the intermediate values in the following long expression, from "
            "left to right, separated by commas.\n\n{context}",
            "The intermediate values are:",
            30000,
            "math_calc",
        ),
        InfiniteBenchTask(
            "code_run",
            "Following is a set of Python functions. Compute the exact value of the call "
            "below.\n\n{context}\n\n{input}",
            "The return value is",
            5,
            "code_run",
        ),
        InfiniteBenchTask(
            "code_debug",
            "There is ONLY ONE function in the large project that is deliberately made "
            "to include an obvious error. Please find the function that contains the most obvious "
            "errors. Tell me the answer using one single letter (A, B, C, or D).\n\n{context}\n\n"
            "Which function has a deliberate error?" + _CHOICE,
            "The correct option is:",
            5,
            "code_debug",
        ),
    ]
}


@dataclass
class Record:
    """One example in the official format, answers normalised to a list."""

    id: str
    context: str
    input: str
    answer: list[Any]
    options: list[str]


def parse_record(task: str, raw: dict[str, Any], where: str) -> Record:
    missing = [key for key in ("context", "input", "answer") if key not in raw]
    if missing:
        raise UserError(
            f"--infinitebench-dir: {where} lacks field(s) {', '.join(missing)}; InfiniteBench jsonl "
            f"records need id, context, input, answer, options"
        )
    answer = raw["answer"] if isinstance(raw["answer"], list) else [raw["answer"]]
    options = [str(option) for option in raw.get("options") or []]
    if TASKS[task].metric in CHOICE_METRICS and (
        not 2 <= len(options) <= len(LETTERS) or str(answer[0]) not in options
    ):
        raise UserError(
            f"--infinitebench-dir: {where}: a {task} record needs 2-4 options, one of them the "
            f"answer {answer[0]!r}; got options {options!r}"
        )
    return Record(str(raw.get("id", where)), str(raw["context"]), str(raw["input"]), answer, options)


def references(task: str, record: Record) -> list[Any]:
    """What the task's metric compares against: [option text, letter] for choice tasks, else the answers."""
    if TASKS[task].metric in CHOICE_METRICS:
        answer = str(record.answer[0])
        return [answer, LETTERS[record.options.index(answer)]]
    return record.answer


def format_options(options: list[str]) -> str:
    return "\n".join(f"{LETTERS[i]}. {option}" for i, option in enumerate(options))


def render(task: str, context: str, record_input: str, options: list[str]) -> tuple[str, str]:
    """(prompt, answer prefix); the prefix is dropped when the record's input already ends with it."""
    spec = TASKS[task]
    prompt = spec.template.format(context=context, input=record_input, options=format_options(options))
    already_there = record_input.rstrip().rstrip(":").endswith(spec.answer_prefix.rstrip(":"))
    return prompt, "" if already_there else spec.answer_prefix
