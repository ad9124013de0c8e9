"""Which step a job restores, and from which copy: the choice a CheckpointManager's ``restore`` makes.

With a process group the ranks agree, in the caller's thread: on the newest step every rank lists
(one ``all_gather_object``), then on whether every rank restored it (a second one). A rank whose
copy was bad sends every rank to the next older step; an error no other step can cure (a target
that does not match the checkpoint) ends the restore on every rank, naming the rank. Without a
process group each rank chooses alone.

For one step, the manifest comes from the fastest shared tier whose copy reads; a tier whose copy
is unusable is passed over with a warning naming it. Files come from the node's local tiers first
(ckpt.restore.load). With buddy copies (``ckpt.promotion.buddy``), a step no shared tier holds yet may come from
the nodes' tier 0 copies: its manifest is then built from every rank's record.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tierio import events
from tierio.errors import ConfigError, DanglingReferenceError, FormatError, IntegrityError, NotFoundError, StorageError
from tierio.format.shard import manifest_key, shard_name

from tierio.ckpt.promotion.buddy_restore import NodeCopies
from tierio.ckpt.promotion.nodes import gather
from tierio.ckpt.steps.reader import read_manifest
from tierio.ckpt.restore.load import RestoreStats, Source, load_state, own_rank
from tierio.ckpt.tier import TierState

log = logging.getLogger("tierio.ckpt")

RESTORE_ERRORS = (FormatError, IntegrityError, StorageError)


@dataclass(frozen=True)
class Agreement:
    """The ranks agreeing on a restore (``group`` None: this rank alone)."""

    group: Any
    world_size: int

    def newest_common(self, candidates: list[int]) -> int | None:
        """The newest of ``candidates`` that every rank has."""
        if self.group is None:
            return max(candidates, default=None)
        common = set.intersection(*(set(c) for c in gather(candidates, self.group, self.world_size)))
        return max(common) if common else None

    def all_restored(self, ok: bool, fatal: BaseException | None) -> bool:
        if self.group is None:
            return ok
        outcomes = gather((ok, None if fatal is None else f"{type(fatal).__name__}: {fatal}"), self.group, self.world_size)
        refused = [(r, why) for r, (_, why) in enumerate(outcomes) if why is not None]
        if refused and fatal is None:
            r, why = refused[0]
            raise ConfigError(f"rank {r} could not restore, so no rank does: {why}")
        return all(o for o, _ in outcomes)


@dataclass
class Request:
    """One restore: what this rank wants, and how to reach the tiers."""

    rank: int
    world_size: int
    into: Any
    per_rank: str
    tiers: Sequence[TierState]
    sources: Callable[[str], list[Source]]  # the read order, given the url of the manifest's tier
    mapped: bool = True  # tensors restored into new memory may be maps of local shard files
    failures: list[str] = field(default_factory=list)
    node_copies: NodeCopies | None = None  # steps restorable from the nodes' tier 0 (buddy copies)
    parts: Sequence[str] | None = None  # only these top-level keys of the state


@dataclass(frozen=True)
class Outcome:
    state: Any
    step: int
    url: str  # where this rank's own shard came from (else the manifest's tier)
    stats: RestoreStats


def restore(req: Request, candidates: list[int], agreement: Agreement, explicit: bool) -> Outcome:
    """Restore the newest of ``candidates`` (newest first) that every rank can; ``explicit``: the
    caller named the step (no falling back)."""
    tried: set[int] = set()
    dangling: DanglingReferenceError | None = None  # the last step failed only for a missing referenced file
    while True:
        step = agreement.newest_common([c for c in candidates if c not in tried])
        if step is None:
            break
        fatal: BaseException | None = None
        try:
            state, url, stats = restore_step(req, step)
            ok = True
        except RESTORE_ERRORS as exc:
            req.failures.append(str(exc))
            dangling = exc if isinstance(exc, DanglingReferenceError) else None
            ok, state, url, stats = False, None, "", RestoreStats()
        except Exception as exc:  # noqa: BLE001 - raised below, after the other ranks heard of it
            ok, state, url, stats, fatal = False, None, "", RestoreStats(), exc
        ok = agreement.all_restored(ok, fatal)
        if fatal is not None:
            raise fatal
        if ok:
            if req.failures:
                log.warning("restored step %d after: %s", step, "; ".join(req.failures))
            return Outcome(state, step, url, stats)
        tried.add(step)
        if not explicit and len(tried) < len(candidates):
            warnings.warn(f"no valid copy of step {step} on any tier; falling back to an older step", stacklevel=3)
    if not candidates:
        raise NotFoundError(f"no committed checkpoint on any tier ({', '.join(t.url for t in req.tiers)})")
    msg = f"no valid copy of step {candidates[0] if explicit else 'any'} on any tier: " + "; ".join(req.failures or ["none found"])
    if dangling is not None:
        raise DanglingReferenceError(msg, dangling.step, dangling.tensor, dangling.file)
    raise IntegrityError(msg)


def restore_step(req: Request, step: int) -> tuple[Any, str, RestoreStats]:
    """This rank's state of ``step``: the manifest from the fastest shared tier whose copy reads,
    every file from the fastest tier with a good copy."""
    if req.node_copies is not None and step in req.node_copies.plans:
        return restore_from_nodes(req, req.node_copies, step)
    dangling: DanglingReferenceError | None = None
    only_dangling = True
    for ts in req.tiers:
        if ts.node_local or not ts.store.exists(manifest_key(step)):
            continue
        try:
            man = read_manifest(ts.store, step)
            if man.world_size != req.world_size and req.rank == 0:
                log.warning("step %d was saved by %d ranks and restores on %d: global tensors are resharded; each "
                            "rank's own values come from the saved rank of the same number%s", step, man.world_size,
                            req.world_size, f" (ranks {man.world_size}.. take rank 0's)" if req.world_size > man.world_size else "")
            got = load_state(man, req.rank, req.into, req.sources(ts.url), world_size=req.world_size,
                             per_rank=req.per_rank, map_files=req.mapped, parts=req.parts)
            return got.state, got.read_from.get(shard_name(own_rank(man, req.rank)), ts.url), got.stats
        except RESTORE_ERRORS as exc:
            only_dangling = only_dangling and isinstance(exc, DanglingReferenceError)
            dangling = exc if isinstance(exc, DanglingReferenceError) else dangling
            msg = f"copy of step {step} on {ts.url} is unusable: {exc}"
            warnings.warn(msg + "; trying the next tier", stacklevel=4)
            log.warning("%s", msg)
            req.failures.append(msg)
            events.emit(events.CopyUnusable(step, ts.url, str(exc)))
    msg = f"no valid copy of step {step} on any tier: " + "; ".join(req.failures[-3:] or ["none found"])
    if dangling is not None and only_dangling:  # every copy failed on a missing referenced file
        raise DanglingReferenceError(msg, dangling.step, dangling.tensor, dangling.file)
    raise IntegrityError(msg)


def restore_from_nodes(req: Request, copies: NodeCopies, step: int) -> tuple[Any, str, RestoreStats]:
    """A step that no shared tier holds yet, from the nodes' tier 0 copies: a rank whose node lost
    its copy fetches its buddy copy first (every rank takes part, in this thread)."""
    man = copies.manifest(step)
    sources = req.sources(None)
    got = load_state(man, req.rank, req.into, sources, world_size=req.world_size, per_rank=req.per_rank,
                     map_files=req.mapped, parts=req.parts)
    return got.state, got.read_from.get(shard_name(req.rank), sources[0].store.url), got.stats
