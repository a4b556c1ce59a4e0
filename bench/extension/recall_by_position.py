"""How much attention mass the sparse pattern keeps for queries all along a long document, not only for the probe.

    python -m bench.extension.recall_by_position MODEL --text 'DIR/**/*.py' --lengths 64k,256k --out DIR \
        --variants 'probe_windows=1;probe_windows=4,p=0.8'

The planner estimates each head's verticals and slashes from `last_q` probe queries of a document (spread over
`probe_windows` windows; 1: its last ones) and reports the share of *those* queries' mass the layout keeps: the
recall in the step line, in sample. Every other query of the document attends with the same pattern. This
measures the share kept for queries spread along one document, between the probe windows, for the shipped settings
and for variants of them (`--variants`: `;`-separated lists of `key=value` attention settings).

One forward pass with dense attention (SDPA) over one document; at every layer a hook estimates each variant's
pattern with mtrain's `estimate_pattern` and builds its layout, then scores windows of 16 queries ending at
1/2W, 3/2W, ... of the document (no probe row of `probe_windows` up to W among them) against all their keys with
the true causal softmax, and sums the mass inside the layout's blocks and vertical columns, per head. Density:
the layout's share of the causal blocks. MODEL: a Hugging Face directory, or an extension job's parts folder.
-> OUT/recall_by_position.json and .md. On a GPU if there is one (256K takes seconds there, ~1 h on 2 cores).

`--oracle-blocks 4,16` also asks what k more key blocks per query block would keep on top of each variant's
pattern, chosen three ways: from the true attention (an upper bound), by mean-pooled q·k, and by one probe query a
block: whether query-block-specific blocks would buy kept mass more cheaply than a larger p.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch
import torch.nn.functional as F
import yaml

from bench.extension.one_document import arguments, document_ids, model_directory
from mtrain_cli.attention import AttentionConfig, document_spans
from mtrain_cli.attention.sparse import Pattern, build_layout, estimate_pattern, slash_block_offsets
from mtrain_cli.config import attention_from_dict
from mtrain_cli.errors import UserError
from mtrain_cli.lengths import parse_lengths

NAME = "recall_by_position"


def causal_probs(q_HQD: torch.Tensor, k_HSD: torch.Tensor, pos_Q: torch.Tensor, scale: float) -> torch.Tensor:
    """[H, Q, S] softmax of the queries at pos_Q over the keys at or before them."""
    score_HQS = (q_HQD @ k_HSD.transpose(-1, -2)) * scale
    future_QS = torch.arange(k_HSD.shape[1], device=k_HSD.device)[None, :] > pos_Q[:, None]
    return score_HQS.masked_fill(future_QS, -torch.inf).softmax(-1)


def coverage(pattern: Pattern, length: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (covered block offsets [H, nb] bool, vertical column mask [H, S] bool) of batch row 0, as the kernels
    compute them."""
    nb = -(-length // block)
    delta_HB = slash_block_offsets(pattern.slash_BHL, nb, block)[0, :, :nb]
    vertical_HV = pattern.vertical_BHV[0].long()
    column_HS = torch.zeros(vertical_HV.shape[0], length + 1, dtype=torch.bool, device=vertical_HV.device)
    column_HS.scatter_(1, vertical_HV.clamp(max=length), True)  # SENTINEL padding lands in the extra column
    return delta_HB, column_HS[:, :length]


def covered_pairs(pos_Q, delta_HB, column_HS, block: int) -> torch.Tensor:
    """[H, Q, S] bool: the (query, key) pairs the layout computes, in its covered blocks or on a vertical column."""
    S = column_HS.shape[-1]
    offset_QS = (pos_Q[:, None] // block - torch.arange(S, device=pos_Q.device)[None, :] // block).clamp(min=0)
    covered_HX = delta_HB.gather(1, offset_QS.reshape(1, -1).expand(delta_HB.shape[0], -1))
    return covered_HX.view(-1, pos_Q.shape[0], S) | column_HS[:, None, :]


def oracle_blocks(prob_HQS, covered_HQS, block: int, counts: list[int]) -> dict[str, float]:
    """What k more key blocks per evaluation window would keep, chosen knowing the true attention (an upper bound
    for any planner of query-block-specific blocks): per k, the mass kept with the window's k key blocks holding
    most of its missed mass, and the share of the causal blocks k blocks a query block would add over the whole
    document."""
    H, Q, S = prob_HQS.shape
    nb = -(-S // block)
    missed_HWB = F.pad(prob_HQS * ~covered_HQS, (0, nb * block - S)).view(H, Q // ROWS, ROWS, nb, block).sum((2, 4))
    kept_W = (prob_HQS * covered_HQS).sum(-1).view(H, -1, ROWS).mean((0, 2))
    rows = torch.arange(1, nb + 1, dtype=torch.float64)  # key blocks a query block sees
    out = {}
    for k in counts:
        top_HW = missed_HWB.topk(min(k, nb), dim=-1).values.sum(-1) / ROWS
        out[f"top{k}_kept"] = float(kept_W.mean() + top_HW.mean())
        out[f"top{k}_kept_by_window"] = (kept_W + top_HW.mean(0)).tolist()
        out[f"top{k}_density"] = float(rows.clamp(max=k).sum() / rows.sum())
    return out


def pooled_blocks(
    q_HSD, k_HSD, prob_HQS, covered_HQS, delta_HB, pos_Q, scale: float, block: int, counts: list[int]
) -> dict[str, float]:
    """What k more key blocks per query block would keep, chosen as a planner could, among the visible key blocks
    the slashes do not cover already. Two estimates of a query block's key blocks: `pooled`, the dot product of its
    mean query with each key block's mean key (MInference's block-sparse estimate); `strided`, the mass per key
    block of one probe query, the previous query block's last (a probe row every block). Per k, the mass kept for
    the queries at pos_Q."""
    H, S, D = q_HSD.shape
    nb = -(-S // block)
    mean_q_HBD = F.pad(q_HSD, (0, 0, 0, nb * block - S)).view(H, nb, block, D).mean(2)
    mean_k_HBD = F.pad(k_HSD, (0, 0, 0, nb * block - S)).view(H, nb, block, D).mean(2)
    row_Q = pos_Q // block
    probe_Q = (row_Q * block - 1).clamp(min=0)
    probe_HQS = causal_probs(q_HSD[:, probe_Q], k_HSD, probe_Q, scale)
    estimates = {
        "pooled": (mean_q_HBD[:, row_Q] @ mean_k_HBD.transpose(-1, -2)) * scale,
        "strided": F.pad(probe_HQS, (0, nb * block - S)).view(H, -1, nb, block).sum(-1),
    }
    offset_QB = row_Q[:, None] - torch.arange(nb, device=pos_Q.device)[None, :]
    slashed_HQB = delta_HB.gather(1, offset_QB.clamp(min=0, max=nb - 1).reshape(1, -1).expand(H, -1)).view(H, -1, nb)
    key_block_S = torch.arange(S, device=pos_Q.device) // block
    visible_QS = torch.arange(S, device=pos_Q.device) <= pos_Q[:, None]
    out = {}
    for estimate, score_HQB in estimates.items():
        score_HQB = score_HQB.masked_fill((offset_QB < 0) | slashed_HQB, -torch.inf)
        for k in counts:
            top_HQK = score_HQB.topk(min(k, nb), dim=-1)
            chosen_HQB = torch.zeros_like(score_HQB, dtype=torch.bool).scatter_(
                2, top_HQK.indices, top_HQK.values > -torch.inf
            )
            chosen_HQS = chosen_HQB[:, :, key_block_S] & visible_QS
            kept_HQ = (prob_HQS * (covered_HQS | chosen_HQS)).sum(-1)
            out[f"{estimate}{k}_kept"] = float(kept_HQ.mean())
            out[f"{estimate}{k}_kept_by_window"] = kept_HQ.view(H, -1, ROWS).mean((0, 2)).tolist()
    return out


class Probe:
    """The attention function of the forward: dense SDPA, and at each layer every variant's kept mass."""

    def __init__(self, variants: dict[str, AttentionConfig], oracle: tuple[int, ...] = ()):
        self.variants, self.oracle = variants, oracle
        self.eval_pos_Q = torch.empty(0)
        self.layers: list[dict] = []

    def start(self, length: int, num_windows: int, device) -> None:
        """Before a forward over `length` tokens: windows ending halfway between the n-ths of the document."""
        ends = [length * (2 * w + 1) // (2 * num_windows) - 1 for w in range(num_windows)]
        self.eval_pos_Q = torch.tensor([e - ROWS + 1 + r for e in ends for r in range(ROWS)], device=device)
        self.layers = []

    def __call__(self, module, q_BHSD, k_BHkSD, v_BHkSD, attention_mask, scaling=None, **_):
        scale = scaling if scaling is not None else q_BHSD.shape[-1] ** -0.5
        G = q_BHSD.shape[1] // k_BHkSD.shape[1]  # K/V repeated: SDPA's GQA path is the O(S^2) math kernel on CUDA
        k_BHSD, v_BHSD = k_BHkSD.repeat_interleave(G, 1), v_BHkSD.repeat_interleave(G, 1)
        out = F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=scale)
        self.layers.append(measure(q_BHSD.float(), k_BHkSD.float(), scale, self.variants, self.eval_pos_Q, self.oracle))
        summary = {name: f"{v['density']:.3f}/{v['kept']:.3f}" for name, v in self.layers[-1].items()}
        print(json.dumps({"length": q_BHSD.shape[2], "layer": len(self.layers) - 1, **summary}), flush=True)
        return out.transpose(1, 2).contiguous(), None


def measure(
    q_BHSD, k_BHkSD, scale: float, variants: dict[str, AttentionConfig], eval_pos_Q, oracle: tuple[int, ...] = ()
) -> dict[str, dict]:
    """Per variant: the mass its pattern keeps for the queries at eval_pos_Q (mean over heads, per window and
    overall), its probe rows' own recall, its layout's block density, and for each k of `oracle` what k more key
    blocks per query block would add (`oracle_blocks`, `pooled_blocks`). One document of one batch row."""
    S = q_BHSD.shape[2]
    q_HSD = q_BHSD[0]
    k_HSD = k_BHkSD[0].repeat_interleave(q_HSD.shape[0] // k_BHkSD.shape[1], 0)
    prob_HQS = causal_probs(q_HSD[:, eval_pos_Q], k_HSD, eval_pos_Q, scale)
    doc_BS = torch.zeros(1, S, dtype=torch.long, device=q_BHSD.device)
    start_BS, span_BS = document_spans(doc_BS)
    out = {}
    for name, settings in variants.items():
        pattern = estimate_pattern(q_BHSD, k_BHkSD, doc_BS, scale, settings)
        block = settings.block_size
        layout = build_layout(pattern, start_BS, span_BS, S, block, settings.dense_below)
        delta_HB, column_HS = coverage(pattern, S, block)
        covered_HQS = covered_pairs(eval_pos_Q, delta_HB, column_HS, block)
        kept_HQ = (prob_HQS * covered_HQS).sum(-1)
        by_window = kept_HQ.view(kept_HQ.shape[0], -1, ROWS).mean((0, 2))
        out[name] = {
            "kept": float(by_window.mean()),
            "kept_by_window": by_window.tolist(),
            "probe_recall": float(pattern.recall_BH.mean()),
            "density": float(layout.density()),
        }
        if oracle:  # the strided estimate scores as many queries again against every key: only when asked
            out[name].update(oracle_blocks(prob_HQS, covered_HQS, block, list(oracle)))
            out[name].update(
                pooled_blocks(q_HSD, k_HSD, prob_HQS, covered_HQS, delta_HB, eval_pos_Q, scale, block, list(oracle))
            )
    return out


ROWS = 16  # queries per evaluation window
DEFAULT_VARIANTS = "probe_windows=1;probe_windows=4;p=0.95;p=0.8"


def parse_variants(text: str) -> dict[str, AttentionConfig]:
    """ "a=1,b=2;c=3" -> {"shipped": the defaults, "a=1,b=2": ..., "c=3": ...}, each checked as a recipe's would be."""
    variants = {"shipped": attention_from_dict({"mode": "sparse"})}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        pairs = [pair.partition("=") for pair in item.split(",")]
        if any(not sep for _, sep, _ in pairs):
            raise SystemExit(f"--variants {item!r}: each setting must look like key=value, e.g. probe_windows=4")
        raw = {key.strip(): yaml.safe_load(value) for key, _, value in pairs}
        try:
            variants[item] = attention_from_dict({"mode": "sparse", **raw})
        except UserError as exc:
            raise SystemExit(f"--variants {item!r}: {exc}") from None
    return variants


def settings_dict(settings: AttentionConfig) -> dict:
    return {key: list(value) if isinstance(value, tuple) else value for key, value in vars(settings).items()}


def main() -> None:
    parser = arguments(NAME, __doc__, lengths="64k")
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows along the document")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="`;`-separated key=value,... attention settings")
    parser.add_argument(
        "--oracle-blocks",
        default="",
        help="comma-separated k: what k more key blocks per query block would keep (the docstring says how chosen)",
    )
    args = parser.parse_args()
    oracle = tuple(int(k) for k in args.oracle_blocks.split(",") if k)
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import AttentionMaskInterface

    model_dir = model_directory(args.model, args.out)
    lengths = parse_lengths(args.lengths)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = parse_variants(args.variants)
    probe = Probe(variants, oracle)
    AttentionInterface.register(NAME, probe)
    AttentionMaskInterface.register(NAME, lambda *a, **k: None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=NAME)
    model = model.eval().to(device)
    ids = document_ids(tokenizer, args.text, max(lengths))
    rows = []
    for length in lengths:
        probe.start(length, args.windows, device)
        started = time.perf_counter()
        with torch.no_grad():
            model.model(input_ids=torch.tensor(ids[:length], device=device)[None], use_cache=False)
        rows.append(
            {
                "length": length,
                "window_ends": [length * (2 * w + 1) // (2 * args.windows) for w in range(args.windows)],
                "seconds": round(time.perf_counter() - started, 1),
                "layers": probe.layers,
            }
        )
    result = {
        "model": str(args.model),
        "text": args.text,
        "tokens_sha256": hashlib.sha256(str(ids).encode()).hexdigest()[:16],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "variants": {name: settings_dict(settings) for name, settings in variants.items()},
        "rows_per_window": ROWS,
        "oracle_blocks": list(oracle),
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lengths": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{NAME}.md").write_text(markdown(result))
    print(markdown(result))


KEYS = ("kept", "probe_recall", "density")


def mean_after_layer0(layers: list, name: str, key: str) -> float:
    """A variant's figure averaged over the layers after the first (whose broad attention sets it apart)."""
    return sum(layer[name][key] for layer in layers[1:]) / (len(layers) - 1)


def markdown(result: dict) -> str:
    lines = [
        f"Attention mass kept (mean over heads and queries) for windows of {result['rows_per_window']} queries"
        " ending at 1/2W, 3/2W, ... of one document, between the probe windows / the probe rows' own recall (what"
        " the step line logs) · the layout's block density",
    ]
    for row in result["lengths"]:
        names = list(row["layers"][0])
        lines += ["", f"{row['length']:,} tokens", "", "| layer | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for i, layer in enumerate(row["layers"]):
            cells = [f"{v['kept']:.3f} / {v['probe_recall']:.3f} · {v['density']:.3f}" for v in layer.values()]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
        mean = {name: [mean_after_layer0(row["layers"], name, key) for key in KEYS] for name in names}
        lines.append(
            f"| 1–{len(row['layers']) - 1} | "
            + " | ".join(f"{k:.3f} / {r:.3f} · {d:.3f}" for k, r, d in mean.values())
            + " |"
        )
        lines += oracle_table(row, names)
    return "\n".join(lines) + "\n"


def oracle_table(row: dict, names: list[str]) -> list[str]:
    """The mass each variant would keep with k more key blocks per query block (`oracle_blocks`, `pooled_blocks`),
    and the density they add; nothing if the run asked for none."""
    counts = [key[3:-5] for key in row["layers"][0][names[0]] if key.startswith("top") and key.endswith("_kept")]
    if not counts:
        return []
    first = row["layers"][0][names[0]]
    lines = [
        "",
        f"With k more key blocks per query block, k = {', '.join(counts)} (density added: "
        + ", ".join(f"+{first[f'top{k}_density']:.3f}" for k in counts)
        + "): mass kept with the k holding most of each window's missed mass, from the true attention (an upper "
        "bound for any planner of such blocks) · with the k a planner would take among the blocks the slashes "
        "leave, by mean-pooled q·k · by one probe query a block (the previous block's last)",
        "",
        "| layer | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    layers = row["layers"]
    figures = [(str(i), lambda name, key, layer=layer: layer[name][key]) for i, layer in enumerate(layers)]
    figures.append((f"1–{len(layers) - 1}", lambda name, key: mean_after_layer0(layers, name, key)))
    for label, figure in figures:
        cells = [
            " / ".join(f"{figure(name, f'top{k}_kept'):.3f}" for k in counts)
            + " · "
            + " / ".join(f"{figure(name, f'pooled{k}_kept'):.3f}" for k in counts)
            + " · "
            + " / ".join(f"{figure(name, f'strided{k}_kept'):.3f}" for k in counts)
            for name in names
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
