"""Sparse training's quality frontier: perplexity gap against tokens/s, by model and sparse setting.

    python -m bench.quality_frontier plan [MODEL ...] [--seed N] [--variants a,b] [--retrieval VARIANT]
    PYTHONPATH=src python3 -m bench.quality_frontier call MODEL CALL [--seed N] [--variants a,b] [--variant V]  # device
    python -m bench.quality_frontier take FILES_AT        # after each call: what it returned, filed under .exp/
    python -m bench.quality_frontier report [DIR ...] [--out STEM]

`plan` prints every device call (its command, what to carry, its time at most); `call` runs one on the device;
`take` files what it returned; `report` makes the frontier (STEM.json, .md, .png) from the jobs' reports and the
rows of STEM.json they do not replace.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from bench.extension.__main__ import Parser, module_parser
from bench.quality_frontier.schedule import CALL_S, RESULTS, Call, plan, retrieval_plan
from bench.quality_frontier.study import MODELS, VARIANTS


def variant_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if unknown := [name for name in names if name not in VARIANTS]:
        raise argparse.ArgumentTypeError(f"{','.join(unknown)}: unknown; choose from {','.join(VARIANTS)}")
    return names


def parse_args() -> argparse.Namespace:
    parser = module_parser("bench.quality_frontier", __doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    seeded = argparse.ArgumentParser(add_help=False)
    seeded.add_argument("--seed", type=int, default=0, help="training seed of the dense and sparse runs (base: 0)")
    seeded.add_argument("--variants", type=variant_list, default=None, help=f"of {','.join(VARIANTS)} (all)")
    show = commands.add_parser("plan", parents=[seeded], help="print the device calls")
    show.add_argument("models", nargs="*", default=list(MODELS), metavar="MODEL", help=f"of {', '.join(MODELS)} (all)")
    show.add_argument("--retrieval", choices=VARIANTS, default=None, help="the NIAH calls of this chosen variant")
    call = commands.add_parser("call", parents=[seeded], help="run one device call (on the device)")
    call.add_argument("model", choices=MODELS)
    call.add_argument("call", help="1, 2, ... (training) or r1, r2, r3 (retrieval, with --variant)")
    call.add_argument("--variant", choices=VARIANTS, default=None, help="retrieval calls: the chosen variant")
    call.add_argument("--out", default=os.environ.get("OUT"), help="what the call returns (default: $OUT)")
    take = commands.add_parser("take", help="file what a call returned")
    take.add_argument("returned", type=Path, help="the folder holding the call's call.json (the device's files_at)")
    report = commands.add_parser("report", help="the frontier from the jobs' reports")
    report.add_argument(
        "dirs", nargs="*", type=Path, default=[Path(RESULTS)], help=f"report JSONs' folders ({RESULTS})"
    )
    report.add_argument(
        "--out", type=Path, default=Path("bench/quality_frontier/results/quality_frontier"), help="output stem"
    )
    args = parser.parse_args()
    if args.command == "plan" and (unknown := [name for name in args.models if name not in MODELS]):
        parser.error(f"plan {' '.join(unknown)}: unknown model; choose from {', '.join(MODELS)}")
    if args.command == "call":
        if args.out is None:
            parser.error("call needs --out DIR or $OUT: where the call's files go")
        retrieval = args.call.startswith("r")
        if retrieval != (args.variant is not None):
            parser.error(f"call {args.call}: --variant goes with the retrieval calls r1, r2, r3 and only with them")
    return args


def calls_of(model: str, args: argparse.Namespace, retrieval: str | None) -> list[Call]:
    if retrieval is not None:
        return retrieval_plan(MODELS[model], VARIANTS[retrieval])
    return plan(MODELS[model], args.seed, args.variants)


def print_plan(args: argparse.Namespace) -> None:
    for name in args.models:
        model = MODELS[name]
        print(f"{name}: {model.about}")
        calls = calls_of(name, args, args.retrieval)
        for call in calls:
            print(
                f"  call {call.name}, at most {minutes(call)} min (budgets {call.budget_s} s of {CALL_S}), carry "
                f"{list(call.carry)}:\n    {call.command}"
            )
            for job in call.jobs:
                print(f"      {job.name}: bash bench/extension_experiment.sh {shlex.join(job.script_args)}")
        print(f"  {len(calls)} calls, at most {sum(float(minutes(call)) for call in calls):.1f} min of device time")
        print("  after each call: python -m bench.quality_frontier take <its files_at>")


def minutes(call: Call) -> str:
    """A call's device time at most: its jobs' budgets and ~10 s of pip and copies."""
    return f"{(call.budget_s + 10) / 60:.1f}"


def main() -> int:
    args = parse_args()
    if args.command == "plan":
        print_plan(args)
        return 0
    if args.command == "take":
        from bench.quality_frontier.device import StaleCall, take

        try:
            print("\n".join(take(args.returned)))
        except StaleCall as exc:
            print(f"take: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "report":
        from bench.quality_frontier.frontier import collect, kept_rows
        from bench.quality_frontier.report import write

        paths = [p for folder in args.dirs for p in sorted(folder.glob("*.json"))]
        before = args.out.with_suffix(".json")
        kept = kept_rows(json.loads(before.read_text())) if before.exists() else []
        command = shlex.join(["python", "-m", "bench.quality_frontier", *sys.argv[1:]])
        result = {"command": command, "frontier": collect(paths, kept)}
        print(f"{len(paths)} reports, {len(kept)} rows of {before} before")
        print("\n".join(str(path) for path in write(result, args.out)))
        return 0
    from bench.quality_frontier.device import run_call

    calls = {call.name: call for call in calls_of(args.model, args, args.variant)}
    if args.call not in calls:
        print(f"bench.quality_frontier: {args.model} has calls {', '.join(calls)}, not {args.call}", file=sys.stderr)
        return 2
    return run_call(calls[args.call], Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
