"""Without a GPU, Triton kernels run under the interpreter: it must be on before triton.jit decorates them."""

import gc
import os

# What collection imports (torch, transformers, the modules under test) lives as long as the worker: the collector
# pauses until collection is done (pytest_collection_finish), instead of walking it again as it grows.
gc.disable()

# OpenMP threads that spin between parallel regions took several times the CPU time of the work when the suite's
# workers and their subprocesses share the cores: here they never spin (the CLI's own default, a short spin, is
# for a command alone on its cores; cli/main.py). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (after the pause above)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor on CPU (tests/test_compile.py) first builds a probe program for each vector ISA the CPU reports, to check
# that the compiler supports it (~3 s of g++ each), and caches the answers under a key holding the environment's
# path: a new checkout builds them again. Here the CPU's flags decide, as those probes do with a current g++.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# MKL resolves each vector math function (per precision) on its first call; first calls on several intra-op
# threads at once can run a low-accuracy kernel on one thread's chunk (pytorch/pytorch#188792: exp off by
# 3e-9 relative in fp64). A one-element call resolves each on one thread before any test compares at 1e-10.
for _dtype in (torch.float32, torch.float64):
    for _fn in (torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.tanh, torch.erf):
        _fn(torch.ones(1, dtype=_dtype))

# The CLI's consoles take their width when mtrain_cli.cli is imported: the width the tests' CLI runs give a command
# (tiny_setup.cli_env), whatever the test runner's own environment says (pytest-xdist's workers say 80).
os.environ["COLUMNS"] = "200"


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, the modules under test) is never garbage: frozen, a full
    collection during a test (each run's in train.distributed.end_parallel, libraries' own) scans only what the
    tests made since, instead of every module's objects."""
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config):
    """The interpreter's last collections see everything again: objects of Triton's bindings still alive at exit
    would be reported as leaks."""
    gc.unfreeze()
