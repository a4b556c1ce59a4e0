"""Dense attention over packed documents without an [S, S] mask: the CPU per-document path, the FlexAttention
block mask (forward on CPU; forward and backward compiled on a GPU), decoding against a KV cache, all against
SDPA with an explicit document-causal mask in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.dense import (
    dense_attention,
    document_block_mask,
    document_layout,
    flex_document_attention,
)
from mtrain_cli.attention.documents import document_spans

SCALE = 0.25


def packed_ids(*rows: list[int]) -> torch.Tensor:
    """Rows of documents of these lengths; a negative length is a padding run (id -1)."""
    out = []
    for lengths in rows:
        out.append(torch.cat([torch.full((abs(n),), i if n > 0 else -1) for i, n in enumerate(lengths)]))
    return torch.stack(out)


def reference(q, k, v, doc_BS):
    S = doc_BS.shape[1]
    runs, _ = document_spans(doc_BS)
    mask = torch.ones(S, S, dtype=torch.bool, device=doc_BS.device).tril()[None] & (
        runs[:, :, None] == runs[:, None, :]
    )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=SCALE, enable_gqa=True)


def qkv(B, S, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, h, S, 16, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
        for h in (4, 2, 2)
    ]


DOCS = packed_ids([37, 51, 24, -8], [120])  # a packed row with padding, and a row of one document


def test_packed_rows_match_the_masked_reference_forward_and_backward():
    q, k, v = qkv(2, DOCS.shape[1])
    out = dense_attention(q, k, v, DOCS, SCALE, BatchCache())
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, DOCS)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout)
    for got, leaf in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad, leaf.grad, rtol=1e-10, atol=1e-12)


def test_documents_are_runs_of_equal_ids():
    """An id that comes back later is a new document, in dense attention and in the sparse planner alike."""
    doc = torch.tensor([[5, 5, 5, 9, 9, 5, 5, 5]])
    start, length = document_spans(doc)
    assert start.tolist() == [[0, 0, 0, 3, 3, 5, 5, 5]] and length.tolist() == [[3, 3, 3, 2, 2, 3, 3, 3]]
    q, k, v = qkv(1, 8)
    cache = BatchCache()
    torch.testing.assert_close(dense_attention(q, k, v, doc, SCALE, cache), reference(q, k, v, doc))
    assert document_layout(doc, cache).spans == [[(0, 3), (3, 5), (5, 8)]]


def block_sets(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) key-block sets per (row, query block) of a BlockMask, as booleans [B, NQ, NK]."""

    def dense(num_BHM, indices_BHMN):
        n = indices_BHMN.shape[-1]
        keep = torch.arange(n)[None, None, None] < num_BHM[..., None]
        out = torch.zeros(*indices_BHMN.shape[:-1], n + 1, dtype=torch.bool)
        out.scatter_(-1, torch.where(keep, indices_BHMN.long(), n), True)
        return out[:, 0, :, :n]

    return dense(mask.kv_num_blocks, mask.kv_indices), dense(mask.full_kv_num_blocks, mask.full_kv_indices)


@pytest.mark.parametrize("block", [16, 32, 128])
def test_block_mask_has_flex_attention_own_blocks(block):
    """Our block-granular builder gives the block sets FlexAttention's own create_block_mask finds by
    evaluating every (query, key) pair: skipped, partial (masked per element) and full blocks."""
    runs, _ = document_spans(DOCS)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (runs[b, q_idx] == runs[b, kv_idx])

    want = create_block_mask(
        document_causal, DOCS.shape[0], None, DOCS.shape[1], DOCS.shape[1], device="cpu", BLOCK_SIZE=block
    )
    got = document_block_mask(runs, block)
    for got_set, want_set in zip(block_sets(got), block_sets(want)):
        assert torch.equal(got_set, want_set)
    q, k, v = (t.detach() for t in qkv(2, DOCS.shape[1]))  # FlexAttention has no CPU backward
    out = flex_document_attention(q, k, v, got, SCALE, compiled=False)
    torch.testing.assert_close(out, reference(q, k, v, DOCS), rtol=1e-10, atol=1e-12)


def test_single_document_rows_take_plain_causal_attention():
    doc = packed_ids([64], [64])
    cache = BatchCache()
    layout = document_layout(doc, cache)
    assert layout.single_document and layout.spans is None and layout.block_mask is None
    q, k, v = qkv(2, 64)
    torch.testing.assert_close(dense_attention(q, k, v, doc, SCALE, cache), reference(q, k, v, doc))


@pytest.mark.parametrize("num_queries", [1, 5])
def test_decoding_against_a_kv_cache_is_bottom_right_causal(num_queries):
    q, _, _ = qkv(1, num_queries)
    _, k, v = qkv(1, 40, seed=1)
    allowed = torch.arange(40)[None, :] <= torch.arange(40 - num_queries, 40)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=SCALE, enable_gqa=True)
    torch.testing.assert_close(dense_attention(q, k, v, None, SCALE, BatchCache()), want)


def test_a_decoding_query_sees_only_its_own_documents_keys():
    """A batch of prompts decoding together: each row's cache is left-padded (id -1) to the longest; the new
    token (the last key) must see its own prompt's keys only, as if decoded alone."""
    lengths = [40, 23, 31]
    q, _, _ = qkv(3, 1)
    _, k, v = qkv(3, 40, seed=1)
    ids_BS = torch.stack([(torch.arange(40) >= 40 - n).long() - 1 for n in lengths])
    got = dense_attention(q, k, v, ids_BS, SCALE, BatchCache())
    for b, n in enumerate(lengths):
        alone = dense_attention(q[b : b + 1], k[b : b + 1, :, -n:], v[b : b + 1, :, -n:], None, SCALE, BatchCache())
        torch.testing.assert_close(got[b : b + 1], alone)
    assert not torch.allclose(got[1], dense_attention(q, k, v, None, SCALE, BatchCache())[1])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a GPU")
def test_compiled_flex_on_gpu_matches_the_reference_forward_and_backward():
    doc = packed_ids([300, 500, 200, -24], [1024]).cuda()
    q, k, v = qkv(2, doc.shape[1], torch.float32, "cuda")
    cache = BatchCache()
    out = dense_attention(q, k, v, doc, SCALE, cache)
    assert document_layout(doc, cache).block_mask is not None  # packed: the FlexAttention path ran
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves, doc)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout.double())
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)  # tf32 matmuls in the kernel
    for got, leaf in zip((q, k, v), leaves):
        torch.testing.assert_close(got.grad.double(), leaf.grad, rtol=5e-3, atol=5e-3)
