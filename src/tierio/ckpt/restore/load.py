"""Carrying out a restore plan (``restore.plan``): maps, reads, verification, fallbacks.

The tensors the plan maps come first (``restore.mapped``); the rest are read into their targets,
new memory for them carved out of one pre-faulted arena (``allocate``). Every file is read from the
first of the plan's sources that holds a good copy (a node-local tier first): a missing file or a
chunk whose xxh3 does not match sends that file to the next source, and a copy passed over is
warned about, naming it. What a rank gets back, and the rules, are in ``restore.plan``.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio import events
from tierio.errors import NotFoundError
from tierio.format.manifest import Manifest, file_key
from tierio.format.shard import step_dir
from tierio.format.statetree import unflatten
from tierio.io.buffers import align_up
from tierio.io.mapping import Arena
from tierio.io.untrusted import parsing
from tierio.stats import Stats
from tierio.storage.base import where

from tierio.ckpt.restore.mapped import map_all
from tierio.ckpt.restore.plan import SOURCE_ERRORS, Loaded, RestorePlan, TensorPlan, own_rank, plan_restore
from tierio.ckpt.restore.reshard import Stored, Target, plan_reads, read_file
from tierio.ckpt.restore.source import Source
from tierio.ckpt.steps.reader import check_shard
from tierio.ckpt.steps.refs import no_good_copy

__all__ = ["Loaded", "RestoreStats", "Restored", "Source", "carry_out", "load_state", "own_rank", "read_all"]

log = logging.getLogger("tierio.ckpt")


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


def carry_out(plan: RestorePlan) -> Restored:
    """The state ``plan`` describes, every byte verified, from the first good source of each file:
    the tensors to map first, then the rest read into their targets."""
    t0 = time.perf_counter()
    wants, manifest = plan.tensors, plan.manifest
    mapped = map_all(manifest.step, plan.loaded.entry, plan.to_map(), plan.sources)
    for k, tensor in mapped.tensors.items():
        wants[k].result = tensor
    rest = plan.to_read(mapped.tensors)
    allocate([w for w in rest if w.fresh])
    read_from = {**mapped.read_from, **read_all(manifest, plan.loaded, [(w.stored, w.target) for w in rest], plan.sources)}
    stats = RestoreStats(mapped_bytes=mapped.nbytes,
                         read_bytes=sum(w.target.dest.numel() * w.target.dest.element_size() for w in rest))
    for w in wants.values():
        if w.finish is not None:
            w.finish()
    with parsing(f"{plan.label}: the state tree"):
        state = unflatten(plan.tree, lambda name, _t: wants[(False, name)].result, plan.into,
                          lambda name, _t: wants[(True, name)].result)
    # The tree walk's recursive closure is a reference cycle holding the callbacks above: emptied,
    # it holds no tensor, so a restored tensor dies with the caller's last reference to it (a
    # mapped one unmaps its file then, instead of at the next garbage collection).
    wants.clear()
    stats.seconds = time.perf_counter() - t0
    return Restored(state, read_from, stats)


def load_state(manifest: Manifest, rank: int, into: Any, sources: Sequence[Source], *, world_size: int | None = None,
               per_rank: str = "strict", map_files: bool = True, parts: Sequence[str] | None = None) -> Restored:
    """Rank ``rank``'s state of ``manifest``: its plan (``plan_restore``), carried out; the
    seconds reported count the planning too (it reads the records)."""
    t0 = time.perf_counter()
    plan = plan_restore(manifest, rank, into, sources, world_size=world_size, per_rank=per_rank, map_files=map_files,
                        parts=parts)
    planned = time.perf_counter() - t0
    got = carry_out(plan)
    got.stats.seconds += planned
    return got


PREFAULT_MIN = 1 << 20  # below this, torch.empty's own faults cost less than an arena


def allocate(wants: list[TensorPlan]) -> None:
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


def _land(w: TensorPlan, fresh: torch.Tensor) -> None:
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
