"""Ranks that fail a multi-rank save, with real gloo processes: a rank that never calls save, and a
rank killed with SIGKILL in the middle of one. The last globally committed step must stay the one
every rank restores, and a partial step is never listed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import zlib

import pytest
import torch
import torch.distributed as dist

from tierio.ckpt import CheckpointManager, list_checkpoints
from tierio.errors import StorageError


def state(rank: int, step: int, rows: int = 64) -> dict:
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{step}".encode()))
    return {"w": torch.randn(rows, 1024, generator=g), "rank": rank, "step": step}


def same(a: dict, b: dict) -> bool:
    return a["rank"] == b["rank"] and a["step"] == b["step"] and torch.equal(a["w"], b["w"])


def worker(rank: int, root: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    mgr = CheckpointManager([f"{root}/shared"], commit_timeout=4)
    mgr.save(1, state(rank, 1)).wait()
    dist.barrier()
    # Step 2: rank 1 never calls save. Rank 0's save returns once staged and its training goes on;
    # the commit, in the background, times out naming the missing rank.
    if rank == 0:
        h = mgr.save(2, state(0, 2))
        assert h.staged.done()
        with pytest.raises(StorageError, match="rank 1 of 2 to write"):
            h.wait()
        with pytest.raises(StorageError, match="rank 1 of 2"):
            mgr.wait()  # the background failure is also reported once by the next wait/save/close
    dist.barrier()
    # Step 3: rank 1 is killed while its shard is being written.
    if rank == 1:
        mgr.save(3, state(1, 3, rows=16 * 1024))  # 64 MiB: save() returns while the write goes on
        step3 = f"{root}/shared/step_000000003"
        while not (os.path.isdir(step3) and any(n.startswith(".rank_00001") for n in os.listdir(step3))):
            time.sleep(0.001)  # its shard is being written (a temp file, not yet renamed)
        os.kill(os.getpid(), signal.SIGKILL)
    h = mgr.save(3, state(0, 3, rows=16 * 1024))
    with pytest.raises(StorageError, match="rank 1 of 2"):
        h.wait()
    with pytest.raises(StorageError):
        mgr.close()
    os._exit(0)  # the peer is dead: leave without tearing down the process group


def test_missing_rank_and_killed_rank_keep_the_last_committed_step(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, str(tmp_path), f"file://{tmp_path}/pg")) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert codes == [0, -signal.SIGKILL]
    shared = tmp_path / "shared"
    assert [c.step for c in list_checkpoints(shared)] == [1]  # the partial steps 2 and 3 are never listed
    assert (shared / "step_000000003").exists() and not (shared / "step_000000003" / "manifest.json").exists()
    # The job restarts: every rank restores step 1, bit-exact.
    got: dict[int, dict] = {}

    def restore(rank: int) -> None:
        with CheckpointManager([shared], rank=rank, world_size=2, run_id="restart") as mgr:
            got[rank] = mgr.restore()

    threads = [threading.Thread(target=restore, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(same(got[r], state(r, 1)) for r in range(2))
