"""A training loop that a test preempts: ``python preempt_worker.py ROOT MIB [--save-every N]``.

Rank and world size come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: real
gloo processes when WORLD_SIZE > 1). Each step does what a data-parallel step does to the state
(one all_reduce), prints ``step N`` and sleeps a little; the state of step N is a function of N,
so a restore can be checked bit for bit."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from tierio.ckpt import CheckpointManager
from tierio.ckpt.preempt import Preemption


def state_of(step: int, mib: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.rand(mib * (1 << 18), generator=g), "step": step}


def main() -> None:
    root, mib = sys.argv[1], int(sys.argv[2])
    every = int(sys.argv[sys.argv.index("--save-every") + 1]) if "--save-every" in sys.argv else 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    with CheckpointManager([root]) as mgr, Preemption(mgr, grace_seconds=60) as preempt:
        for step in range(1, 100_000):
            state = state_of(step, mib)
            if world > 1:
                dist.all_reduce(torch.ones(1))  # a collective each step, as DDP's gradient all-reduce
            if every and step % every == 0:
                mgr.save(step, state)
            print(f"step {step}", flush=True)
            if preempt.requested(step):
                preempt.save(step, state)
            time.sleep(0.02)


if __name__ == "__main__":
    main()
