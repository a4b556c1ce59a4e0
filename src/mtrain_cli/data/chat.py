"""Conversations (`messages` records) rendered with the model's own chat template, the loss on assistant tokens only.

Which tokens are the assistant's: a template that marks them (`{% generation %}` ... `{% endgeneration %}`, HF's
convention) says so itself (`apply_chat_template(..., return_assistant_tokens_mask=True)`). Most templates do not;
for those the conversation is rendered a prefix at a time: the assistant turn i is the text that
render(messages[:i + 1]) adds to render(messages[:i], add_generation_prompt=True), i.e. its content and the
template's end-of-turn marker, less trailing whitespace (the separator before the next turn, which generation
never produces). That needs a template that renders each prefix as a prefix of the whole; one that does not (e.g.
one that rewrites earlier turns) is refused in one line rather than guessed at. The whole text is then tokenised
once (a fast tokenizer's offsets map characters to tokens), so the tokens are exactly the template's.

A conversation longer than `data.seq_len` is cut or dropped (`data.long_conversations`). Cutting removes the
excess from the middle of its longest stretch without loss (the long document of a user turn), the way long-context
benchmarks truncate their inputs: the template's head, the question and the answers stay. A conversation whose
answers alone do not fit is dropped even then. Each is counted (`ChatCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np

from mtrain_cli.data.sources import MESSAGES_FIELD
from mtrain_cli.errors import UserError

KEPT, CUT, DROPPED = 0, 1, 2  # `chat_fate` of a tokenised conversation


def is_chat(ds: datasets.Dataset) -> bool:
    return MESSAGES_FIELD in ds.column_names


def check_chat_template(tokenizer, source: str) -> None:
    """A tokenizer that can render conversations: a chat template, and offsets (a fast tokenizer)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"data source {source!r} holds conversations ({MESSAGES_FIELD!r}), but the tokenizer has no chat "
            f"template to render them; pass the tokenizer of a chat model (model.tokenizer=DIR) or one whose "
            f"tokenizer_config.json has a chat_template"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"data source {source!r} holds conversations: rendering them needs a fast tokenizer (tokenizer.json), "
            f"which maps text to tokens; pass a tokenizer directory with tokenizer.json"
        )


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def has_generation_marks(tokenizer) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%").replace("-%}", "%}")


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character span of each assistant turn in it), by rendering prefixes."""
    text = _render(tokenizer, messages)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], generation_prompt=True)  # the template's head when index 0
        through = _render(tokenizer, messages[: index + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise UserError(
                "the chat template does not render a conversation's first turns as the start of the whole "
                "conversation, so the assistant's tokens cannot be told apart; use a template that marks them with "
                "{% generation %} ... {% endgeneration %} (model.tokenizer=DIR with that chat_template)"
            )
        start, end = len(before), len(through.rstrip())
        if end > start:
            spans.append((start, end))
    return text, spans


def render_conversation(tokenizer, messages: list[dict], last_turn_only: bool) -> tuple[list[int], list[int]]:
    """(token ids, 1 on the assistant tokens that carry loss else 0) of one conversation."""
    if has_generation_marks(tokenizer):
        encoded = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(encoded["input_ids"]), list(encoded["assistant_masks"])
        if last_turn_only:
            mask = _last_run(mask)
        return ids, mask
    text, spans = assistant_spans(tokenizer, messages)
    if last_turn_only:
        spans = spans[-1:]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]], np.int64)
    mask = np.zeros(len(starts), np.int8)
    for start, end in spans:  # a token is the assistant's when its first character is
        mask[(starts >= start) & (starts < end)] = 1
    return list(encoded["input_ids"]), mask.tolist()


def _last_run(mask: list[int]) -> list[int]:
    """The mask with only its last run of ones kept (the last assistant turn)."""
    out = [0] * len(mask)
    index = len(mask) - 1
    while index >= 0 and not mask[index]:
        index -= 1
    while index >= 0 and mask[index]:
        out[index] = 1
        index -= 1
    return out


def fit_conversation(ids: list[int], mask: list[int], max_len: int, cut: bool) -> tuple[list[int], list[int], int]:
    """A conversation of at most `max_len` tokens: as it is, cut (the excess out of the middle of its longest
    stretch of tokens without loss), or dropped (empty). -> (ids, mask, KEPT | CUT | DROPPED)."""
    excess = len(ids) - max_len
    if excess <= 0:
        return ids, mask, KEPT
    if cut:
        flags = np.asarray(mask, np.int8)
        edges = np.flatnonzero(np.diff(np.concatenate([[1], flags, [1]])))  # starts and ends of zero runs
        runs = edges.reshape(-1, 2)
        start, end = max(runs.tolist(), key=lambda run: run[1] - run[0])
        if end - start >= excess:
            left = start + (end - start - excess) // 2
            return ids[:left] + ids[left + excess :], mask[:left] + mask[left + excess :], CUT
    return [], [], DROPPED


@dataclass
class ChatCounts:
    num_conversations: int = 0
    num_conversations_cut: int = 0  # past data.seq_len, cut to fit
    num_conversations_dropped: int = 0  # past data.seq_len and dropped (asked for, or answers alone too long)

    def add(self, ds: datasets.Dataset) -> None:
        fates = np.asarray(ds.with_format("numpy")["chat_fate"])
        self.num_conversations += len(fates)
        self.num_conversations_cut += int((fates == CUT).sum())
        self.num_conversations_dropped += int((fates == DROPPED).sum())


def _tokenize_batch(
    batch: dict, indices: list[int], tokenizer, source: str, last_turn_only: bool, max_len: int, cut: bool
) -> dict:
    out = {"input_ids": [], "loss_mask": [], "chat_fate": []}
    for row, messages in zip(indices, batch[MESSAGES_FIELD]):
        try:
            ids, mask = render_conversation(tokenizer, messages, last_turn_only)
        except UserError:
            raise
        except Exception as exc:  # the template's own checks (e.g. roles must alternate) raise what they like
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(
                f"data source {source!r}: conversation {row} (counting from 0) could not be rendered by the chat "
                f"template ({cause}); fix that record (or the template)"
            ) from None
        ids, mask, fate = fit_conversation(ids, mask, max_len, cut)
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["chat_fate"].append(fate)
    return out


def tokenize_chat(
    ds: datasets.Dataset, tokenizer, source: str, max_len: int, turns: str, long_conversations: str, num_proc: int = 1
) -> datasets.Dataset:
    """`ds` (a `messages` column) as `input_ids` (int32), `loss_mask` (int8: 1 where a token is a target) and
    `chat_fate` (KEPT, CUT or DROPPED; a dropped conversation has no tokens) per conversation. turns: "all" or
    "last" (the assistant turns that carry loss); long_conversations: "cut" or "drop"."""
    check_chat_template(tokenizer, source)
    return ds.map(
        _tokenize_batch,
        batched=True,
        with_indices=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names,
        desc="rendering conversations",
        fn_kwargs={
            "tokenizer": tokenizer,
            "source": source,
            "last_turn_only": turns == "last",
            "max_len": max_len,
            "cut": long_conversations == "cut",
        },
        features=datasets.Features(
            {
                "input_ids": datasets.List(datasets.Value("int32")),
                "loss_mask": datasets.List(datasets.Value("int8")),
                "chat_fate": datasets.Value("int8"),
            }
        ),
    )
