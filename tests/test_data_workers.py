"""BatchWorkers: StreamingDataset batches from worker processes, handed over as ring slot numbers."""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest
import torch

import tierio.data.workers as workers_mod
import tierio.data.loader as loader_mod
from tierio.data.loader import build_loader, loader_settings
from tierio.data.ring import RingBatch
from tierio.data.shards import ShardWriter, load_manifest
from tierio.data.streaming import StreamingDataset
from tierio.data.workers import BatchWorkers, WorkerError
from tierio.errors import IntegrityError

N = 400


@pytest.fixture
def url(tmp_path) -> str:
    u = f"file://{tmp_path / 'remote'}"
    with ShardWriter(u, ["x", "doc"], shard_bytes=640) as w:
        for i in range(N):
            w.write({"x": np.array([i, i % 7], np.int64), "doc": np.arange(i % 3, dtype=np.int32)})
    return u


def _dataset(tmp_path, url, **kw):
    return StreamingDataset(url, tmp_path / "cache", "4MiB", seed=3, shuffle_buffer=48, batch_size=8, **kw)


def _loader(ds, workers=2, **kw):
    return build_loader(ds, 8, settings=loader_settings(num_workers=workers, drop_last=False), **kw)


def _ids(batches):
    return [i for b in batches for i in b["x"][:, 0].tolist()]


def test_workers_send_slot_numbers_and_the_order_is_one_process_order(tmp_path, url, monkeypatch):
    items = []
    decode = workers_mod._decode

    def spy(raw):  # the loop's side of every worker message
        msg = decode(raw)
        items.append(msg.item)
        return msg

    monkeypatch.setattr(workers_mod, "_decode", spy)
    ds = _dataset(tmp_path, url)
    order = ds.rank_sample_ids(0).tolist()
    loader = _loader(_dataset(tmp_path, url))
    assert isinstance(loader.workers, BatchWorkers)
    batches = list(loader)
    assert _ids(batches) == order
    b = batches[0]
    assert b["x"].dtype == torch.int64 and isinstance(b["doc"], list) and all(isinstance(d, torch.Tensor) for d in b["doc"])
    # the fixed-size field stays in the ring; only the variable-size one travels with the message
    sent = [i for i in items if i is not None]
    assert len(sent) == len(batches) and all(isinstance(i, RingBatch) and set(i.rest) == {"doc"} for i in sent)
    loader.shutdown()


def test_fixed_fields_only_travel_as_two_numbers(tmp_path, monkeypatch):
    u = f"file://{tmp_path / 'fixed'}"
    with ShardWriter(u, ["x"], shard_bytes=640) as w:
        for i in range(N):
            w.write({"x": np.array([i, 1], np.int64)})
    sizes = []
    decode = workers_mod._decode
    monkeypatch.setattr(workers_mod, "_decode", lambda raw: (sizes.append(len(raw)), decode(raw))[1])
    ds = StreamingDataset(u, None, seed=1, batch_size=8)
    order = ds.rank_sample_ids(0).tolist()
    loader = _loader(StreamingDataset(u, None, seed=1, batch_size=8))
    assert _ids(loader) == order
    assert sizes and max(sizes) == workers_mod._HEADER.size  # no pickled batch crossed the pipe
    loader.shutdown()


def test_stopping_early_moves_on_to_the_next_epoch_and_frees_the_slots(tmp_path, url):
    ds = _dataset(tmp_path, url)
    loader = _loader(ds)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    assert _ids(got) == ds.rank_sample_ids(0).tolist()[:24]
    del it, got
    gc.collect()
    assert _ids(loader) == ds.rank_sample_ids(1).tolist()  # as a DataLoader with persistent workers
    gc.collect()
    assert int((loader.ring.state == 1).sum()) == 0  # every slot of the abandoned epoch came back
    assert _ids(loader) == ds.rank_sample_ids(2).tolist()
    loader.shutdown()


def test_non_persistent_workers_stop_after_each_epoch(tmp_path, url):
    ds = _dataset(tmp_path, url)
    loader = _loader(ds, persistent_workers=False)
    assert _ids(loader) == ds.rank_sample_ids(0).tolist()
    assert not loader.workers.started


def test_a_worker_error_reaches_the_loop_with_its_type(tmp_path, url):
    man = load_manifest(url)
    victim = tmp_path / "remote" / man.shards[3].key
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    loader = _loader(_dataset(tmp_path, url))
    with pytest.raises(IntegrityError, match=man.shards[3].key):
        list(loader)
    loader.shutdown()


def test_a_worker_that_dies_is_named(tmp_path, url, monkeypatch):
    monkeypatch.setattr(loader_mod, "SMALL_BATCH_PREFETCH_BYTES", 0)  # one batch in flight per worker
    loader = _loader(_dataset(tmp_path, url), prefetch_factor=1)
    it = iter(loader)
    next(it)
    os.kill(loader.workers.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match="batch worker 1 .* died"):
        for _ in it:
            pass
    loader.shutdown()
