"""Write a jsonl of a few very long documents for GPU training benchmarks (sparse attention needs documents
of at least `attention.dense_below` tokens; the shipped demo stories are 1K-8K characters each).

Each document concatenates the shipped long stories (data/corpus/long.jsonl) in a seeded order until it
has about --chars characters. Offline and deterministic.

    python3 bench/make_long_docs.py --chars 3000000 --num-docs 3 --out /tmp/long.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus" / "long.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, required=True, help="characters per document (about)")
    parser.add_argument("--num-docs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    stories = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    with args.out.open("w") as f:
        for _ in range(args.num_docs):
            parts, size = [], 0
            while size < args.chars:
                parts.append(rng.choice(stories))
                size += len(parts[-1]) + 2
            f.write(json.dumps({"text": "\n\n".join(parts)}) + "\n")


if __name__ == "__main__":
    main()
