"""torch.distributed.checkpoint (DCP) storage on tierio tiers: ``TierioWriter`` and ``TierioReader``.

    with CheckpointManager(tiers) as mgr:
        dcp.save(state, storage_writer=TierioWriter(mgr, step=100))          # or dcp.async_save
        dcp.load(state, storage_reader=TierioReader(mgr))                    # the latest step

DCP plans (which rank writes which slice, its resharding planner on load); tierio stores: each
rank writes one safetensors shard of its write items and its record through the manager (staging
buffer, O_DIRECT, xxh3 per chunk, node-local tier 0 published to the first shared tier), and DCP's
coordinator commits the manifest in ``finish`` through the same commit protocol as
``CheckpointManager.save`` (``ckpt.steps.commit``). Promotion to slower tiers and retention follow on
each rank's background thread. The checkpoint is an ordinary tierio checkpoint: every tensor is a
global tensor named by its path, the manifest carries one state tree for the whole job, and
``CheckpointManager.restore`` reads it, as ``TierioReader`` reads checkpoints that
``CheckpointManager.save`` wrote.

No pickle reaches storage: DCP hands non-tensor values over pickled, so the writer takes the value
itself from the planner (``DefaultSavePlanner.lookup_object``) and stores it as JSON (refusing what
JSON cannot hold, like ``save``); the reader gives DCP's planner ``torch.save`` bytes it makes from
that JSON.

``dcp.async_save`` runs ``save`` (and its collectives) on a thread of its own: give it a process
group of its own (``process_group=dist.new_group(backend="gloo")``) so no collective of the
training group runs in the background.
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tierio.errors import ConfigError, FormatError, NotFoundError
from tierio.format.manifest import Manifest
from tierio.format.safetensors import torch_dtype
from tierio.format.shard import Placement, ShardBytes, manifest_key, step_dir
from tierio.format.slices import Box
from tierio.format.statetree import flatten, unflatten
from tierio.io.untrusted import parsing
from tierio.storage.base import Store

from tierio.ckpt.manager import CheckpointManager
from tierio.ckpt.promotion.cluster import Own
from tierio.ckpt.promotion.copy import copy_shard
from tierio.ckpt.saving.job import SaveHandle, Staged, check_space
from tierio.ckpt.steps.commit import CommitPlan, await_commit, build_manifest, commit, write_record
from tierio.ckpt.steps.lineage import Lineage
from tierio.ckpt.steps.reader import committed_steps, read_manifest
from tierio.ckpt.restore.reshard import Piece, Stored, Target, global_tensors, own_tensors
from tierio.ckpt.restore.load import read_all
from tierio.ckpt.restore.plan import Loaded, own_rank
from tierio.ckpt.restore.source import Source
from tierio.ckpt.tier import Tier, as_tier, commit_tier, open_tier_store

_STEP_ID = re.compile(r"(?:step_)?(\d{1,9})")


def step_of(checkpoint_id: Any) -> int:
    """A DCP checkpoint id for tierio: a step number (100, "100" or "step_000000100")."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool) and checkpoint_id >= 0:
        return checkpoint_id
    m = _STEP_ID.fullmatch(os.fspath(checkpoint_id)) if isinstance(checkpoint_id, (str, os.PathLike)) else None
    if m is None:
        raise ConfigError(f"checkpoint_id {checkpoint_id!r} is not a tierio step: pass a step number such as 100")
    return int(m.group(1))


# -- writing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankPart:
    """What one rank's write_data tells DCP's coordinator (it travels in WriteResult.storage_data)."""

    rank: int
    own: Own
    leaves: list[tuple[tuple[str | int, ...], Any]]  # (object path, state-tree leaf)


def _path(planner: SavePlanner, fqn: str) -> tuple[str | int, ...]:
    mappings = getattr(planner, "mappings", None) or {}
    return tuple(mappings.get(fqn, (fqn,)))


def _json_leaf(planner: SavePlanner, index: MetadataIndex) -> Any:
    lookup = getattr(planner, "lookup_object", None)
    if lookup is None:
        raise ConfigError(f"{type(planner).__name__} cannot hand over the value of {index.fqn!r} unpickled; "
                          "use DefaultSavePlanner (or one derived from it) with TierioWriter")
    try:
        flat = flatten(lookup(index))
    except ConfigError as exc:
        raise ConfigError(f"{index.fqn!r}: {exc}") from None
    if flat.tensors or flat.globals:
        raise ConfigError(f"{index.fqn!r} holds tensors inside a value DCP stores as bytes (a tuple?); use a list or dict")
    return flat.tree


@dataclass(frozen=True)
class _Leaf:
    value: Any


def tree_from(leaves: list[tuple[tuple[str | int, ...], Any]]) -> Any:
    """A state tree from (object path, leaf) pairs: string keys make dicts, integers lists."""
    root: dict[Any, Any] = {}
    for path, leaf in leaves:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = _Leaf(leaf)

    def build(node: Any) -> Any:
        if isinstance(node, _Leaf):
            return node.value
        items = {k: build(v) for k, v in node.items()}
        if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
            return [items[i] for i in range(len(items))]
        if all(isinstance(k, str) and not k.startswith("__") for k in items):
            return items
        return {"__dict__": [[k, v] for k, v in items.items()]}

    return build(root)


# -- the manager's engine, driven by DCP ------------------------------------------------------------
# DCP blocks while it saves and commits on its coordinator: these three calls drive the manager's
# persister, promoter and step book directly, in DCP's thread, instead of through ``save``.

def write_now(mgr: CheckpointManager, step: int, tensors: dict[str, torch.Tensor], places: dict[str, Placement]) -> Own:
    """Write this rank's shard and record of ``step`` now, in this thread, and when tier 0 is
    node-local copy them to the first shared tier too (``write_data``). ``places`` places the
    global tensors' slices; the step is committed by ``commit_now``."""
    mgr._check_open()
    persister, book, tiers, cluster = mgr._persister, mgr._book, mgr._tiers, mgr._cluster
    rollback = persister.check(step)
    if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
        # The tensors go out through the writer's bounce buffers, copied while earlier requests
        # are in flight, instead of all staged first: they do not change while DCP saves.
        layout = persister.layout(step, tensors)
        book.raise_error()
        check_space(tiers[0], layout.total_bytes, step, mgr.rank)
        book.start(step)
        book.started(step, rollback)
        job = Staged(layout, None, places, None, rollback, ShardBytes(layout, tensors))
    else:
        job = persister.stage(step, tensors, places, None, rollback, SaveHandle(step))
    own: Own | None = None
    try:
        own, lineage = persister.write(step, job, True)
        if tiers[0].node_local:
            shared = commit_tier(tiers)
            cluster.ensure(shared)
            book.account(shared, copy_shard(tiers[0].store, shared.store, step, own.entry, cluster.pool,
                                            cluster.limiter))
            write_record(shared.store, step, mgr.world_size, own.entry, lineage.token)
    except BaseException:
        persister.cleanup_failed(step, own)
        book.end(step)
        raise
    return own


def commit_now(mgr: CheckpointManager, step: int, parts: dict[int, Own], tree: Any) -> None:
    """Commit ``step`` from every rank's part, with one job-wide state ``tree`` (``finish``, on the
    coordinator)."""
    store = commit_tier(mgr._tiers).store
    rollback = mgr._book.rollback()
    lineage = Lineage(mgr._cluster.run(), rollback.after if rollback is not None else None)
    plan = CommitPlan(step, mgr.world_size, {r: p.record for r, p in parts.items() if p.record is not None},
                      {r: p.entry.bytes for r, p in parts.items()}, lineage.extra(),
                      {r: p.entry for r, p in parts.items()}, tree, mgr.options.inline_record_bytes)
    commit(store, build_manifest(store, plan), [p.record.name for p in parts.values() if p.record is not None],
           mgr._cluster.fence(store))


def track(mgr: CheckpointManager, step: int, own: Own) -> SaveHandle:
    """After ``write_now``: wait for the commit of ``step`` and promote this rank's part of it, in
    the background, like a save's."""
    book, promoter = mgr._book, mgr._promoter
    handle = SaveHandle(step, bytes=own.entry.bytes)
    handle.staged.set_result(step)
    handle.persisted.set_result(step)
    book.add(handle, log=False)

    def run() -> None:
        try:
            await_commit(commit_tier(mgr._tiers).store, step, own.entry, own.record, mgr._cluster.wait)
            handle.committed.set_result(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            book.end(step)
            handle.fail(exc)
            return
        if len(mgr._tiers) > 1:
            promoter.run([step], handle, False)
        else:
            promoter.done(step, handle)
    promoter.submit(run)
    return handle


class TierioWriter(StorageWriter):
    """A DCP StorageWriter that saves ``step`` through ``manager`` (its tiers, leases, retention).

    The step may instead come as DCP's ``checkpoint_id`` (a step number)."""

    def __init__(self, manager: CheckpointManager, step: int | None = None) -> None:
        super().__init__()
        self.manager = manager
        self.step = step
        self.is_coordinator = False
        self.handle = None  # this rank's SaveHandle of the last write (promotion in the background)

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is not None and rank != self.manager.rank:
            raise ConfigError(f"DCP runs this process as rank {rank} but its CheckpointManager is rank "
                              f"{self.manager.rank}; build the manager on the process group DCP uses")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.step is None:
            raise ConfigError("TierioWriter needs a step: TierioWriter(manager, step=100) or dcp.save(..., checkpoint_id=100)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.step is not None
        tensors: dict[str, torch.Tensor] = {}
        places: dict[str, Placement] = {}
        leaves: list[tuple[tuple[str | int, ...], Any]] = []
        for item in plan.items:
            path = _path(planner, item.index.fqn)
            if item.type == WriteItemType.BYTE_IO:
                leaves.append((path, _json_leaf(planner, item.index)))
                continue
            name = "/".join(map(str, path))
            if name in tensors:
                raise ConfigError(f"{item.index.fqn!r} has several local chunks on rank {self.manager.rank}; one is supported")
            data = planner.resolve_data(item)
            assert isinstance(data, torch.Tensor) and item.tensor_data is not None
            tensors[name] = data.detach()
            places[name] = Placement(tuple(item.tensor_data.chunk.offsets), tuple(item.tensor_data.size))
            leaves.append((path, {"__global__": name}))
        own = write_now(self.manager, self.step, tensors, places)
        self.handle = track(self.manager, self.step, own)
        part = RankPart(self.manager.rank, own, leaves)
        results = [WriteResult(item.index, item.tensor_storage_size() or 0, part if i == 0 else None)
                   for i, item in enumerate(plan.items)]
        if not results:  # a rank DCP gave nothing to write still reports its (empty) shard
            results = [WriteResult(MetadataIndex(f"tierio.rank{self.manager.rank}"), 0, part)]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.step is not None
        parts: dict[int, RankPart] = {}
        for rank_results in results:
            for r in rank_results:
                if isinstance(r.storage_data, RankPart):
                    parts[r.storage_data.rank] = r.storage_data
        missing = [r for r in range(self.manager.world_size) if r not in parts]
        if missing:
            raise ConfigError(f"DCP finished step {self.step} without the writes of ranks {missing}; nothing committed")
        tree = tree_from([leaf for r in sorted(parts) for leaf in parts[r].leaves])
        commit_now(self.manager, self.step, {r: p.own for r, p in parts.items()}, tree)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step) if self.step is not None else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            step_of(checkpoint_id)
        except ConfigError:
            return False
        return True


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


def _sources(source: CheckpointManager | str | os.PathLike | Store | Tier | Sequence[Any]) -> list[Source]:
    if isinstance(source, CheckpointManager):
        return source.sources()
    items = source if isinstance(source, (list, tuple)) else [source]
    tiers = [as_tier(s) for s in items]
    return [Source(open_tier_store(t), t.node_local) for t in tiers]


class TierioReader(StorageReader):
    """A DCP StorageReader of tierio checkpoints: ``source`` is a CheckpointManager (its tiers) or
    tier URLs / Stores, fastest first; ``step`` defaults to the latest committed (or DCP's
    ``checkpoint_id``). Each rank reads only the chunks its plan needs, every chunk verified."""

    def __init__(self, source: CheckpointManager | str | os.PathLike | Store | Sequence[Any], step: int | None = None,
                 *, rank: int | None = None) -> None:
        super().__init__()
        self.sources = _sources(source)
        self.step = step
        self.rank = rank if rank is not None else (source.rank if isinstance(source, CheckpointManager) else None)
        self._man: Manifest | None = None
        self._loaded: Loaded | None = None
        self._cat: _Catalog | None = None

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self._man = self._loaded = self._cat = None

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
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
        return TierioWriter.validate_checkpoint_id(checkpoint_id)


__all__ = ["TierioReader", "TierioWriter", "step_of"]
