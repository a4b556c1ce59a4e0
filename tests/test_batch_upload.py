"""BatchUploader: a batch's tensors reach the device unchanged, as separate tensors, also when a pinned buffer is
refilled by a later micro-batch before the first one was read."""

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
@pytest.mark.parametrize("num_buffers", [1, 2])
def test_cuda_uploads_reuse_their_pinned_buffers_safely(num_buffers):
    upload = BatchUploader(torch.device("cuda"), num_buffers=num_buffers)
    sent = [_batch(seed) for seed in range(3)]
    got = [upload(batch) for batch in sent]  # the later ones refill the buffers the first came from
    (buffers,) = upload._staging.values()
    assert len(buffers) == num_buffers
    for batch, on_device in zip(sent, got):
        assert list(on_device) == list(batch)
        assert all(on_device[k].is_cuda and torch.equal(on_device[k].cpu(), batch[k]) for k in batch)
    other = upload(_batch(3, shape=(1, 32)))  # another shape: buffers of its own
    assert len(upload._staging) == 2 and other["labels"].shape == (1, 32)
