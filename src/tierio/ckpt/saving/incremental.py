"""Incremental checkpoints: a save writes only the tensors that changed since the base step.

The unit is a whole tensor (all its chunks): a tensor whose every chunk has the same xxh3, byte
range shape and global offsets as in this rank's entry of the base step (the last step this
manager committed) is not written again; the new manifest's chunks refer to the file that holds
those bytes (``step_<n>/rank_<r>.safetensors``: the base step's shard, or the earlier shard the
base itself referred to, so references never chain and cannot form a cycle). The new shard holds
only the changed tensors, written straight from the staging buffer (no copy).

The detection runs on the persist thread: one xxh3 pass over the staged bytes (the checksums the
manifest needs anyway), compared with the base entry's. The base step stays protected from
retention until the step referring to it is committed; after that the references protect its
files (``ckpt.steps.refs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tierio.format.manifest import ChunkInfo, RankEntry, TensorInfo, ref_file
from tierio.format.shard import Placement, ShardLayout, describe, plan_subset


@dataclass(frozen=True)
class Base:
    """This rank's entry of a committed step, which the next save compares against."""

    step: int
    entry: RankEntry


@dataclass
class Delta:
    """What an incremental save writes: the shard of the changed tensors (``layout``, written as
    ``parts``) and every tensor's manifest description (references for the unchanged ones)."""

    layout: ShardLayout
    parts: list[memoryview]
    tensors: dict[str, TensorInfo]
    reused_bytes: int


def _unchanged(new: TensorInfo, old: TensorInfo | None) -> bool:
    if old is None or (old.dtype, old.shape, old.is_global) != (new.dtype, new.shape, new.is_global):
        return False
    if len(old.chunks) != len(new.chunks):
        return False
    return all((a.xxh3, a.offsets, a.shape, a.nbytes) == (b.xxh3, b.offsets, b.shape, b.nbytes)
               for a, b in zip(old.chunks, new.chunks))


def _referenced(old: TensorInfo, base_step: int) -> TensorInfo:
    """``old`` (from the base entry) as references: to the base step's shard, or to the file an
    earlier reference already named (never a reference to a reference)."""
    chunks = [c if c.is_ref else ChunkInfo(ref_file(base_step, c.file), c.begin, c.end, c.offsets, c.shape, c.xxh3)
              for c in old.chunks]
    return TensorInfo(old.name, old.dtype, old.shape, chunks, old.is_global)


def diff(layout: ShardLayout, view: memoryview, file: str, places: dict[str, Placement] | None,
         base: Base) -> Delta:
    """Checksum the staged shard ``view`` (laid out as ``layout``) and keep only what changed since
    ``base``: the changed tensors move to a smaller shard, the others become references."""
    full = describe(layout, view, file, places)
    old = base.entry.tensors
    same = {n for n, t in full.items() if _unchanged(t, old.get(n))}
    sub = plan_subset(layout, [n for n in full if n not in same])
    tensors: dict[str, TensorInfo] = {}
    parts: list[memoryview] = [memoryview(sub.header_bytes)]
    # The new shard's data section holds the changed tensors back to back, in its header's order.
    for name, e in sorted(sub.header.tensors.items(), key=lambda kv: kv[1].begin):
        lo, hi = layout.span(name)
        if hi > lo:
            parts.append(view[lo:hi])
        shift = sub.header.data_offset + e.begin - lo
        t = full[name]
        tensors[name] = TensorInfo(name, t.dtype, t.shape, [
            ChunkInfo(file, c.begin + shift, c.end + shift, c.offsets, c.shape, c.xxh3) for c in t.chunks], t.is_global)
    reused = 0
    for name in same:
        tensors[name] = _referenced(old[name], base.step)
        reused += tensors[name].nbytes
    ordered = {n: tensors[n] for n in full}  # the manifest lists tensors as a full save would
    return Delta(sub, parts, ordered, reused)
