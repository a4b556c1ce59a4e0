"""The first decoder layer's sparse pattern by cap and length: probe recall and block density, on CPU.

    python -m bench.extension.cap_sweep MODEL --text 'DIR/**/*.py' --lengths 64k,128k,256k \\
        --caps 4096,8192,16384,32768 --out DIR

The flex rule keeps the fewest verticals (and, apart, slashes) holding share p of the probe mass, at most `cap`
each. A layer whose attention is broad needs more entries as documents grow, and the cap then binds: recall falls
below p. The first layer's queries and keys need no attention before them (embeddings, norm, projections, RoPE), so
its pattern at 256K is cheap to estimate here, without a GPU. MODEL: a Hugging Face directory, or an extension
job's parts folder (joined first, bench/extension/handoff.py). Text: files matching --text, read in sorted order and
joined into one document of the longest length. -> OUT/cap_sweep.json and .md.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from bench.extension.one_document import arguments, document_ids, model_directory
from mtrain_cli.attention import AttentionConfig, document_spans
from mtrain_cli.attention.sparse import SENTINEL, build_layout, estimate_pattern
from mtrain_cli.lengths import parse_lengths


def first_layer_qk(model, ids_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q [B, H, S, D], k [B, Hk, S, D]) of decoder layer 0, RoPE applied, as the model computes them."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    layer, cfg = model.model.layers[0], model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    x = layer.input_layernorm(model.model.embed_tokens(ids_BS))
    cos, sin = model.model.rotary_emb(x, torch.arange(ids_BS.shape[1])[None])
    attn = layer.self_attn
    q = attn.q_proj(x).view(*ids_BS.shape, -1, head_dim)
    k = attn.k_proj(x).view(*ids_BS.shape, -1, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


def main() -> None:
    parser = arguments("cap_sweep", __doc__, lengths="64k,128k,256k")
    parser.add_argument("--caps", default="4096,8192,16384,32768")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = model_directory(args.model, args.out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lengths, caps = parse_lengths(args.lengths), [int(c) for c in args.caps.split(",")]
    ids = document_ids(tokenizer, args.text, max(lengths))
    ids_BS = torch.tensor(ids)[None]
    with torch.no_grad():
        q_BHSD, k_BHkSD = first_layer_qk(model, ids_BS)
    rows = []
    for length in lengths:
        doc_BS = torch.zeros(1, length, dtype=torch.long)
        start, span = document_spans(doc_BS)
        for cap in caps:
            settings = AttentionConfig(mode="sparse", cap=cap)
            q, k = q_BHSD[:, :, :length].contiguous(), k_BHkSD[:, :, :length].contiguous()
            t0 = time.perf_counter()
            pattern = estimate_pattern(q, k, doc_BS, q.shape[-1] ** -0.5, settings)
            layout = build_layout(pattern, start, span, length, settings.block_size, settings.dense_below)
            row = {
                "length": length,
                "cap": cap,
                "recall": float(pattern.recall_BH.mean()),
                "recall_min_head": float(pattern.recall_BH.min()),
                "density": float(layout.density()),
                "verticals": float((pattern.vertical_BHV < SENTINEL).sum(-1).float().mean()),
                "slashes": float((pattern.slash_BHL < SENTINEL).sum(-1).float().mean()),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "model": str(args.model),
        "text": args.text,
        "tokens_sha256": hashlib.sha256(str(ids).encode()).hexdigest()[:16],
        "p": AttentionConfig().p,
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cap_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    table = [
        "| length | cap | recall (lowest head) | block density | verticals | slashes |",
        "|---|---:|---|---:|---:|---:|",
    ]
    table += [
        f"| {r['length']:,} | {r['cap']:,} | {r['recall']:.3f} ({r['recall_min_head']:.3f}) | {r['density']:.3f} | "
        f"{r['verticals']:,.0f} | {r['slashes']:,.0f} |"
        for r in rows
    ]
    (args.out / "cap_sweep.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
