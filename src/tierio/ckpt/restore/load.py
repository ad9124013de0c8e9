"""Restoring one rank's state from a committed step: targets, reads, verification, fallbacks.

What a rank gets back:

* its **own values** (plain tensors and everything else in its state tree) are those the saved
  rank of the same number wrote; a rank the saved job did not have takes rank 0's. On another
  world size a plain tensor must be the same on every saved rank (an optimizer's step count, a
  replicated weight): one that differs between ranks (a ZeRO shard saved as a plain tensor, an RNG
  state) has no meaning there and is refused, naming it, unless ``per_rank="own"`` says to take
  the namesake rank's values anyway;
* **global tensors** (saved as DTensors or TensorSlices, or by torch.distributed.checkpoint) are
  resharded: a DTensor or TensorSlice in ``into=`` is filled with the region of the tensor its
  placement holds, whatever placement and world size the checkpoint was saved with; a plain
  tensor in ``into=`` receives the whole tensor; without ``into=`` the whole tensor comes back.

The rules are strict: a target whose global shape or dtype differs from the checkpoint's is a
ConfigError naming the tensor; the checkpoint's chunks must cover what is wanted without overlap
(a FormatError naming the tensor and the files otherwise).

Every file is read from the first of ``sources`` that holds a good copy (a node-local tier first):
a missing file or a chunk whose xxh3 does not match sends that file to the next source.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio import events
from tierio.errors import ConfigError, FormatError, IntegrityError, NotFoundError, StorageError
from tierio.format.manifest import Manifest, RankEntry, file_key
from tierio.format.safetensors import torch_dtype
from tierio.format.shard import step_dir
from tierio.format.slices import Box, TensorSlice, dtensor_box, is_dtensor
from tierio.format.statetree import tensor_refs, unflatten
from tierio.io.buffers import align_up
from tierio.io.mapping import Arena
from tierio.io.untrusted import parsing
from tierio.stats import Stats
from tierio.storage.base import where

from tierio.ckpt.steps.commit import read_record
from tierio.ckpt.restore.mapped import map_all, placed
from tierio.ckpt.steps.reader import check_shard
from tierio.ckpt.steps.refs import no_good_copy
from tierio.ckpt.restore.reshard import Stored, Target, global_tensors, own_tensors, plan_reads, read_file
from tierio.ckpt.restore.source import Source

__all__ = ["Loaded", "RestoreStats", "Restored", "Source", "load_state", "own_rank", "read_all"]

log = logging.getLogger("tierio.ckpt")

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
class _Want:
    """One tensor to restore: where its bytes go, how the result reaches the caller."""

    stored: Stored
    target: Target
    result: Any
    finish: Callable[[], None] | None = None
    fresh: bool = False  # new memory the restore chooses (no into= target): may be a map of the file


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


def own_want(name: str, stored: Stored, into: torch.Tensor | None) -> _Want:
    whole = Box((0,) * len(stored.shape), stored.shape)
    if into is not None and (tuple(into.shape) != stored.shape or into.dtype != torch_dtype(stored.dtype)):
        raise _mismatch("tensor", name, into.shape, into.dtype, stored)
    target, finish = _landing(name, stored, into, whole)
    return _Want(stored, target, into if into is not None else target.dest, finish, fresh=into is None)


def global_want(name: str, stored: Stored, into: Any) -> _Want:
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
        return _Want(stored, target, into, finish)
    if into is not None and (tuple(into.shape) != stored.shape or into.dtype != dtype):
        raise _mismatch("tensor", name, into.shape, into.dtype, stored)
    target, finish = _landing(name, stored, into, Box((0,) * len(stored.shape), stored.shape))
    return _Want(stored, target, into if into is not None else target.dest, finish, fresh=into is None)


# -- the restore -----------------------------------------------------------------------------------
@dataclass
class RestoreStats(Stats):
    """How a restore moved its bytes: ``mapped_bytes`` became copy-on-write maps of local shard
    files (new memory, ckpt.restore.mapped), ``read_bytes`` were read into tensors (in place, or tensors
    that no single local file holds whole)."""

    mapped_bytes: int = 0
    read_bytes: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        n = self.mapped_bytes + self.read_bytes
        return {"mapped_bytes": self.mapped_bytes, "read_bytes": self.read_bytes, "seconds": self.seconds,
                "gb_per_s": n / self.seconds / 1e9 if self.seconds else 0.0}


@dataclass
class Restored:
    """A restored state and where its files came from (file name -> tier url)."""

    state: Any
    read_from: dict[str, str]
    stats: RestoreStats = field(default_factory=RestoreStats)


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


def load_state(manifest: Manifest, rank: int, into: Any, sources: Sequence[Source], *, world_size: int | None = None,
               per_rank: str = "strict", map_files: bool = True) -> Restored:
    """Rank ``rank``'s state of ``manifest`` in a job of ``world_size`` ranks (default: the saved
    number), every byte verified, from the first good source of each file. Tensors restored into
    new memory are maps of local shard files where they lie whole in one (``map_files``; ckpt.restore.mapped)."""
    t0 = time.perf_counter()
    if per_rank not in PER_RANK:
        raise ConfigError(f"per_rank={per_rank!r} must be one of {', '.join(PER_RANK)}")
    loaded = Loaded(manifest, sources)
    src = own_rank(manifest, rank)
    own = loaded.entry(src)
    tree = own.tree if own.tree is not None else manifest.tree
    label = where(sources[0].store, step_dir(manifest.step) + "/manifest.json")
    with parsing(f"{label}: the state tree"):
        uses_globals = bool(tensor_refs(tree, ("__global__",)))
    globals_ = global_tensors(loaded.all()) if uses_globals else {}
    owns = own_tensors(own)
    wants: dict[tuple[bool, str], _Want] = {}

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
    stats = RestoreStats()
    fresh = [p for k, w in wants.items() if map_files and w.fresh and (p := placed(k, w.stored, w.target, label))]
    mapped = map_all(manifest.step, loaded.entry, fresh, sources)
    for k, tensor in mapped.tensors.items():
        wants[k].result = tensor
    rest = [w for k, w in wants.items() if k not in mapped.tensors]
    allocate([w for w in rest if w.fresh])
    read_from = {**mapped.read_from, **read_all(manifest, loaded, [(w.stored, w.target) for w in rest], sources)}
    stats.mapped_bytes = mapped.nbytes
    stats.read_bytes = sum(w.target.dest.numel() * w.target.dest.element_size() for w in rest)
    for w in wants.values():
        if w.finish is not None:
            w.finish()
    with parsing(f"{label}: the state tree"):
        state = unflatten(tree, lambda name, _t: wants[(False, name)].result, into,
                          lambda name, _t: wants[(True, name)].result)
    # The tree walk's recursive closure is a reference cycle holding the callbacks above: emptied,
    # it holds no tensor, so a restored tensor dies with the caller's last reference to it (a
    # mapped one unmaps its file then, instead of at the next garbage collection).
    wants.clear()
    stats.seconds = time.perf_counter() - t0
    return Restored(state, read_from, stats)


PREFAULT_MIN = 1 << 20  # below this, torch.empty's own faults cost less than an arena


def allocate(wants: list[_Want]) -> None:
    """Memory for the new tensors the restore reads into (not mapped: on S3, spread over several
    files, or ``mapped=False``): carved out of one huge-page arena faulted in by several threads
    before the reads (first-touch faults of 4 KiB pages cost more than the read on virtual
    machines), or plain tensors when they are empty or below PREFAULT_MIN in all."""
    sizes = [w.target.dest.numel() * w.target.dest.element_size() for w in wants]
    big = sum(sizes) >= PREFAULT_MIN
    carved = [(w, n) for w, n in zip(wants, sizes) if big and n]
    for w in (w for w, n in zip(wants, sizes) if not (big and n)):
        _land(w, torch.empty(w.target.dest.shape, dtype=w.target.dest.dtype))
    if not carved:
        return
    offsets, total = [], 0
    for _, n in carved:
        offsets.append(total)
        total += align_up(n, 64)  # every tensor starts on a cache line
    arena = Arena(total)
    arena.populate_all()
    for (w, n), at in zip(carved, offsets):
        dest = w.target.dest
        _land(w, arena.typed(at, dest.dtype, dest.numel()).view(dest.shape))


def _land(w: _Want, fresh: torch.Tensor) -> None:
    w.target = Target(w.target.name, fresh, w.target.box)
    w.result = fresh


def read_all(manifest: Manifest, loaded: Loaded, wanted: list[tuple[Stored, Target]],
             sources: Sequence[Source]) -> dict[str, str]:
    """Read every file ``wanted`` needs, each from the first source with a good copy; returns where
    each file came from. A bad copy passed over is warned about, naming it."""
    label = f"step {manifest.step}"
    read_from: dict[str, str] = {}
    for file, reads in plan_reads(wanted, where(sources[0].store, f"{step_dir(manifest.step)}/manifest.json")).items():
        problems: list[str] = []
        for src in sources:
            w = where(src.store, file_key(manifest.step, file))
            try:
                check_shard(src.store, manifest.step, loaded.entry(reads.rank))
                read_file(src.store, manifest.step, reads, w)
                read_from[file] = src.store.url
                break
            except NotFoundError as exc:
                if not src.node_local:  # another node's file is never on this node's tier
                    problems.append(str(exc))
            except SOURCE_ERRORS as exc:
                problems.append(str(exc))
                events.emit(events.CopyUnusable(manifest.step, src.store.url, str(exc)))
        else:
            raise no_good_copy(manifest.step, file, [s.name for s, _ in wanted if file in s.files], problems)
        if problems:
            msg = f"read {file} of {label} from {src.store.url}; the copies passed over are unusable: " + "; ".join(problems)
            warnings.warn(msg, stacklevel=4)
            log.warning("%s", msg)
    return read_from
