"""Conversations: rendered with the tokenizer's own chat template, the loss on exactly the assistant's tokens (against
the template rendered by hand), packed whole with their own positions and ids (no attention across a boundary),
mixed with text, cut or dropped past seq_len and counted, bad records named in one line; the sparse probe windows
of a chat row reach its answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny_setup import only_run_dir, run_cli, set_args, small_run
from transformers import AutoTokenizer

from mtrain_cli.attention import AttentionConfig, AttentionRouter
from mtrain_cli.attention.sparse.pattern import probe_rows
from mtrain_cli.config import load_config
from mtrain_cli.data import ChatCounts, load_text_dataset, pack_documents, tokenize_chat, tokenize_dataset
from mtrain_cli.data.chat import CUT, DROPPED, KEPT, fit_conversation, render_conversation
from mtrain_cli.data.packing import IGNORE_INDEX
from mtrain_cli.errors import UserError
from mtrain_cli.model import build_model, load_tokenizer
from mtrain_cli.resources import shipped_path

# ChatML, as Qwen writes it; the second marks the assistant's tokens the way HF's return_assistant_tokens_mask reads
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]
# the same conversation written out by hand: (text, is it the assistant's)
BY_HAND = [
    ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is two plus two?<|im_end|>\n", False),
    ("<|im_start|>assistant\n", False),
    ("Four.<|im_end|>", True),
    ("\n<|im_start|>user\nAnd three plus three?<|im_end|>\n<|im_start|>assistant\n", False),
    ("Six, of course.<|im_end|>", True),
    ("\n", False),
]


def make_chat_tokenizer(directory: Path, template: str = CHATML) -> Path:
    """The shipped tokenizer with ChatML's two special tokens and `template`, saved to `directory`."""
    tokenizer = AutoTokenizer.from_pretrained(str(shipped_path("data/tokenizer")))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


def by_hand(tokenizer, last_only: bool) -> tuple[list[int], list[int]]:
    ids, mask = [], []
    last = max(i for i, (_, assistant) in enumerate(BY_HAND) if assistant)
    for index, (text, assistant) in enumerate(BY_HAND):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [int(assistant and (index == last or not last_only))] * len(piece)
    return ids, mask


@pytest.mark.parametrize("template", [CHATML, CHATML_MARKED], ids=["prefixes", "generation-marks"])
@pytest.mark.parametrize("turns", ["all", "last"])
def test_chat_labels_are_exactly_the_assistant_tokens(tmp_path, template, turns):
    tokenizer = AutoTokenizer.from_pretrained(str(make_chat_tokenizer(tmp_path / "tok", template)))
    expected_ids, expected_mask = by_hand(tokenizer, last_only=turns == "last")
    ids, mask = render_conversation(tokenizer, CONVERSATION, last_turn_only=turns == "last")
    assert tokenizer.decode(ids) == "".join(text for text, _ in BY_HAND)
    assert ids == expected_ids and mask == expected_mask
    assert 4 <= sum(mask) < len(mask) // 2

    # packed next to a text document: a label is the next token where that token is the assistant's, else -100
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    chat = tokenize_chat(load_text_dataset(str(tmp_path / "chat.jsonl")), tokenizer, "chat", 128, turns, "cut")
    text = tokenize_dataset(load_text_dataset(str(_text_file(tmp_path, ["plain words here"]))), tokenizer)
    packed = pack_documents([chat, text], seq_len=128, seed=0, packing="best_fit")
    (row,) = [packed[i] for i in range(len(packed))]
    in_chat = row["document_ids"] == row["document_ids"][(row["input_ids"] == expected_ids[0]).nonzero()[0, 0]]
    chat_input = row["input_ids"][in_chat].tolist()
    assert chat_input == expected_ids
    chat_labels = row["labels"][in_chat].tolist()
    assert chat_labels == [t if m else IGNORE_INDEX for t, m in zip(expected_ids[1:], expected_mask[1:])] + [-100]
    is_text = (row["document_ids"] >= 0) & ~in_chat
    assert (row["labels"][is_text][:-1] != IGNORE_INDEX).all()  # text: every next token
    assert packed.stats.num_loss_tokens == sum(expected_mask) + int(is_text.sum()) - 1


def _text_file(tmp_path: Path, texts: list[str]) -> Path:
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_long_conversations_are_cut_in_their_context_or_dropped():
    ids = list(range(100, 130))
    mask = [0] * 5 + [0] * 15 + [1] * 4 + [0] * 2 + [1] * 3 + [0]  # a long context, two answers
    kept = fit_conversation(ids, mask, 30, cut=True)
    assert kept == (ids, mask, KEPT)
    cut_ids, cut_mask, fate = fit_conversation(ids, mask, 24, cut=True)
    assert fate == CUT and len(cut_ids) == 24
    assert cut_ids[:7] == ids[:7] and cut_ids[-10:] == ids[-10:]  # 6 tokens out of the middle of the 20
    assert [t for t, m in zip(cut_ids, cut_mask) if m] == [t for t, m in zip(ids, mask) if m]
    assert fit_conversation(ids, mask, 24, cut=False) == ([], [], DROPPED)
    assert fit_conversation(ids, mask, 8, cut=True) == ([], [], DROPPED)  # the answers alone are too long


def test_conversations_past_seq_len_are_counted(tmp_path, chat_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(chat_tokenizer_dir))
    long_user = {"role": "user", "content": "word " * 200}
    records = [CONVERSATION, [long_user, {"role": "assistant", "content": "Yes."}], CONVERSATION]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    ds = load_text_dataset(str(tmp_path / "c.jsonl"))
    for how, fates in (("cut", [KEPT, CUT, KEPT]), ("drop", [KEPT, DROPPED, KEPT])):
        tokens = tokenize_chat(ds, tokenizer, "c", 128, "all", how)
        assert list(tokens["chat_fate"]) == fates
        assert max(len(ids) for ids in tokens["input_ids"]) <= 128
        counts = ChatCounts()
        counts.add(tokens)
        assert (counts.num_conversations, counts.num_conversations_cut, counts.num_conversations_dropped) == (
            3,
            fates.count(CUT),
            fates.count(DROPPED),
        )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"messages": "hello"}', "has a 'messages' that is a string, not a list of messages"),
        ('{"messages": [{"role": "user", "content": "q"}]}', "has no assistant message"),
        ('{"messages": [{"role": "bot", "content": "a"}]}', "message 0 with role 'bot'"),
        ('{"messages": [{"role": "assistant", "content": 3}]}', "message 0 whose 'content' is a number"),
    ],
)
def test_a_bad_conversation_is_one_line_naming_file_and_line(tmp_path, line, expected):
    good = json.dumps({"messages": CONVERSATION})
    (tmp_path / "c.jsonl").write_text(f"{good}\n{line}\n")
    with pytest.raises(UserError) as caught:
        load_text_dataset(str(tmp_path / "c.jsonl"))
    message = str(caught.value)
    assert "\n" not in message and "c.jsonl" in message and "line 2" in message and expected in message, message
    assert 'each conversation needs "messages"' in message


def test_conversations_need_a_chat_template_and_whole_rows(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    ds = load_text_dataset(str(tmp_path / "c.jsonl"))
    plain = AutoTokenizer.from_pretrained(str(shipped_path("data/tokenizer")))
    with pytest.raises(UserError, match="has no chat template"):
        tokenize_chat(ds, plain, "c.jsonl", 64, "all", "cut")
    result = run_cli("extend", *set_args(small_run(1, tmp_path / "runs")), "--data", str(tmp_path / "c.jsonl"))
    assert result.returncode == 2 and "set data.packing=best_fit" in result.stderr, result.stderr


def _chat_row(tokenizer_dir: Path, tmp_path: Path, num_user_words: int):
    """One packed row of two conversations (a long one first) and the row's tokens."""
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    records = [
        [{"role": "user", "content": "word " * num_user_words}, {"role": "assistant", "content": "A short answer."}],
        CONVERSATION,
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    tokens = tokenize_chat(load_text_dataset(str(tmp_path / "c.jsonl")), tokenizer, "c", 256, "all", "cut")
    packed = pack_documents(tokens, seq_len=256, seed=0, packing="best_fit")
    assert len(packed) == 1
    return packed.rows([0])


def test_a_conversation_never_attends_across_a_packed_boundary(tmp_path, chat_tokenizer_dir):
    """A packed row of two conversations gives each one's logits as it gives them alone."""
    config = load_config("tiny", [*small_run(1, tmp_path), f"model.tokenizer={chat_tokenizer_dir}"])
    model = build_model(config, load_tokenizer(config), torch.device("cpu")).eval()
    row = _chat_row(chat_tokenizer_dir, tmp_path, 40)
    with torch.no_grad(), AttentionRouter():
        packed = model(
            input_ids=row["input_ids"], position_ids=row["position_ids"], document_ids=row["document_ids"]
        ).logits[0]
        for doc in range(int(row["document_ids"].max()) + 1):
            mine = row["document_ids"][0] == doc
            alone = model(input_ids=row["input_ids"][:, mine], position_ids=row["position_ids"][:, mine]).logits[0]
            torch.testing.assert_close(packed[mine], alone, rtol=1e-4, atol=1e-5)
    assert int(row["document_ids"].max()) == 1


def test_the_sparse_probe_windows_of_a_chat_row_reach_its_answer(tmp_path, chat_tokenizer_dir):
    """The last probe window of every long document ends at its last token: in a conversation, its last answer
    (the template's end-of-turn marker and the newline after it come last). With the defaults' 32 rows a window,
    the window holds answer tokens that carry loss."""
    row = _chat_row(chat_tokenizer_dir, tmp_path, 40)
    lengths = torch.bincount(row["document_ids"][0][row["document_ids"][0] >= 0])
    assert lengths[0] > lengths[1]
    settings = AttentionConfig(mode="sparse", dense_below=int(lengths[0]))  # the first conversation is long
    rows = probe_rows(row["document_ids"], settings)
    (window,) = [w for w in range(rows.valid_BW.shape[1]) if rows.valid_BW[0, w]][-1:]
    probed = rows.pos_BWR[0, window][rows.row_ok_BWR[0, window]]
    assert len(probed) == settings.last_q // settings.probe_windows == 32
    has_loss = row["labels"][0] != IGNORE_INDEX
    first_doc_end = int((row["document_ids"][0] == 0).nonzero().max())
    assert int(probed.max()) == first_doc_end
    assert has_loss[probed].sum() >= 2, (probed, has_loss.nonzero().flatten())


def test_extend_trains_on_chat_and_text_together(tmp_path, chat_tokenizer_dir):
    records = [CONVERSATION, [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "Ok."}]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in records * 6))
    shutil.copy(_text_file(tmp_path, ["Some plain text to continue. " * 20] * 4), tmp_path / "t.jsonl")
    overrides = small_run(2, tmp_path / "runs", f"model.tokenizer={chat_tokenizer_dir}", "data.packing=best_fit")
    result = run_cli(
        "extend", *set_args(overrides), "--data", str(tmp_path / "c.jsonl"), "--data", str(tmp_path / "t.jsonl")
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "12 conversations: 6 cut and 0 dropped past data.seq_len 256" in result.stdout, result.stdout
    assert "tokens carry loss" in result.stdout
    packing = json.loads((only_run_dir(tmp_path / "runs") / "summary.json").read_text())["packing"]
    assert packing["num_conversations_cut"] == 6 and packing["num_documents"] == 16
    assert 0 < packing["num_loss_tokens"] < packing["num_input_tokens"]


def test_a_conversation_the_template_refuses_is_one_line(tmp_path):
    strict = "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('must start with a user') }}{% endif %}"
    tokenizer = AutoTokenizer.from_pretrained(str(make_chat_tokenizer(tmp_path / "tok", strict + CHATML)))
    records = [CONVERSATION, [{"role": "assistant", "content": "Hi."}]]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in records))
    with pytest.raises(UserError) as caught:
        tokenize_chat(load_text_dataset(str(tmp_path / "c.jsonl")), tokenizer, "c.jsonl", 128, "all", "cut")
    message = str(caught.value)
    assert "\n" not in message and "conversation 1" in message and "must start with a user" in message, message
