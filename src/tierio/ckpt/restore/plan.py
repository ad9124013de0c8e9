"""One restore plan: what a rank's restore of one step reads, and where each byte lands, built once.

Every kind of restore (into the caller's tensors in place, into new memory, resharded onto another
world size or placement) is planned here in one walk over the state tree, then carried out by
``restore.load.carry_out`` without deciding anything again (DCP's reader plans its tensors from
DCP's load plan and reads them through the same ``read_all``). The plan holds:

* the **rank entries** it needs, their records read from the first source with a good copy (``Loaded``);
* each **tensor**: its stored chunks, the region of it this rank wants (a DTensor's or TensorSlice's
  box, or the whole tensor), the memory it lands in (the caller's tensor, a bounce tensor copied
  into it afterwards, or new memory) and how the result reaches the state tree;
* each tensor's **read way**: a copy-on-write map of the one local file holding it whole (new
  memory only; ``restore.mapped``), or a read;
* from the tensors read, the **files and byte ranges** they take (``reshard.plan_reads``: each
  stored chunk's intersection with each target, merged per file);
* the **tiers**, in read order (``sources``; a node-local tier first).

The strict rules are checked while planning, before any byte is read: a target of another global
shape or dtype is a ConfigError naming the tensor; chunks that overlap or leave holes are a
FormatError naming the tensor and the files; on another world size a rank-local tensor that differs
between the saved ranks is refused unless ``per_rank="own"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError, StorageError
from tierio.format.manifest import Manifest, RankEntry
from tierio.format.safetensors import torch_dtype
from tierio.format.shard import step_dir
from tierio.format.slices import Box, TensorSlice, dtensor_box, is_dtensor
from tierio.format.statetree import tensor_refs, unflatten
from tierio.io.untrusted import parsing
from tierio.storage.base import where

from tierio.ckpt.restore.mapped import Placed, placed
from tierio.ckpt.restore.reshard import Stored, Target, global_tensors, own_tensors
from tierio.ckpt.restore.source import Source
from tierio.ckpt.steps.commit import read_record

__all__ = ["Loaded", "RestorePlan", "TensorPlan", "own_rank", "plan_restore"]

SOURCE_ERRORS = (NotFoundError, IntegrityError, FormatError, StorageError)


@dataclass
class Loaded:
    """The rank entries a restore needs, their records read (from the first source that has them)."""

    manifest: Manifest
    sources: Sequence[Source]
    entries: dict[int, RankEntry] = field(default_factory=dict)

    def entry(self, rank: int) -> RankEntry:
        if rank not in self.entries:
            e = self.manifest.ranks[rank]
            self.entries[rank] = e if e.loaded else self._read(e)
        return self.entries[rank]

    def all(self) -> list[RankEntry]:
        return [self.entry(r) for r in range(self.manifest.world_size)]

    def _read(self, e: RankEntry) -> RankEntry:
        assert e.record is not None
        problems = []
        for store in (src.store for src in self.sources):
            try:
                got = read_record(store, self.manifest.step, self.manifest.world_size, e.record)
            except SOURCE_ERRORS as exc:
                problems.append(str(exc))
                continue
            if got.rank != e.rank or got.bytes != e.bytes:
                problems.append(f"{where(store, step_dir(self.manifest.step) + '/' + e.record.name)}: describes rank "
                                f"{got.rank}'s {got.bytes}-byte shard, the manifest rank {e.rank}'s {e.bytes} bytes")
                continue
            return got
        raise IntegrityError(f"no good copy of rank {e.rank}'s record {e.record.name} of step {self.manifest.step}: "
                             + "; ".join(problems))


def own_rank(manifest: Manifest, rank: int) -> int:
    """The saved rank whose own values rank ``rank`` restores."""
    return rank if rank < manifest.world_size else 0


# -- targets ---------------------------------------------------------------------------------------
@dataclass
class TensorPlan:
    """One tensor to restore: its stored chunks, its target (the region this rank wants and the
    memory it lands in), how the result reaches the caller, and its read way (``placed``: a map
    of the one local file that holds it whole; else a read)."""

    stored: Stored
    target: Target
    result: Any
    finish: Callable[[], None] | None = None  # a bounce tensor's copy into the caller's tensor
    fresh: bool = False  # new memory the restore chooses (no into= target): may be a map of the file
    placed: Placed | None = None


def _mismatch(kind: str, name: str, got_shape, got_dtype, stored: Stored) -> ConfigError:
    return ConfigError(
        f"into= {kind} for {name!r} has shape {list(got_shape)} and dtype {got_dtype}; the checkpoint holds "
        f"{list(stored.shape)} {torch_dtype(stored.dtype)}; pass a matching {kind} or restore without into=")


def _landing(name: str, stored: Stored, local: torch.Tensor | None, box: Box) -> tuple[Target, Callable[[], None] | None]:
    """A Target for ``box``: ``local`` itself when bytes can land in it, else a fresh CPU tensor
    copied into ``local`` afterwards."""
    dtype = torch_dtype(stored.dtype)
    if local is not None and local.device.type == "cpu" and local.is_contiguous() and local.dtype == dtype:
        return Target(name, local, box), None
    if local is None:
        # Memory the restore chooses: a shape for now (most such tensors become maps of their
        # files); ``allocate`` gives real memory to those that are read instead. One element
        # expanded, not a "meta" tensor: a process's first meta tensor runs library code no
        # training step runs, paged in from disk then (13-38 ms measured, in a timed restore).
        return Target(name, torch.empty((), dtype=dtype).expand(box.sizes), box), None
    fresh = torch.empty(box.sizes, dtype=dtype)

    def finish() -> None:
        with torch.no_grad():
            local.copy_(fresh)
    return Target(name, fresh, box), finish


def own_want(name: str, stored: Stored, into: torch.Tensor | None) -> TensorPlan:
    whole = Box((0,) * len(stored.shape), stored.shape)
    if into is not None and (tuple(into.shape) != stored.shape or into.dtype != torch_dtype(stored.dtype)):
        raise _mismatch("tensor", name, into.shape, into.dtype, stored)
    target, finish = _landing(name, stored, into, whole)
    return TensorPlan(stored, target, into if into is not None else target.dest, finish, fresh=into is None)


def global_want(name: str, stored: Stored, into: Any) -> TensorPlan:
    """The target of a global tensor: a DTensor's or TensorSlice's region, a whole plain tensor,
    or (no target) a fresh whole tensor."""
    dtype = torch_dtype(stored.dtype)
    if is_dtensor(into) or isinstance(into, TensorSlice):
        if is_dtensor(into):
            kind, shape, local, box = "DTensor", tuple(into.shape), into._local_tensor, dtensor_box(into, name)
        else:
            kind, shape, local, box = "TensorSlice", into.shape, into.local, Box(into.offsets, tuple(into.local.shape))
        if shape != stored.shape or local.dtype != dtype:
            raise ConfigError(
                f"into= {kind} for {name!r} has global shape {list(shape)} and dtype {local.dtype}; the checkpoint "
                f"holds {list(stored.shape)} {dtype}; pass a {kind} of the saved shape and dtype (any placement)")
        target, finish = _landing(name, stored, local, box)
        return TensorPlan(stored, target, into, finish)
    if into is not None and (tuple(into.shape) != stored.shape or into.dtype != dtype):
        raise _mismatch("tensor", name, into.shape, into.dtype, stored)
    target, finish = _landing(name, stored, into, Box((0,) * len(stored.shape), stored.shape))
    return TensorPlan(stored, target, into if into is not None else target.dest, finish, fresh=into is None)


PER_RANK = ("strict", "own")


def check_per_rank(loaded: Loaded, own: RankEntry, names: list[str], world_size: int, label: str) -> None:
    """On another world size: refuse rank-local tensors that differ between the saved ranks."""
    saved = loaded.manifest.world_size
    for name in names:
        mine = own.tensors[name]
        sig = (mine.dtype, mine.shape, [c.xxh3 for c in mine.chunks])
        for e in loaded.all():
            t = e.tensors.get(name)
            if t is None or t.is_global or (t.dtype, t.shape, [c.xxh3 for c in t.chunks]) != sig:
                raise ConfigError(
                    f"{label}: tensor {name!r} is rank-local (a plain tensor each of the {saved} saved ranks wrote for "
                    f"itself) and differs between them, so it has no place on {world_size} ranks; restore with the same "
                    f"world size, save sharded state as DTensors or TensorSlices, or pass per_rank='own' to take the "
                    "values of the saved rank with the same number (rank 0's for ranks it did not have)")


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class RestorePlan:
    """One rank's restore of one step (see the module docstring)."""

    loaded: Loaded
    tree: Any
    into: Any
    label: str  # the manifest, for messages
    tensors: dict[tuple[bool, str], TensorPlan] = field(default_factory=dict)

    @property
    def manifest(self) -> Manifest:
        return self.loaded.manifest

    @property
    def sources(self) -> Sequence[Source]:
        return self.loaded.sources

    def to_map(self) -> list[Placed]:
        return [t.placed for t in self.tensors.values() if t.placed is not None]

    def to_read(self, mapped: Any = ()) -> list[TensorPlan]:
        """The tensors read (every one not in ``mapped``: a map can find no local copy)."""
        return [t for k, t in self.tensors.items() if k not in mapped]


def _only(tree: Any, parts: Sequence[str], label: str) -> dict[str, Any]:
    """The top-level ``parts`` of a saved state tree (a dict), so nothing else is read."""
    missing = [p for p in parts if not isinstance(tree, dict) or p not in tree]
    if missing:
        raise ConfigError(f"{label}: the saved state has no part {', '.join(map(repr, missing))}; pass parts among "
                          f"{sorted(tree) if isinstance(tree, dict) else 'none (it is not a dict)'}")
    return {p: tree[p] for p in parts}


def plan_restore(manifest: Manifest, rank: int, into: Any, sources: Sequence[Source], *,
                 world_size: int | None = None, per_rank: str = "strict", map_files: bool = True,
                 parts: Sequence[str] | None = None) -> RestorePlan:
    """The plan of rank ``rank``'s restore of ``manifest`` in a job of ``world_size`` ranks (default:
    the saved number). With ``map_files``, tensors restored into new memory that lie whole in one
    file are to be maps of it. ``parts``: only these top-level keys of the state are read."""
    if per_rank not in PER_RANK:
        raise ConfigError(f"per_rank={per_rank!r} must be one of {', '.join(PER_RANK)}")
    loaded = Loaded(manifest, sources)
    src = own_rank(manifest, rank)
    own = loaded.entry(src)
    tree = own.tree if own.tree is not None else manifest.tree
    label = where(sources[0].store, step_dir(manifest.step) + "/manifest.json")
    if parts is not None:
        tree = _only(tree, parts, label)
    with parsing(f"{label}: the state tree"):
        uses_globals = bool(tensor_refs(tree, ("__global__",)))
    globals_ = global_tensors(loaded.all()) if uses_globals else {}
    owns = own_tensors(own)
    plan = RestorePlan(loaded, tree, into, label)
    wants = plan.tensors

    def note_own(name: str, target: torch.Tensor | None) -> torch.Tensor:
        if name not in owns:
            raise FormatError(f"{label}: rank {src}'s state tree refers to unknown tensor {name!r}")
        if (False, name) not in wants:
            wants[(False, name)] = own_want(name, owns[name], target)
        return torch.empty(0)

    def note_global(name: str, target: Any) -> torch.Tensor:
        if name not in globals_:
            raise FormatError(f"{label}: the state tree refers to global tensor {name!r}, which no rank's entry describes")
        if (True, name) not in wants:
            wants[(True, name)] = global_want(name, globals_[name], target)
        return torch.empty(0)

    with parsing(f"{label}: the state tree"):  # a hostile tree is a bad copy, not a crash
        unflatten(tree, note_own, into, note_global)
    if world_size not in (None, manifest.world_size) and per_rank == "strict":
        check_per_rank(loaded, own, [n for is_global, n in wants if not is_global], world_size, label)
    if map_files:
        for k, w in wants.items():
            w.placed = placed(k, w.stored, w.target, label) if w.fresh else None
    return plan
