"""The frontier: every sparse job's report (bench/extension's JSON: its sparse run against the dense run it resumed)
as one row, grouped by model, with the floors each row meets, and how well the dense check agrees with the eval.

A row: the perplexity gap sparse / dense − 1 of the two models evaluated with dense attention on held-out text, at
every length and over each length's second half; the sparse model with sparse prefill against itself with dense
attention; sparse / dense training tokens/s by the median step and over all steps (both without the dense
checks' seconds, which the report takes out: a run of the study checks every 10 steps, a default run every 50),
against the dense run trained again on the sparse run's machine where the job did (bench.extension --dense-here:
machines differ by 1-2%), else against the dense run;
density, recall, layer 0's recall and the share of layer calls the recall controller ran dense; the dense check's
mean gap over the last fifth of the run (as a perplexity ratio) beside the eval gap at the training length.
Rows of one model and variant from two or more training seeds are pooled (their mean) in a row of their own.

The jobs' reports live under .exp/ (git-ignored), which a new checkout does not have: the frontier a report wrote
before keeps its rows, and a row from a job's report replaces the kept row of the same model, variant and seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.quality_frontier.study import CHECK_EVERY, MODELS, REFERENCE, VARIANTS, Floor

NEAR = 0.2  # a figure this close to its floor is reported over two training seeds (the rule)
SECOND_HALF = "perplexity, second half"


def ratio_pct(table: dict[str, Any], model: str, reference: str, metric: str) -> dict[int, float]:
    """length -> 100 × (model / reference − 1) for `metric`, where both have it."""
    ours, theirs = table.get(model, {}).get(metric) or {}, table.get(reference, {}).get(metric) or {}
    return {int(n): 100 * (ours[n] / theirs[n] - 1) for n in ours if n in theirs}


def which_model(report: dict[str, Any]) -> str:
    """The study's model of the report's scale whose base settings it has (the most of them, where several)."""
    given = set(report.get("base_set") or [])
    matches = [m for m in MODELS.values() if m.scale_name == report.get("scale") and set(m.base_set) <= given]
    return max(matches, key=lambda m: len(m.base_set)).name if matches else str(report.get("scale"))


def which_variant(settings: list[str]) -> str:
    """The study's variant of these added attention settings, else the settings themselves."""
    check = CHECK_EVERY.split("=")[0] + "="
    chosen = [item for item in settings if not item.startswith(check)]  # every run of the study checks
    for item in REFERENCE:  # every run starts from it (runs from before it was explicit have it from the recipe)
        if item in chosen:
            chosen.remove(item)
    chosen.sort()
    for variant in VARIANTS.values():
        if sorted(variant.sets) == chosen:
            return variant.name
    return " ".join(chosen)


def training_seed(report: dict[str, Any]) -> int:
    seeds = [item.split("=", 1)[1] for item in report.get("extend_set") or [] if item.startswith("run.seed=")]
    return int(seeds[-1]) if seeds else 0


def job_date(report: dict[str, Any], phase: str) -> str | None:
    """When the report's job of `phase` ran (its date stands for that run)."""
    return next((j.get("date_utc") for j in report.get("jobs") or [] if j["phase"] == phase), None)


def row(report: dict[str, Any], file: str) -> dict[str, Any]:
    """One sparse job's report as a row of the frontier."""
    table = report["quality"]["table"]
    sparse = report["training"].get("sparse") or {}
    speed_steps, here = report.get("speed_steps") or {}, report.get("same_machine") or {}
    check = sparse.get("dense_check") or {}
    layers = sparse.get("attention_layers") or {}
    layer0 = (sparse.get("layer_means") or {}).get("0") or {}
    gap = ratio_pct(table, "sparse", "dense", "perplexity")
    longest = max(gap) if gap else None
    check_pct = 100 * check["perplexity_gap_last_fifth"] if check.get("perplexity_gap_last_fifth") is not None else None
    return {
        "file": file,
        "model": which_model(report),
        "variant": which_variant(report.get("sparse_extend_set") or []),
        "settings": sorted(report.get("sparse_extend_set") or []),
        "seed": training_seed(report),
        "gpu_name": report.get("gpu_name"),
        "trained_on": report.get("trained_on"),
        "provenance": {  # the sparse job's: its commit, date and versions
            "commit": (report.get("git_commit") or "")[:12],
            "dirty": report.get("git_dirty"),
            "date_utc": report.get("date_utc"),
            "torch": (report.get("versions") or {}).get("torch"),
            "triton": (report.get("versions") or {}).get("triton"),
        },
        "dense_job": job_date(report, "dense"),
        "extend_steps": report.get("extend_steps"),
        "gap_pct": gap,
        "gap_second_half_pct": ratio_pct(table, "sparse", "dense", SECOND_HALF),
        "sparse_prefill_pct": ratio_pct(table, "sparse-prefill", "sparse", "perplexity"),
        "speed": {  # against the dense run trained again on the sparse run's machine where the job did (here)
            "median": here.get("median")
            or report.get("sparse_vs_dense_tokens_per_s_without_checks")
            or report.get("sparse_vs_dense_tokens_per_s"),
            "all_steps": here.get("all_steps")
            or speed_steps.get("ratio_without_checks")
            or report.get("sparse_vs_dense_tokens_per_s_all"),
            "here": bool(here),
            "median_against_dense_run": report.get("sparse_vs_dense_tokens_per_s_without_checks"),
            "median_as_run": report.get("sparse_vs_dense_tokens_per_s"),
            "all_steps_as_run": report.get("sparse_vs_dense_tokens_per_s_all"),
        },
        "density": sparse.get("sparse_density"),
        "recall": sparse.get("sparse_recall"),
        "layer0_recall": layer0.get("recall"),
        "dense_recall_share": layers.get("dense-recall", 0) / sum(layers.values()) if layers else None,
        "dense_step_share": layers.get("dense-step", 0) / sum(layers.values()) if layers else None,
        "check": {
            "every": check.get("every"),
            "checks": check.get("checks"),
            "gap_last_fifth_nats": check.get("gap_last_fifth"),
            "last_fifth_pct": check_pct,
            "share_of_training": check.get("share_of_training"),
        },
        "check_minus_eval_pct": check_pct - gap[longest] if check_pct is not None and longest else None,
        "niah_sparse_minus_dense": report["quality"].get("paired", {}).get("niah") or {},
    }


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows of one model and variant over training seeds (a seed's rows averaged first): their mean."""
    by_seed: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_seed.setdefault(r["seed"], []).append(r)

    def mean(values: list[float | None]) -> float | None:
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    def seed_mean(get) -> float | None:
        return mean([mean([get(r) for r in group]) for group in by_seed.values()])

    def by_length(key: str) -> dict[int, float]:
        lengths = set.intersection(*(set(r[key]) for r in rows))
        return {n: seed_mean(lambda r, n=n: r[key][n]) for n in sorted(lengths)}

    first = rows[0]
    gap = by_length("gap_pct")
    check_pct = seed_mean(lambda r: r["check"]["last_fifth_pct"])
    return {
        **{k: first[k] for k in ("model", "variant", "settings")},
        "file": f"mean of seeds {', '.join(map(str, sorted(by_seed)))}",
        "seed": "pooled",
        "gap_pct": gap,
        "gap_second_half_pct": by_length("gap_second_half_pct"),
        "sparse_prefill_pct": by_length("sparse_prefill_pct"),
        "speed": {
            **{k: seed_mean(lambda r, k=k: r["speed"].get(k)) for k in first["speed"] if k != "here"},
            "here": all(r["speed"].get("here") for r in rows),
        },
        **{
            k: seed_mean(lambda r, k=k: r[k])
            for k in ("density", "recall", "layer0_recall", "dense_recall_share", "dense_step_share")
        },
        "check": {"last_fifth_pct": check_pct, "checks": sum(r["check"]["checks"] or 0 for r in rows)},
        "check_minus_eval_pct": check_pct - gap[max(gap)] if check_pct is not None and gap else None,
        "niah_sparse_minus_dense": {},
    }


def floor_value(floor: Floor, r: dict[str, Any]) -> float | None:
    """The row's figure a floor bounds: a gap at its length (every length: the largest), or a speed ratio."""
    if floor.is_gap:
        gaps = r["gap_pct"] if floor.figure == "gap" else r["gap_second_half_pct"]
        if floor.length is None:
            return max(gaps.values()) if gaps else None
        return gaps.get(floor.length)
    return r["speed"]["median" if floor.figure == "speed, median" else "all_steps"]


def judge(r: dict[str, Any], floors: tuple[Floor, ...], seeds: int) -> dict[str, Any]:
    """Each floor: the row's figure, whether it holds, and whether it lies within NEAR of the bound with fewer
    than two training seeds behind it (then a second seed is due)."""
    verdicts = {}
    for floor in floors:
        value = floor_value(floor, r)
        holds = None if value is None else value <= floor.bound if floor.is_gap else value >= floor.bound
        near = value is not None and abs(value - floor.bound) < NEAR and seeds < 2
        verdicts[floor.describe()] = {"value": value, "holds": holds, "second_seed_due": near}
    return verdicts


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    i = 0
    while i < len(order):  # ties share their mean rank
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else None


def agreement(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The dense check's last-fifth gap against the eval gap at the training length, over a model's runs (one per
    file): mean and mean absolute difference in points, and Spearman's rank correlation; the same against the
    sparse model's own sparse-prefill gap, which measures what the check does (sparse against dense attention on
    one model's weights) where the eval gap sets two models apart."""
    pairs = [
        (r["check"]["last_fifth_pct"], r["gap_pct"][max(r["gap_pct"])], r["sparse_prefill_pct"].get(max(r["gap_pct"])))
        for r in rows
        if r["check"]["last_fifth_pct"] is not None and r["gap_pct"]
    ]
    if not pairs:
        return {"runs": 0}
    checks, evals = [p[0] for p in pairs], [p[1] for p in pairs]
    prefill = [(c, s) for c, _e, s in pairs if s is not None]
    return {
        "runs": len(pairs),
        "mean_check_minus_eval": sum(c - e for c, e in zip(checks, evals, strict=True)) / len(pairs),
        "mean_abs_check_minus_eval": sum(abs(c - e) for c, e in zip(checks, evals, strict=True)) / len(pairs),
        "spearman_check_eval": spearman(checks, evals),
        "spearman_check_sparse_prefill": spearman([c for c, _s in prefill], [s for _c, s in prefill]),
    }


# Settings that change only how many probe queries a plan scores, and those a run of the default probe may carry
PROBE_SETTINGS = ("attention.last_q", "attention.max_probe_rows")
PLAIN_SETTINGS = ("attention.p", "attention.check_every", "run.seed")


def probe_cost(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """How far runs with more probe queries sit above the default probe's line. Per dense run, its runs with the
    default probe (settings of p alone) fit sparse / dense step time by the median step = a + b · density; a run
    with more probe queries is, above that line, its plan's probe work and whatever else moved its median step.
    Needs three runs of the default probe against one dense run; `fit_error` is the largest of their distances
    from the line."""
    by_dense: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        names = {item.split("=")[0] for item in r["settings"]}
        # against the dense run itself, which the group shares (not the one trained again on the row's machine)
        median = r["speed"].get("median_against_dense_run") or r["speed"].get("median")
        if r.get("dense_job") and median and names <= {*PLAIN_SETTINGS, *PROBE_SETTINGS}:
            by_dense.setdefault(r["dense_job"], []).append(
                {**r, "median": median, "probed": bool(names & set(PROBE_SETTINGS))}
            )
    costs = []
    for group in by_dense.values():
        base = [(r["density"], 1 / r["median"]) for r in group if not r["probed"]]
        if len(base) < 3:
            continue
        mx, my = sum(x for x, _ in base) / len(base), sum(y for _, y in base) / len(base)
        slope = sum((x - mx) * (y - my) for x, y in base) / sum((x - mx) ** 2 for x, _ in base)
        line = [my - slope * mx, slope]
        fit_error = max(abs(y - line[0] - line[1] * x) / y for x, y in base)
        for r in group:
            if r["probed"]:
                step, expected = 1 / r["median"], line[0] + line[1] * r["density"]
                costs.append(
                    {
                        "variant": r["variant"],
                        "seed": r["seed"],
                        "share_of_step": (step - expected) / step,
                        "speed_on_the_line": 1 / expected,
                        "fit_error": fit_error,
                        "fit_runs": len(base),
                    }
                )
    return costs


def report_rows(paths: list[Path]) -> list[dict[str, Any]]:
    """A row per sparse run among the reports at `paths` (others, e.g. a dense job's, are left out)."""
    latest: dict[tuple, tuple[int, dict[str, Any]]] = {}  # one sparse run -> (its report's jobs, its row)
    for path in sorted(paths):
        report = json.loads(path.read_text())
        if not ((report.get("training") or {}).get("sparse") and (report.get("training") or {}).get("dense")):
            continue
        r = row(report, path.name)
        if "niah" in (report.get("command") or ""):  # the job's own command: --evals pg19,niah or niah
            r["variant"] += ", NIAH run"  # trained again for retrieval: a row of its own, not another seed
        # an eval job's report repeats the sparse job's it resumed (bench/extension restores its records): the
        # report of the most jobs stands for that sparse run
        key = (r["model"], r["variant"], r["seed"], job_date(report, "sparse"))
        if key not in latest or len(report.get("jobs") or []) > latest[key][0]:
            latest[key] = (len(report.get("jobs") or []), r)
    return [r for _jobs, r in latest.values()]


def kept_rows(frontier_json: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of a frontier written before (its pooled rows and verdicts left out: they are made again)."""
    rows = []
    for entry in frontier_json["frontier"]["models"].values():
        for r in entry["rows"]:
            if r["seed"] == "pooled":
                continue
            r = {k: v for k, v in r.items() if k != "floors"}
            for key in ("gap_pct", "gap_second_half_pct", "sparse_prefill_pct"):  # JSON made the lengths strings
                r[key] = {int(n): v for n, v in r[key].items()}
            rows.append(r)
    return rows


def run_key(r: dict[str, Any]) -> tuple:
    return r["model"], r["variant"], r["seed"]


def collect(paths: list[Path], kept: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The frontier of the sparse jobs' reports among `paths` and the `kept` rows they do not replace."""
    fresh = report_rows(paths)
    replaced = {run_key(r) for r in fresh}
    rows = [r for r in kept if run_key(r) not in replaced] + fresh
    models: dict[str, Any] = {}
    for r in rows:
        models.setdefault(r["model"], {"rows": []})["rows"].append(r)
    for name, entry in models.items():
        floors = MODELS[name].floors if name in MODELS else ()
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in entry["rows"]:
            groups.setdefault(r["variant"], []).append(r)
        for group in groups.values():
            seeds = len({r["seed"] for r in group})
            for r in group:
                r["floors"] = judge(r, floors, seeds)
            if seeds > 1:
                mean_row = pooled(group)
                mean_row["floors"] = judge(mean_row, floors, seeds)
                entry["rows"].append(mean_row)
        order = list(VARIANTS)
        entry["rows"].sort(
            key=lambda r: (order.index(r["variant"]) if r["variant"] in order else len(order), str(r["seed"]))
        )
        entry["floors"] = [
            {"text": f.describe(), "figure": f.figure, "bound": f.bound, "length": f.length} for f in floors
        ]
        entry["agreement"] = agreement([r for r in entry["rows"] if r["seed"] != "pooled"])
        entry["probe_cost"] = probe_cost([r for r in entry["rows"] if r["seed"] != "pooled"])
        entry["about"] = MODELS[name].about if name in MODELS else ""
    return {"models": models}
