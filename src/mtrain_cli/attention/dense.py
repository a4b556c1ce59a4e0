"""Dense causal attention over packed documents in O(S) memory: no [S, S] mask or score matrix is built.

Tokens attend to earlier tokens of their own document. A document is a contiguous run of equal ids in a
row, as packing writes them (padding, id -1, is one more run, so no query row is empty). The kernel:
- one document per row (no ids, or every row a single run): SDPA with is_causal (cuDNN/flash on GPU, the
  flash kernel on CPU);
- packed rows on CUDA: FlexAttention with a document-causal BlockMask, made once per batch (the caller's BatchCache)
  and shared by every layer's forward and backward; the kernel is compiled once per process (an uncompiled
  FlexAttention would materialise the scores);
- packed rows on CPU: SDPA is_causal once per document (rows × documents calls of the CPU flash kernel);
- a KV cache (fewer queries than keys): a single query sees every key, or, with ids, the keys of its own
  document (the left padding of a batch of prompts decoding together is another); a chunk of queries (one
  document) is bottom-right causal through SDPA's CausalBias, which keeps the flash/cuDNN kernels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import document_spans


@dataclass(frozen=True)
class DocumentLayout:
    """What dense attention needs from one batch's document ids; the same for all of its layers."""

    single_document: bool  # every row is one run: plain causal attention
    spans: list[list[tuple[int, int]]] | None  # CPU, packed: per row, each document's [start, end)
    block_mask: BlockMask | None  # CUDA, packed: document-causal FlexAttention mask


def document_layout(document_ids_BS: torch.Tensor, cache: BatchCache) -> DocumentLayout:
    """Per batch (cached by the id tensor); one host read decides whether rows hold one document each (none where
    the trainer gave the cache the batch's HostDocuments)."""

    def build() -> DocumentLayout:
        start_BS, _ = document_spans(document_ids_BS)  # a token's document start: its document's key
        host = cache.host_rows(document_ids_BS)
        single_document = host.single_document() if host is not None else int(start_BS[:, -1].max()) == 0
        if single_document:
            return DocumentLayout(True, None, None)
        if document_ids_BS.is_cuda:
            return DocumentLayout(False, None, document_block_mask(start_BS))
        ends_BS = torch.ones_like(start_BS, dtype=torch.bool)
        ends_BS[:, :-1] = start_BS[:, 1:] != start_BS[:, :-1]
        spans = []
        for row_ends_S in ends_BS:
            ends = (row_ends_S.nonzero()[:, 0] + 1).tolist()
            spans.append(list(zip([0, *ends[:-1]], ends)))
        return DocumentLayout(False, spans, None)

    return cache.per_batch(document_ids_BS, ("dense",), build)


def document_block_mask(doc_start_BS: torch.Tensor, block: int = 128) -> BlockMask:
    """FlexAttention's block mask for document-causal attention over rows whose tokens carry their document's
    start `doc_start_BS` (documents.document_spans), built at block granularity ([B, S/block, S/block], no
    [S, S] evaluation and nothing to compile): a block pair is skipped when it is above the diagonal or its
    query and key blocks share no document, full when both lie inside one document below the diagonal, and
    partial (masked per element by `mask_mod`) otherwise."""

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc_start_BS[b, q_idx] == doc_start_BS[b, kv_idx])

    _B, S = doc_start_BS.shape
    num_blocks = -(-S // block)
    starts_N = torch.arange(num_blocks, device=doc_start_BS.device) * block
    first_BN = doc_start_BS[:, starts_N]  # starts are non-decreasing along a row: a block spans [first, last]
    last_BN = doc_start_BS[:, (starts_N + block - 1).clamp(max=S - 1)]
    below_NN = torch.ones(num_blocks, num_blocks, dtype=torch.bool, device=doc_start_BS.device).tril()
    shared_BNN = (first_BN[:, None, :] <= last_BN[:, :, None]) & (last_BN[:, None, :] >= first_BN[:, :, None])
    one_document_BN = (first_BN == last_BN) & (starts_N + block <= S)
    full_BNN = (
        below_NN.tril(-1)
        & one_document_BN[:, :, None]
        & one_document_BN[:, None, :]
        & (first_BN[:, :, None] == first_BN[:, None, :])
    )
    partial_BNN = below_NN & shared_BNN & ~full_BNN

    def ordered(blocks_BNN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # per query block, the key blocks in ascending order first (a stable sort of "not in the set")
        indices = torch.argsort((~blocks_BNN).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return blocks_BNN.sum(-1, dtype=torch.int32)[:, None], indices[:, None]

    return BlockMask.from_kv_blocks(
        *ordered(partial_BNN), *ordered(full_BNN), BLOCK_SIZE=block, mask_mod=document_causal, seq_lengths=(S, S)
    )


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def flex_document_attention(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    block_mask: BlockMask,
    scale: float,
    compiled: bool = True,
) -> torch.Tensor:
    """FlexAttention under a document-causal block mask; GQA without repeating K/V. -> [B, H, S, D].
    Uncompiled (tests on CPU) it computes the full score matrix."""
    attend = _compiled_flex_attention() if compiled else flex_attention
    with torch.autocast(q_BHSD.device.type, enabled=False):  # q/k/v come in one compute dtype already
        return attend(
            q_BHSD, k_BHkSD, v_BHkSD, block_mask=block_mask, scale=scale, enable_gqa=q_BHSD.shape[1] != k_BHkSD.shape[1]
        )


def dense_attention(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    v_BHkSD: torch.Tensor,
    document_ids_BS: torch.Tensor | None,
    scale: float,
    cache: BatchCache,
) -> torch.Tensor:
    """Causal (document-masked when ids are given) attention; GQA without repeating K/V. -> [B, H, Sq, D]."""
    num_queries, num_keys = q_BHSD.shape[2], k_BHkSD.shape[2]
    gqa = q_BHSD.shape[1] != k_BHkSD.shape[1]
    sdpa = functools.partial(F.scaled_dot_product_attention, scale=scale, enable_gqa=gqa)
    if num_queries != num_keys:
        if num_queries == 1:  # the newest token sees the whole cache, or with ids the keys of its own document
            if document_ids_BS is None:
                return sdpa(q_BHSD, k_BHkSD, v_BHkSD)
            assert document_ids_BS.shape[1] == num_keys, "document ids must cover every key"
            own_B11S = (document_ids_BS == document_ids_BS[:, -1:])[:, None, None, :]
            return sdpa(q_BHSD, k_BHkSD, v_BHkSD, attn_mask=own_B11S)
        assert document_ids_BS is None, "a chunk of queries against a cache is one document (no ids)"
        from torch.nn.attention.bias import causal_lower_right  # loads torch._dynamo, and with it Triton

        return sdpa(q_BHSD, k_BHkSD, v_BHkSD, attn_mask=causal_lower_right(num_queries, num_keys))
    if document_ids_BS is None:
        return sdpa(q_BHSD, k_BHkSD, v_BHkSD, is_causal=True)
    assert document_ids_BS.shape[1] == num_keys, "document ids must cover every key"
    layout = document_layout(document_ids_BS, cache)
    if layout.single_document:
        return sdpa(q_BHSD, k_BHkSD, v_BHkSD, is_causal=True)
    if layout.block_mask is not None:
        return flex_document_attention(q_BHSD, k_BHkSD, v_BHkSD, layout.block_mask, scale)
    rows = []
    for b, spans in enumerate(layout.spans):
        rows.append(
            torch.cat(
                [
                    sdpa(
                        q_BHSD[b : b + 1, :, s:e],
                        k_BHkSD[b : b + 1, :, s:e],
                        v_BHkSD[b : b + 1, :, s:e],
                        is_causal=True,
                    )
                    for s, e in spans
                ],
                dim=2,
            )
        )
    return torch.cat(rows, dim=0)
