"""A batch's documents read on the host (HostDocuments): the same counts, geometry and ring documents as read from
the device, and the plans take them when the trainer gave them."""

from __future__ import annotations

import dataclasses
import io
import weakref

import pytest
import torch
from rich.console import Console
from tiny_setup import small_run

from mtrain_cli.attention.batch_cache import BatchCache
from mtrain_cli.attention.documents import HostDocuments, document_spans
from mtrain_cli.attention.ring import cp_attention
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse import ops
from mtrain_cli.config import load_config
from mtrain_cli.parallel.layouts import TokenLayout
from mtrain_cli.parallel.topology import RingTopology
from mtrain_cli.train.loop import build_trainer

SETTINGS = AttentionConfig(mode="sparse", block_size=16, last_q=8, probe_windows=2, dense_below=40)


def packed_rows(seed: int, B: int = 3, S: int = 256) -> torch.Tensor:
    """Rows of documents of 1-120 tokens, an id coming back later in a row, and padding (-1) at a row's end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        lengths = torch.randint(1, 120, (S,), generator=g)
        ids = torch.repeat_interleave(torch.arange(S) % 5, lengths)[:S]
        if b == 1:
            ids[-30:] = -1
        rows.append(ids)
    return torch.stack(rows)


def device_counts(ids_BS: torch.Tensor, dense_below: int) -> tuple[int, int, bool]:
    """(longest, most long documents in a row, one document a row) as the builders read them from the device."""
    start_BS, length_BS = document_spans(ids_BS)
    end_BS = torch.arange(ids_BS.shape[1]) == start_BS + length_BS - 1
    most_long = int((end_BS & (length_BS >= dense_below)).sum(1).max())
    return int(length_BS.max()), most_long, int(start_BS[:, -1].max()) == 0


def assert_same(a, b, path: str = "") -> None:
    """Dataclasses, tuples and lists of tensors: equal field by field."""
    if dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            assert_same(getattr(a, field.name), getattr(b, field.name), f"{path}.{field.name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif not callable(a):
        assert a == b, path


@pytest.mark.parametrize("seed", range(4))
def test_host_counts_equal_the_devices(seed):
    ids_BS = packed_rows(seed)
    host = HostDocuments.of(ids_BS)
    for dense_below in (1, 40, 100, 10_000):
        assert (host.longest(), host.most_long(dense_below), host.single_document()) == device_counts(
            ids_BS, dense_below
        )
    one_each = HostDocuments.of(torch.tensor([[3, 3, 3], [-1, -1, -1]]))
    assert one_each.single_document() and not HostDocuments.of(torch.tensor([[3, 3, 4]])).single_document()


def test_a_batch_geometry_from_the_host_equals_the_devices_and_takes_the_hosts_counts(monkeypatch):
    ids_BS = packed_rows(7)
    B, S = ids_BS.shape
    read = ops.batch_geometry(ids_BS, B, S, torch.device("cpu"), SETTINGS, BatchCache())
    cache = BatchCache()
    cache.add_host_documents(ids_BS, HostDocuments.of(ids_BS))
    hosted = ops.batch_geometry(ids_BS, B, S, torch.device("cpu"), SETTINGS, cache)
    assert_same(read, hosted)
    assert ops.batch_documents(ids_BS, B, S, torch.device("cpu"), cache).longest == device_counts(ids_BS, 1)[0]

    # the counts come from the host: one more long document a row than the device holds shows in the probe rows
    monkeypatch.setattr(HostDocuments, "most_long", lambda self, dense_below: device_counts(ids_BS, dense_below)[1] + 1)
    cache = BatchCache()
    cache.add_host_documents(ids_BS, HostDocuments.of(ids_BS))
    widened = ops.batch_geometry(ids_BS, B, S, torch.device("cpu"), SETTINGS, cache)
    assert widened.rows.pos_BQ.shape[1] > read.rows.pos_BQ.shape[1]


def test_host_documents_follow_the_very_ids_they_were_given():
    ids_BS = packed_rows(1)
    cache = BatchCache()
    cache.add_host_documents(ids_BS, HostDocuments.of(ids_BS))
    assert cache.host_documents(ids_BS) is not None
    assert cache.host_documents(ids_BS.clone()) is None and cache.host_documents(None) is None
    ids_BS[0, 0] = 99  # changed in place: its host copy no longer holds
    assert cache.host_documents(ids_BS) is None

    host = HostDocuments.of(ids_BS)
    held = weakref.ref(host)
    cache.add_host_documents(ids_BS, host)
    del host, ids_BS  # the batch is done: the cache lets its documents go
    assert held() is None


def test_a_ring_takes_the_whole_rows_from_the_host_without_gathering(monkeypatch):
    """Rank 1 of a stripe ring of 2: its documents and geometry from the host equal those from gathered ids, and
    nothing is gathered."""
    ids_BS = packed_rows(3)
    S = ids_BS.shape[1]
    layout = TokenLayout("stripe", 2, SETTINGS.block_size, S)
    topology = RingTopology(1, 2, 2, 0, None, None, None)
    local_BS = ids_BS[:, layout.positions(1)]
    monkeypatch.setattr(cp_attention, "gather_document_ids", lambda local, token_layout, group: ids_BS.to(torch.int32))
    read = cp_attention.ring_geometry(local_BS, layout, topology, SETTINGS, torch.device("cpu"), BatchCache())

    def no_gather(*_):
        raise AssertionError("gathered the ids the host holds")

    monkeypatch.setattr(cp_attention, "gather_document_ids", no_gather)
    cache = BatchCache()
    cache.add_host_documents(local_BS, HostDocuments.of(ids_BS, ids_BS))
    hosted = cp_attention.ring_geometry(local_BS, layout, topology, SETTINGS, torch.device("cpu"), cache)
    assert_same(read, hosted)
    documents = cp_attention.global_documents(local_BS, layout, topology, torch.device("cpu"), cache)
    assert documents.longest == device_counts(ids_BS, 1)[0]


def test_the_trainer_gives_each_batch_its_host_documents(tmp_path):
    config = load_config("tiny", small_run(2, tmp_path, "checkpoint.export=false", "train.grad_accum=2"))
    trainer = build_trainer(config, tmp_path / "run", Console(file=io.StringIO(), width=200))
    fetched = trainer.feed.fetch()
    assert len(fetched.batches) == 2
    for row, batch in zip(fetched.rows, fetched.batches):
        host = trainer.router.batch_cache.host_documents(batch["document_ids"])
        assert host is not None and host.shape == row["document_ids"].shape and host.on_device is None
        runs = [lengths.tolist() for lengths in HostDocuments.of(row["document_ids"]).run_lengths]
        assert [lengths.tolist() for lengths in host.run_lengths] == runs
