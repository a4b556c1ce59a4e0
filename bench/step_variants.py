"""Where a training step of a study model goes under several attention settings: `mtrain profile step` of one
trained model, the same batches each time, a column a setting.

    PYTHONPATH=src python3 -m bench.step_variants --out DIR NAME:KEY=VALUE,KEY=VALUE ...   # on the device
    python -m bench.step_variants --table DIR --out STEM                                   # the table again

The model is a quality-frontier job's export (`--parts`, default strong128k's dense-extended model, and the logs
tarball of its job, `--logs`): the job's run config (its data, length and settings; the model's YaRN is in its
config.json), the corpus rebuilt from the job's manifest at the paths the config names (checked against the one
the model was trained on). Each setting adds its `--set`s to that config, e.g.
`p95lq512:attention.mode=sparse,attention.p=0.95,attention.last_q=512`; a trained model's attention is what
sparse settings are about (random weights attend almost uniformly). DIR gets each setting's profile (NAME.json,
.md, .log; with `--trace` its profiler trace in NAME-trace/) and step_variants.json / .md: step time, phases, GPU
idle, the largest kernels, density and recall, a column a setting. `--src` profiles another source tree (an A/B of
two commits in one device call: `git archive <commit> src | tar -x -C <dir>`). The device image lacks `datasets`:
carry .whl/ (bench/run_train_gpu.sh says how to fetch it), whose wheels the profiles get, installed into /tmp/site.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

from bench.extension.handoff import check_corpus, corpus_fingerprint, join_parts

TOP_KERNELS = 5  # attention and plan kernels shown a setting


def variant(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"{text}: NAME:KEY=VALUE,... with a NAME of letters, digits, - and _")
    pairs = [s for s in sets.split(",") if s]
    if bad := [s for s in pairs if "=" not in s]:
        raise argparse.ArgumentTypeError(f"{text}: {', '.join(bad)} is not KEY=VALUE")
    return name, pairs


def run_config(logs: Path) -> tuple[dict, dict]:
    """(the dense run's config, the corpus manifest's options) from a job's logs tarball."""
    with tarfile.open(logs) as tar:
        names = tar.getnames()
        config = next(n for n in names if n.endswith("config.yaml") and "/runs/dense/" in n)
        manifest = next(n for n in names if n.endswith("corpus/manifest.json"))
        return yaml.safe_load(tar.extractfile(config)), json.load(tar.extractfile(manifest))["options"]


def corpus_command(corpus: Path, options: dict) -> list[str]:
    cmd = [sys.executable, "-m", "data.make_code_corpus", "--out", str(corpus)]
    for key, value in options.items():
        for item in value if isinstance(value, list) else [value]:
            cmd += [f"--{key.replace('_', '-')}", str(item)]
    return cmd


def child_path(src: Path) -> str:
    """PYTHONPATH of the profiles: the source tree, the carried wheels where the image lacks `datasets`, ours."""
    paths = [str(src)]
    wheels = sorted(Path(".whl").glob("*.whl"))
    if importlib.util.find_spec("datasets") is None and wheels:
        site = "/tmp/site"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
        subprocess.run([*pip, "--target", site, *map(str, wheels)], check=True)
        paths.append(site)
    return os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])


def summary(profile: dict, name: str, sets: list[str]) -> dict:
    mean = profile["mean"]
    top = profile["top_kernels"]
    return {
        "name": name,
        "sets": sets,
        "device": profile["device"],
        "torch": profile["torch"],
        "step_ms": mean["step_ms"],
        "phases_ms": {k: mean[k] for k in ("attention", "plan", "matmul", "communication", "optimizer", "other")},
        "idle_ms": mean["idle_ms"],
        "idle_plan_ms": mean.get("idle_before", {}).get("plan", 0.0),
        "kernels_ms": {phase: top.get(phase, [])[:TOP_KERNELS] for phase in ("attention", "plan")},
        "density": profile.get("sparse_density"),
        "recall": profile.get("sparse_recall"),
    }


def table(rows: list[dict]) -> str:
    head = "| | " + " | ".join(f"`{r['name']}`" for r in rows) + " |"
    lines = [head, "|---|" + "---:|" * len(rows)]

    def line(label: str, cells: list[str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    line("step (wall), ms", [f"{r['step_ms']:.1f}" for r in rows])
    dense = next((r["step_ms"] for r in rows if r["density"] is None), None)
    if dense is not None:
        line("dense step / this step", [f"{dense / r['step_ms']:.2f}×" for r in rows])
    for phase in ("attention", "plan", "matmul", "other"):
        line(f"{phase}, ms", [f"{r['phases_ms'][phase]:.1f}" for r in rows])
    line("GPU idle (of it waiting for the plan), ms", [f"{r['idle_ms']:.1f} ({r['idle_plan_ms']:.1f})" for r in rows])
    by_row = [dict(r["kernels_ms"]["attention"] + r["kernels_ms"]["plan"]) for r in rows]
    ours = {k for kernels in by_row for k in kernels if k.startswith("_")}  # torch's and cuDNN's names run long
    for kernel in sorted(ours, key=lambda k: -max(kernels.get(k, 0.0) for kernels in by_row)):
        line(f"`{kernel}`, ms", [f"{kernels[kernel]:.2f}" if kernel in kernels else "–" for kernels in by_row])
    line("density / recall", [f"{r['density']:.3f} / {r['recall']:.3f}" if r["density"] else "–" for r in rows])
    return "\n".join(lines) + "\n"


def write(rows: list[dict], stem: Path, header: dict) -> None:
    stem.with_suffix(".json").write_text(json.dumps({**header, "variants": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(table(rows))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_variants", description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", type=variant, metavar="NAME:KEY=VALUE,...")
    parser.add_argument("--out", type=Path, required=True, help="the profiles and the table (--table: its stem)")
    parser.add_argument("--parts", type=Path, default=Path(".exp/strong128k/dense_parts"), help="the model's parts")
    parser.add_argument("--logs", type=Path, default=Path(".exp/strong128k/dense_logs.tar.gz"), help="its job's logs")
    parser.add_argument("--src", type=Path, default=Path("src"), help="the mtrain source tree to profile")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=200, help="seconds a setting")
    parser.add_argument("--trace", action="store_true", help="keep each setting's profiler trace in DIR/NAME-trace")
    parser.add_argument("--table", type=Path, default=None, help="only the table of DIR's profiles, in NAME order")
    args = parser.parse_args()
    if args.table is not None:
        names = [name for name, _ in args.variants] or sorted(p.stem for p in args.table.glob("*.json"))
        rows = [summary(json.loads((args.table / f"{n}.json").read_text()), n, []) for n in names]
        write(rows, args.out, {})
        return 0
    config, options = run_config(args.logs)
    corpus = Path(config["data"]["sources"][0]).parent
    model = corpus.parent / "models" / "profiled"
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if not (corpus / "manifest.json").exists():
        env = dict(os.environ, TOKENIZERS_PARALLELISM="true")
        subprocess.run(corpus_command(corpus, options), check=True, env=env, stdout=subprocess.DEVNULL)
    # the data the model was trained on, or the profiles would read other batches
    check_corpus(join_parts(args.parts, model)["corpus"], corpus_fingerprint(corpus))
    recipe = args.out / "config.yaml"
    recipe.write_text(yaml.safe_dump(config, sort_keys=False))
    print(f"step_variants: corpus and model ready in {time.time() - started:.0f} s", flush=True)
    env = dict(os.environ, PYTHONPATH=child_path(args.src))
    rows = []
    for name, sets in args.variants:
        cmd = [sys.executable, "-m", "mtrain_cli", "profile", "step", "--recipe", str(recipe), "--model", str(model)]
        cmd += ["--set", "context.method=none", *(a for s in sets for a in ("--set", s))]
        cmd += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(args.out / f"{name}.json")]
        if args.trace:
            cmd += ["--trace-dir", str(args.out / f"{name}-trace")]
        with open(args.out / f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.timeout).returncode
        if rc != 0:
            print(f"step_variants: {name} failed (exit {rc}): {args.out / f'{name}.log'}", flush=True)
            continue
        rows.append(summary(json.loads((args.out / f"{name}.json").read_text()), name, sets))
        print(f"step_variants: {name}: {rows[-1]['step_ms']:.1f} ms a step", flush=True)
    write(rows, args.out / "step_variants", {"parts": str(args.parts), "src": str(args.src)})
    print(table(rows))
    return 0 if len(rows) == len(args.variants) else 1


if __name__ == "__main__":
    sys.exit(main())
