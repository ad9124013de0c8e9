"""The checkpoint state the ckpt benchmarks save: its own module so that the single-process bench
(bench/ckpt.py) and the multi-rank one (bench/cluster.py) both use it without importing each other."""

from __future__ import annotations

from typing import Any

import torch

from tierio.errors import ConfigError


def make_state(total: int, n: int, seed: int = 0) -> dict[str, Any]:
    """``n`` tensors of uneven sizes adding up to about ``total`` bytes, fp32 and bf16 alternating,
    random contents (so no layer of the stack can compress or deduplicate them)."""
    if n < 1 or total < n * 64:
        raise ConfigError(f"cannot split {total} bytes into {n} tensors; use a larger --size or fewer --tensors")
    weights = [1 + (i * 7919) % 13 for i in range(n)]  # deterministic spread: ~1x..13x
    scale = total / sum(weights)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        elems = max(16, int(w * scale) // dtype.itemsize // 1024 * 1024)
        # Filled in place (no temporaries), so the process holds the state and little else.
        t = torch.empty(elems // 1024 if elems % 1024 == 0 else elems, *((1024,) if elems % 1024 == 0 else ()), dtype=dtype)
        t.view(torch.int16 if dtype.itemsize == 2 else torch.int32).random_(generator=g)
        t.nan_to_num_()  # random bit patterns include NaN and inf; keep values finite
        tensors[f"layer{i:03d}.{'weight' if i % 3 else 'bias'}"] = t
    return {"step": 0, "tensors": tensors}


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["tensors"].values())
