"""`mtrain profile` flows: a training step of a fresh model (dense and sparse: where its time goes), and the sparse
kernels against dense and FlexAttention (CUDA only: on CPU the CLI's refusal is recorded as a skip)."""

from __future__ import annotations

import json
from collections.abc import Callable

from bench.gpu_e2e.checks import as_int, finish, rnd
from bench.gpu_e2e.job import Flow, Job, Record, tail
from bench.gpu_e2e.scales import Scale, length_label


def step_flow(mode: str) -> Callable[[Job, Record], None]:
    def run(job: Job, rec: Record) -> None:
        s = job.scale
        out = job.out_dir("profile", rec.name) / "step.json"
        cmd = job.mtrain(
            "profile",
            "step",
            "--recipe",
            str(job.work / "e2e.yaml"),
            "--data",
            str(job.state.data[f"x4_{s.short}"]),
            "--warmup",
            str(s.profile_warmup),
            "--steps",
            str(s.profile_steps),
            "--out",
            str(out),
            "--set",
            f"attention.mode={mode}",
        )
        job.run(rec, cmd, rec.timeout_s)
        problems, checks = [], []
        if not out.is_file():
            problems.append("no profile JSON written")
        else:
            r = json.loads(out.read_text())
            meanr = r.get("mean") or {}
            rec.metrics.update(
                step_s=rnd(meanr.get("step_ms", 0) / 1e3, 4),
                tokens_per_s=as_int(r.get("tokens_per_s_per_rank")),
                tflops=rnd(r.get("tflops_per_rank"), 2),
                mfu=rnd(r.get("mfu")),
                peak_mem_gib=rnd(r.get("peak_mem_gib"), 3),
                sparse_density=rnd(r.get("sparse_density")),
                sparse_recall=rnd(r.get("sparse_recall")),
                layers=r.get("layers"),
                phases_ms={
                    k: rnd(meanr.get(k), 2) for k in ("attention", "matmul", "communication", "optimizer", "other")
                },
                device=r.get("device"),
                seq_len=r.get("seq_len"),
            )
            if not meanr.get("step_ms"):
                problems.append("no step time")
            if (
                mode == "sparse"
                and r.get("sparse_density") is None
                and not (r.get("layers") or {}).get("dense-crossover")
            ):
                problems.append("sparse profile: no sparse density and no layer counted dense by the crossover")
            if mode == "dense" and r.get("sparse_density") is not None:
                problems.append("dense profile reports a sparse density")
            checks.append(f"phases {rec.metrics['phases_ms']}")
        if rec.rc != 0:
            problems.insert(0, f"exit code {rec.rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
        finish(rec, problems, checks)

    return run


def flow_kernels(job: Job, rec: Record) -> None:
    out = job.out_dir("profile", rec.name) / "kernels.json"
    cmd = job.mtrain("profile", "kernels", *job.scale.kernels_args, "--out", str(out))
    rc = job.run(rec, cmd, rec.timeout_s)
    err = tail(job.work / "logs" / f"{rec.name}.err", 5)
    if job.scale.name == "cpu":
        if rc == 2 and "needs a CUDA GPU" in err:
            rec.status = "skipped"
            rec.reason = f"needs CUDA (the CLI checked the arguments, then refused with exit 2: {err.strip()})"
        else:
            finish(rec, [f"on CPU expected exit 2 'needs a CUDA GPU', got rc {rc}: {err[-300:]}"], [])
        return
    problems, checks = [], []
    result = json.loads(out.read_text()) if out.is_file() else {}
    rows = result.get("rows") or []
    if not rows:
        problems.append("no rows in the kernels JSON")
    for r in rows[:1]:
        rec.metrics.update(
            seq_len=r.get("seq_len"),
            pattern=f"{r.get('pattern')} ({r.get('planted_slashes')})",
            sparse_density=rnd(r.get("density")),
            sparse_recall=rnd(r.get("recall")),
            sparse_fwd_ms=rnd(r.get("sparse_fwd_ms"), 2),
            sparse_bwd_ms=rnd(r.get("sparse_bwd_ms"), 2),
            sparse_fwd_bwd_ms=rnd(r.get("sparse_fwd_bwd_ms"), 2),
            dense_cudnn_fwd_bwd_ms=rnd(r.get("dense_cudnn_fwd_bwd_ms"), 2),
            dense_flash_fwd_bwd_ms=rnd(r.get("dense_flash_fwd_bwd_ms"), 2),
            flex_exact_fwd_bwd_ms=rnd(r.get("flex_exact_fwd_bwd_ms"), 2),
            peak_mem_gib=rnd(r.get("sparse_peak_gib"), 3),
            accuracy_vs_fp32=result.get("accuracy_vs_fp32"),
        )
        checks.append(f"{len(rows)} row(s)")
    if rc != 0:
        problems.insert(0, f"exit code {rc}" + (" (killed at its timeout)" if rec.timed_out else ""))
    finish(rec, problems, checks)


def flows(scale: Scale) -> list[Flow]:
    short = length_label(scale.short)
    return [
        *[
            Flow(
                f"profile-step-{mode}",
                "step",
                f"profile step, fresh model, {mode}, {short} packed rows",
                step_flow(mode),
            )
            for mode in ("dense", "sparse")
        ],
        Flow(
            "profile-kernels",
            "kernels",
            "profile kernels " + " ".join(scale.kernels_args),
            flow_kernels,
            min_s=10 if scale.name == "cpu" else 120,
        ),
    ]
