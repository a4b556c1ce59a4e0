"""Plain chunk pairs of the ring by a library attention kernel that returns the LSE.

A plain pair (ring_plan.py) has one document over all its queries and keys in every batch row, and its rows run
dense, so its mask is all-visible or causal on the diagonal: exactly what a fused attention library computes.
The algorithm, per ring step:
1. `library_calls` coalesces the step's plain pairs into as few calls as give the same mask: two all-visible
   pairs sharing a query (key) range with adjacent key (query) ranges become one; on the diagonal step the
   causal pair of each local chunk and the all-visible pair between them become one causal call over the
   rank's whole shard (the local order of a zigzag shard is its global order). A one-document row thus makes
   one call per step, as PyTorch's own ring (`context_parallel`) does.
2. forward: the library's (out, lse) of the call is merged into the rows' fp32 (out, lse) by LSE.
3. backward: the library's backward is given the rows' *final* lse and output (its own delta comes from them,
   as in PyTorch's ring) and returns this call's dQ, dK, dV, added into the fp32 accumulators.

Engines: "triton" (CUDA) runs cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention` and its
backward: the fastest SDPA backend on H100/H200 with GQA served natively, 1.7x the flash backend on our shape;
chosen over flash for that; bf16/fp16 only). "reference" runs the same contract in plain torch (CPU, tests).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mtrain_cli.attention.ring.ring_plan import ChunkPair
from mtrain_cli.attention.sparse.chunk import masked_backward, masked_forward, merge_partial
from mtrain_cli.attention.sparse.engine import Engine

LIBRARY_DTYPES = (torch.bfloat16, torch.float16)  # what cuDNN's fused attention takes

# The rank of the LSE cuDNN's forward returns ([B, H, S] or [B, H, S, 1], by torch version); its backward takes
# the LSE in that same shape. Learned from the first forward of the process, which precedes every backward.
_cudnn_lse_rank: list[int] = []


@dataclass(frozen=True)
class LibraryCall:
    q_slice: slice  # of the rank's local queries
    k_slice: slice  # of the K/V chunk held at this step
    causal: bool  # top-left causal over the two ranges (same positions); else every key visible


def _merged(one: LibraryCall, other: LibraryCall) -> LibraryCall | None:
    """One all-visible call over both (`one` before `other`), or None."""
    if one.causal or other.causal:
        return None
    if one.q_slice == other.q_slice and one.k_slice.stop == other.k_slice.start:
        return LibraryCall(one.q_slice, slice(one.k_slice.start, other.k_slice.stop), False)
    if one.k_slice == other.k_slice and one.q_slice.stop == other.q_slice.start:
        return LibraryCall(slice(one.q_slice.start, other.q_slice.stop), one.k_slice, False)
    return None


def _diagonal(calls: list[LibraryCall]) -> list[LibraryCall]:
    """causal(A, A) + full(B, A) + causal(B, B), A just before B -> causal(A ∪ B, A ∪ B)."""
    for first in calls:
        if not first.causal:
            continue
        for second in calls:
            if not (second.causal and second.q_slice.start == first.q_slice.stop):
                continue
            between = LibraryCall(second.q_slice, first.k_slice, False)
            if between in calls:
                whole = slice(first.q_slice.start, second.q_slice.stop)
                rest = [c for c in calls if c not in (first, second, between)]
                return _diagonal([LibraryCall(whole, whole, True), *rest])
    return calls


def library_calls(pairs: Sequence[ChunkPair]) -> list[LibraryCall]:
    """The step's plain pairs as library calls, coalesced (see the module's docstring)."""
    calls = _diagonal([LibraryCall(p.q_slice, p.k_slice, p.plain == "causal") for p in pairs if p.plain is not None])
    while True:
        pairs_of_calls = ((one, other) for one in calls for other in calls if one is not other)
        found = next(((a, b, both) for a, b in pairs_of_calls if (both := _merged(a, b)) is not None), None)
        if found is None:
            return calls
        one, other, both = found
        calls = [c for c in calls if c is not one and c is not other] + [both]


def library_runs(engine: Engine, q_BHSD: torch.Tensor) -> bool:
    """Whether plain pairs run the library (else our kernels, on their layouts). cuDNN takes bf16/fp16 only:
    fp32 on CUDA runs every pair on our kernels, and says so once. The Triton engine on CPU tensors (the
    kernels' interpreter, in tests) has no cuDNN: our kernels run every pair."""
    if engine == "reference":
        return True
    if not q_BHSD.is_cuda:
        return False
    if q_BHSD.dtype in LIBRARY_DTYPES:
        return True
    warnings.warn(
        f"dense ring attention in {q_BHSD.dtype} on CUDA: cuDNN takes bf16/fp16 only, so every chunk pair runs the "
        f"Triton kernels (slower); train in bf16 (train.dtype auto or bf16) for the library path",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def _causal_mask(call: LibraryCall, device: torch.device) -> torch.Tensor | None:
    if not call.causal:
        return None
    n = call.q_slice.stop - call.q_slice.start
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def plain_forward(engine: Engine, q_BHSD, k_BHkSD, v_BHkSD, call: LibraryCall, scale: float, out_BHSD, lse_BHS) -> None:
    """Merge the call's attention of q (its query range) over k, v (its key range) into fp32 (out, lse)."""
    if engine == "reference":
        masked_forward(q_BHSD, k_BHkSD, v_BHkSD, _causal_mask(call, q_BHSD.device), scale, out_BHSD, lse_BHS)
        return
    B, H, Sq, _ = q_BHSD.shape
    # contiguous inputs, as PyTorch's own ring gives its K/V (a slice of a chunk costs one copy; a whole shard none)
    part_BHSD, part_lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention.default(
        q_BHSD.contiguous(),
        k_BHkSD.contiguous(),
        v_BHkSD.contiguous(),
        None,
        True,
        0.0,
        call.causal,
        False,
        scale=scale,
    )
    if not _cudnn_lse_rank:
        _cudnn_lse_rank.append(part_lse.dim())
    merge_partial(out_BHSD, lse_BHS, part_BHSD.float(), part_lse.reshape(B, H, Sq))


def plain_backward(
    engine: Engine,
    q_BHSD,
    k_BHkSD,
    v_BHkSD,
    out_BHSD,
    lse_BHS,
    dout_BHSD,
    delta_BHS,
    call: LibraryCall,
    scale: float,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Add the call's dQ, dK, dV into grads (fp32), from the rows' final lse (fp32) and output. The reference
    uses delta; cuDNN takes the output in the inputs' dtype (`out_BHSD`) and makes its own delta."""
    if engine == "reference":
        mask = _causal_mask(call, q_BHSD.device)
        masked_backward(q_BHSD, k_BHkSD, v_BHkSD, lse_BHS, dout_BHSD, delta_BHS, mask, scale, grads)
        return
    assert _cudnn_lse_rank, "a cuDNN backward runs after its forward"
    lse = lse_BHS.contiguous()
    if _cudnn_lse_rank[0] == 4:
        lse = lse[..., None]
    seed = torch.zeros((), dtype=torch.int64, device=q_BHSD.device)  # no dropout: never read
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default(
        dout_BHSD.contiguous(),
        q_BHSD.contiguous(),
        k_BHkSD.contiguous(),
        v_BHkSD.contiguous(),
        out_BHSD.contiguous(),
        lse,
        seed,
        seed,
        None,
        None,
        None,
        q_BHSD.shape[2],
        k_BHkSD.shape[2],
        0.0,
        call.causal,
        scale=scale,
    )
    assert dk.shape == k_BHkSD.shape and dq.shape == q_BHSD.shape, "cuDNN returns GQA gradients per K/V head"
    for acc, part in zip(grads, (dq, dk, dv)):
        acc.add_(part)
