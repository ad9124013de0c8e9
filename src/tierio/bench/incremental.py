"""`tierio bench ckpt`'s incremental checkpoint figures: ``incremental_bytes_ratio`` and
``incremental_persist_vs_full``.

The same state is saved by a manager writing full checkpoints and by one with
``incremental=True``; between saves the tensors holding about ``CHANGED`` of the bytes change
(smallest first, as a fine-tuning run's adapters would) and the others stay as they are (frozen
layers). Bytes are what the shard files hold (the incremental shard holds only the
changed tensors). The first incremental save is a full one (its base) and is not timed.

Persist is the manager's persist stage (``stats()["saves"][i]["persist_seconds"]``: from the staged
shard to the step committed: checksums, the comparison with the base, the write, the commit). The
staging copy before it is the save's blocking part, the same memcpy for both kinds; the figures
from the save() call to the commit are reported beside (``*_call_to_commit_s``).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

CHANGED = 0.05  # the share of the state's bytes that changes between saves
REPEAT = 3  # timed saves of each kind (the bench keeps its added time small)


def changing(state: dict[str, Any], share: float = CHANGED) -> list[torch.Tensor]:
    """The smallest tensors holding at most ``share`` of the state's bytes (at least one)."""
    tensors = sorted(state["tensors"].values(), key=lambda t: t.numel() * t.element_size())
    total = sum(t.numel() * t.element_size() for t in tensors)
    out, n = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if out and n + size > share * total:
            break
        out.append(t)
        n += size
    return out


def _saves(state: dict[str, Any], root: Path, incremental: bool, change: list[torch.Tensor],
           repeat: int) -> tuple[list[float], list[float], list[int]]:
    from tierio.ckpt import CheckpointManager, KeepLast, Tier

    persist, calls, written = [], [], []
    with CheckpointManager([Tier(str(root), retention=KeepLast(2))], min_keep=1, incremental=incremental) as mgr:
        for i in range(repeat + 1):  # save 0: staging buffers faulted in (and the incremental base)
            step = i + 1
            state["step"] = step
            with torch.no_grad():
                for t in change:  # the update: the changing tensors move, the rest stay
                    t.neg_()
            t0 = time.perf_counter()
            h = mgr.save(step, state)
            h.persisted.result()
            took = time.perf_counter() - t0
            if i == 0:
                continue
            calls.append(took)
            saved = mgr.stats()["saves"][-1]
            persist.append(saved["persist_seconds"])
            written.append(saved.get("written_bytes", saved["bytes"]))
        mgr.wait()
    return persist, calls, written


def measure(state: dict[str, Any], root: Path, repeat: int = REPEAT) -> dict[str, Any]:
    change = changing(state)
    total = sum(t.numel() * t.element_size() for t in state["tensors"].values())
    full_s, full_c, full_b = _saves(state, root / "full", False, change, repeat)
    inc_s, inc_c, inc_b = _saves(state, root / "incremental", True, change, repeat)
    full_persist, inc_persist = statistics.median(full_s), statistics.median(inc_s)
    full_bytes, inc_bytes = statistics.median(full_b), statistics.median(inc_b)
    return {
        "changed_share": sum(t.numel() * t.element_size() for t in change) / total,
        "changed_tensors": len(change),
        "full_persist_s": full_persist,
        "incremental_persist_s": inc_persist,
        "full_call_to_commit_s": statistics.median(full_c),
        "incremental_call_to_commit_s": statistics.median(inc_c),
        "full_bytes": full_bytes,
        "incremental_bytes": inc_bytes,
        "bytes_ratio": full_bytes / inc_bytes,
        "persist_ratio": full_persist / inc_persist,
    }
