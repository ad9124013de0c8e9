"""kill -9 of a saving process at random points: the latest committed checkpoint always restores
bit-exact, every listed checkpoint is whole, and a restarted job goes on saving."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import torch

from tierio.ckpt import CheckpointManager, KeepLast, Tier, list_checkpoints, verify
from saving_loops import save_forever

TRIALS = 20


def state_for(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    n = (1 + step % 4) * 128 * 1024  # 0.5 - 2 MiB of fp32, varying so layouts differ between steps
    return {"model": {"w": torch.randn(n, generator=g), "b": torch.randn(64, generator=g).bfloat16()},
            "opt": {"m": torch.randn(n // 2, generator=g)}, "step": step}


def tiers(root: str) -> list:
    return [Tier(os.path.join(root, "fast"), KeepLast(3)), Tier(os.path.join(root, "slow"), KeepLast(4))]


def saver(root: str, first: int, ready, persisted) -> None:
    """Child: save steps forever, asynchronously, reporting each step once it is durable."""
    mgr = CheckpointManager(tiers(root), min_keep=2)
    ready.set()
    save_forever(mgr, first, state_for, persisted)


def test_kill_dash_nine_while_saving(tmp_path):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tierio.ckpt"])
    rng = random.Random(1234)
    root = str(tmp_path)
    next_step = 1
    seen_latest = 0
    for trial in range(TRIALS):
        ready, persisted = ctx.Event(), ctx.Value("q", 0, lock=False)  # a lock would die held by a killed child
        p = ctx.Process(target=saver, args=(root, next_step, ready, persisted))
        p.start()
        assert ready.wait(60), "saver did not start"
        if trial % 5 == 4:
            # Every fifth kill lands after at least one commit, so a loaded machine (where no
            # save finishes within the random window) still exercises restore after a kill.
            deadline = time.monotonic() + 120
            while persisted.value == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.4))
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        durable = persisted.value

        with CheckpointManager(tiers(root), min_keep=2) as mgr:
            steps = mgr.steps()
            latest = mgr.latest()
            if durable:
                assert latest is not None and latest >= durable, f"trial {trial}: step {durable} was reported durable"
            if latest is None:
                continue
            assert latest >= seen_latest
            seen_latest = latest
            out = mgr.restore()
            assert mgr.restored_step == latest
            exp = state_for(latest)
            assert out["step"] == latest
            assert torch.equal(out["model"]["w"], exp["model"]["w"]) and torch.equal(out["opt"]["m"], exp["opt"]["m"])
            assert torch.equal(out["model"]["b"], exp["model"]["b"])
            # Every listed copy on every tier is complete (no manifest-less directory is ever listed).
            for t in ("fast", "slow"):
                for info in list_checkpoints(os.path.join(root, t)):
                    assert info.error is None
                    assert verify(os.path.join(root, t), info.step).ok, f"trial {trial}: {t} step {info.step}"
            assert set(steps) >= {latest}
        next_step = max(next_step, latest or 0, durable) + 1
    assert seen_latest > 0, "no checkpoint ever committed"
    # A fresh job after all those crashes still saves, promotes and cleans up.
    with CheckpointManager(tiers(root), min_keep=2) as mgr:
        mgr.save(next_step, state_for(next_step)).wait()
        mgr.gc()
        assert mgr.latest() == next_step
        assert len(list_checkpoints(os.path.join(root, "fast"))) <= 3
