"""Preemption, end to end: from the scheduler's SIGTERM to the emergency step durable.

``measure`` runs a 2-rank gloo job (``python -m tierio.bench.preempt``, the training loop below)
on one directory, sends SIGTERM to every rank as SLURM does, and reads each rank's
"durable ... after SIGTERM" line; ``preempt_signal_to_durable_s`` is the slowest rank's. fio's
time to write the same bytes (two jobs, one a rank) in the same directory stands beside it: the
signal waits for the next step boundary, and the save then writes every rank's share at once.

The loop: each step changes the state in place (``state_of`` says what it holds after a step, so
a restore can be checked bit for bit), does one all_reduce (a data-parallel step's collective),
checks ``Preemption.requested`` and sleeps a little.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierio.bench import common
from tierio.storage.seaweed import free_port

DURABLE = re.compile(r"tierio: step (\d+) durable in ([0-9.]+) s after (\w+)")


def state_of(step: int, nbytes: int) -> dict[str, Any]:
    """The state after ``step``: the same random weights each step but for the first one, which
    holds the step (a step changes the state in place, as an optimizer does)."""
    w = torch.rand(max(1, nbytes // 4), generator=torch.Generator().manual_seed(0))
    w[0] = step
    return {"w": w, "step": step}


def start(root: Path, nbytes: int, *, rank: int = 0, world: int = 1, port: int = 0,
          save_every: int = 0) -> subprocess.Popen:
    """One rank of the loop, as its own process (text pipes: its stdout says ``step N`` each step)."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "tierio.bench.preempt", str(root), str(nbytes), str(save_every)],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(proc: subprocess.Popen, prefix: str, stream: str = "stdout") -> str:
    """The first line of ``stream`` starting with ``prefix`` (AssertionError if the process ends first)."""
    for line in getattr(proc, stream):
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the loop ended (exit {proc.wait()}) before printing {prefix!r}: {proc.stderr.read()}")


def measure(nbytes: int, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """``nbytes`` of state over 2 ranks: seconds from SIGTERM to the emergency step durable."""
    root = work / "preempt"
    port = free_port()
    procs = [start(root, nbytes // 2, rank=r, world=2, port=port) for r in range(2)]
    try:
        for p in procs:
            wait_for(p, "step 3")
        log(f"SIGTERM to both ranks of a 2-rank job holding {nbytes >> 20} MiB")
        for p in procs:
            p.send_signal(signal.SIGTERM)
        lines = [wait_for(p, "tierio: step", "stderr") for p in procs]
        codes = [p.wait(300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    got = [DURABLE.search(line) for line in lines]
    if not all(got) or codes != [143, 143]:
        raise RuntimeError(f"the preempted ranks did not report a durable step: exits {codes}, lines {lines}")
    fio = common.run_fio(work / "fio", "write", nbytes // 2, jobs=2)
    slowest = max(float(m.group(2)) for m in got if m)
    return {"state_bytes": nbytes, "ranks": 2, "step": int(got[0].group(1)) if got[0] else None,
            "signal_to_durable_s": [float(m.group(2)) for m in got if m], "fio_write_s": nbytes / fio["bytes_per_s"],
            "ratios": {"preempt_signal_to_durable_s": round(slowest, 3),
                       "preempt_signal_to_durable_vs_fio_write": round(slowest / (nbytes / fio["bytes_per_s"]), 3)}}


def loop(root: str, nbytes: int, save_every: int) -> None:
    import torch.distributed as dist

    from tierio.ckpt import CheckpointManager
    from tierio.ckpt.preempt import Preemption

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    with CheckpointManager([root]) as mgr, Preemption(mgr, grace_seconds=120) as preempt:
        state = state_of(0, nbytes)
        for step in range(1, 1_000_000):
            state["w"][0], state["step"] = step, step
            if world > 1:
                dist.all_reduce(torch.ones(1))
            if save_every and step % save_every == 0:
                mgr.save(step, state)
            print(f"step {step}", flush=True)
            if preempt.requested(step):
                preempt.save(step, state)
            time.sleep(0.02)


if __name__ == "__main__":
    loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
