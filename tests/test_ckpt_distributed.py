"""Multi-rank checkpoints with real gloo processes: each rank writes its shard, rank 0 commits."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierio.ckpt import CheckpointManager, inspect, verify
from tierio.errors import ConfigError

WORLD = 3


def rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"model": {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).bfloat16()},
            "rank": rank, "step": step}


def worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        with CheckpointManager([os.path.join(root, "fast"), os.path.join(root, "slow")]) as mgr:
            assert (mgr.rank, mgr.world_size) == (rank, WORLD)
            for step in (10, 20):
                h = mgr.save(step, rank_state(rank, step))
            h.wait()
            dist.barrier()  # only so the test can compare: the commit itself uses no collectives
            for step in (10, 20):
                out = mgr.restore(step)
                exp = rank_state(rank, step)
                assert out["rank"] == rank and torch.equal(out["model"]["w"], exp["model"]["w"])
                assert torch.equal(out["model"]["b"], exp["model"]["b"])
            assert mgr.steps() == [10, 20]
    finally:
        dist.destroy_process_group()


def test_three_gloo_ranks_save_and_restore(tmp_path):
    init = f"file://{tmp_path}/pg"
    tmp.start_processes(worker, args=(str(tmp_path), init), nprocs=WORLD, start_method="spawn", join=True)
    for tier in ("fast", "slow"):
        man = inspect(tmp_path / tier, 20)
        assert man.world_size == WORLD and [r.file for r in man.ranks] == [f"rank_{r:05d}.safetensors" for r in range(WORLD)]
        assert verify(tmp_path / tier, 20).ok
        names = sorted(p.name for p in (tmp_path / tier / "step_000000020").iterdir())
        assert names == ["manifest.json"] + [f"rank_{r:05d}.safetensors" for r in range(WORLD)]  # fragments merged away
        doc = json.loads((tmp_path / tier / "step_000000020" / "manifest.json").read_text())
        chunk = doc["ranks"][1]["tensors"]["model/w"]["chunks"][0]
        assert chunk["offsets"] == [0, 0] and chunk["shape"] == [256, 64]
    # Restoring on another world size is refused clearly (resharding is not supported yet).
    with CheckpointManager([tmp_path / "fast"], rank=0, world_size=2) as mgr:
        with pytest.raises(ConfigError, match="same world size"):
            mgr.restore()
    with CheckpointManager([tmp_path / "fast"], rank=2, world_size=WORLD) as mgr:
        assert torch.equal(mgr.restore(10)["model"]["w"], rank_state(2, 10)["model"]["w"])
