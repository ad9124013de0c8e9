"""The accelerator paths on a CUDA device, each checked byte for byte against the CPU path's:
pinned staging with the side-stream device-to-host copy (plain and overlapped saves), the weight
loader's pinned ring and GPUDirect Storage, the KV device tier, and ``pin_memory_device``.

Marked ``gpu``: scripts/gpu-check.sh runs them (``pytest -m gpu``) on a GPU machine; where CUDA
is absent every one skips. The 2-process NCCL checkpoint is in test_gpu_nccl.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from kv_helpers import LAYOUT, NS, assert_clean, block_of, config, tokens
from tierio.ckpt import CheckpointManager, inspect
from tierio.errors import SnapshotChangedError
from tierio.io import gds
from tierio.io.buffers import HostBuffer
from tierio.kv import KVCache, KVTier
from tierio.weights import LoadStats, load, load_into

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: scripts/gpu-check.sh runs this on a GPU machine")]


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        g = got[k].cpu()
        assert g.dtype == v.dtype and g.shape == v.shape and torch.equal(g, v), k


# -- checkpoint staging ------------------------------------------------------------------------
def host_state() -> dict:
    """Tensors of several dtypes and sizes: some above the overlapped save's in-save limit, one
    not contiguous (the copy gathers it), one empty."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(1024, 384, generator=g)
    return {"model": {"w": w, "wt": w.t(), "b": torch.randn(70_001, generator=g).bfloat16(),
                      "ids": torch.arange(77), "h": torch.randn(3, 5, 7, generator=g).half(), "e": torch.empty(0, 4)},
            "step": 3}


def on(state: dict, device: str) -> dict:
    return {"model": {k: v.to(device, copy=True) for k, v in state["model"].items()}, "step": state["step"]}


def chunk_digests(root, step: int) -> dict:
    return {n: [(c.begin, c.end, c.xxh3) for c in t.chunks] for n, t in inspect(root, step).ranks[0].tensors.items()}


def test_host_buffers_are_pinned():
    buf = HostBuffer(1 << 20)
    assert buf.pinned and buf.tensor().is_pinned()
    shared = HostBuffer(1 << 20, offload=True)  # the persist process's staging memory (cudaHostRegister)
    assert shared.offload and shared.pinned and shared.tensor().is_pinned()


@pytest.mark.parametrize("overlap", [False, True], ids=["save", "zero-stall"])
def test_a_save_of_device_tensors_writes_the_bytes_of_the_cpu_save(tmp_path, overlap):
    cpu = host_state()
    dev = on(cpu, "cuda")
    with CheckpointManager([tmp_path / "cpu"], overlap=overlap) as mgr:
        mgr.save(1, cpu).wait()
    with CheckpointManager([tmp_path / "gpu"], overlap=overlap) as mgr:
        h = mgr.save(1, dev)
        mgr.before_update()  # overlap: the copies are done (without overlap they were done in save)
        for t in dev["model"].values():
            t.add_(1)  # queued on the caller's stream after the copies: not in the save
        h.wait()
        into = {"model": {k: torch.full(v.shape, 9, dtype=v.dtype, device="cuda") for k, v in dev["model"].items()}}
        out = mgr.restore(into=into)
    assert chunk_digests(tmp_path / "gpu", 1) == chunk_digests(tmp_path / "cpu", 1)
    assert_same(out["model"], cpu["model"])
    assert all(v.is_cuda for v in out["model"].values()) and out["step"] == 3


def test_a_device_tensor_changed_before_the_update_fails_the_overlapped_save(tmp_path):
    dev = on(host_state(), "cuda")
    with CheckpointManager([tmp_path], overlap=True) as mgr:
        h = mgr.save(1, dev)
        dev["model"]["w"].mul_(2)  # the promise broken: changed in place before before_update()
        with pytest.raises(SnapshotChangedError, match="tensor 'model/w' changed in place"):
            mgr.before_update()
        assert isinstance(h.persisted.exception(), SnapshotChangedError)
        mgr.wait()  # reported once, by before_update()
        assert mgr.steps() == []


# -- weight loads -------------------------------------------------------------------------------
@pytest.fixture
def weights_file(tmp_path):
    """Tensors whose file offsets are not multiples of their element size after the first, and
    one of 6 MiB so a load takes several windows of the ring."""
    g = torch.Generator().manual_seed(1)
    tensors = {"a.int8": torch.randint(-100, 100, (13,), dtype=torch.int8, generator=g),
               "b.bf16": torch.randn(777, generator=g).bfloat16(), "c.f32": torch.randn(1536, 1024, generator=g),
               "d.f16": torch.randn(3, 5, 7, generator=g).half(), "e.i64": torch.arange(1001)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


def test_the_pinned_ring_loads_the_bytes_of_a_cpu_load(weights_file):
    want = load_file(str(weights_file))
    stats = LoadStats()
    got = load(weights_file, device="cuda", use_gds=False, chunk_bytes="1MiB", stats=stats)
    assert stats.method == "pinned-ring" and all(v.is_cuda for v in got.values())
    assert_same(got, want)
    default = LoadStats()  # GDS where kvikio works, else the ring
    assert_same(load(weights_file, device="cuda", stats=default), want)
    assert default.method in ("pinned-ring", "gds")
    assert_same(load(weights_file, device="cuda", use_gds=False, dtype=torch.bfloat16),
                {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in want.items()})
    dst = {k: torch.zeros_like(v, device="cuda") for k, v in want.items()}
    dst["c.f32"] = torch.zeros(1536, 1024, dtype=torch.float16, device="cuda")  # staged, then converted
    load_into(dst, weights_file, chunk_bytes="1MiB")
    assert_same(dst, {**want, "c.f32": want["c.f32"].half()})


@pytest.mark.skipif(not gds.available(), reason="kvikio does not work with a CUDA device here: the GDS path is not run")
def test_gds_loads_the_bytes_of_a_cpu_load(weights_file):
    stats = LoadStats()
    got = load(weights_file, device="cuda", use_gds=True, stats=stats)
    assert stats.method == "gds", f"GDS fell back to {stats.method} (compat mode: {gds.compat_mode()})"
    assert_same(got, load_file(str(weights_file)))


# -- the KV device tier ---------------------------------------------------------------------------
def test_the_kv_device_tier_on_cuda_serves_the_bytes_of_its_cpu_stand_in():
    B = LAYOUT.block_bytes
    seen = {}
    for device in ("cpu", "cuda"):
        with KVCache(LAYOUT, NS, config(dram_blocks=16, device_bytes=4 * B, device=device)) as c:
            keys = c.hash_blocks(tokens(10))
            src = torch.from_numpy(np.concatenate([block_of(k) for k in keys])).to(device)
            assert c.put(keys, src).result().dropped == 0  # 10 blocks, 4 slots: 6 written down to DRAM
            c.wait()
            tiers = c.lookup(keys).tiers
            flat = torch.zeros_like(src)
            assert c.get(keys, flat).result().blocks == 10
            per_block = [torch.zeros(LAYOUT.shape, dtype=torch.float16, device=device) for _ in keys]
            assert c.get(keys, per_block).result().blocks == 10
            host = np.zeros(src.numel(), dtype=np.uint8)  # device blocks into host memory
            assert c.get(keys, host).result().blocks == 10
            seen[device] = (tiers, flat.cpu(), torch.cat([t.view(torch.uint8).reshape(-1).cpu() for t in per_block]),
                            torch.from_numpy(host))
            assert c.stats().device == (str(torch.device("cuda", torch.cuda.current_device())) if device == "cuda" else "cpu")
            assert_clean(c)
    want = torch.from_numpy(np.concatenate([block_of(k) for k in keys]))
    for tiers, *_ in seen.values():  # which blocks went down depends on timing; never more than the slots
        assert set(tiers) == {KVTier.DEVICE, KVTier.DRAM} and tiers.count(KVTier.DEVICE) <= 4
    for got in seen["cuda"][1:] + seen["cpu"][1:]:
        assert torch.equal(got, want)


# -- pin_memory_device ----------------------------------------------------------------------------
def test_loaders_with_pin_memory_device_give_pinned_batches_of_the_same_bytes(tmp_path):
    from tierio.data.builder import build_indexed
    from tierio.data.loader import build_loader
    from tierio.data.shards import ShardWriter
    from tierio.data.streaming import StreamingDataset
    from tierio.data.window import TokenWindowDataset

    rng = np.random.default_rng(0)
    build_indexed([rng.integers(0, 30000, 500) for _ in range(40)], tmp_path / "c", vocab_size=32000)
    url = f"file://{tmp_path / 'remote'}"
    with ShardWriter(url, ["x"], shard_bytes=640) as w:
        for i in range(200):
            w.write({"x": np.array([i, i % 7], np.int64)})
    makers = {"windows": lambda: TokenWindowDataset(tmp_path / "c", 64),
              "stream": lambda: StreamingDataset(url, None, seed=1, batch_size=8)}
    for name, make in makers.items():
        plain = list(build_loader(make(), 8, num_workers=0, pin_memory=False))
        pinned = list(build_loader(make(), 8, num_workers=2, persistent_workers=False, pin_memory=True,
                                   pin_memory_device="cuda"))
        assert len(plain) == len(pinned) > 0, name
        for a, b in zip(plain, pinned):
            assert a.keys() == b.keys(), name
            for k in a:
                assert b[k].is_pinned() and torch.equal(a[k], b[k]), (name, k)


def test_probe_gds_reads_the_same_file_both_ways(tmp_path):
    from tierio.diag.probe import probe_gds

    report = probe_gds(tmp_path, 64 << 20)
    if not gds.available():
        assert report is None
        return
    assert [(r.mode, r.op) for r in report.results] == [("gds", "read"), ("bounce", "read")]
    assert all(r.bytes == 64 << 20 and r.seconds > 0 for r in report.results)
    assert not list(tmp_path.glob(".tierio-gds-*"))
