"""End-to-end check of every `mtrain` user flow through the real CLI, in one device call.

Each flow is a subprocess `PYTHON -m mtrain_cli ...` (never library internals) with its own timeout, inside
one time budget for the whole job. After every flow the results are rewritten, so a job that runs out of
time (or is killed) still leaves them:

    OUT/gpu_e2e_<gpu>.json         every flow: command, rc, pass/fail/skipped and why, wall time, and what
                                   its outputs say (tokens/s, peak memory, step time, sparse density/recall,
                                   eval scores), plus the machine, versions and date
    OUT/gpu_e2e_<gpu>.md           one row per flow
    OUT/gpu_e2e_<gpu>_logs.tar.gz  each flow's stdout/stderr, and the small files its run wrote (config.yaml,
                                   summary.json, metrics.jsonl, results.json, profile JSON/markdown, ...)

<gpu> is h100 / h200 (from nvidia-smi's name) or cpu. Flows, in order (a flow whose prerequisite did not pass
is skipped with the reason; one the budget cannot fit is skipped as such):

    pretrain                  base model at its native context (context.method=none), one document per row
    resume-interrupt          extend --model <pretrain export>, sparse, packed rows; Ctrl-C (SIGINT) after
                              the first logged step: expects exit 130, a checkpoint and the --resume command
    resume-continue           extend --resume RUN_DIR to the end: step numbers continue, export written
    export-check              the export loads with plain transformers (AutoModelForCausalLM) and runs a forward
    eval-dense, eval-sparse   eval RUN_DIR --suite ruler,niah,pg19,infinitebench with local data made here
    extend-model-{dense,sparse}-{16k,64k}   extend --model <pretrain export> with YaRN
    extend-fresh-{dense,sparse}-{16k,64k}   extend of a fresh model
    chat-sft-sparse           extend --model <pretrain export> on conversations (chat template, loss on answers)
    lora-sparse, lora-export-eval           LoRA at the long length, sparse; mtrain eval of its merged export
    lora-adapter-eval         LoRA with the adapter exported alone, then mtrain eval of it on its base
    profile-step-{dense,sparse}             profile step
    profile-kernels                          profile kernels (CUDA only: on CPU the CLI's refusal is recorded
                                             as a skip)

`--scale cpu` runs the same flows at tiny sizes (the tiny recipe's model shape, 512/1024 tokens) to test
this script on a CPU machine. Usage (repository root):

    OUT=/tmp/out bash bench/gpu_e2e.sh                                  # on the GPU machine
    python3 -m bench.gpu_e2e --out /tmp/out --scale cpu --python .venv/bin/python
    python3 -m bench.gpu_e2e --out /tmp/out --flows eval-sparse,profile-kernels   # prerequisites are added
    python3 -m bench.gpu_e2e --out /tmp/out --list                      # the flows, with their prerequisites
    python3 -m bench.gpu_e2e --out /tmp/out --merge part0/gpu_e2e_h100.json part1/gpu_e2e_h100.json
    OUT=/tmp/out bash bench/gpu_e2e_parallel.sh     # four parts side by side on a machine of several GPUs

Adding a flow: bench/gpu_e2e/flows/__init__.py says how.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.gpu_e2e.flows import all_flows, select
from bench.gpu_e2e.report import merge
from bench.gpu_e2e.runner import run_flows
from bench.gpu_e2e.scales import CPU, GPU


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_e2e",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--out", required=True, help="results directory ($OUT)")
    parser.add_argument("--scale", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--python", default="python3", help="interpreter that runs `-m mtrain_cli`")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole job, counted from $E2E_START if set (gpu 540, cpu 1800)",
    )
    parser.add_argument("--flows", default=None, help="comma-separated flow names or globs (prerequisites added)")
    parser.add_argument("--work", default=None, help="scratch directory (default /tmp/gpu_e2e_<scale>; wiped)")
    parser.add_argument("--list", action="store_true", help="print the flows and exit")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        help="instead of running: merge these results JSONs (parts run in separate device calls; a "
        "flow's latest record wins) into --out",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="with --merge: the parts ran at the same time, one a GPU (bench/gpu_e2e_parallel.sh)",
    )
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, Path(args.out), side_by_side=args.side_by_side)
        return
    scale = GPU if args.scale == "gpu" else CPU
    chosen = select(all_flows(scale), args.flows)
    if args.list:
        for f in chosen:
            print(f"{f.name:24s} {f.description}" + (f"  [after {', '.join(f.deps)}]" if f.deps else ""))
        return
    run_flows(args, scale, chosen)


if __name__ == "__main__":
    main()
