"""What computes a sparse layout: the Triton kernels, or the plain-torch reference (CPU runs; the tests' oracle,
the same arithmetic on a dense mask built from the layout)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

Engine = Literal["triton", "reference"]


def default_engine(device: torch.device) -> Engine:
    """Triton on CUDA; the reference on CPU (tests run the kernels under TRITON_INTERPRET=1)."""
    return "triton" if device.type == "cuda" else "reference"
