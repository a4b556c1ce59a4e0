"""Training step time of `mtrain extend` variants, back to back on one machine, paired step by step.

Speed differences of a few percent show only between runs on one machine, one after another: 16 probe windows
took a median 1.14x the step of 1 window in two runs on two 4 x H200 machines, and 1.009x back to back on one
2 x H200 machine (bench/results/train_2gpu_128k_h200.md). Each variant trains the
same model on the same data with the same seed for --steps steps, so step i of every variant reads the same
rows. The table gives each variant's median step and total over the compared steps (from --skip on, leaving out
every step where any variant built a kernel), and its paired ratio to the first variant: the median over those
steps of its step time over the first's. The first variant is run once more at the end: its ratio to itself is
the machine's noise.

    python3 -m bench.step_pairs --out $OUT --model-parts .exp/h200x4_256k/dense_parts --corpus-mb 24 \
        --nproc 2 --steps 40 --set data.seq_len=131072 --set context.method=none --set attention.mode=sparse \
        --variant main: --variant 'window1:attention.probe_windows=1' --variant 'b001597@.exp/b001597/src:' \
        --variant 'dense:attention.mode=dense'

A variant is NAME[@SRC]:KEY=VALUE;KEY=VALUE... SRC is another source tree (`git archive REV src | tar -x -C
.exp/REV`; on the device, carry it), put first on PYTHONPATH. Its KEY=VALUE items come after the shared --set
ones. --corpus-mb builds the code corpus of the extension experiment (data/make_code_corpus.py, MB of text; its
models' own tokenizer is in their export), --data uses files as they are. Without --model or --model-parts every
variant trains a fresh model of the recipe's shape (with --corpus-mb, the corpus's tokenizer): random weights
make a denser pattern than a trained model's, but the host's and the ring's costs are the same. Writes
$OUT/step_pairs.json and .md after every variant and $OUT/step_pairs_logs.tar.gz (the runs' logs) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

from bench.source_identity import source_identity, src_sha256
from bench.train_multi_gpu import device_info, latest_run

REPO = Path(__file__).resolve().parents[1]
CORPUS_ARGS = ("--seed", "0", "--base-context", "4096", "--retrieval-share", "0.4", "--max-heldout-mb", "1")


@dataclass(frozen=True)
class Variant:
    name: str
    src: Path | None
    sets: tuple[str, ...]


def parse_variant(spec: str) -> Variant:
    """NAME[@SRC]:KEY=VALUE;... -> Variant; ValueError naming a malformed one."""
    head, sep, tail = spec.partition(":")
    name, _, src = head.partition("@")
    sets = tuple(item.strip() for item in tail.split(";") if item.strip())
    if not sep or not name or not all("=" in item for item in sets):
        raise ValueError(f"--variant {spec!r}: expected NAME[@SRC]:KEY=VALUE;KEY=VALUE (e.g. 'window1:a.b=1')")
    if src and not (Path(src) / "mtrain_cli").is_dir():
        raise ValueError(f"--variant {spec!r}: {src} holds no mtrain_cli package; give the tree's src folder")
    return Variant(name, Path(src).resolve() if src else None, sets)


def step_records(run_dir: Path | None) -> dict[int, dict]:
    metrics = run_dir / "metrics.jsonl" if run_dir else None
    if metrics is None or not metrics.exists():
        return {}
    records = (json.loads(line) for line in metrics.read_text().splitlines())
    return {r["step"]: r for r in records if "step_s" in r}


def compare(runs: dict[str, dict[int, dict]], skip: int) -> dict:
    """Medians, totals and paired ratios (to the first run) over the steps every run has, from `skip` on,
    where no run built a kernel."""
    names = [name for name, steps in runs.items() if steps]
    if not names:
        return {"steps": [], "variants": {}}
    common = set.intersection(*(set(runs[name]) for name in names))
    steps = sorted(s for s in common if s >= skip and not any(runs[n][s].get("kernels_built") for n in names))
    first = names[0]
    table = {}
    for name in names:
        times = [runs[name][s]["step_s"] for s in steps]
        densities = [runs[name][s]["sparse_density"] for s in steps if runs[name][s].get("sparse_density") is not None]
        table[name] = {
            "median_step_s": statistics.median(times) if times else None,
            "total_s": sum(times),
            "paired_ratio": statistics.median(t / runs[first][s]["step_s"] for s, t in zip(steps, times))
            if times
            else None,
            "density": statistics.mean(densities) if densities else None,
            "peak_mem_gib": max((r.get("peak_mem_gib") or 0 for r in runs[name].values()), default=None),
        }
    return {"steps": steps, "variants": table}


def markdown(result: dict) -> str:
    def f(value, fmt):
        return "–" if value is None else format(value, fmt)

    source = result["source"]
    device = f"{result['num_gpus']} x {result['device']}" if result["num_gpus"] else result["device"]
    lines = [
        f"{device} · torch {result['torch']} · triton {result['triton']} · {result['date']} · source "
        f"{(source['git_commit'] or '–')[:12]} (src sha256 {source['src_sha256']}, the one to trust on a device: "
        f"its .git may be older; dirty files {len(source.get('git_dirty') or [])})",
        "",
        f"`{result['command']}`",
        "",
        f"Compared steps: {len(result['comparison']['steps'])} of {result['num_steps']} (from step {result['skip']}, "
        "none where a run built kernels). Paired: the median over those steps of a run's step time over the "
        "first run's.",
        "",
        "| variant | source | settings | rc | median step s | total s | paired | density | peak GiB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        c = result["comparison"]["variants"].get(row["name"], {})
        source = f"{row['src']} (src sha256 {row['src_sha256']})" if row["src"] else "this tree"
        lines.append(
            f"| {row['name']} | {source} | {'; '.join(row['sets']) or '–'} | {row.get('rc', '–')} "
            f"| {f(c.get('median_step_s'), '.3f')} | {f(c.get('total_s'), '.2f')} | {f(c.get('paired_ratio'), '.3f')} "
            f"| {f(c.get('density'), '.3f')} | {f(c.get('peak_mem_gib'), '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def run_variant(
    variant: Variant, args: argparse.Namespace, model: Path | None, data: list[Path], short_data: list[Path], log: Path
) -> dict:
    run_root = args.work / "runs" / variant.name
    cmd = [sys.executable, "-m", "mtrain_cli", "extend"]
    cmd += ["--nproc", str(args.nproc)] if args.nproc > 1 else []
    cmd += ["--recipe", args.recipe, *(["--model", str(model)] if model else []), "--output-dir", str(run_root)]
    cmd += [arg for path in data for arg in ("--data", str(path))]
    # a fresh model (no --model) reads the built corpus's tokenizer, or the recipe's
    tokenizer = model or (data[0].parent / "tokenizer" if args.corpus_mb is not None else None)
    sets = [
        *([f"model.tokenizer={tokenizer}"] if tokenizer else []),
        f"train.num_steps={args.steps}",
        f"train.eval_every={args.steps + 1}",
        "data.num_val_rows=0",
        "checkpoint.export=false",
        "logging.every=1",
        f"run.name={variant.name}",
        *([f"parallel.cp={args.nproc}"] if args.nproc > 1 else []),
        *([f"data.short_sources=[{', '.join(map(str, short_data))}]"] if short_data else []),
        *args.set,
        *variant.sets,
    ]
    cmd += [arg for item in sets for arg in ("--set", item)]
    path = os.pathsep.join(p for p in (str(variant.src or ""), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = f"killed at --timeout {args.timeout:g} s"
    run_dir = latest_run(run_root)
    return {
        "name": variant.name,
        "src": str(variant.src) if variant.src else None,
        "src_sha256": src_sha256(variant.src.parent) if variant.src else None,
        "sets": list(variant.sets),
        "rc": rc,
        "wall_s": round(time.monotonic() - start, 1),
        "run_dir": str(run_dir) if run_dir else None,
        "command": " ".join(cmd[1:]),
    }


def prepare(args: argparse.Namespace) -> tuple[Path | None, list[Path], list[Path]]:
    """The model directory (joined from --model-parts if given; None: a fresh one), the training files and the
    short-context ones (built by --corpus-mb, or --data and --short-data). A later call with the same --work
    reuses what it made only for the same parts (their tar's sha256) and corpus size."""
    model = args.model
    if args.model_parts is not None:
        from bench.extension import handoff

        model = args.work / f"model-{handoff.read_parts_manifest(args.model_parts)['tar_sha256'][:16]}"
        if not (model / "config.json").exists():
            handoff.join_parts(args.model_parts, model)
    if args.corpus_mb is None:
        return model, args.data, args.short_data
    corpus = args.work / f"corpus-{args.corpus_mb:g}mb-{args.long_context}"
    if not (corpus / "manifest.json").exists():
        cmd = [sys.executable, "-m", "data.make_code_corpus", "--out", str(corpus), *CORPUS_ARGS]
        cmd += ["--max-mb", f"{args.corpus_mb:g}", "--long-context", str(args.long_context)]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return model, [corpus / "train_code.jsonl", corpus / "retrieval_long.jsonl"], [corpus / "retrieval_base.jsonl"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variant", action="append", required=True, help="NAME[@SRC]:KEY=VALUE;... (repeatable)")
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory (neither: a fresh model)")
    parser.add_argument("--model-parts", type=Path, help="an extension-experiment job's parts folder, joined")
    parser.add_argument("--data", type=Path, action="append", default=[], help="training file (repeatable)")
    parser.add_argument("--short-data", type=Path, action="append", default=[], help="data.short_sources file")
    parser.add_argument("--corpus-mb", type=float, help="build the code corpus (MB of text) instead of --data")
    parser.add_argument("--long-context", type=int, default=131072, help="the corpus's long documents, tokens")
    parser.add_argument("--recipe", default="recipes/code-extend.yaml", help="a file (SRC trees ship no recipes)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every variant (repeatable)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs); above 1, parallel.cp is set to it")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--skip", type=int, default=6, help="first step compared")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds a run may take")
    parser.add_argument("--work", type=Path, default=Path("/tmp/step_pairs"))
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(spec) for spec in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    if len({v.name for v in variants}) < len(variants):
        parser.error("--variant: every variant needs a name of its own")
    if (args.model is not None and args.model_parts is not None) or (args.corpus_mb is None) == (not args.data):
        parser.error("give at most one of --model and --model-parts, and one of --data and --corpus-mb")
    variants.append(Variant(f"{variants[0].name}-again", variants[0].src, variants[0].sets))
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    model, data, short_data = prepare(args)
    result = {
        **device_info(),
        "date": date.today().isoformat(),
        "source": source_identity(),
        "command": " ".join(["python3 -m bench.step_pairs", *(argv if argv is not None else sys.argv[1:])]),
        "num_steps": args.steps,
        "skip": args.skip,
        "rows": [],
    }
    logs = []
    for variant in variants:
        logs.append(args.work / f"{variant.name}.log")
        row = run_variant(variant, args, model, data, short_data, logs[-1])
        print(f"{variant.name}: rc {row['rc']}, {row['wall_s']} s", flush=True)
        result["rows"].append(row)
        runs = {r["name"]: step_records(Path(r["run_dir"]) if r["run_dir"] else None) for r in result["rows"]}
        result["comparison"] = compare(runs, args.skip)
        (args.out / "step_pairs.json").write_text(json.dumps(result, indent=1))
        (args.out / "step_pairs.md").write_text(markdown(result))
    with tarfile.open(args.out / "step_pairs_logs.tar.gz", "w:gz") as tar:
        for log in logs:
            tar.add(log, arcname=log.name)
    print(markdown(result))


if __name__ == "__main__":
    main()
