"""The results of the end-to-end flows as markdown (one row per flow, then each failure with its command and
stderr), and the merge of results from parts of the flows run in separate device calls."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    if isinstance(value, int) and abs(value) >= 1000:
        return f"{value:,}"
    return str(value)


def note(r: dict[str, Any]) -> str:
    m = r.get("metrics") or {}
    if r["status"] != "pass":
        return (r.get("reason") or "")[:300].replace("|", "/").replace("\n", " ")
    if "suites" in m:
        parts = [f"{k} {fmt(v['headline'], 1)} ({v['cells']} cells)" for k, v in m["suites"].items()]
        extra = f" · {m.get('prefills_probed')}/{m.get('prefills')} prefills probed" if m.get("prefills") else ""
        return "; ".join(parts) + f" · {len(m.get('skipped') or [])} skipped" + extra
    if "phases_ms" in m:
        # a sparse profile under the default rule may run every layer dense: say so beside its phases
        routes = ", ".join(f"{n} {route}" for route, n in (m.get("layers") or {}).items() if n)
        return (
            "ms/step: "
            + ", ".join(f"{k} {fmt(v, 1)}" for k, v in m["phases_ms"].items() if v)
            + (f" · layers: {routes}" if routes else "")
        )
    if "sparse_fwd_bwd_ms" in m:
        return (
            f"{m.get('seq_len')} {m.get('pattern')}: ours fwd+bwd {fmt(m.get('sparse_fwd_bwd_ms'))} ms, "
            f"cuDNN {fmt(m.get('dense_cudnn_fwd_bwd_ms'))}, flex {fmt(m.get('flex_exact_fwd_bwd_ms'))}"
        )
    if "logits_finite" in m:
        return f"{m.get('class')}, attn {m.get('attn_implementation')}, max_pos {m.get('max_position_embeddings')}"
    parts = []
    if m.get("sigint"):
        parts.append(f"SIGINT after step {m['sigint'].get('after_step')}")
    if m.get("resumed_at_step") is not None:
        parts.append(f"resumed at step {m['resumed_at_step']}")
    if m.get("first_step_s") is not None:
        parts.append(f"first step {fmt(m['first_step_s'])} s")
    if m.get("loss_last") is not None:
        parts.append(f"loss {fmt(m.get('loss_first'), 3)}→{fmt(m.get('loss_last'), 3)}")
    pack = m.get("packing") or {}
    if pack.get("mean_documents_per_row"):
        parts.append(f"{pack['mean_documents_per_row']:.2f} docs/row")
    rope = m.get("rope") or {}
    if rope.get("extended_context"):
        parts.append(f"ctx {rope.get('original_context')}→{rope['extended_context']}")
    return " · ".join(parts)


def markdown(payload: dict[str, Any]) -> str:
    env = payload
    source = env.get("source") or {}
    imports = env.get("imports") or {}
    versions = ", ".join(
        f"{k} {imports.get(k)}" for k in ("torch", "triton", "transformers", "datasets") if k in imports
    )
    lines = [
        f"# mtrain end-to-end flows ({env.get('scale')} scale): {env.get('gpu_name') or 'CPU'}",
        "",
        f"- date {env.get('date_utc')} · driver {env.get('driver', '–')} · {versions} · python {env.get('python')}",
        f"- source {source.get('git_commit') or '–'} (src sha256 {source.get('src_sha256')}, "
        f"dirty files {len(source.get('git_dirty') or [])})",
        f"- {env['counts']['pass']} passed, {env['counts']['fail']} failed, {env['counts']['skipped']} skipped"
        f"{', ' + str(env['counts']['pending']) + ' pending' if env['counts']['pending'] else ''} · "
        f"{env['elapsed_s']:.0f} s of a {env['budget_s']} s budget · "
        f"{'complete' if env['complete'] else 'PARTIAL (written after each flow)'}",
    ]
    if env.get("missing_imports"):
        lines.append("- **missing imports:** " + "; ".join(f"{k}: {v}" for k, v in env["missing_imports"].items()))
    lines += [
        "",
        "| flow | result | wall s | tokens/s | peak GiB | step s | density / recall | note |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in env["flows"]:
        m = r.get("metrics") or {}
        dr = (
            f"{fmt(m.get('sparse_density'), 3)} / {fmt(m.get('sparse_recall'), 3)}"
            if m.get("sparse_density") is not None or m.get("sparse_recall") is not None
            else "–"
        )
        lines.append(
            f"| {r['name']} | {r['status'].upper() if r['status'] == 'fail' else r['status']} | "
            f"{fmt(r.get('wall_s'), 1)} | {fmt(m.get('tokens_per_s'))} | {fmt(m.get('peak_mem_gib'))} | "
            f"{fmt(m.get('step_s'), 3)} | {dr} | {note(r)} |"
        )
    lines += [
        "",
        "Tokens/s and step s: median over the steps after the first (the first compiles); peak GiB: "
        "max_memory_allocated on GPU, peak RSS on CPU; density / recall: mean over the steps (eval: over "
        "the prefills). Commands, logs and the runs' small files: the JSON and the logs tar.gz.",
        "The `extend-*-sparse-*` flows set `attention.crossover=false` so that every layer runs the sparse "
        "kernels (they check the kernels, not the speed: a 25M model with 4 heads, whose steps are mostly "
        "host time); the resume and profile-step flows run the default rule. Sparse against dense speed "
        "with the rule: train_speed_<gpu>.md.",
        "",
    ]
    if env.get("rerun_flows"):
        lines += [
            f"Skipped for the time budget; run them in another call: `OUT=... bash bench/gpu_e2e.sh --flows "
            f"{','.join(env['rerun_flows'])}` (prerequisites are added).",
            "",
        ]
    failed = [r for r in env["flows"] if r["status"] == "fail"]
    for r in failed:
        lines += [
            f"## {r['name']} failed",
            "",
            f"`{r['command'].splitlines()[-1] if r['command'] else ''}`",
            "",
            r.get("reason", ""),
            "",
            "```",
            (r.get("stderr_tail") or "")[-2500:],
            "```",
            "",
        ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------


def gpus_of(parts: list[dict[str, Any]]) -> str:
    """How side-by-side parts shared the GPUs (bench/gpu_e2e_parallel.sh: part i on GPU i mod the count)."""
    gpus = {p.get("cuda_visible_devices") for p in parts}
    if len(gpus) == len(parts):
        return "one GPU each"
    return f"{len(parts)} parts on {len(gpus)} GPUs: a GPU shared by parts running at once, their timings too"


def merge(paths: list[Path], out: Path, side_by_side: bool = False) -> None:
    """One results file from parts of the job run in separate calls (one call is limited to 10 minutes), or
    `side_by_side` in one call, a GPU each (their CUDA_VISIBLE_DEVICES recorded): every flow's latest record,
    tagged with the part it ran in; each part's environment kept under `parts`. A file that is itself a merge
    brings its parts in as they are, so that each flow keeps the date and commit of the call that ran it."""
    files = [json.loads(p.read_text()) for p in paths]
    parts: list[dict[str, Any]] = []
    flows_by_name: dict[str, dict[str, Any]] = {}
    for file in files:
        offset = len(parts)
        # a part merged before this was written (parts nested in parts) is described by its own top level
        own_parts = file.get("parts") or [file]
        parts += [{k: v for k, v in part.items() if k not in ("flows", "parts")} for part in own_parts]
        for record in file["flows"]:
            if record["status"] != "skipped" or record["name"] not in flows_by_name:
                index = offset + (record.get("part", 0) if "parts" in file else 0)
                flows_by_name[record["name"]] = {**record, "part": index}
    # only the parts a kept flow ran in, numbered again
    used = sorted({record["part"] for record in flows_by_name.values()})
    parts = [parts[i] for i in used]
    flows = [{**record, "part": used.index(record["part"])} for record in flows_by_name.values()]
    merged = {
        **files[-1],
        "flows": flows,
        "parts": parts,
        "elapsed_s": (max if side_by_side else sum)(file["elapsed_s"] for file in files),
        "budget_s": (max if side_by_side else sum)(file["budget_s"] for file in files),
        "complete": all(file["complete"] for file in files),
        "rerun_flows": [],
    }
    merged["counts"] = {
        status: sum(r["status"] == status for r in merged["flows"]) for status in ("pass", "fail", "skipped", "pending")
    }
    # a part is described by the flows the merge keeps from it: a part may have selected more than ran
    taken = [[r["name"] for r in merged["flows"] if r["part"] == i] for i in range(len(parts))]
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu_e2e_{merged['gpu']}"
    atomic_write(out / f"{name}.json", json.dumps(merged, indent=2))
    atomic_write(
        out / f"{name}.md",
        markdown(merged).replace(
            "\n\n| flow |",
            (
                f"\n- run as {len(parts)} parts side by side in one device call, {gpus_of(parts)}: "
                if side_by_side
                else f"\n- run as {len(parts)} device calls (one is limited to 10 minutes): "
            )
            + "; ".join(
                f"part {i}: {', '.join(taken[i])} ({p['date_utc']}, "
                f"{(p.get('source') or {}).get('git_commit', '–')[:12]}"
                + (f", GPU {p['cuda_visible_devices']}" if p.get("cuda_visible_devices") is not None else "")
                + ")"
                for i, p in enumerate(parts)
            )
            + "\n\n| flow |",
            1,
        ),
    )
