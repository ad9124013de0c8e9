"""``TierioReader``: DCP's StorageReader of tierio checkpoints (see ``tierio.ckpt.dcp``)."""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.format.manifest import Manifest
from tierio.format.safetensors import torch_dtype
from tierio.format.shard import manifest_key, step_dir
from tierio.format.slices import Box
from tierio.format.statetree import unflatten
from tierio.io.untrusted import parsing

from tierio.ckpt.dcp.ids import TIERS_TAKEN, Place, is_checkpoint_id, place_of, tier_list, url_of
from tierio.ckpt.manager import CheckpointManager
from tierio.ckpt.steps.reader import committed_steps, read_manifest
from tierio.ckpt.restore.reshard import Piece, Stored, Target, global_tensors, own_tensors
from tierio.ckpt.restore.load import read_all
from tierio.ckpt.restore.plan import Loaded, own_rank
from tierio.ckpt.restore.source import Source
from tierio.ckpt.tier import as_tier, open_tier_store


# -- reading ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _TensorLoc:
    """Where DCP's chunk (fqn, offsets) of a tensor is: one stored piece of it."""

    stored: Stored
    piece: Piece


@dataclass
class _Catalog:
    """A checkpoint as DCP sees it from one rank: every fqn, its metadata, and where its bytes are."""

    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[MetadataIndex, _TensorLoc] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


def _catalog(man: Manifest, loaded: Loaded, rank: int, where: str) -> _Catalog:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    own = loaded.entry(own_rank(man, rank))
    tree = own.tree if own.tree is not None else man.tree
    stored = {**{(False, n): s for n, s in own_tensors(own).items()},
              **{(True, n): s for n, s in global_tensors(loaded.all()).items()}}
    marks: dict[int, Stored] = {}

    def mark(is_global: bool, name: str) -> torch.Tensor:
        s = stored.get((is_global, name))
        if s is None:
            raise FormatError(f"{where}: the state tree refers to tensor {name!r}, which no entry describes")
        t = torch.empty(s.shape, dtype=torch_dtype(s.dtype), device="meta")
        marks[id(t)] = s
        return t

    with parsing(f"{where}: the state tree"):
        obj = unflatten(tree, lambda n, _t: mark(False, n), None, lambda n, _t: mark(True, n))
    flat, _ = flatten_state_dict(obj if isinstance(obj, dict) else {"state": obj})
    cat = _Catalog()
    for fqn, value in flat.items():
        s = marks.get(id(value)) if isinstance(value, torch.Tensor) else None
        if s is None:
            if isinstance(value, torch.Tensor):
                raise FormatError(f"{where}: {fqn!r} holds a tensor DCP cannot address")
            cat.metadata[fqn] = BytesStorageMetadata()
            cat.values[fqn] = value
            continue
        chunks = [ChunkStorageMetadata(torch.Size(p.chunk.offsets), torch.Size(p.chunk.shape)) for p in s.pieces]
        cat.metadata[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(s.dtype)), torch.Size(s.shape), chunks)
        for p in s.pieces:
            cat.tensors[MetadataIndex(fqn, p.chunk.offsets)] = _TensorLoc(s, p)
    return cat


def _sources(source: CheckpointManager | Place | Sequence[Place]) -> list[Source]:
    if isinstance(source, CheckpointManager):
        return source.sources()
    tiers = [as_tier(s) for s in tier_list(source, "TierioReader")]
    return [Source(open_tier_store(t), t.node_local) for t in tiers]


class TierioReader(StorageReader):
    """A DCP StorageReader of tierio checkpoints: ``source`` is a CheckpointManager (its tiers) or
    tier paths, URLs, Stores or Tiers, fastest first (as ``FileSystemReader(path)`` takes a path);
    without one, DCP's ``checkpoint_id`` names it. ``step`` defaults to the latest committed, or
    comes from ``checkpoint_id`` (a step number, or a path ``/ckpt/run1/step_000000100``). Each rank
    reads only the chunks its plan needs, every chunk verified."""

    def __init__(self, source: CheckpointManager | Place | Sequence[Place] | None = None, step: int | None = None,
                 *, rank: int | None = None) -> None:
        super().__init__()
        self.sources = _sources(source) if source is not None else []
        self.step = step
        self.rank = rank if rank is not None else (source.rank if isinstance(source, CheckpointManager) else None)
        self._man: Manifest | None = None
        self._loaded: Loaded | None = None
        self._cat: _Catalog | None = None

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            place, step = place_of(checkpoint_id)
            self.step = step if step is not None else self.step
            if place is not None:
                urls = [url_of(s.store) for s in self.sources]
                if not urls:
                    self.sources = _sources(place)
                elif url_of(place) not in urls:
                    raise ConfigError(f"checkpoint_id {os.fspath(checkpoint_id)!r} is outside this reader's tiers "
                                      f"({', '.join(urls)}): pass a step number, or a path in one of them")
        self._man = self._loaded = self._cat = None

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if not self.sources:
            raise ConfigError(f"TierioReader has no tiers: pass {TIERS_TAKEN}, or a path as dcp.load's checkpoint_id")
        shared = [s.store for s in self.sources if not s.node_local]
        step = self.step
        if step is None:
            steps = sorted({s for store in shared for s in committed_steps(store)})
            if not steps:
                raise NotFoundError(f"no committed checkpoint on {', '.join(s.url for s in shared)}")
            step = steps[-1]
        home = next((s for s in shared if s.exists(manifest_key(step))), None)
        if home is None:
            raise NotFoundError(f"step {step} has no committed checkpoint on {', '.join(s.url for s in shared)}")
        self.step, self._man = step, read_manifest(home, step)
        self._loaded = Loaded(self._man, self.sources)
        where = f"{home.url}/{step_dir(step)}/manifest.json"
        self._cat = _catalog(self._man, self._loaded, self._rank(), where)
        return Metadata(dict(self._cat.metadata), storage_meta=StorageMeta(checkpoint_id=str(step)))

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._cat is None:
            self.read_metadata()
        rank = kwargs.get("rank")
        if rank is not None and self.rank is None:
            self.rank = rank

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        assert self._cat is not None and self._man is not None and self._loaded is not None
        wanted: list[tuple[Stored, Target]] = []
        done: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(self._cat.values[item.storage_index.fqn], buf)  # built here from JSON, never read
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            loc = self._cat.tensors.get(MetadataIndex(item.storage_index.fqn, item.storage_index.offset))
            if loc is None:
                raise FormatError(f"step {self.step} holds no chunk {item.storage_index.fqn!r} at {list(item.storage_index.offset or [])}")
            dest = planner.resolve_tensor(item).detach()
            offsets = tuple(o + d for o, d in zip(loc.piece.chunk.offsets, item.storage_offsets))
            box = Box(offsets, tuple(item.lengths))
            dtype = torch_dtype(loc.stored.dtype)
            if dest.dtype != dtype or tuple(dest.shape) != box.sizes:
                raise ConfigError(f"DCP's target for {item.dest_index.fqn!r} is {dest.dtype} {list(dest.shape)}; the "
                                  f"checkpoint holds {dtype} {list(box.sizes)} there")
            direct = dest.device.type == "cpu" and dest.is_contiguous()
            land = dest if direct else torch.empty(box.sizes, dtype=dtype)
            wanted.append((Stored(loc.stored.name, loc.stored.dtype, loc.stored.shape, [loc.piece]),
                           Target(loc.stored.name, land, box)))
            done.append((item, dest, None if direct else land))
        read_all(self._man, self._loaded, wanted, self.sources)
        for item, dest, land in done:
            if land is not None:
                dest.copy_(land)
            planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_checkpoint_id(checkpoint_id)
