"""Slices of global tensors: the local part a rank holds of a tensor that is sharded or replicated
across ranks, placed by its global offsets.

Two kinds of leaves in a state are global: ``torch.distributed.tensor.DTensor`` (any placement of
``Shard`` and ``Replicate`` on any mesh, as FSDP2, tensor parallelism and
``torch.distributed.checkpoint.state_dict.get_state_dict`` produce them) and ``TensorSlice``, the
same idea for frameworks that shard without DTensor (a local tensor, its offsets in the global
tensor, the global shape). A checkpoint stores each slice once with its global offsets, so any
world size and any placement can restore it.

A replicated slice (the same offsets held by several ranks) is written by one owner only: for a
DTensor, the rank at coordinate 0 of every ``Replicate`` mesh dimension; for a ``TensorSlice``,
the ranks that pass ``write=False`` leave it to the one that does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tierio.errors import ConfigError


@dataclass
class TensorSlice:
    """The part ``local`` of a global tensor of ``shape``, starting at ``offsets``.

    Save: pass it in the state; set ``write=False`` on the ranks holding a replica another rank
    writes. Restore: pass it in ``into=`` and ``local`` is filled with the bytes of that region,
    whatever slicing the checkpoint was saved with."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    write: bool = True

    def __post_init__(self) -> None:
        self.offsets = tuple(int(o) for o in self.offsets)
        self.shape = tuple(int(s) for s in self.shape)
        check_box(self.offsets, tuple(self.local.shape), self.shape, "TensorSlice")


@dataclass(frozen=True)
class Box:
    """A box of a global tensor: ``sizes`` elements from ``offsets`` along each dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        hi = tuple(min(a + n, b + m) for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))
        if any(h <= l for l, h in zip(lo, hi)) and self.sizes:
            return None
        return Box(lo, tuple(h - l for l, h in zip(lo, hi)))


@dataclass(frozen=True)
class GlobalLeaf:
    """One global tensor leaf of a state as a rank holds it: what it writes, where it belongs."""

    local: torch.Tensor  # this rank's part, a plain tensor (may be non-contiguous)
    box: Box  # where ``local`` lies in the global tensor
    shape: tuple[int, ...]  # the global shape
    write: bool  # False: another rank writes these bytes (a replica)


def check_box(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...], what: str) -> None:
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise ConfigError(f"{what}: offsets {list(offsets)} and local shape {list(sizes)} must have the "
                          f"{len(shape)} dimensions of the global shape {list(shape)}")
    if any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape)):
        raise ConfigError(f"{what}: offsets {list(offsets)} + local shape {list(sizes)} lie outside the global shape {list(shape)}")


def is_dtensor(obj: Any) -> bool:
    return type(obj).__name__ == "DTensor" and hasattr(obj, "_local_tensor")


def global_leaf(obj: Any, where: str) -> GlobalLeaf:
    """The GlobalLeaf of a DTensor or TensorSlice (``where`` names it in errors)."""
    if isinstance(obj, TensorSlice):
        return GlobalLeaf(obj.local, Box(obj.offsets, tuple(obj.local.shape)), obj.shape, obj.write)
    return _dtensor_leaf(obj, where)


def dtensor_box(dt: Any, where: str) -> Box:
    """Where this rank's local tensor of a DTensor lies in the global tensor."""
    for p in dt.placements:
        kind = type(p).__name__
        if kind not in ("Shard", "Replicate"):
            hint = ("it holds partial sums: redistribute it to Replicate() or Shard() first" if kind == "Partial"
                    else "only Shard and Replicate placements are stored; redistribute it first")
            raise ConfigError(f"tensor at {where!r} is a DTensor with placement {p}; {hint}")
    chunks = dt.__create_chunk_list__()
    if len(chunks) != 1:
        raise ConfigError(f"tensor at {where!r} is a DTensor with {len(chunks)} local chunks; one is supported")
    c = chunks[0]
    box = Box(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes))
    if box.sizes != tuple(dt._local_tensor.shape):
        raise ConfigError(f"tensor at {where!r}: the DTensor's local tensor has shape {list(dt._local_tensor.shape)} "
                          f"but its placement says {list(box.sizes)} (padded shards are not supported)")
    return box


def _dtensor_leaf(dt: Any, where: str) -> GlobalLeaf:
    box = dtensor_box(dt, where)
    coord = dt.device_mesh.get_coordinate()
    # The replica at coordinate 0 of every Replicate dimension writes; the others hold the same bytes.
    owner = coord is not None and all(c == 0 for c, p in zip(coord, dt.placements) if type(p).__name__ == "Replicate")
    return GlobalLeaf(dt._local_tensor.detach(), box, tuple(int(s) for s in dt.shape), owner)
