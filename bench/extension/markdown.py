"""The markdown of the extension experiment's report (report.py gathers what it shows): the
header (versions, source, jobs, corpus), training, the issue's figures, the quality tables and what was skipped.
Not run on its own.
"""

from __future__ import annotations

from typing import Any

from mtrain_cli.eval import SECOND_HALF  # the pg19 row of the tokens at positions L/2..L-1

# sparse-prefill: the sparse-extended model evaluated with sparse prefill (the others: dense attention)
MODELS = ("base", "base-yarn", "dense", "sparse", "sparse-prefill")
# What the report's JSON leaves to the logs tarball, which stays out of git
LOGS_NOT_KEPT = "every step of every run, every prompt's answer and each subprocess's output"
DENSE_HERE = "dense-here"  # a sparse job's dense run trained again on its machine (--dense-here): timed only
TRAIN_RUNS = ("base", "dense", DENSE_HERE, "sparse")
HEADLINE_METRICS = (
    "perplexity",
    SECOND_HALF,
    "niah",
    "ruler niah tasks",
    "infinitebench/passkey",
    "infinitebench/number_string",
    "infinitebench/kv_retrieval",
    "infinitebench/math_find",
)
# Steps left out of the speed figures: the first compiles, and so may the next few (a 64K extension's second step
# can take ten times a later one)
WARMUP_STEPS = 5
# A later step over this many times its run's median compiled too (a sparse run's first row without a long document
# compiles FlexAttention: 5.1 s at 64K on an H100 in a probe; 0.3-0.5 s in the experiment, whose validation compiles
# its forward first): left out of the speed over all steps, in both runs
COMPILE_FACTOR = 10


def compiled_note(speed_steps: dict[str, Any]) -> str:
    """The later steps left out of the speed over all steps because a run compiled in them."""
    compiled = speed_steps.get("compiled") or {}
    if not compiled:
        return ""
    each = "; ".join(
        f"step {step}: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in runs.items())
        for step, runs in compiled.items()
    )
    return f", and {len(compiled)} later step{'s' * (len(compiled) > 1)} in both runs where one compiled ({each})"


def machines_note(trained_on: dict[str, str], trained_in: dict[str, str]) -> str:
    """Where the dense and sparse runs trained: one job's machine, two jobs on machines of one kind, or two jobs'
    machines (a warning if they differ)."""
    dense, sparse = trained_on.get("dense"), trained_on.get("sparse")
    if dense is None or (dense == sparse and trained_in.get("dense") == trained_in.get("sparse")):
        return "the runs one after the other, alone on the device"
    if sparse is None:
        return f"dense on {dense}"
    if dense == sparse:
        return f"each run in a job of its own on {dense}, alone on the device (the jobs' dates above)"
    return f"**dense on {dense}, sparse on {sparse}: the ratio compares the machines too**"


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def label(length: int) -> str:
    return f"{length // 1024}K" if length % 1024 == 0 else str(length)


def header_lines(p: dict[str, Any]) -> list[str]:
    v = {**(p.get("versions") or {}), **(p["quality"].get("versions") or {})}
    lines = [
        f"# Context extension, dense vs sparse: {p.get('gpu_name')} ({p.get('scale')} scale)",
        "",
        f"- {p.get('date_utc')} · "
        + ", ".join(f"{k} {val}" for k, val in v.items())
        + f" · commit {str(p.get('git_commit'))[:12]} ({len(p.get('git_dirty') or [])} files changed"
        + (f", src sha256 {p['src_sha256']})" if p.get("src_sha256") else ")"),
        f"- {p.get('elapsed_s', 0):.0f} s of a {p.get('budget_s', 0):.0f} s budget · "
        f"{'complete' if p.get('complete') else 'PARTIAL (rewritten after every phase)'} · phases (s): "
        + ", ".join(f"{k} {fmt(val, 0)}" for k, val in p["phases_s"].items())
        + f" · eval jobs {p['eval_jobs']}",
    ]
    jobs = p.get("jobs") or []
    if len(jobs) > 1 or (jobs and jobs[0]["phase"] != "all"):
        lines.append(
            "- jobs: "
            + "; ".join(
                f"**{j['phase']}** on {j.get('procs') or 1} × {j.get('gpu_name')} {j.get('date_utc')}, "
                f"{fmt(j.get('elapsed_s'), 0)} s of "
                f"{fmt(j.get('budget_s'), 0)}, commit {str(j.get('git_commit'))[:12]}"
                + (f", src sha256 {j['src_sha256']}" if j.get("src_sha256") else "")
                for j in jobs
            )
        )
    commands = [j["command"] for j in jobs if j.get("command")]
    if commands:
        lines.append(
            "- run as "
            + "; then ".join(f"`{command}`" for command in commands)
            + f" (they make the logs tarball again, which git does not keep: {LOGS_NOT_KEPT})"
        )
    lines += [f"- **note:** {note}" for note in p.get("notes") or []]
    c = p.get("corpus")
    if c:
        f = c["files"]
        lines += [
            f"- corpus: {c['num_packages']} packages (sha256 {c['packages_sha256'][:16]}), {c['split']['train']} "
            f"train / {c['split']['held_out']} held out; "
            + ", ".join(
                f"{name} {f['num_docs'][name]:,} docs ~{f['approx_tokens'][name] / 1e6:.1f}M tokens"
                for name in f["num_docs"]
            )
            + f"; held-out text {c['heldout']['files']} files "
            f"~{c['heldout']['approx_tokens'] / 1e6:.1f}M tokens; tokenizer {c['tokenizer']['vocab_size']} "
            f"({c['tokenizer']['chars_per_token']['heldout_code']} chars/token on held-out code)"
        ]
    return lines


def training_lines(p: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Training",
        "",
        "| run | params | steps × tokens | wall s | tokens/s | step s | peak GiB | loss "
        "first→last | val loss | density / recall | layers sparse / crossover / no long doc / dense_layers / "
        "dense-recall / dense-step |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for name, m in p["training"].items():
        val = m["val_loss"] or {}
        layers = m.get("attention_layers") or {}
        lines.append(
            f"| {name} | {fmt(m['num_params'])} | {m['steps']} × {fmt(m['tokens_per_step'])} | "
            f"{fmt(m['wall_s'])} | {fmt(m['tokens_per_s'], 0)} | {fmt(m['step_s'], 3)} | "
            f"{fmt(m['peak_mem_gib'], 2)} | {fmt(m['loss_first'], 3)}→{fmt(m['loss_last'], 3)} | "
            f"{fmt(val[max(val, key=int)], 3) if val else '–'} | {fmt(m['sparse_density'], 3)} / "
            f"{fmt(m['sparse_recall'], 3)} | "
            + (
                f"{layers.get('sparse')} / {layers.get('dense-crossover')} / "
                f"{layers.get('dense-short-documents', '–')} / {layers.get('dense-layer', '–')} / "
                f"{layers.get('dense-recall', '–')} / {layers.get('dense-step', '–')} |"
                if name == "sparse"
                else "– |"
            )
        )
    means = (p["training"].get("sparse") or {}).get("layer_means")
    if means:
        steps = sorted({m["steps"] for m in means.values()})
        lines += [
            "",
            f"**Sparse run, per layer over its training** (mean over its {'–'.join(map(str, steps))} steps "
            f"of each decoder layer's plans; first → last: means over the first and the last tenth of the steps; a "
            "layer that ran dense has no plan)",
            "",
            "| layer | density | recall | density first → last | recall first → last |",
            "|---|---:|---:|---|---|",
        ]
        lines += [
            f"| {layer} | {m['density']:.3f} | {m['recall']:.3f} | {m['density_first']:.3f} → "
            f"{m['density_last']:.3f} | {m['recall_first']:.3f} → {m['recall_last']:.3f} |"
            for layer, m in means.items()
        ]
    if p.get("sparse_vs_dense_tokens_per_s"):
        lines += [
            "",
            f"Sparse / dense training tokens/s: **{p['sparse_vs_dense_tokens_per_s']:.2f}×** by the median step, "
            f"{fmt(p.get('sparse_vs_dense_tokens_per_s_all'), 2)}× in tokens over seconds of all the steps (both "
            f"after the first {WARMUP_STEPS}, which compile{compiled_note(p.get('speed_steps') or {})}; "
            f"{machines_note(p.get('trained_on') or {}, p.get('trained_in') or {})}). Validation loss: each run "
            "with its own attention (the sparse run's is sparse).",
        ]
    lines += dense_check_lines(p) + same_machine_lines(p)
    profile = p.get("sparse_step_profile")
    if profile:
        mean, step_ms = profile["mean"], profile["mean"]["step_ms"]
        parts = ", ".join(
            f"{phase} {mean[phase]:.1f} ms ({mean[phase] / step_ms:.0%})"
            for phase in ("plan", "attention", "matmul", "optimizer", "other")
        )
        lines += [
            "",
            f"Where the sparse step's time goes (`mtrain profile step`, the sparse-extended model at "
            f"{profile['seq_len']:,} tokens, {profile['steps']} steps after {profile['warmup']}, kernel time per "
            f"step): step {step_ms:.1f} ms; {parts}; density {fmt(profile.get('sparse_density'), 3)}. The plan's "
            f"share of the step: **{mean['plan'] / step_ms:.1%}**.",
        ]
        largest = [
            f"{phase} `{name[:60]}` {ms:.1f}"
            for phase in ("attention", "other")
            for name, ms in profile.get("top_kernels", {}).get(phase, [])[:3]
        ]
        if largest:
            lines.append("Its largest kernels, ms per step: " + "; ".join(largest) + ".")
        if profile.get("device_type") == "cuda":  # idle is measured from the GPU's timeline
            waits = ", ".join(f"{phase} {ms:.1f}" for phase, ms in mean.get("idle_before", {}).items())
            lines.append(
                f"GPU idle under the profiler: {mean['idle_ms']:.1f} ms a step; by the phase it waited for, ms: "
                f"{waits or 'none'}."
            )
        builds = profile.get("builds") or {}
        if any(builds.values()):
            lines.append(
                f"**The profiled steps built {builds['kernels_built']} Triton kernels and captured "
                f"{builds['plans_captured']} plans**: their times include those one-time costs."
            )
    return lines


def dense_check_lines(p: dict[str, Any]) -> list[str]:
    """The sparse run's dense check (attention.check_every): its loss gap on the training batches, and its cost."""
    check = (p["training"].get("sparse") or {}).get("dense_check")
    if not check or not check.get("checks"):
        return []
    last = check.get("perplexity_gap_last_fifth")
    return [
        "",
        f"Dense check of the sparse run (every {check['every']} steps, {check['checks']} checks: the step's batch "
        f"again, forward only, dense): loss gap sparse − dense {check['gap_mean']:+.4f} nats over all checks, "
        f"{fmt(check.get('gap_last_fifth'), 4)} over the last fifth of the run (perplexity "
        + (f"{100 * last:+.2f}%" if last is not None else "–")
        + f"); {check['seconds']:.1f} s, {fmt(100 * (check.get('share_of_training') or 0), 1)}% of training. "
        f"Without the checks' seconds: {fmt(p.get('sparse_vs_dense_tokens_per_s_without_checks'), 2)}× by the "
        f"median step, {fmt((p.get('speed_steps') or {}).get('ratio_without_checks'), 2)}× over all steps.",
    ]


def same_machine_lines(p: dict[str, Any]) -> list[str]:
    """The speed against the dense run trained again on the sparse run's machine (--dense-here)."""
    here = p.get("same_machine")
    if not here:
        return []
    return [
        "",
        f"On this machine, against the dense run trained again here ({DENSE_HERE}: median step "
        f"{fmt(here['dense_step_s'], 3)} s against the dense run's {fmt(here['dense_run_step_s'], 3)} s; its losses "
        f"equal the dense run's at {here['losses_equal']} of {here['losses_compared']} steps), without the checks' "
        f"seconds: **{fmt(here['median'], 2)}×** by the median step, {fmt(here['all_steps'], 2)}× over all steps.",
    ]


def target_lines(p: dict[str, Any]) -> list[str]:
    """The issue's figures to reach, read off the tables: sparse against dense, both against base+YaRN."""
    table, base_context = p["quality"]["table"], p.get("base_context")

    def cell(model: str, metric: str, length: int) -> float | None:
        return (table.get(model, {}).get(metric) or {}).get(length)

    def diff(metric: str, length: int, model: str = "sparse", paired: str = "paired") -> str:
        dense, sparse = cell("dense", metric, length), cell(model, metric, length)
        if dense is None or sparse is None:
            return "–"
        pair = (p["quality"].get(paired, {}).get(metric) or {}).get(length)
        if pair is None or pair["ci95"] is None:
            return f"{sparse - dense:+.1f}"
        return f"{sparse - dense:+.1f} (paired {pair['mean']:+.1f} ± {pair['ci95']:.1f}, {pair['prompts']})"

    prefill = "sparse-prefill" in table and bool(table["sparse-prefill"])
    prefill_head = " NIAH sparse, sparse prefill − dense | RULER niah sparse, sparse prefill − dense |"
    lines = [
        "",
        "## Figures to reach",
        "",
        f"- base at its context ({base_context}): passkey "
        f"{fmt(cell('base', 'infinitebench/passkey', base_context))}%, "
        f"NIAH {fmt(cell('base', 'niah', base_context))}% (target ≥ 90)",
        f"- sparse / dense training tokens/s {fmt(p.get('sparse_vs_dense_tokens_per_s'), 2)} by the median step, "
        f"{fmt(p.get('sparse_vs_dense_tokens_per_s_all'), 2)} over all steps (target ≥ "
        f"{p.get('speed_target', 2.0):g} at the longest length)",
        "",
        f"| length | ppl sparse / dense − 1 (≤ {p.get('ppl_target_pct', 2.0):g}%) | its second half | NIAH sparse − "
        "dense | RULER niah sparse − dense | ppl below base+YaRN: dense, sparse | NIAH ≥ base+YaRN: dense, sparse |"
        + (prefill_head if prefill else ""),
        "|---|---:|---:|---:|---:|---|---|" + ("---:|---:|" if prefill else ""),
    ]
    notes = [
        "",
        "Score differences in points: of the table means, then (paired) the mean difference over the prompts both "
        "models answered ± its 95% half-width (normal approximation), and how many prompts. A difference within "
        "± the half-width cannot be told from prompt sampling; training noise (another seed) comes on top. "
        "Its second half: the perplexity ratio over the tokens at positions L/2..L-1 alone, which have a long "
        "context behind them.",
    ]
    for length in p.get("lengths") or []:
        dense, sparse, yarn = (cell(m, "perplexity", length) for m in ("dense", "sparse", "base-yarn"))
        ratio = f"{100 * (sparse / dense - 1):+.2f}%" if dense and sparse else "–"
        dense_half, sparse_half = (cell(m, SECOND_HALF, length) for m in ("dense", "sparse"))
        half_ratio = f"{100 * (sparse_half / dense_half - 1):+.2f}%" if dense_half and sparse_half else "–"
        beats = ", ".join("–" if v is None or yarn is None else ("yes" if v < yarn else "NO") for v in (dense, sparse))
        yarn_niah = cell("base-yarn", "niah", length)
        finds = ", ".join(
            "–" if v is None or yarn_niah is None else ("yes" if v >= yarn_niah else "NO")
            for v in (cell("dense", "niah", length), cell("sparse", "niah", length))
        )
        row = (
            f"| {label(length)} | {ratio} | {half_ratio} | {diff('niah', length)} | {diff('ruler niah tasks', length)} "
            f"| {beats} | {finds} |"
        )
        if prefill:
            row += "".join(
                f" {diff(metric, length, 'sparse-prefill', 'paired_sparse_prefill')} |"
                for metric in ("niah", "ruler niah tasks")
            )
        lines.append(row)
    return lines + notes


def quality_lines(p: dict[str, Any]) -> list[str]:
    table, samples, lengths = p["quality"]["table"], p["quality"]["samples"], p.get("lengths") or []
    present = {name for model in table.values() for name in model}
    lines = [
        "",
        "## Quality (model × length)",
        "",
        "Each RULER task, and every prompt's answer: the JSON and the logs tarball. RULER runs its niah tasks (the "
        "issue's); their mean is over the tasks that ran at a length.",
        "",
    ]
    for metric in [m for m in HEADLINE_METRICS if m in present]:
        unit = {
            "perplexity": "perplexity on held-out packages; the base beyond its context without YaRN",
            SECOND_HALF: "the same, over the tokens at positions L/2..L-1 only",
        }.get(metric, "% correct")
        counts = sorted({n for model in samples.values() for n in (model.get(metric) or {}).values()})
        note = f"; {'–'.join(map(str, counts[:: max(1, len(counts) - 1)]))} prompts a cell" if counts else ""
        lines += [
            f"**{metric}** ({unit}{note})",
            "",
            "| model | " + " | ".join(map(label, lengths)) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for model in MODELS:
            cells = table.get(model, {}).get(metric)
            if cells:
                lines.append(
                    f"| {model} | "
                    + " | ".join(fmt(cells.get(n), 2 if metric.startswith("perplexity") else 1) for n in lengths)
                    + " |"
                )
        lines.append("")
    for model, probe in p["sparsity_by_layer"].items():
        rows = [r for r in probe["lengths"] if r.get("layers") and not r.get("dense_below")]
        if rows:
            lines += [
                f"**Sparse pattern per layer, {model}-extended model** (density / recall; one held-out text, "
                f"settings of the sparse run)",
                "",
                "| layer | " + " | ".join(label(r["length"]) for r in rows) + " |",
                "|---|" + "---:|" * len(rows),
            ]
            for i in range(len(rows[0]["layers"])):
                lines.append(
                    f"| {i} | "
                    + " | ".join(
                        f"{fmt(r['layers'][i]['density'], 3)} / {fmt(r['layers'][i]['recall'], 3)}" for r in rows
                    )
                    + " |"
                )
            lines.append("")
    return lines


def markdown(p: dict[str, Any], files: list[str]) -> str:
    lines = header_lines(p) + training_lines(p) + target_lines(p) + quality_lines(p)
    lines += [f"![{name}]({name})" for name in files]
    lines += ["", "## Skipped and failed", ""]
    lines += [
        f"- {r['name']}: {r['status']} — {r['reason']}" for r in p["records"] if r["status"] in ("fail", "skipped")
    ]
    lines += [f"- eval ({', '.join(models)}): {what}" for what, models in p["quality"]["eval_skipped"].items()]
    return "\n".join(lines) + "\n"
