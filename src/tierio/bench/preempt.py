"""Preemption, end to end: from the scheduler's SIGTERM to the emergency step durable.

``measure`` runs a 2-rank gloo job (``python -m tierio.bench.preempt``, the training loop below)
twice: on one shared directory, then with a node-local tier 0 per rank ("node0", "node1") before
the shared one. Each time it sends SIGTERM to every rank as SLURM does and reads each rank's
"durable ... after SIGTERM" line; ``preempt_signal_to_durable_s`` and
``preempt_signal_to_durable_nodelocal_s`` are the slowest rank's. fio's time to write the same
bytes (two jobs, one a rank) in the same directory stands beside them: the signal waits for the
next step boundary, and the save then writes every rank's share at once. On node-local tiers the
ranks exit once every part is there; the copy to the shared tier is the next run's.

The loop: each step changes the state in place (``state_of`` says what it holds after a step, so
a restore can be checked bit for bit), does one all_reduce (a data-parallel step's collective),
checks ``Preemption.requested`` and sleeps a little.
"""

from __future__ import annotations

import os
import re
import shutil
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


def tiers_of(root: str | Path, rank: int, node_local: bool) -> list[Any]:
    """The loop's tiers: ``root`` alone, or (``node_local``) rank r's node tier ``root/node<r>``
    (each rank its own "node") before the shared ``root/shared``."""
    from tierio.ckpt import Tier

    return [Tier(f"{root}/node{rank}", scope="node"), f"{root}/shared"] if node_local else [str(root)]


def start(root: Path, nbytes: int, *, rank: int = 0, world: int = 1, port: int = 0, save_every: int = 0,
          node_local: bool = False, promote_bandwidth: int = 0) -> subprocess.Popen:
    """One rank of the loop, as its own process (text pipes: its stdout says ``step N`` each step);
    ``node_local``: on ``tiers_of(root, rank, True)``, promotion limited to ``promote_bandwidth``
    bytes/s (0: no limit)."""
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    argv = [str(root), str(nbytes), str(save_every), str(int(node_local)), str(promote_bandwidth)]
    return subprocess.Popen([sys.executable, "-m", "tierio.bench.preempt", *argv],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(proc: subprocess.Popen, prefix: str, stream: str = "stdout") -> str:
    """The first line of ``stream`` starting with ``prefix`` (AssertionError if the process ends first)."""
    for line in getattr(proc, stream):
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the loop ended (exit {proc.wait()}) before printing {prefix!r}: {proc.stderr.read()}")


def preempt_job(root: Path, nbytes: int, node_local: bool, log: Callable[[str], None]) -> list[float]:
    """SIGTERM to both ranks of a 2-rank job holding ``nbytes``: each rank's seconds to durable."""
    port = free_port()
    procs = [start(root, nbytes // 2, rank=r, world=2, port=port, node_local=node_local) for r in range(2)]
    try:
        for p in procs:
            wait_for(p, "step 3")
        log(f"SIGTERM to both ranks of a 2-rank job holding {nbytes >> 20} MiB"
            + (" on node-local tiers" if node_local else ""))
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
    return [float(m.group(2)) for m in got if m]


def measure(nbytes: int, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """``nbytes`` of state over 2 ranks: seconds from SIGTERM to the emergency step durable, with a
    shared tier 0 and with node-local ones."""
    shared = preempt_job(work / "preempt", nbytes, False, log)
    shutil.rmtree(work / "preempt", ignore_errors=True)
    nodes = preempt_job(work / "preempt-nodelocal", nbytes, True, log)
    shutil.rmtree(work / "preempt-nodelocal", ignore_errors=True)
    fio = common.run_fio(work / "fio", "write", nbytes // 2, jobs=2)
    fio_s = nbytes / fio["bytes_per_s"]
    return {"state_bytes": nbytes, "ranks": 2, "signal_to_durable_s": shared, "signal_to_durable_nodelocal_s": nodes,
            "fio_write_s": fio_s,
            "ratios": {"preempt_signal_to_durable_s": round(max(shared), 3),
                       "preempt_signal_to_durable_vs_fio_write": round(max(shared) / fio_s, 3),
                       "preempt_signal_to_durable_nodelocal_s": round(max(nodes), 3),
                       "preempt_signal_to_durable_nodelocal_vs_fio_write": round(max(nodes) / fio_s, 3)}}


def loop(root: str, nbytes: int, save_every: int, node_local: bool = False, promote_bandwidth: int = 0) -> None:
    import torch.distributed as dist

    from tierio.ckpt import CheckpointManager
    from tierio.ckpt.preempt import Preemption

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    kw: dict[str, Any] = {"node": f"node{rank}", "promote_bandwidth": promote_bandwidth or None} if node_local else {}
    with CheckpointManager(tiers_of(root, rank, node_local), **kw) as mgr, \
            Preemption(mgr, grace_seconds=120) as preempt:
        state = state_of(0, nbytes)
        for step in range(1, 1_000_000):
            state["w"][0], state["step"] = step, step
            if world > 1:
                dist.all_reduce(torch.ones(1))
            print(f"step {step}", flush=True)
            if preempt.requested(step):
                preempt.save(step, state)  # the emergency save stands for this step's periodic one
            if save_every and step % save_every == 0:
                mgr.save(step, state)
            time.sleep(0.02)


if __name__ == "__main__":
    loop(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5]))
