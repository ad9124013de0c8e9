"""A data position that survives a change of world size: save on 4 ranks x 2 workers at a random step,
resume on 2 ranks without workers and on 3 ranks; every sample of the epoch is seen exactly once.

The ranks are simulated in one process (each rank's dataset is made with its rank and world size, as
torch.distributed would give them); the workers are real loader worker processes."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest

from tierio.data import IndexedDataset, PackedDataset, TokenWindowDataset, build_indexed, plan_packing
from tierio.data.blend import BlendedDataset
from tierio.data.loader import StatefulLoader
from tierio.data.position import EpochSplit
from tierio.data.shards import ShardWriter
from tierio.data.streaming import StreamingDataset
from tierio.errors import ConfigError, FormatError

SEQ, B = 4, 4
SEED = random.randrange(1 << 30)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Makers of rank datasets of each kind, and how to name a batch's samples."""
    root = tmp_path_factory.mktemp("position")
    with ShardWriter(f"file://{root / 'stream'}", ["x"], shard_bytes=256) as w:
        for i in range(250):
            w.write({"x": np.array([i], np.int64)})
    build_indexed([np.arange(250 * SEQ + 1)], root / "flat", dtype=np.int32)
    build_indexed([np.arange(10_000, 10_000 + 190 * SEQ + 1)], root / "flat2", dtype=np.int32)
    docs = [np.full(n, j + 1) for j, n in enumerate(np.random.default_rng(0).integers(2, 9, 500))]
    build_indexed(docs, root / "docs", dtype=np.int32)
    ds = IndexedDataset(root / "docs")
    plan = plan_packing(ds.document_lengths(), 16)

    def stream(r, w):
        return StreamingDataset(f"file://{root / 'stream'}", root / "cache", "64MiB", seed=5, shuffle_buffer=40,
                                batch_size=B, rank=r, world_size=w)

    def windows(r, w):
        return TokenWindowDataset(root / "flat", SEQ, rank=r, world_size=w)

    def packed(r, w):
        return PackedDataset(ds, plan, rank=r, world_size=w)

    def blend(r, w):
        return BlendedDataset([windows(0, 1), TokenWindowDataset(root / "flat2", SEQ)], [0.6, 0.4], rank=r,
                              world_size=w)

    def first_token(batch):
        return batch["input_ids"][:, 0].tolist()

    def pack_docs(batch):  # a pack is named by its documents (document j's tokens are all j + 1)
        return [tuple(sorted(set(row.tolist()) - {0})) for row in batch["input_ids"]]

    return {"stream": (stream, lambda b: b["x"][:, 0].tolist(), None),
            "windows": (windows, first_token, None),
            "packed": (packed, pack_docs, _collate_packs),
            "blend": (blend, first_token, None)}


def _collate_packs(packs):
    import torch

    return {"input_ids": torch.from_numpy(np.stack([p["input_ids"] for p in packs]))}


def _loader(make, collate, r, w, workers):
    kw = {"collate_fn": collate} if collate else {}
    return StatefulLoader(make(r, w), B, num_workers=workers, drop_last=False, **kw)


@pytest.mark.parametrize("kind", ["stream", "windows", "packed", "blend"])
def test_resume_on_another_world_size_sees_every_sample_once(sources, kind):
    make, names, collate = sources[kind]
    rng = random.Random(f"{SEED}-{kind}")
    epoch = [n for r in range(1) for b in _loader(make, collate, 0, 1, 0) for n in names(b)]
    assert len(set(epoch)) == len(epoch)
    steps = rng.randrange(1, len(make(0, 4)) // B)
    before, states = [], []
    for r in range(4):
        loader = _loader(make, collate, r, 4, 2)
        for step, batch in enumerate(loader):
            before += names(batch)
            if step + 1 == steps:
                states.append(loader.state_dict())
                break
        loader._drop_loader()
        del loader
    gc.collect()
    assert all(s == states[0] for s in states), "every rank records the same global position"
    assert states[0]["epoch"] == 0 and len(before) == 4 * steps * B
    for world, workers in ((2, 0), (3, 1)):
        after = []
        for r in range(world):
            loader = _loader(make, collate, r, world, workers)
            loader.load_state_dict(states[0])
            after += [n for b in loader for n in names(b)]
            assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["consumed"] == []
            if r == 0 and workers:  # the next epoch is whole again, as on a fresh start
                fresh = _loader(make, collate, 0, world, 0)
                fresh.dataset.set_epoch(1)
                fresh.epoch = 1
                assert [n for b in loader for n in names(b)] == [n for b in fresh for n in names(b)]
            loader._drop_loader()
        seen = before + after
        assert len(seen) == len(set(seen)), f"a sample seen twice (seed {SEED}, {steps} steps, {world} ranks)"
        missing = set(epoch) - set(seen)
        assert set(seen) <= set(epoch) and len(missing) < world, f"skipped {len(missing)} (seed {SEED})"


def test_state_dicts_are_checked():
    split = EpochSplit(100, 0, 2, "contiguous")
    with pytest.raises(FormatError, match="consumed interval"):
        split.from_state({"epoch": 0, "total": 100, "consumed": [[5, 500]]}, "x")
    with pytest.raises(FormatError, match="consumed interval"):
        split.from_state({"epoch": 0, "total": 100, "consumed": [[5, 2.5]]}, "x")
    with pytest.raises(FormatError, match="epoch"):
        split.from_state({"epoch": -1, "total": 100, "consumed": []}, "x")
    with pytest.raises(ConfigError, match="epoch of 90 samples"):
        split.from_state({"epoch": 0, "total": 90, "consumed": []}, "x")
    assert split.from_state(split.state(10), "x").consumed == ((0, 10), (50, 60))


def test_a_state_of_the_previous_format_resumes_where_it_implies(sources):
    make = sources["stream"][0]
    ds = make(1, 2)
    old = {"format": "tierio-stream-state", "version": 1, "dataset": ds.manifest.fingerprint, "seed": 5,
           "shuffle": True, "shuffle_buffer": 40, "rank": 1, "world_size": 2, "epoch": 0, "position": 20}
    ds.load_state_dict(old)
    assert ds.rank_sample_ids(0)[20:].tolist() == [int(x) for b in ds.iter_batches() for x in b["x"][:, 0]]


def test_the_checkpoint_manager_carries_the_position(sources, tmp_path):
    from tierio.ckpt import CheckpointManager

    make, names, _ = sources["windows"]
    loader = StatefulLoader(make(0, 1), B, num_workers=0, drop_last=False)
    seen = []
    for step, batch in enumerate(loader):
        seen += names(batch)
        if step == 6:
            break
    with CheckpointManager([str(tmp_path / "ck")]) as mgr:
        mgr.save(7, {"step": 7, "data": loader.state_dict()})
        mgr.wait()
    with CheckpointManager([str(tmp_path / "ck")]) as mgr:
        state = mgr.restore()
    resumed = StatefulLoader(make(1, 2), B, num_workers=0, drop_last=False)  # rank 1 of 2 now
    resumed.load_state_dict(state["data"])
    assert not set(seen) & {n for b in resumed for n in names(b)}
