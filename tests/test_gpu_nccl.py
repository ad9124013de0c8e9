"""A cluster checkpoint over NCCL: 2 processes, one GPU each, save DTensors that live on their
GPUs and restore them resharded (on the same 2 ranks with other placements, then whole in one
process), every byte checked against the tensors made on the CPU; then each rank on a "node" of its
own saves with buddy copies (their exchange runs on a gloo group beside NCCL). Marked ``gpu``; it
needs two CUDA devices and skips, saying so, with fewer."""

from __future__ import annotations

import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierio.ckpt import CheckpointManager, Tier, inspect, verify

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    GPUS < 2, reason=f"NCCL needs 2 CUDA devices, this machine has {GPUS}: the 2-process checkpoint is not run")]

SHAPES = {"w": (37, 16), "v": (8, 30), "r": (10, 4)}


def full(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same in every process
    t = torch.randn(*SHAPES[name], generator=g)
    return t.bfloat16() if name == "v" else t


def worker(rank: int, root: str, init: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120),
                            device_id=torch.device("cuda", rank))
    try:
        mesh = init_device_mesh("cuda", (2,))
        saved = {"w": [Shard(0)], "v": [Shard(1)], "r": [Replicate()]}
        state = {"model": {n: distribute_tensor(full(n).cuda(), mesh, p) for n, p in saved.items()}, "step": 1}
        with CheckpointManager([f"{root}/t0"]) as mgr:
            mgr.save(1, state).wait()
        dist.barrier()
        other = {"w": [Shard(1)], "v": [Shard(0)], "r": [Shard(0)]}
        into = {"model": {n: distribute_tensor(torch.zeros_like(full(n)).cuda(), mesh, p) for n, p in other.items()}}
        with CheckpointManager([f"{root}/t0"]) as mgr:
            out = mgr.restore(into=into)
        for n in SHAPES:
            got = out["model"][n]
            assert got.device_mesh.device_type == "cuda" and got.placements == tuple(other[n]), n
            assert torch.equal(got.full_tensor().cpu(), full(n)), n
        assert out["step"] == 1
        tiers = [Tier(f"{root}/node{rank}", scope="node"), Tier(f"{root}/shared")]
        with CheckpointManager(tiers, node=f"node{rank}", buddy=True, commit_timeout=60) as mgr:
            h = mgr.save(2, {**state, "step": 2})
            assert h.buddied.result(timeout=60) == 2  # the partner node holds this rank's copy
            h.wait(timeout=60)
    finally:
        dist.destroy_process_group()


def test_two_nccl_ranks_save_and_restore_resharded(tmp_path):
    root = str(tmp_path)
    tmp.start_processes(worker, args=(root, f"file://{root}/pg"), nprocs=2, start_method="spawn")
    man = inspect(tmp_path / "t0", 1)
    assert man.world_size == 2 and verify(tmp_path / "t0", 1).ok
    assert [("model/r" in r.tensors) for r in man.ranks] == [True, False]  # replicated: written once
    into = {"model": {n: torch.zeros(SHAPES[n], dtype=full(n).dtype, device="cuda") for n in SHAPES}}
    with CheckpointManager([tmp_path / "t0"]) as mgr:  # one process reads the 2 ranks' shards whole
        out = mgr.restore(into=into)
    for n in SHAPES:
        assert out["model"][n].is_cuda and torch.equal(out["model"][n].cpu(), full(n)), n
    assert verify(tmp_path / "shared", 2).ok
