"""Training: the parts built from the config (parts.py), parallelism applied to the model (parallelize.py), the
processes set up (distributed.py), the loop (loop.py), loss, optimizer and schedule, DCP checkpoints, progress and
the run's records; `mtrain extend` as a run (run.py).

This is the package's public face; other packages import from here. Names resolve on first use: importing the
face loads nothing heavy.
"""

from mtrain_cli.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "run": ("run_extend",),
        "loop": ("build_trainer",),
        "parts": ("read_inputs",),
        "distributed": ("parallel_scope",),
        "records": ("FINAL_LOSS_STEPS",),
        "stops": ("Interrupted",),
        "lora": ("adapter_base", "apply_lora", "is_adapter_directory", "load_adapter_model", "merged_model"),
        "checkpoint": (
            "CheckpointMismatch",
            "UnreadableCheckpoint",
            "checkpoint_dirs",
            "load_model_weights",
            "verify_checkpoint",
        ),
    },
)
