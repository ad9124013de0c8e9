"""``TierioWriter``: DCP's StorageWriter on tierio tiers (see ``tierio.ckpt.dcp``)."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierio.errors import ConfigError
from tierio.format.shard import Placement
from tierio.format.statetree import flatten

from tierio.ckpt.dcp.engine import commit_now, track, write_now
from tierio.ckpt.dcp.ids import TIERS_TAKEN, Place, is_checkpoint_id, place_of, tier_list, url_of
from tierio.ckpt.manager import CheckpointManager
from tierio.ckpt.options import CheckpointOptions
from tierio.ckpt.promotion.cluster import Own


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



class TierioWriter(StorageWriter):
    """A DCP StorageWriter that saves ``step`` through a CheckpointManager (its tiers, leases,
    retention, promotion).

    ``target`` is a CheckpointManager, used as it is, or what one takes: a path or URL (as
    ``FileSystemWriter(path)`` takes), a Store, a Tier, or a list of them, fastest first. For those
    the writer builds a manager of its own (``options`` or keyword overrides: CheckpointOptions) at
    DCP's first call, on ``process_group`` (default: the world; one process without a group), and
    closes it with ``close()`` (or ``with TierioWriter(...)``; else when the writer is collected or the
    process exits). Without a target, DCP's ``checkpoint_id`` names the place. ``checkpoint_id`` is a
    step number, a tier path (the step from ``step=``) or a step in one (``/ckpt/run1/step_000000100``);
    a path outside the writer's tiers is refused. ``reason`` is recorded in the step's manifest
    (``tierio ckpt ls`` shows it), as ``CheckpointManager.save(reason=...)`` records it."""

    def __init__(self, target: CheckpointManager | Place | Sequence[Place] | None = None, step: int | None = None,
                 options: CheckpointOptions | None = None, *, process_group: Any = None, reason: str | None = None,
                 **overrides: Any) -> None:
        super().__init__()
        if reason is not None and not (isinstance(reason, str) and 0 < len(reason) <= 128):
            raise ConfigError(f"TierioWriter(reason=...) takes a short text (1 to 128 characters); got {reason!r}")
        self.reason = reason  # recorded in the manifest, as CheckpointManager.save(reason=...) does
        self._manager = target if isinstance(target, CheckpointManager) else None
        self._tiers = None if target is None or self._manager is not None else tier_list(target, "TierioWriter")
        self._options = CheckpointOptions.resolve(options, overrides) if self._manager is None else None
        if self._manager is not None and (options is not None or overrides):
            raise ConfigError("TierioWriter(manager, ...) uses that manager's options; pass options with a path or URL")
        self._group = process_group
        self._closer: weakref.finalize | None = None
        self.step = step
        self.is_coordinator = False
        self.handle = None  # this rank's SaveHandle of the last write (promotion in the background)

    @property
    def manager(self) -> CheckpointManager:
        """The manager saves go through (built here on first use when the writer owns it)."""
        if self._manager is None:
            if self._tiers is None:
                raise ConfigError(f"TierioWriter has no tiers: pass {TIERS_TAKEN}, or a path as dcp.save's checkpoint_id")
            import torch.distributed as dist

            alone = {} if dist.is_available() and dist.is_initialized() else {"rank": 0, "world_size": 1}
            self._manager = CheckpointManager(self._tiers, self._options, process_group=self._group, **alone)
            self._closer = weakref.finalize(self, self._manager.close)
        return self._manager

    def close(self) -> None:
        """Wait for the saves in flight and close the manager this writer built (not one it was given)."""
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> TierioWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def reset(self, checkpoint_id: str | os.PathLike | int | None = None) -> None:
        if checkpoint_id is None:
            return
        place, step = place_of(checkpoint_id)
        if step is not None:
            self.step = step
        if place is None:
            return
        tiers = self._manager.tiers if self._manager is not None else self._tiers
        mine = None if tiers is None else [url_of(t) for t in tiers]
        if mine is None:
            self._tiers = [place]
        elif url_of(place) not in mine:
            raise ConfigError(f"checkpoint_id {os.fspath(checkpoint_id)!r} is outside this writer's tiers "
                              f"({', '.join(mine)}): pass a step number, or a path in one of them")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        if rank is not None and rank != self.manager.rank:
            raise ConfigError(f"DCP runs this process as rank {rank} but its CheckpointManager is rank "
                              f"{self.manager.rank}; build the manager on the process group DCP uses")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self.step is None:
            raise ConfigError("TierioWriter needs a step: TierioWriter(tiers, step=100), dcp.save(..., checkpoint_id=100) "
                              "or checkpoint_id='/ckpt/run1/step_000000100'")
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
        commit_now(self.manager, self.step, {r: p.own for r, p in parts.items()}, tree, self.reason)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=str(self.step) if self.step is not None else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_checkpoint_id(checkpoint_id)
