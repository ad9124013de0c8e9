"""load_into(): fill the existing tensors of a module or state dict in place, streaming the
staging ring straight into each tensor's memory (CPU or GPU), so no second copy of the model is
ever allocated; with ``shard=``, one tensor-parallel rank's slices."""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

import torch

from tierio.errors import ConfigError, NotFoundError
from tierio.format.safetensors import TensorEntry, torch_dtype
from tierio.weights import engine, presharded, sliced
from tierio.weights.engine import Counters, Extent
from tierio.weights.loader import ReadSpec, Timer, copy_to_device, staging_node
from tierio.weights.options import LoadOptions
from tierio.weights.sources import ModelSource, Shard, resolve
from tierio.weights.stats import LoadIntoResult, LoadStats
from tierio.weights.tp import TensorParallel


def _target_tensors(target: Any) -> dict[str, torch.Tensor]:
    if isinstance(target, torch.nn.Module):
        return dict(target.state_dict(keep_vars=False))
    if isinstance(target, Mapping):
        bad = [k for k, v in target.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ConfigError(f"load_into target has non-tensor values for {bad[:5]}")
        return dict(target)
    raise ConfigError(f"load_into needs a torch.nn.Module or a dict of tensors, got {type(target).__name__}")


def load_into(
    target: Any,
    source: str | Any,
    options: LoadOptions | None = None,
    shard: TensorParallel | None = None,
    **overrides: Any,
) -> LoadIntoResult:
    """Fill the existing tensors of a module or state dict in place from ``source``.

    Bytes stream through the bounded staging ring straight into each tensor's memory (CPU or
    GPU): no second copy of the model is ever allocated. A tensor whose dtype differs from the
    file, or that is not contiguous, is staged in a temporary of its own size and converted.
    With ``strict`` every target tensor must be in the source (tied weights excepted) and shapes
    must match (with ``shard``, the rank's slice shapes). ``options`` (or keyword overrides) as
    for :func:`load`; GPU and mapping knobs do not apply.
    """
    o = LoadOptions.resolve(options, overrides)
    strict = o.strict
    stats = o.stats if o.stats is not None else LoadStats()
    opts = ReadSpec(direct=o.direct, chunk_size=int(o.chunk_bytes), depth=o.depth, progress=o.progress,
                    numa_node=staging_node(o, stats))
    with Timer(stats):
        root = presharded.is_presharded(source) if shard is not None else None
        src = presharded.open_rank(root, shard)[0] if root is not None and shard is not None else (
            source if isinstance(source, ModelSource) else resolve(source))
        shard = None if root is not None else shard  # a rank's own file holds exactly its slices
        stats.source, stats.method = src.url, "in-place"
        dests = _target_tensors(target)
        table = src.tensors()
        names = [k for k in dests if k in table]
        missing = [k for k in dests if k not in table]
        unexpected = [k for k in table if k not in dests]
        if missing and strict:
            # Tied weights (lm_head sharing the embedding) are saved once; they fill through their twin.
            loaded_ptrs = {dests[k].untyped_storage().data_ptr() for k in names if dests[k].numel()}
            really = [k for k in missing if dests[k].numel() and dests[k].untyped_storage().data_ptr() not in loaded_ptrs]
            if really:
                raise NotFoundError(f"{src.url} lacks tensor(s) {really[:5]} of the target; pass strict=False to skip them")
        if shard is None:
            for k in names:
                e = table[k][1]
                if tuple(dests[k].shape) != e.shape:
                    raise ConfigError(f"tensor {k!r}: target shape {tuple(dests[k].shape)} but {table[k][0].where} holds {list(e.shape)}")
            plain, strided = {k: (dests[k], *table[k]) for k in names}, []
        else:
            plain, strided = sliced.targets(src, sliced.with_rules(shard, src), {k: dests[k] for k in names})
        _fill_in_place(plain, opts, stats)
        if strided:
            stats.add_read(sliced.read_strided(strided, chunk_size=opts.chunk_size, depth=opts.depth, direct=opts.direct,
                                               gap=o.slice_gap_bytes), files=0)
            sliced.fill_targets(strided, dests)
    stats.tensors += len(names)
    return LoadIntoResult(names, missing, unexpected, stats)


def _fill_in_place(targets: dict[str, tuple[torch.Tensor, Shard, TensorEntry]], opts: ReadSpec, stats: LoadStats) -> None:
    """Stream the bytes of each (destination, shard, entry) through the ring into the destination."""
    by_shard: dict[int, list[TensorEntry]] = {}
    shards: dict[int, Shard] = {}
    sinks: dict[tuple[int, str], torch.Tensor] = {}  # (shard, stored name) -> destination bytes
    finish: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, staged temporary)
    for dst, shard, e in targets.values():
        if e.nbytes == 0:
            continue
        file_dt = torch_dtype(e.dtype)
        if dst.dtype == file_dt and dst.is_contiguous():
            stage = dst
        else:
            stage = torch.empty(e.shape, dtype=file_dt, device=dst.device)
            finish.append((dst, stage))
        sinks[(id(shard), e.name)] = stage.reshape(-1).view(torch.uint8)
        by_shard.setdefault(id(shard), []).append(e)
        shards[id(shard)] = shard
    extents = [x for i, es in by_shard.items() for x in engine.plan_extents(shards[i], es)]
    engine.check_entries_fit(extents)
    plans: dict[int, tuple[list[int], list[TensorEntry]]] = {}
    for ext in extents:
        es = sorted(ext.entries, key=lambda e: e.begin)
        plans[id(ext)] = ([ext.offset_of(e) for e in es], es)

    def sink(ext: Extent, rel: int, view: memoryview, n: int, buf) -> None:
        starts, es = plans[id(ext)]
        src_t = buf.tensor()
        i = max(0, bisect.bisect_right(starts, rel) - 1)
        while i < len(es) and starts[i] < rel + n:
            a, e = starts[i], es[i]
            lo, hi = max(a, rel), min(a + e.nbytes, rel + n)
            if lo < hi:
                dst = sinks[(id(ext.shard), e.name)][lo - a : hi - a]
                piece = src_t[lo - rel : hi - rel]
                if dst.is_cuda:
                    copy_to_device(dst, piece)
                else:
                    dst.copy_(piece)
            i += 1

    counters = Counters(total=sum(x.end - x.start for x in extents), progress=opts.progress)
    engine.read_through_ring(extents, sink, chunk_size=opts.chunk_size, depth=opts.depth, direct=opts.direct,
                             counters=counters, numa_node=opts.numa_node)
    with torch.no_grad():
        for dst, staged in finish:
            dst.copy_(staged)
    if any(d.is_cuda for d, _, _ in targets.values()):
        torch.cuda.synchronize()
    stats.add_read(counters, files=len(shards))


__all__ = ["load_into"]
