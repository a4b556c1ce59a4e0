"""Synthetic retrieval documents in the formats `mtrain eval` asks, with needles eval can never ask.

Used by data/make_code_corpus.py (not run on its own). Each document is a prompt in eval's own wording followed
by its answer, so a model pretrained on the mix learns to retrieve at its own context. Five task families:
  passkey, number_string  InfiniteBench's "important info hidden inside a lot of irrelevant text"
  kv_retrieval            InfiniteBench's JSON key-value lookup (UUID keys and values)
  niah                    eval/niah.py's "secret code of the <key>"
  ruler_niah              RULER's "special magic" needles (eval/ruler/niah_tasks.py): single, multi-key,
                          needles-only, multi-value and multi-query, numbers or UUIDs
Haystacks: eval's noise sentences; training code flattened to words and cut into sentences (what
`mtrain eval --haystack-dir` makes of held-out code); training code kept as lines, the needle planted as a
comment line.

Never an eval needle, by construction (eval draws from mtrain_cli/eval/words.py and its generators):
  keys     adjective-noun pairs from word lists that share no word with eval's (tests/test_code_corpus.py)
  numbers  digit counts eval never draws: needle values 5, 6, 8 or 9 digits (eval 7), pass keys 3, 4, 6 or 7
           (eval 5), digit strings 8, 9, 11 or 12 (eval 10). Counts on both sides of eval's, several of them: with
           only 6 and 8 the first base model learned those lengths: at its own context 3 of its 5 NIAH misses were
           6-digit prefixes of eval's 7-digit values, 5 of its 17 hits 8 digits long. Copying the digits up to the
           full stop is the one rule that fits many lengths
  UUIDs    variant nibble c or d (eval's are uuid4: 8, 9, a or b)
and the random stream is seeded apart from eval's (the caller's `code-corpus:<seed>:...` strings).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass

from mtrain_cli.eval.words import NOISE_SENTENCES

ADJECTIVES = [
    "agile",
    "airy",
    "alert",
    "ashen",
    "azure",
    "balmy",
    "blunt",
    "breezy",
    "bubbly",
    "burly",
    "chilly",
    "cloudy",
    "coarse",
    "cozy",
    "crisp",
    "damp",
    "dapper",
    "dense",
    "dim",
    "dreamy",
    "dull",
    "dusky",
    "earthy",
    "faint",
    "fluffy",
    "foggy",
    "fresh",
    "fuzzy",
    "gleaming",
    "glum",
    "grassy",
    "gritty",
    "hardy",
    "hasty",
    "hazy",
    "hefty",
    "husky",
    "inky",
    "jagged",
    "jumpy",
    "knotty",
    "lanky",
    "leafy",
    "lofty",
    "lush",
    "mighty",
    "murky",
    "nimble",
    "nutty",
    "oaken",
    "plush",
    "prickly",
    "quaint",
    "rocky",
    "rosy",
    "rustic",
    "salty",
    "sandy",
    "shady",
    "sharp",
    "shy",
    "silky",
    "slim",
    "snowy",
    "soggy",
    "sour",
    "sparkly",
    "spotted",
    "stony",
    "striped",
    "sugary",
    "tangy",
    "tart",
    "thorny",
    "toasty",
    "twisty",
    "upbeat",
    "vague",
    "wavy",
    "windy",
    "wiry",
    "woolly",
    "zany",
]
NOUNS = [
    "acorn",
    "almond",
    "antler",
    "apron",
    "arrow",
    "axle",
    "bagel",
    "banjo",
    "barrel",
    "beetle",
    "biscuit",
    "blossom",
    "bobbin",
    "bonnet",
    "boulder",
    "bracelet",
    "bramble",
    "buckle",
    "bungalow",
    "burrow",
    "cabbage",
    "canoe",
    "carousel",
    "cedar",
    "chestnut",
    "cobble",
    "coconut",
    "comet",
    "cookie",
    "coral",
    "cricket",
    "cupboard",
    "cymbal",
    "daisy",
    "dune",
    "easel",
    "ember",
    "fjord",
    "flannel",
    "funnel",
    "gadget",
    "gazebo",
    "gravel",
    "griddle",
    "hammock",
    "hazel",
    "hedge",
    "heron",
    "igloo",
    "jasmine",
    "kayak",
    "kernel",
    "lattice",
    "ledger",
    "mitten",
    "moss",
    "muffin",
    "nectar",
    "nutmeg",
    "olive",
    "orchid",
    "pantry",
    "parsnip",
    "pelican",
    "pinecone",
    "plum",
    "poppy",
    "prism",
    "pumpkin",
    "quartz",
    "radish",
    "reef",
    "robin",
    "saffron",
    "sapling",
    "seashell",
    "sequoia",
    "sleigh",
    "sprocket",
    "thimble",
    "toffee",
    "trellis",
    "truffle",
    "turnip",
    "walrus",
    "wicker",
    "yarn",
]
KEYS = [f"{adjective}-{noun}" for adjective, noun in itertools.product(ADJECTIVES, NOUNS)]

VALUE_DIGITS = (5, 6, 8, 9)  # eval's NIAH and RULER values: 7 digits
PASSKEY_DIGITS = (3, 4, 6, 7)  # eval's pass keys: 5
DIGIT_STRING_DIGITS = (8, 9, 11, 12)  # eval's number_string: 10
UUID_VARIANTS = "cd"  # eval's uuid4 values: 8, 9, a or b

FAMILY_WEIGHTS = {"passkey": 0.15, "number_string": 0.1, "kv_retrieval": 0.2, "niah": 0.2, "ruler_niah": 0.35}
HAYSTACK_KINDS = ("noise", "flat", "lines", "json", "needles")  # chars-per-token is measured for each
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")  # as eval/haystack.py splits essay text
_FIND_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
_PROMPT_CHARS = 300  # room for a prompt's fixed words, taken from the haystack's share


@dataclass(frozen=True)
class RulerShape:
    haystack: str  # "noise" | "flat" | "needles"
    key_kind: str  # "words" | "uuids"
    value_kind: str  # "numbers" | "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


# RULER's eight variants (eval/ruler/niah_tasks.py SPECS), "essay" being flattened training code here.
RULER_SHAPES = (
    RulerShape("noise", "words", "numbers"),
    RulerShape("flat", "words", "numbers"),
    RulerShape("flat", "words", "uuids"),
    RulerShape("flat", "words", "numbers", num_keys=4),
    RulerShape("needles", "words", "numbers"),
    RulerShape("needles", "uuids", "uuids"),
    RulerShape("flat", "words", "numbers", num_values=4),
    RulerShape("flat", "words", "numbers", num_keys=4, num_queries=4),
)


def number(rng, digit_counts: tuple[int, ...]) -> str:
    digits = rng.choice(digit_counts)
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def uuid_text(rng) -> str:
    """A version-4-looking UUID whose variant nibble (c or d) no uuid4 has."""
    hexits = f"{rng.getrandbits(128):032x}"
    hexits = hexits[:12] + "4" + hexits[13:16] + rng.choice(UUID_VARIANTS) + hexits[17:]
    return f"{hexits[:8]}-{hexits[8:12]}-{hexits[12:16]}-{hexits[16:20]}-{hexits[20:]}"


# Share of needle depths drawn at an end of the haystack (0 or 100%, half each). Eval asks for both ends as often
# as any other depth (2 of NIAH's 11), but a uniform draw puts a needle first only below 50 / len(units) percent:
# ~0.3% of 4K documents' needles. A 4K base trained so found NIAH needles at depth 0% in 7 of 16 prompts (89%
# over all depths).
END_DEPTH_SHARE = 0.2


def needle_depth(rng) -> float:
    """A needle's depth in percent: an end with probability END_DEPTH_SHARE, else uniform."""
    if rng.random() < END_DEPTH_SHARE:
        return rng.choice((0.0, 100.0))
    return rng.uniform(0, 100)


def plant(units: list[str], needles: list[str], depths: list[float]) -> list[str]:
    """Each needle before the unit at depth% of `units` (eval's rule); deepest first, so no insertion moves
    a position still to be used."""
    placed = list(units)
    for index in sorted(range(len(needles)), key=lambda i: (depths[i], i), reverse=True):
        placed.insert(round(depths[index] / 100 * len(units)), needles[index])
    return placed


class RetrievalWriter:
    """Retrieval documents of a requested size in tokens. code_docs: training code (never held-out packages);
    chars_per_token: per haystack kind, measured with the corpus tokenizer (HAYSTACK_KINDS)."""

    def __init__(self, code_docs: list[str], chars_per_token: dict[str, float]):
        self.code_docs = [doc for doc in code_docs if doc]
        self.chars_per_token = chars_per_token

    def document(self, rng, num_tokens: int) -> tuple[str, str]:
        """(family, text) of about `num_tokens` tokens."""
        family = rng.choices(list(FAMILY_WEIGHTS), weights=list(FAMILY_WEIGHTS.values()))[0]
        return family, getattr(self, family)(rng, num_tokens)

    # -- haystacks ---------------------------------------------------------------------------------------
    def _chars(self, kind: str, num_tokens: int) -> int:
        return max(0, int(num_tokens * self.chars_per_token[kind]) - _PROMPT_CHARS)

    def _code(self, rng, num_chars: int) -> str:
        """About `num_chars` of training code from a random place, running on into the next documents."""
        index = rng.randrange(len(self.code_docs))
        start = rng.randrange(len(self.code_docs[index]))
        parts, size = [], 0
        while size < num_chars:
            piece = self.code_docs[index][start : start + num_chars - size]
            parts.append(piece)
            size += len(piece)
            index, start = (index + 1) % len(self.code_docs), 0
        return "".join(parts)

    def _units(self, rng, kind: str, num_chars: int) -> tuple[list[str], str]:
        """(haystack units, their separator) of about `num_chars`: sentences, or code lines."""
        if kind == "noise":
            mean_chars = sum(map(len, NOISE_SENTENCES)) / len(NOISE_SENTENCES) + 1
            return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(int(num_chars / mean_chars))], " "
        if kind == "flat":  # whitespace collapses: read more code than the words it leaves
            text = " ".join(self._code(rng, 2 * num_chars).split())[:num_chars]
            return [sentence for sentence in _SENTENCE_END.split(text) if sentence], " "
        return self._code(rng, num_chars).split("\n"), "\n"

    def _context(self, rng, kind: str, num_tokens: int, needles: list[str]) -> str:
        units, separator = self._units(rng, kind, self._chars(kind, num_tokens))
        if kind == "lines":
            needles = [f"# {needle}" for needle in needles]
        return separator.join(plant(units, needles, [needle_depth(rng) for _ in needles]))

    # -- task families -----------------------------------------------------------------------------------
    def passkey(self, rng, num_tokens: int) -> str:
        key = number(rng, PASSKEY_DIGITS)
        kind = rng.choices(("noise", "flat", "lines"), weights=(2, 1, 1))[0]
        context = self._context(rng, kind, num_tokens, [f"The pass key is {key}. Remember it. {key} is the pass key."])
        return f"{_FIND_INTRO}{context}\n\nWhat is the pass key?\nThe pass key is {key}."

    def number_string(self, rng, num_tokens: int) -> str:
        digits = number(rng, DIGIT_STRING_DIGITS)
        kind = rng.choices(("noise", "flat", "lines"), weights=(2, 1, 1))[0]
        needle = f"The sequence of digits is {digits}. Remember it. {digits} is the sequence of digits."
        context = self._context(rng, kind, num_tokens, [needle])
        return f"{_FIND_INTRO}{context}\n\nWhat is the sequence of digits?\nThe sequence of digits is {digits}."

    def kv_retrieval(self, rng, num_tokens: int) -> str:
        pair_chars = 2 * 36 + 6  # '"key": "value", '
        pairs = [(uuid_text(rng), uuid_text(rng)) for _ in range(max(1, self._chars("json", num_tokens) // pair_chars))]
        key, value = pairs[rng.randrange(len(pairs))]
        return (
            "Extract the value corresponding to the specified key in the JSON object below.\n\n"
            f'{json.dumps(dict(pairs))}\n\nKey: "{key}"\nThe value associated with the specified key is: {value}'
        )

    def niah(self, rng, num_tokens: int) -> str:
        key, value = rng.choice(KEYS), number(rng, VALUE_DIGITS)
        kind = rng.choices(("flat", "noise", "lines"), weights=(2, 1, 1))[0]
        context = self._context(rng, kind, num_tokens, [f"The secret code of the {key} is {value}."])
        return (
            "A secret code is hidden somewhere in the following text. Find it and remember it.\n\n"
            f"{context}\n\nWhat is the secret code of the {key}?\nThe secret code of the {key} is {value}."
        )

    def ruler_niah(self, rng, num_tokens: int) -> str:
        shape = rng.choice(RULER_SHAPES)
        kind = shape.value_kind

        def value() -> str:
            return number(rng, VALUE_DIGITS) if kind == "numbers" else uuid_text(rng)

        def needle(key: str, needle_value: str) -> str:
            return f"One of the special magic {kind} for {key} is: {needle_value}."

        keys = (
            rng.sample(KEYS, shape.num_keys)
            if shape.key_kind == "words"
            else [uuid_text(rng) for _ in range(shape.num_keys)]
        )
        values = {key: [value() for _ in range(shape.num_values)] for key in keys}
        needles = [needle(key, v) for key in keys for v in values[key]]
        rng.shuffle(needles)
        if shape.haystack == "needles":  # a haystack of distractor needles with other keys
            num_distractors = self._chars("needles", num_tokens) // len(needles[0])
            if shape.key_kind == "words":
                others = [
                    key for key in rng.sample(KEYS, min(len(KEYS), num_distractors + len(keys))) if key not in keys
                ][:num_distractors]
            else:
                others = [uuid_text(rng) for _ in range(num_distractors)]
            units = [needle(key, value()) for key in others]
            context = " ".join(plant(units, needles, [needle_depth(rng) for _ in needles]))
        else:
            context = self._context(rng, shape.haystack, num_tokens, needles)
        queried = keys[: shape.num_queries]
        query = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + f", and {queried[-1]}"
        answers = ", ".join(v for key in queried for v in values[key])
        return (
            f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {kind} afterwards.\n{context}\n"
            f"What are all the special magic {kind} for {query} mentioned in the provided text?\n"
            f"The special magic {kind} for {query} mentioned in the provided text are {answers}."
        )

    def sample_haystacks(self, rng, num_chars: int) -> dict[str, str]:
        """About `num_chars` of each haystack kind, to measure its characters per token."""
        texts = {}
        for kind in ("noise", "flat", "lines"):
            units, separator = self._units(rng, kind, num_chars)
            texts[kind] = separator.join(units)
        texts["json"] = json.dumps({uuid_text(rng): uuid_text(rng) for _ in range(num_chars // 78 + 1)})
        texts["needles"] = " ".join(
            f"One of the special magic numbers for {rng.choice(KEYS)} is: {number(rng, VALUE_DIGITS)}."
            for _ in range(num_chars // 60 + 1)
        )
        return texts
