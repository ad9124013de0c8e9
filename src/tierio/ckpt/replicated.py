"""Replicated state written once overall, spread evenly over the ranks (data-parallel jobs).

In DDP every rank holds the same model and optimizer state. Saved as is, each rank would write all
of it (N copies), or rank 0 alone would (one writer for the whole job). ``spread`` turns each
tensor of such a state into ``TensorSlice`` leaves so that every byte is written by exactly one
rank and each rank writes about 1/N of the bytes, as torchsnapshot partitions replicated state:

* a tensor of at least ``world_size`` rows and ``SPLIT_MIN_BYTES`` is cut into ``world_size`` row
  blocks, one a rank;
* a smaller one goes whole to the rank that has the fewest bytes so far (the others hold it as a
  replica, ``write=False``), largest first.

Every rank must call it on the same state (same tensors, shapes and order): the assignment is a
pure function of the shapes, so no collective is needed. DTensors and TensorSlices are already
placed (an FSDP2 state's shards) and are left as they are: in a sharded state only the plain
tensors (optimizer step counters, scheduler state) are spread. The checkpoint holds global tensors:
``restore(into=model_state)`` fills whole tensors on any number of ranks (each reads the pieces it
needs from every rank's shard), and ``restore()`` returns whole tensors.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from tierio.dist import rank_world
from tierio.format.slices import TensorSlice, is_dtensor
from tierio.format.statetree import alias_key

SPLIT_MIN_BYTES = 1 << 20  # below this a tensor is not worth cutting: it goes whole to one rank


def _placed(obj: Any) -> bool:
    return is_dtensor(obj) or isinstance(obj, TensorSlice)


def _tensors(obj: Any, out: list[torch.Tensor]) -> None:
    if _placed(obj):
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensors(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensors(v, out)


def plan(sizes: list[tuple[tuple[int, ...], int]], world_size: int) -> list[list[tuple[int, int]] | int]:
    """For each tensor (shape, bytes): the row block of every rank ([(start, stop)] * world_size)
    or the one rank that writes it whole."""
    out: list[list[tuple[int, int]] | int] = [0] * len(sizes)
    load = [(0, r) for r in range(world_size)]  # (bytes so far, rank): a heap, the least loaded first
    whole = []
    for i, (shape, nbytes) in enumerate(sizes):
        rows = shape[0] if shape else 0
        if world_size > 1 and rows >= world_size and nbytes >= SPLIT_MIN_BYTES:
            cuts = [rows * r // world_size for r in range(world_size + 1)]
            out[i] = [(cuts[r], cuts[r + 1]) for r in range(world_size)]
        else:
            whole.append(i)
    # Split tensors add at most one row of difference a rank; the whole ones balance what is left.
    for i in sorted(whole, key=lambda i: -sizes[i][1]):
        got, rank = heapq.heappop(load)
        out[i] = rank
        heapq.heappush(load, (got + sizes[i][1], rank))
    return out


def spread(state: Any, rank: int | None = None, world_size: int | None = None) -> Any:
    """``state`` (a replicated state: the same on every rank) with each tensor replaced by the
    ``TensorSlice`` this rank writes (see the module docstring); other values are kept. Rank and
    world size come from the process group unless given."""
    rank, world_size = rank_world(rank, world_size)
    found: list[torch.Tensor] = []
    _tensors(state, found)
    unique = list({_key(t): t for t in reversed(found)}.values())[::-1]  # tied weights once, first name first
    parts = plan([(tuple(t.shape), t.numel() * t.element_size()) for t in unique], world_size)
    slices = {_key(t): _slice(t, p, rank) for t, p in zip(unique, parts)}

    def walk(obj: Any) -> Any:
        if _placed(obj):
            return obj
        if isinstance(obj, torch.Tensor):
            return slices[_key(obj)]  # tied weights: one slice object, which the checkpoint stores once
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(walk(v) for v in obj) if not hasattr(obj, "_fields") else type(obj)(*map(walk, obj))
        return obj
    return walk(state)


def _key(t: torch.Tensor) -> tuple:
    return alias_key(t) or (id(t),)


def _slice(t: torch.Tensor, part: list[tuple[int, int]] | int, rank: int) -> TensorSlice:
    t = t.detach()
    shape = tuple(t.shape)
    if isinstance(part, int):
        return TensorSlice(t, (0,) * len(shape), shape, write=part == rank)
    start, stop = part[rank]
    return TensorSlice(t[start:stop], (start,) + (0,) * (len(shape) - 1), shape)


__all__ = ["spread"]
