"""Without a GPU, Triton kernels run under the interpreter: it must be on before triton.jit decorates them."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
