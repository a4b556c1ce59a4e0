"""`mtrain profile`: the sparse kernels against dense (kernels.py), the measured crossover (crossover.py), ring
attention over ranks (ring.py) and whole training steps (step.py), each written as a report (report.py).

This is the package's public face; other packages import from here. Names resolve on first use: importing the
face loads neither torch nor Triton.
"""

from mtrain_cli.lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    {
        "kernels": ("KernelProfileSpec", "cuda_time_ms", "kernel_profile_table", "kernel_table", "run_kernel_profile"),
        "crossover": ("CrossoverSpec", "crossover_table", "run_crossover_profile"),
        "ring": ("profile_ring_main",),
        "step": ("profile_step", "step_table"),
        "report": ("write_report",),
    },
)
