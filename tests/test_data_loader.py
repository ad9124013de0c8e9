"""Loader settings, pinned-memory estimate, worker equivalence, data-wait instrumentation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tierio.data.builder import build_indexed
from tierio.data.loader import build_loader, loader_settings, pinned_memory_estimate
from tierio.data.packing import PackedDataset, collate_packed, plan_packing
from tierio.data.indexed import IndexedDataset
from tierio.data.window import TokenWindowDataset
from tierio.errors import ConfigError


def test_production_settings():
    s = loader_settings(accelerators=8, cores=96)
    assert s.num_workers == 8 and s.pin_memory and s.persistent_workers and s.drop_last and s.prefetch_factor == 4
    assert loader_settings(accelerators=8, cores=32).num_workers == 4  # cores per accelerator
    assert loader_settings(accelerators=4, cores=2).num_workers == 1  # never zero by default
    cpu = loader_settings(accelerators=0, cores=4)
    assert cpu.num_workers == 4 and not cpu.pin_memory
    here = loader_settings()
    assert here.pin_memory == torch.cuda.is_available()
    with pytest.raises(ConfigError):
        loader_settings(prefetch_factor=0)


def test_pinned_memory_estimate():
    s = loader_settings(accelerators=1, cores=8)  # 8 workers x 4 batches ahead, pinned
    est = pinned_memory_estimate(32 << 20, s)
    assert est["batches_in_flight"] == 32 and est["shared_bytes"] == 32 * (32 << 20)
    assert est["pinned_bytes"] == 33 * (32 << 20)
    assert pinned_memory_estimate(1 << 20, loader_settings(accelerators=0, cores=8))["pinned_bytes"] == 0


def _windows(tmp_path):
    rng = np.random.default_rng(0)
    build_indexed([rng.integers(0, 30000, 500) for _ in range(40)], tmp_path / "c", vocab_size=32000)
    return TokenWindowDataset(tmp_path / "c", 64)


def test_windows_through_workers_equal_single_process(tmp_path):
    ds = _windows(tmp_path)
    single = list(build_loader(ds, 8, num_workers=0))
    multi = list(build_loader(ds, 8, num_workers=2, persistent_workers=False))
    assert len(single) == len(multi) == len(ds) // 8
    for a, b in zip(single, multi):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
    assert single[0]["input_ids"].dtype == torch.int64
    shuffled = [b["input_ids"] for b in build_loader(ds, 8, num_workers=0, shuffle=True, seed=1)]
    again = [b["input_ids"] for b in build_loader(ds, 8, num_workers=0, shuffle=True, seed=1)]
    assert all(torch.equal(a, b) for a, b in zip(shuffled, again))


def test_packed_batches_through_a_loader(tmp_path):
    rng = np.random.default_rng(1)
    build_indexed([rng.integers(1, 100, int(rng.integers(1, 60))) for _ in range(200)], tmp_path / "p", vocab_size=100)
    ds = IndexedDataset(tmp_path / "p")
    packed = PackedDataset(ds, plan_packing(ds.document_lengths(), 128))
    batch = next(iter(build_loader(packed, 4, num_workers=0, collate_fn=collate_packed)))
    assert batch["input_ids"].shape == (4, 128)
    assert int(batch["cu_seqlens"][-1]) == 4 * 128
    assert (batch["position_ids"][:, 0] == 0).all()


def test_wait_timer_on_a_real_loader(tmp_path):
    from tierio.diag.timers import WaitTimer

    ds = _windows(tmp_path)
    wt = WaitTimer()
    steps = 0
    for batch in wt.wrap(build_loader(ds, 8, num_workers=0)):
        steps += batch["input_ids"].shape[0] // 8
    s = wt.summary()
    assert steps == len(ds) // 8
    out = tmp_path / "wait.json"
    wt.to_json(out)
    assert json.loads(out.read_text())
    assert s  # mean/P50/P99 etc. are the diag module's business; here: it runs on our loader


def test_ring_slots_are_reused_only_when_nothing_views_them():
    from tierio.data.ring import BatchRing, RingRef

    ring = BatchRing(num_workers=1, slots_per_worker=2, row_shape=(3,), batch_size=2)
    s0 = ring.acquire(0)
    ring.data[s0].fill_(7)
    t = ring.materialize(RingRef(s0, 2))
    arr = t[:, 1:].numpy()  # a numpy view derived from the batch keeps the slot pinned
    del t
    assert ring.acquire(0) == 1  # the other slot
    assert ring.acquire(0) is None  # slot 0 still viewed: the worker must not overwrite it
    assert int(arr.sum()) == 7 * 4
    del arr
    assert ring.acquire(0) is None  # slot 1's turn: still filled (nobody materialised it)
    assert ring.acquire(0) == 0  # slot 0's turn: free again


def test_ring_loader_batches_equal_the_plain_path(tmp_path):
    ds = _windows(tmp_path)
    plain = [b["input_ids"].clone() for b in build_loader(ds, 4, num_workers=0)]
    fast = build_loader(_windows(tmp_path), 4, num_workers=2, persistent_workers=False)
    assert type(fast).__name__ == "RingLoader" and len(fast) == len(plain)
    streamed = []
    for b in fast:  # batches dropped each step: the ring path
        streamed.append(b["input_ids"].clone())
    assert all(torch.equal(a, b) for a, b in zip(plain, streamed))
