"""How much attention mass the sparse pattern keeps for queries all along a long document, not only for the probe.

    python -m bench.extension.recall_by_position MODEL --text 'DIR/**/*.py' --length 64k --out DIR

The planner estimates each head's verticals and slashes from the last `last_q` queries of a document and
reports the share of *those* queries' mass the layout keeps: the recall in the step line, in-sample. Every other
query of the document attends with the same pattern. This measures the share kept for queries spread along one
document, out of sample, for the shipped estimate and for probe windows placed along the document instead of
only at its end (the same number of probe rows), on CPU.

One forward pass with dense attention (SDPA); at every layer a hook scores windows of `--rows` queries ending at
1/W, 2/W, ... of the document against all their keys (the true causal softmax), and measures the mass inside
each pattern's blocks and vertical columns, per head. Patterns: `shipped` is mtrain's `estimate_pattern` with
the recipe defaults; the others select with the same flex rule (share p of the probe mass, at most `cap`
entries besides the sinks and the local window) from probe rows placed as named. Density: the share of the
causal block triangle's work the pattern computes (covered blocks, plus vertical columns outside them).
MODEL: a Hugging Face directory, or an extension job's parts folder. -> OUT/recall_by_position.json and .md.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.extension import handoff
from mtrain_cli.attention import AttentionConfig
from mtrain_cli.attention.sparse import SENTINEL, estimate_pattern
from mtrain_cli.lengths import parse_lengths

NAME = "recall_by_position"


def probe_positions(length: int, num_windows: int, rows: int) -> torch.Tensor:
    """`rows` consecutive query positions ending at each of `num_windows` evenly spaced points, the last at the end."""
    ends = [length * (w + 1) // num_windows - 1 for w in range(num_windows)]
    return torch.tensor([e - rows + 1 + r for e in ends for r in range(rows)])


def causal_probs(q_HQD: torch.Tensor, k_HSD: torch.Tensor, pos_Q: torch.Tensor, scale: float) -> torch.Tensor:
    """[H, Q, S] softmax of the queries at pos_Q over the keys at or before them."""
    score_HQS = (q_HQD @ k_HSD.transpose(-1, -2)) * scale
    future_QS = torch.arange(k_HSD.shape[1], device=k_HSD.device)[None, :] > pos_Q[:, None]
    return score_HQS.masked_fill(future_QS, -torch.inf).softmax(-1)


def flex_select(score_HN: torch.Tensor, forced_N: torch.Tensor, p: float, cap: int) -> list[torch.Tensor]:
    """Per head: the forced entries plus the fewest top-scored ones holding share p of the mass (at most cap)."""
    chosen = []
    for score_N in score_HN:
        ranked_N = torch.where(forced_N, torch.inf, score_N)
        order_N = ranked_N.argsort(descending=True)
        mass_N = score_N[order_N]
        before_N = mass_N.cumsum(0) - mass_N
        keep = int(((before_N < p * score_N.sum()) & (mass_N > 0)).sum())
        num_forced = int(forced_N.sum())
        chosen.append(order_N[: max(min(keep, num_forced + cap), num_forced)].sort().values)
    return chosen


def pattern_from_probes(q_HSD, k_HSD, pos_Q, scale, settings: AttentionConfig) -> tuple[list, list]:
    """Verticals and slash offsets per head from the probe queries at pos_Q (the flex rule, one document)."""
    S = k_HSD.shape[1]
    prob_HQS = causal_probs(q_HSD[:, pos_Q], k_HSD, pos_Q, scale)
    vertical_HS = prob_HQS.sum(1)
    offset_QS = (pos_Q[:, None] - torch.arange(S, device=k_HSD.device)[None, :]).clamp(min=0)
    slash_HS = torch.zeros_like(vertical_HS).scatter_add_(
        1, offset_QS.reshape(1, -1).expand(prob_HQS.shape[0], -1), prob_HQS.reshape(prob_HQS.shape[0], -1)
    )
    sinks_S = torch.arange(S, device=k_HSD.device) < settings.num_sink
    window_S = torch.arange(S, device=k_HSD.device) < settings.local_window
    return (
        flex_select(vertical_HS, sinks_S, settings.p, settings.cap),
        flex_select(slash_HS, window_S, settings.p, settings.cap),
    )


def coverage(verticals: list, slashes: list, length: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (covered block offsets [H, nb] bool, vertical column mask [H, S] bool), as the kernels compute them:
    a slash d covers block offsets d // block and, off the block grid, the next one."""
    nb = -(-length // block)
    delta_HB = torch.zeros(len(slashes), nb + 1, dtype=torch.bool, device=device)
    column_HS = torch.zeros(len(verticals), length, dtype=torch.bool, device=device)
    for h, (vertical, slash) in enumerate(zip(verticals, slashes)):
        slash = slash.long()
        delta_HB[h, (slash // block).clamp(max=nb)] = True
        delta_HB[h, torch.where(slash % block > 0, slash // block + 1, slash // block).clamp(max=nb)] = True
        column_HS[h, vertical.long()] = True
    return delta_HB[:, :nb], column_HS


def kept_mass(prob_HQS, pos_Q, delta_HB, column_HS, block: int) -> torch.Tensor:
    """[H, Q]: each query's mass inside the covered blocks or on a vertical column."""
    S = prob_HQS.shape[-1]
    offset_QS = (pos_Q[:, None] // block - torch.arange(S, device=pos_Q.device)[None, :] // block).clamp(min=0)
    covered_HQS = delta_HB.gather(1, offset_QS.reshape(1, -1).expand(delta_HB.shape[0], -1)).view(prob_HQS.shape)
    return (prob_HQS * (covered_HQS | column_HS[:, None, :])).sum(-1)


def density(delta_HB: torch.Tensor, column_HS: torch.Tensor, block: int) -> float:
    """Share of the causal block triangle's work: covered blocks, plus vertical columns in blocks left out."""
    H, nb = delta_HB.shape
    S = column_HS.shape[1]
    columns_HK = F.pad(column_HS, (0, nb * block - S)).view(H, nb, block).sum(-1).float()
    qb_M, kb_K = torch.arange(nb, device=delta_HB.device)[:, None], torch.arange(nb, device=delta_HB.device)[None, :]
    causal_MK = kb_K <= qb_M
    covered_HMK = delta_HB[:, (qb_M - kb_K).clamp(min=0)] & causal_MK
    work = covered_HMK.sum((1, 2)) * block + ((~covered_HMK & causal_MK) * columns_HK[:, None, :]).sum((1, 2))
    return float((work / (causal_MK.sum() * block)).mean())


class Probe:
    """The attention function of the forward: dense SDPA, and at each layer the patterns' kept mass."""

    def __init__(self, settings: AttentionConfig):
        self.settings = settings
        self.layouts: dict[str, torch.Tensor | None] = {}
        self.eval_pos_Q = torch.empty(0)
        self.layers: list[dict] = []

    def start(self, length: int, num_windows: int, device) -> None:
        """Before a forward over `length` tokens: the probe placements compared, the evaluation windows."""
        R = self.settings.last_q
        self.layouts = {
            "shipped": None,  # mtrain's estimate_pattern
            f"end {R}": probe_positions(length, 1, R).to(device),
            f"4 x {R // 4}": probe_positions(length, 4, R // 4).to(device),
            f"16 x {R // 16}": probe_positions(length, 16, R // 16).to(device),
        }
        self.eval_pos_Q = probe_positions(length, num_windows, ROWS).to(device)
        self.layers = []

    def __call__(self, module, q_BHSD, k_BHkSD, v_BHkSD, attention_mask, scaling=None, **_):
        scale = scaling if scaling is not None else q_BHSD.shape[-1] ** -0.5
        G = q_BHSD.shape[1] // k_BHkSD.shape[1]  # K/V repeated: SDPA's GQA path is the O(S^2) math kernel on CUDA
        k_BHSD, v_BHSD = k_BHkSD.repeat_interleave(G, 1), v_BHkSD.repeat_interleave(G, 1)
        out = F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=scale)
        self.measure(q_BHSD, k_BHkSD, scale)
        return out.transpose(1, 2).contiguous(), None

    def measure(self, q_BHSD, k_BHkSD, scale) -> None:
        settings, block = self.settings, self.settings.block_size
        q_HSD = q_BHSD[0].float()
        k_HSD = k_BHkSD[0].float().repeat_interleave(q_HSD.shape[0] // k_BHkSD.shape[1], 0)
        S = q_HSD.shape[1]
        prob_HQS = causal_probs(q_HSD[:, self.eval_pos_Q], k_HSD, self.eval_pos_Q, scale)
        layer = {}
        for name, probe_pos_Q in self.layouts.items():
            if probe_pos_Q is None:
                doc_BS = torch.zeros(1, S, dtype=torch.long, device=q_BHSD.device)
                pattern = estimate_pattern(q_BHSD.float(), k_BHkSD.float(), doc_BS, scale, settings)
                verticals = [v[v < SENTINEL] for v in pattern.vertical_BHV[0]]
                slashes = [s[s < SENTINEL] for s in pattern.slash_BHL[0]]
            else:
                verticals, slashes = pattern_from_probes(q_HSD, k_HSD, probe_pos_Q, scale, settings)
            delta_HB, column_HS = coverage(verticals, slashes, S, block, q_BHSD.device)
            kept_HQ = kept_mass(prob_HQS, self.eval_pos_Q, delta_HB, column_HS, block)
            layer[name] = {
                "recall_by_window": kept_HQ.view(kept_HQ.shape[0], -1, ROWS).mean((0, 2)).tolist(),
                "density": density(delta_HB, column_HS, block),
                "verticals": sum(len(v) for v in verticals) / len(verticals),
                "slashes": sum(len(s) for s in slashes) / len(slashes),
            }
        self.layers.append(layer)
        summary = {
            k: f"{v['density']:.3f}/{sum(v['recall_by_window']) / len(v['recall_by_window']):.3f}"
            for k, v in layer.items()
        }
        print(json.dumps({"length": S, "layer": len(self.layers) - 1, **summary}), flush=True)


ROWS = 16  # queries per evaluation window


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=f"python -m bench.extension.{NAME}",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("model", type=Path)
    parser.add_argument("--text", required=True, help="a glob of text files (** allowed), joined in sorted order")
    parser.add_argument("--lengths", default="64k")
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows along the document")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.masking_utils import AttentionMaskInterface

    model_dir = args.model
    if (args.model / handoff.PARTS_MANIFEST).is_file():
        model_dir = args.out / "model"
        if not (model_dir / "config.json").is_file():
            handoff.join_parts(args.model, model_dir)
    lengths = parse_lengths(args.lengths)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    settings = AttentionConfig(mode="sparse")
    probe = Probe(settings)
    AttentionInterface.register(NAME, probe)
    AttentionMaskInterface.register(NAME, lambda *a, **k: None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=NAME)
    model = model.eval().to(device)
    files, ids = sorted(glob.glob(args.text, recursive=True)), []
    for path in files:
        ids += tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) >= max(lengths):
            break
    if len(ids) < max(lengths):
        raise SystemExit(f"--text: {len(files)} files hold {len(ids)} tokens, fewer than {max(lengths)}")
    rows = []
    for length in lengths:
        probe.start(length, args.windows, device)
        started = time.perf_counter()
        with torch.no_grad():
            model.model(input_ids=torch.tensor(ids[:length], device=device)[None], use_cache=False)
        rows.append(
            {
                "length": length,
                "window_ends": [length * (w + 1) // args.windows for w in range(args.windows)],
                "seconds": round(time.perf_counter() - started, 1),
                "layers": probe.layers,
            }
        )
    result = {
        "model": str(args.model),
        "text": args.text,
        "tokens_sha256": hashlib.sha256(str(ids[: max(lengths)]).encode()).hexdigest()[:16],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "settings": {"p": settings.p, "cap": settings.cap, "last_q": settings.last_q, "block": settings.block_size},
        "rows_per_window": ROWS,
        "torch": torch.__version__,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "lengths": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{NAME}.md").write_text(markdown(result))
    print(markdown(result))


def markdown(result: dict) -> str:
    lines = [
        "Kept attention mass (mean over heads) of queries along one document, by probe placement: windows "
        f"of {result['rows_per_window']} queries at 1/W ... W/W of it; out of sample (all windows but the last) / the "
        "last window (in sample for `shipped` and `end`) · block density",
    ]
    for row in result["lengths"]:
        names = list(row["layers"][0])
        lines += ["", f"{row['length']:,} tokens", "", "| layer | " + " | ".join(names) + " |"]
        lines.append("|---|" + "---|" * len(names))
        for i, layer in enumerate(row["layers"]):
            cells = []
            for name in names:
                by_window = layer[name]["recall_by_window"]
                out_of_sample = sum(by_window[:-1]) / (len(by_window) - 1)
                cells.append(f"{out_of_sample:.3f} / {by_window[-1]:.3f} · {layer[name]['density']:.3f}")
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
