"""Generate mtrain's built-in CPU-demo corpus and its byte-level BPE tokenizer.

What: `corpus/long.jsonl` (long stories with a pass key and a secret colour planted at seeded
depths and asked for at the end), `corpus/short.jsonl` (short stories with one local fact and its
question), `corpus/passkey_short.jsonl` and `corpus/passkey_long.jsonl` (the passkey retrieval test
with its answer, fitting 256 and 2,048 tokens), `corpus/README.md`, and `tokenizer/` (byte-level BPE,
512 tokens, trained on the corpus).

Why: the demo pretrains a ~0.85M-parameter model at 256 tokens (recipes/tiny-base.yaml, shipped as
data/tiny-base) and extends it 256 -> 2048 tokens on 2 CPU cores, with nothing downloaded. The
language is a small templated English over word lists below: repetitive enough for a tiny model's
loss to fall a lot, random enough not to be periodic, and each story reuses its own cast of names,
places and objects, so longer context helps. The planted facts make long-range retrieval measurable
(pass key accuracy by depth).

Deterministic: one `random.Random(SEED)`, no hash-order dependence; rerunning rewrites every file
byte for byte.

Run from the repository root: `python data/make_corpus.py [--out DIR]` (default: this data/ dir).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
NUM_LONG_DOCS = 600
NUM_SHORT_DOCS = 2000
NUM_PASSKEY_SHORT_DOCS = 3000
NUM_PASSKEY_LONG_DOCS = 300
# Passkey documents' haystack, in noise sentences: short ones fit the base model's 256-token context,
# long ones span the extended 2048 (about 5 tokens a sentence).
PASSKEY_SHORT_SENTENCES = (0, 30)
PASSKEY_LONG_SENTENCES = (80, 380)
# Target lengths in characters; a document ends with the first sentence that reaches its target,
# so it may run up to one sentence past it (the ranges below leave room for that).
LONG_DOC_CHARS = (1000, 7900)
SHORT_DOC_CHARS = (100, 520)
MAX_FACT_DEPTH = 0.95
PARAGRAPH_BREAK_PROBABILITY = 0.15

VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
# Generous on purpose: evals may tokenise prompts longer than the demo's training length.
MODEL_MAX_LENGTH = 131072
# Qwen2's pre-tokenizer split: words with their leading space, every digit on its own (so a pass
# key is read digit by digit), punctuation runs, newlines.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NAMES = (
    "Anna",
    "Ben",
    "Clara",
    "David",
    "Elsa",
    "Felix",
    "Greta",
    "Hugo",
    "Ida",
    "Jonas",
    "Karin",
    "Leo",
    "Maria",
    "Nils",
    "Olga",
    "Paul",
    "Rosa",
    "Sven",
    "Tara",
    "Viktor",
    "Wendy",
    "Yusuf",
)
COLOURS = (
    "red",
    "blue",
    "green",
    "yellow",
    "orange",
    "purple",
    "pink",
    "brown",
    "black",
    "white",
    "grey",
    "gold",
    "silver",
    "teal",
)
# (singular, plural): a plural is spelled out rather than derived, to keep the grammar right.
OBJECTS = (
    ("cup", "cups"),
    ("book", "books"),
    ("box", "boxes"),
    ("lamp", "lamps"),
    ("chair", "chairs"),
    ("apple", "apples"),
    ("ball", "balls"),
    ("hat", "hats"),
    ("coat", "coats"),
    ("bag", "bags"),
    ("bell", "bells"),
    ("clock", "clocks"),
    ("brush", "brushes"),
    ("spoon", "spoons"),
    ("plate", "plates"),
    ("kite", "kites"),
    ("shoe", "shoes"),
    ("candle", "candles"),
    ("basket", "baskets"),
    ("map", "maps"),
    ("ring", "rings"),
    ("boat", "boats"),
    ("umbrella", "umbrellas"),
    ("egg", "eggs"),
)
PLACES = (
    "kitchen",
    "garden",
    "library",
    "market",
    "school",
    "harbour",
    "forest",
    "station",
    "bakery",
    "museum",
    "park",
    "attic",
    "village",
    "tower",
    "bridge",
    "farm",
    "office",
    "cellar",
)
OBJECT_ADJECTIVES = (
    "small",
    "big",
    "old",
    "new",
    "heavy",
    "light",
    "soft",
    "round",
    "shiny",
    "broken",
    "clean",
    "tiny",
    "empty",
    "odd",
)
PLACE_ADJECTIVES = ("quiet", "busy", "warm", "cold", "dark", "bright", "empty", "crowded")
TIMES = ("morning", "afternoon", "evening", "night")
NUMBER_WORDS = (
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
)

# Filler sentences; each placeholder is filled by `sentence_fields`.
FILLER_TEMPLATES = (
    "{name} walks to the {place}.",
    "{name} gives the {object} to {other}.",
    "The {object} is {colour}.",
    "The {colour} {object} is in the {place}.",
    "{name} has {count_objects}.",
    "There are {count_objects} in the {place}.",
    "In the {place}, {name} finds {a_colour} {object}.",
    "{name} and {other} go to the {place} in the {time}.",
    "{name} likes the {adjective} {object}.",
    "The {place} is {place_adjective} in the {time}.",
    "{name} puts the {object} on the table.",
    "{other} asks {name} about the {object}.",
    "{name} says that the {object} is {adjective}.",
    "Every {time}, {name} reads in the {place}.",
    "{name} cannot find the {colour} {object}.",
    "{name} paints the {object} {colour}.",
    "{other} sees {count_objects} near the {place}.",
    "The {adjective} {object} belongs to {name}.",
    "{name} is in the {place} with {other}.",
    "After the {time}, {name} cleans the {place}.",
    "{name} buys {a_adjective} {object} for {other}.",
    "{name} counts {count_objects} and smiles.",
    "Later, {name} leaves the {place}.",
    "{other} waits for {name} at the {place}.",
)


@dataclass(frozen=True)
class Cast:
    """The names, places and objects one story keeps coming back to."""

    names: tuple[str, ...]
    places: tuple[str, ...]
    objects: tuple[tuple[str, str], ...]


def pick_cast(rng: random.Random) -> Cast:
    return Cast(
        names=tuple(rng.sample(NAMES, rng.randint(2, 5))),
        places=tuple(rng.sample(PLACES, rng.randint(2, 4))),
        objects=tuple(rng.sample(OBJECTS, rng.randint(3, 6))),
    )


def with_article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def count_phrase(rng: random.Random, noun: tuple[str, str]) -> str:
    count = rng.randint(1, len(NUMBER_WORDS))
    return f"{NUMBER_WORDS[count - 1]} {noun[0] if count == 1 else noun[1]}"


def sentence_fields(rng: random.Random, cast: Cast) -> dict[str, str]:
    name, other = rng.sample(cast.names, 2)
    colour = rng.choice(COLOURS)
    adjective = rng.choice(OBJECT_ADJECTIVES)
    return {
        "name": name,
        "other": other,
        "place": rng.choice(cast.places),
        "object": rng.choice(cast.objects)[0],
        "count_objects": count_phrase(rng, rng.choice(cast.objects)),
        "colour": colour,
        "a_colour": with_article(colour),
        "adjective": adjective,
        "a_adjective": with_article(adjective),
        "place_adjective": rng.choice(PLACE_ADJECTIVES),
        "time": rng.choice(TIMES),
    }


def filler_sentences(rng: random.Random, cast: Cast, num_chars: int) -> list[str]:
    """Random filler sentences until their length (with separators) reaches `num_chars`."""
    sentences: list[str] = []
    total = 0
    while total < num_chars:
        sentence = rng.choice(FILLER_TEMPLATES).format(**sentence_fields(rng, cast))
        sentences.append(sentence)
        total += len(sentence) + 1
    return sentences


def insert_at_depth(sentences: list[str], fact: str, depth: float) -> None:
    """Insert `fact` before the sentence at fraction `depth` of the list."""
    sentences.insert(round(depth * len(sentences)), fact)


def join_sentences(rng: random.Random, sentences: list[str]) -> str:
    """Sentences separated by spaces, with a paragraph break now and then."""
    parts = [sentences[0]]
    for sentence in sentences[1:]:
        parts.append("\n" if rng.random() < PARAGRAPH_BREAK_PROBABILITY else " ")
        parts.append(sentence)
    return "".join(parts)


def make_passkey(rng: random.Random) -> str:
    return str(rng.randint(10000, 99999))


def stratified_depths(rng: random.Random, num_docs: int) -> list[float]:
    """One depth per document in [0, MAX_FACT_DEPTH), evenly spread, in shuffled order."""
    depths = [(i + rng.random()) / num_docs * MAX_FACT_DEPTH for i in range(num_docs)]
    rng.shuffle(depths)
    return depths


def long_document(rng: random.Random, passkey_depth: float, colour_depth: float) -> str:
    cast = pick_cast(rng)
    passkey = make_passkey(rng)
    secret_name = rng.choice(cast.names)
    secret_colour = rng.choice(COLOURS)
    header = f"This is a story about {', '.join(cast.names[:-1])} and {cast.names[-1]}."
    passkey_fact = f"The pass key is {passkey}. Remember it."
    colour_fact = f"The secret colour of {secret_name} is {secret_colour}."
    questions = (
        f"What is the secret colour of {secret_name}? It is {secret_colour}.\n"
        f"What is the pass key? The pass key is {passkey}."
    )
    num_fixed_chars = len(header) + len(passkey_fact) + len(colour_fact) + len(questions) + 3
    body = filler_sentences(rng, cast, rng.randint(*LONG_DOC_CHARS) - num_fixed_chars)
    # Insert the deeper fact first so the shallower one's index still refers to the filler alone.
    for fact, depth in sorted([(passkey_fact, passkey_depth), (colour_fact, colour_depth)], key=lambda item: -item[1]):
        insert_at_depth(body, fact, depth)
    return f"{header}\n{join_sentences(rng, body)}\n{questions}"


def short_document(rng: random.Random) -> str:
    """A few filler sentences around one fact, with the fact's question at the end."""
    cast = pick_cast(rng)
    name = rng.choice(cast.names)
    fact_kind = rng.choice(("passkey", "colour", "place"))
    if fact_kind == "passkey":
        passkey = make_passkey(rng)
        fact = f"The pass key is {passkey}. Remember it."
        question = f"What is the pass key? The pass key is {passkey}."
    elif fact_kind == "colour":
        colour = rng.choice(COLOURS)
        fact = f"The secret colour of {name} is {colour}."
        question = f"What is the secret colour of {name}? It is {colour}."
    else:
        thing, place = rng.choice(cast.objects)[0], rng.choice(cast.places)
        fact = f"{name} keeps the {thing} in the {place}."
        question = f"Where does {name} keep the {thing}? In the {place}."
    body = filler_sentences(rng, cast, rng.randint(*SHORT_DOC_CHARS) - len(fact) - len(question))
    insert_at_depth(body, fact, rng.random() * MAX_FACT_DEPTH)
    return f"{join_sentences(rng, body)}\n{question}"


# The passkey retrieval test (Mohtashami & Jaggi 2023, as YaRN and InfiniteBench use it; `mtrain eval --suite
# infinitebench` generates its passkey task the same way): an instruction, a haystack of five noise sentences
# repeated, one pass key planted at some depth, then the question and the answer.
PASSKEY_INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
NOISE_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


def passkey_document(rng: random.Random, num_sentences: int, depth: float) -> str:
    passkey = make_passkey(rng)
    haystack = [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(num_sentences)]
    insert_at_depth(haystack, f"The pass key is {passkey}. Remember it. {passkey} is the pass key.", depth)
    return f"{PASSKEY_INSTRUCTION}\n\n{' '.join(haystack)}\n\nWhat is the pass key?\nThe pass key is {passkey}."


def passkey_documents(rng: random.Random, num_docs: int, sentences: tuple[int, int]) -> list[str]:
    depths = [(i + rng.random()) / num_docs for i in range(num_docs)]
    rng.shuffle(depths)
    return [passkey_document(rng, rng.randint(*sentences), depth) for depth in depths]


def write_jsonl(path: Path, texts: list[str]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as file:
        for text in texts:
            file.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def write_readme(path: Path) -> None:
    path.write_text(
        "# Built-in demo corpus (generated by `python data/make_corpus.py`, seed "
        f"{SEED}; do not edit by hand)\n\n"
        f"- `long.jsonl`: {NUM_LONG_DOCS} stories of {LONG_DOC_CHARS[0]}-8000 characters in a small "
        "templated English; each plants `The pass key is NNNNN. Remember it.` and `The secret colour "
        "of <name> is <colour>.` at seeded depths (0-95%) and ends with both questions and answers.\n"
        f"- `short.jsonl`: {NUM_SHORT_DOCS} stories of 100-600 characters, each with one local fact "
        "(pass key, secret colour or where something is kept) and its question and answer.\n"
        f"- `passkey_short.jsonl`, `passkey_long.jsonl`: {NUM_PASSKEY_SHORT_DOCS} and {NUM_PASSKEY_LONG_DOCS} "
        "passkey tests (an instruction, the noise sentences `The grass is green. The sky is blue. ...` repeated "
        f"{PASSKEY_SHORT_SENTENCES[0]}-{PASSKEY_SHORT_SENTENCES[1]} and {PASSKEY_LONG_SENTENCES[0]}-"
        f"{PASSKEY_LONG_SENTENCES[1]} times with `The pass key is NNNNN. Remember it. NNNNN is the pass key.` at an "
        "even spread of depths, `What is the pass key?` and the answer), up to 256 and 2,048 tokens: the "
        "demo's pretraining and extension data.\n"
        f"- `../tokenizer/`: byte-level BPE ({VOCAB_SIZE} tokens, `{EOS_TOKEN}` = eos = pad) trained "
        "on these files.\n",
        encoding="utf-8",
    )


def train_tokenizer(texts: list[str], out_dir: Path) -> None:
    """Byte-level BPE, Qwen-style: digits split, no normalizer, `<|endoftext|>` last (id 511)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 1,  # the last id is the special token, added below
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: lossless
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Put the special token inside the model vocab (not only as an added token), so that
    # `vocab_size` and `len(tokenizer)` agree at VOCAB_SIZE.
    model_state = json.loads(tokenizer.to_str())["model"]
    vocab = dict(model_state["vocab"], **{EOS_TOKEN: VOCAB_SIZE - 1})
    merges = [tuple(merge) for merge in model_state["merges"]]
    tokenizer.model = models.BPE(vocab, merges)
    tokenizer.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])

    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
    ).save_pretrained(str(out_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="directory to write corpus/ and tokenizer/ into (default: the data/ dir)",
    )
    out_dir = parser.parse_args().out

    rng = random.Random(SEED)
    passkey_depths = stratified_depths(rng, NUM_LONG_DOCS)
    colour_depths = stratified_depths(rng, NUM_LONG_DOCS)
    long_texts = [long_document(rng, p, c) for p, c in zip(passkey_depths, colour_depths)]
    short_texts = [short_document(rng) for _ in range(NUM_SHORT_DOCS)]
    passkey_short = passkey_documents(rng, NUM_PASSKEY_SHORT_DOCS, PASSKEY_SHORT_SENTENCES)
    passkey_long = passkey_documents(rng, NUM_PASSKEY_LONG_DOCS, PASSKEY_LONG_SENTENCES)

    corpus_dir = out_dir / "corpus"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(corpus_dir / "long.jsonl", long_texts)
    write_jsonl(corpus_dir / "short.jsonl", short_texts)
    write_jsonl(corpus_dir / "passkey_short.jsonl", passkey_short)
    write_jsonl(corpus_dir / "passkey_long.jsonl", passkey_long)
    write_readme(corpus_dir / "README.md")
    train_tokenizer(long_texts + short_texts + passkey_short + passkey_long, out_dir / "tokenizer")


if __name__ == "__main__":
    main()
