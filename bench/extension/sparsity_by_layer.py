"""Per-layer density and recall of mtrain's sparse attention on a trained model, on held-out text, by length.

    python3 -m bench.extension.sparsity_by_layer MODEL --text-dir DIR --lengths 8192,16384,32768 \
        --attention-from RUN/config.yaml --out probe.json

`mtrain extend` logs the mean over layers per step; this shows each layer. For each length: the first .txt
file under --text-dir (sorted by name) with that many tokens, cut to it, one forward pass through the model's
decoder with every layer routed through mtrain's attention hook in sparse mode (settings: the `attention`
section of --attention-from; no crossover rule, so every layer makes its plan). After each layer the router's
`sparse_stats()` gives that layer's probe recall (attention mass its layout keeps) and block density (share
of causal blocks computed). Lengths below the settings' dense_below run dense: reported as such.
MODEL: what `mtrain eval` takes (an HF directory, a run directory or a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml

from mtrain_cli.attention import ATTENTION_NAME, AttentionRouter, register_attention
from mtrain_cli.config import attention_from_dict
from mtrain_cli.eval import load_model
from mtrain_cli.lengths import parse_lengths


def first_long_text(tokenizer, files: list[Path], length: int) -> tuple[str, list[int]] | None:
    for path in files:
        text = path.read_text(encoding="utf-8")
        ids = tokenizer(text[: length * 12], add_special_tokens=True, verbose=False).input_ids
        if len(ids) >= length:
            return path.name, ids[:length]
    return None


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2
        print(f"sparsity_by_layer.py: {message}", file=sys.stderr)
        sys.exit(2)


def main() -> int:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--text-dir", type=Path, required=True)
    parser.add_argument("--lengths", required=True)
    parser.add_argument("--attention-from", type=Path, required=True, help="a run's config.yaml")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    files = sorted(args.text_dir.glob("*.txt"))
    if not files or not args.attention_from.is_file():
        print(f"sparsity_by_layer.py: no .txt files in {args.text_dir} or no {args.attention_from}", file=sys.stderr)
        return 2
    raw = (yaml.safe_load(args.attention_from.read_text()) or {}).get("attention") or {}
    attention = attention_from_dict({**raw, "mode": "sparse"})
    register_attention()
    router = AttentionRouter(attention)
    loaded = load_model(args.model, attn_implementation=ATTENTION_NAME)
    per_layer: list[dict[str, float]] = []
    for layer in loaded.model.base_model.layers:  # after each layer: its plan's recall and density
        layer.register_forward_hook(lambda *_: per_layer.append(router.sparse_stats()))
    rows = []
    for length in parse_lengths(args.lengths):
        found = first_long_text(loaded.tokenizer, files, length)
        if found is None:
            rows.append({"length": length, "skipped": f"no .txt file in {args.text_dir} has {length} tokens"})
            continue
        name, ids = found
        router.sparse_stats()  # drop anything planned before this forward
        per_layer.clear()
        started = time.perf_counter()
        with torch.inference_mode(), router:
            loaded.model.base_model(input_ids=torch.tensor([ids], device=loaded.device), use_cache=False)
        seconds = time.perf_counter() - started
        dense = length < attention.dense_below
        rows.append(
            {
                "length": length,
                "text": name,
                "forward_s": round(seconds, 3),
                "dense_below": dense,
                "layers": [
                    {"recall": stats.get("sparse_recall"), "density": stats.get("sparse_density")}
                    for stats in per_layer
                ],
            }
        )
    settings = {key: value for key, value in vars(attention).items() if key not in ("mode", "crossover")}
    payload = {
        "model": str(args.model),
        "settings": settings,
        "settings_from": str(args.attention_from),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype),
        "lengths": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    for row in rows:
        layers = row.get("layers") or []
        print(
            f"{row['length']}: "
            + (
                row.get("skipped")
                or " ".join(
                    f"L{i} {layer['density']:.2f}/{layer['recall']:.3f}"
                    for i, layer in enumerate(layers)
                    if layer["density"] is not None
                )
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
