"""`tierio bench ckpt`'s zero-stall snapshot figure: ``overlap_stall_vs_memcpy``.

A training loop saves with ``overlap=True``, runs a forward + backward stand-in that only reads the
state and takes twice the measured memcpy of the state (torch matmuls on the CPU, so here the
compute competes with the copy thread for the same cores: on a GPU it would not), then calls
``before_update()`` and changes the state in place (the update). The stall of one checkpoint is
what ``save`` blocked for plus what the update waited; the ratio is the memcpy of the state into a
faulted buffer over that stall. The next save starts after the previous one persisted (the interval
is never shorter than the background write), so no save waits for a staging buffer.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

COMPUTE_VS_COPY = 2.0  # the forward + backward stand-in lasts this many memcpy times


def _forward_backward(seconds: float, a: torch.Tensor, b: torch.Tensor, reads: list[torch.Tensor]) -> float:
    """Matmuls for ``seconds``, plus a read of a few saved tensors (forward only reads them)."""
    t0 = time.perf_counter()
    for t in reads:
        t.sum()
    while time.perf_counter() - t0 < seconds:
        a @ b
    return time.perf_counter() - t0


def measure(state: dict[str, Any], root: Path, repeat: int, memcpy_s: float) -> dict[str, Any]:
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    tensors = list(state["tensors"].values())
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    compute_s = COMPUTE_VS_COPY * memcpy_s
    blocking, waits, stalls, computes = [], [], [], []
    with CheckpointManager([Tier(str(root), retention=KeepLast(2))], min_keep=1, overlap=True) as mgr:
        for i in range(repeat + 1):  # save 0 allocates and faults the staging buffer: warm-up
            step = i + 1
            state["step"] = step
            t0 = time.perf_counter()
            h = mgr.save(step, state)
            t1 = time.perf_counter()
            took = _forward_backward(compute_s, a, b, tensors[:4])
            t2 = time.perf_counter()
            mgr.before_update()
            t3 = time.perf_counter()
            tensors[step % len(tensors)].add_(1)  # the update changes the state in place
            h.persisted.result()  # the next save comes after this one persisted (untimed)
            if i == 0:
                continue
            blocking.append(t1 - t0)
            waits.append(t3 - t2)
            stalls.append((t1 - t0) + (t3 - t2))
            computes.append(took)
        mgr.wait()
        saves = mgr.stats()["saves"]
    stall = statistics.median(stalls)
    return {
        "stall_s": stall,
        "save_blocking_s": statistics.median(blocking),
        "update_wait_s": statistics.median(waits),
        "forward_backward_s": statistics.median(computes),
        "memcpy_s": memcpy_s,
        "all_stall_s": stalls,
        "persist_s": [s.get("persist_seconds") for s in saves[1:]],
        "ratio": memcpy_s / stall if stall > 0 else float("inf"),
    }
