"""BatchUploader: a batch's tensors reach the device unchanged, as separate tensors, also when the pinned buffer is
reused by the next micro-batch before the first one was read."""

from __future__ import annotations

import pytest
import torch

from mtrain_cli.train.batch_upload import BatchUploader


def _batch(seed: int, shape=(2, 64)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    names = ("input_ids", "labels", "position_ids", "document_ids")
    return {name: torch.randint(0, 1000, shape, generator=g) for name in names}


def test_cpu_upload_is_the_batch():
    batch = _batch(0)
    out = BatchUploader(torch.device("cpu"))(batch)
    assert list(out) == list(batch) and all(torch.equal(out[k], batch[k]) for k in batch)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_uploads_reuse_one_pinned_buffer_safely():
    upload = BatchUploader(torch.device("cuda"))
    first, second = _batch(1), _batch(2)
    on_first, on_second = upload(first), upload(second)  # the second overwrites the buffer the first came from
    assert len(upload._staging) == 1
    for sent, got in ((first, on_first), (second, on_second)):
        assert list(got) == list(sent)
        assert all(got[k].is_cuda and torch.equal(got[k].cpu(), sent[k]) for k in sent)
    other = upload(_batch(3, shape=(1, 32)))  # another shape: its own buffer
    assert len(upload._staging) == 2 and other["labels"].shape == (1, 32)
