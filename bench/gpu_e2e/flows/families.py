"""The model families users bring, as they bring them: a Llama-3.x-style model (rope_type llama3, which YaRN
replaces) and a Qwen3-style one (q/k RMSNorm, head_dim 128 at twice hidden/heads), each saved in bf16 as sharded
safetensors with an index, a chat template and a generation config (`python -m mtrain_cli.model.tiny`; random
weights). Each is extended with --model, dense and sparse, evaluated sparse, and its export loaded back."""

from __future__ import annotations

from collections.abc import Callable

from bench.gpu_e2e.checks import finish
from bench.gpu_e2e.flows.evaluate import eval_flow
from bench.gpu_e2e.flows.resume import export_check_flow
from bench.gpu_e2e.flows.train import extend_flow
from bench.gpu_e2e.job import Flow, Job, Record
from bench.gpu_e2e.scales import Scale, length_label

# family -> hidden size giving head dim 128 with 4 heads (qwen3's head_dim is twice hidden/heads)
FAMILIES = {"llama3": 512, "qwen3": 256}


def make_model_flow(family: str, hidden_size: int) -> Callable[[Job, Record], None]:
    def run(job: Job, rec: Record) -> None:
        s = job.scale
        model_dir = job.out_dir("models", rec.name)
        cmd = [
            job.args.python,
            "-m",
            "mtrain_cli.model.tiny",
            family,
            str(model_dir),
            "--context",
            str(s.native),
            "--hidden-size",
            str(hidden_size),
            "--num-layers",
            str(s.model["num_hidden_layers"]),
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--bf16",
            "--max-shard-size",
            "2MB",
        ]
        rc = job.run(rec, cmd, rec.timeout_s)
        shards = sorted(model_dir.glob("*.safetensors"))
        problems = [] if rc == 0 else [f"exit code {rc}"]
        if len(shards) < 2 or not (model_dir / "model.safetensors.index.json").is_file():
            problems.append(f"expected sharded safetensors with an index, found {[p.name for p in shards]}")
        finish(rec, problems, [f"{len(shards)} bf16 shards with an index"])
        if rec.status == "pass":
            job.state.models[rec.name] = model_dir

    return run


def flows(scale: Scale) -> list[Flow]:
    flows = []
    for family, hidden_size in FAMILIES.items():
        made = f"{family}-model"
        flows.append(
            Flow(made, "export", f"a {family} model: bf16, sharded, random", make_model_flow(family, hidden_size))
        )
        for mode in ("dense", "sparse"):
            flows.append(
                Flow(
                    f"{family}-extend-{mode}",
                    "extend_short",
                    f"extend --model <{family} model>, {mode}, {length_label(scale.short)}, 4 documents per row",
                    extend_flow("model", mode, "short", "x4", model_flow=made),
                    (made,),
                    min_s=30,
                )
            )
        trained = f"{family}-extend-sparse"
        flows += [
            Flow(
                f"{family}-eval-sparse",
                "eval",
                f"mtrain eval --attention sparse of the sparse {family} run",
                eval_flow("sparse", trained),
                (trained,),
                min_s=50,
            ),
            Flow(
                f"{family}-export-check",
                "export",
                f"the sparse {family} run's export loads with plain transformers",
                export_check_flow(trained, scale.short),
                (trained,),
                min_s=15,
            ),
        ]
    return flows
