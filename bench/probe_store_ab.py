"""Probe scoring and eager pattern estimation at 128K (planted inputs), blocks 64 and 128: an A/B of two commits.

    PYTHONPATH=src python3 bench/probe_store_ab.py new
    PYTHONPATH=old_src/src python3 bench/probe_store_ab.py old    # old_src: `git archive <commit> src | tar -x -C old_src`

Prints, per block, `score_probes` (the two probe kernels) and `estimate_from_probes` timed eagerly (CUDA events,
median of 10; host launch gaps count, unlike the graphed plan of a training step) with its top kernels.
"""

import sys

import torch

from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.pattern import estimate_from_probes, probe_queries, probe_rows
from mtrain_cli.attention.sparse.probe import score_probes
from mtrain_cli.profile.kernels import cuda_time_ms, kernel_table
from mtrain_cli.profile.synthetic import planted_qkv


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "this"
    device, seq_len, scale = torch.device("cuda"), 128 * 1024, 128 ** -0.5
    q, k, _ = planted_qkv(1, 16, 2, seq_len, 128, torch.bfloat16, device)
    doc = torch.zeros(1, seq_len, dtype=torch.int32, device=device)
    for block in (64, 128):
        settings = AttentionConfig(dense_below=0, block_size=block)
        rows = probe_rows(doc, settings)
        probe = probe_queries(q, rows)
        score_ms = cuda_time_ms(lambda: score_probes(probe, k, rows.pos_BQ, rows.lo_BQ, rows.keys, scale), 10)
        estimate = lambda: estimate_from_probes(probe, k, rows, scale, settings)  # noqa: E731
        top = [(r["name"][:28], round(r["cuda_ms"], 3)) for r in kernel_table(estimate, 5)[:5]]
        print(f"{label} block {block}: score_probes {score_ms:.3f} ms, estimate {cuda_time_ms(estimate, 10):.3f} ms, "
              f"top kernels {top}", flush=True)


if __name__ == "__main__":
    main()
