"""`mtrain extend` flows: the pretrained base (what `--model` flows extend) and extensions of a fresh model or of that
base, dense and sparse, at the scale's short and long lengths."""

from __future__ import annotations

from collections.abc import Callable

from bench.gpu_e2e.checks import check_dense_check, check_dense_steps, check_train, finish, only_subdir
from bench.gpu_e2e.job import Flow, Job, Record
from bench.gpu_e2e.scales import Scale, length_label


def flow_pretrain(job: Job, rec: Record) -> None:
    s = job.scale
    runs = job.out_dir("runs", rec.name)
    cmd = job.mtrain(
        "extend",
        "--recipe",
        str(job.work / "e2e.yaml"),
        "--data",
        str(job.state.data["pretrain"]),
        "--output-dir",
        str(runs),
        "--set",
        "run.name=pretrain",
        "--set",
        "context.method=none",
        "--set",
        f"data.seq_len={s.native}",
        "--set",
        f"train.num_steps={s.pretrain_steps}",
        "--set",
        f"train.batch_size={s.pretrain_batch}",
        "--set",
        "train.lr=1e-3",
        "--set",
        f"train.warmup_steps={max(1, s.pretrain_steps // 10)}",
        "--set",
        "data.num_val_rows=2",
        "--set",
        f"train.eval_every={s.pretrain_steps}",
        "--set",
        f"logging.every={max(1, s.pretrain_steps // 8)}",
    )
    job.run(rec, cmd, rec.timeout_s)
    run_dir = only_subdir(runs)
    check_train(job, rec, run_dir, s.pretrain_steps, "dense", s.native, "x1", None)
    if rec.status == "pass":
        rope = rec.metrics.get("rope") or {}
        if rope.get("method") == "yarn" or rope.get("extended_context") != s.native:
            finish(rec, [f"pretrain with context.method=none reports rope {rope}"], [])
        else:
            job.state.run_dirs[rec.name] = run_dir
            job.state.models[rec.name] = run_dir / "export"


def extend_flow(
    source: str,
    mode: str,
    slot: str,
    packing: str,
    model_sets: tuple[str, ...] = (),
    rope_type: str = "yarn",
    model_flow: str = "pretrain",
    attention_sets: tuple[str, ...] = (),
) -> Callable[[Job, Record], None]:
    """extend a fresh model (`source` "fresh") or the model that flow `model_flow` made ("model") to the scale's
    `slot` ("short" or "long") length with YaRN, `mode` dense or sparse, on rows of `packing` ("x4": 4 documents a
    row, "x1": one document cut into rows). model_sets: `--set model.*=...` items over the scale's model section
    (another architecture, for a fresh model); rope_type: what the export's config.json must say; attention_sets:
    `--set attention.*=...` items (a sparse run's dense check, when they set check_every, must have run)."""

    def run(job: Job, rec: Record) -> None:
        s = job.scale
        length = s.short if slot == "short" else s.long
        runs = job.out_dir("runs", rec.name)
        cmd = job.mtrain(
            "extend",
            "--recipe",
            str(job.work / "e2e.yaml"),
            "--data",
            str(job.state.data[f"{packing}_{length}"]),
            "--output-dir",
            str(runs),
        )
        if source == "model":
            cmd += ["--model", str(job.state.models[model_flow])]
        cmd += [
            "--set",
            f"run.name={rec.name}",
            "--set",
            f"data.seq_len={length}",
            "--set",
            f"context.factor={length // s.native}",
            "--set",
            f"attention.mode={mode}",
            "--set",
            f"train.activation_checkpointing={'true' if slot == 'long' else 'false'}",
            *[arg for item in (*model_sets, *attention_sets) for arg in ("--set", item)],
        ]
        if mode == "sparse":  # the sparse kernels themselves; the resume flows run the default crossover rule
            cmd += ["--set", "attention.crossover=false"]
        job.run(rec, cmd, rec.timeout_s)
        rec.metrics["packing_kind"] = packing
        run_dir = only_subdir(runs)
        check_train(job, rec, run_dir, s.extend_steps, mode, length, packing, rope_type)
        sets = dict(item.split("=", 1) for item in attention_sets)
        if rec.status == "pass" and "attention.check_every" in sets:
            check_dense_check(rec, run_dir, s.extend_steps // int(sets["attention.check_every"]))
        if rec.status == "pass" and "attention.dense_every" in sets:
            check_dense_steps(rec, run_dir, int(sets["attention.dense_every"]))
        if rec.status == "pass":
            job.state.run_dirs[rec.name] = run_dir

    return run


def pretrain_flows(scale: Scale) -> list[Flow]:
    return [
        Flow(
            "pretrain",
            "pretrain",
            f"base model at its native {scale.native} context (context.method=none), one document per row",
            flow_pretrain,
            min_s=40,
        )
    ]


def extend_flows(scale: Scale) -> list[Flow]:
    """extend-{model,fresh}-{dense,sparse}-{short,long}: packed rows and one document per row alternate over the
    model's source and the length."""
    flows = []
    for source in ("model", "fresh"):
        for slot, length in (("short", scale.short), ("long", scale.long)):
            for mode in ("dense", "sparse"):
                packing = "x4" if (source == "fresh") == (slot == "short") else "x1"
                rows = "4 documents per row" if packing == "x4" else "one document per row"
                what = "--model <pretrain export>" if source == "model" else "fresh model"
                flows.append(
                    Flow(
                        f"extend-{source}-{mode}-{length_label(length)}",
                        f"extend_{slot}",
                        f"extend {what}, {mode}, {length_label(length)}, {rows}"
                        + (", activation checkpointing" if slot == "long" else ""),
                        extend_flow(source, mode, slot, packing),
                        ("pretrain",) if source == "model" else (),
                        min_s=45 if slot == "long" else 30,
                    )
                )
    flows.append(
        Flow(
            f"extend-model-sparse-recall-{length_label(scale.long)}",
            "extend_long",
            f"extend --model <pretrain export>, sparse with attention.recall_target 0.95 and a dense check every 2 "
            f"steps, {length_label(scale.long)}, one document per row, activation checkpointing",
            extend_flow(
                "model",
                "sparse",
                "long",
                "x1",
                attention_sets=("attention.recall_target=0.95", "attention.check_every=2"),
            ),
            ("pretrain",),
            min_s=45,
        )
    )
    flows.append(
        Flow(
            f"extend-fresh-sparse-dense-steps-{length_label(scale.short)}",
            "extend_short",
            f"extend a fresh model, sparse with a dense step every 2 (attention.dense_every), "
            f"{length_label(scale.short)}, 4 documents per row",
            extend_flow("fresh", "sparse", "short", "x4", attention_sets=("attention.dense_every=2",)),
            min_s=30,
        )
    )
    return flows
