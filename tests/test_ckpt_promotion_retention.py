"""Two gloo ranks save back to back onto two tiers whose retention keeps one step: rank 0 may
commit a promoted step and retention delete it again before rank 1 has looked for it. Rank 1
must not wait for it until ``commit_timeout`` (it did: both ranks then waited on each other)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from dataclasses import dataclass

from tierio.ckpt import CheckpointManager, KeepLast, Tier
from tierio.ckpt.steps.retention import Retention
from tierio.storage.seaweed import free_port

SAVES = 40


@dataclass(frozen=True)
class KeepNone(Retention):
    """A tier that wants no step for itself (as a framework's pointers removed before promotion):
    retention may delete a step there right after its promotion commits it."""

    def keep(self, steps, now):
        return set()


def worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        tiers = [Tier(os.path.join(root, "t0"), KeepLast(1)), Tier(os.path.join(root, "t1"), KeepNone())]
        with CheckpointManager(tiers, min_keep=1, commit_timeout=60) as mgr:
            for step in range(1, SAVES + 1):
                mgr.save(step, {"w": torch.full((1024,), float(step + rank))})
            mgr.wait()
            assert mgr.steps()[-1] == SAVES
    finally:
        dist.destroy_process_group()


def test_back_to_back_promotions_under_retention_never_wait_for_a_deleted_commit(tmp_path):
    init = f"tcp://127.0.0.1:{free_port()}"
    tmp.start_processes(worker, args=(str(tmp_path), init), nprocs=2, start_method="spawn", join=True)
