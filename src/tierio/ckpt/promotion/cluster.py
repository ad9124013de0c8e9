"""Moving a rank's part of a step down the tiers: publication from a node-local tier to the first
shared tier (the global commit), and promotion of committed steps to slower tiers.

Both run on a manager's promotion thread and coordinate ranks through the destination store only:

* **publication** (node-local tier 0): each rank copies its shard and its record from its node's
  tier to the first shared tier, verifying every chunk, and the commit protocol (``ckpt.steps.commit``)
  runs there: rank 0 commits the manifest once every rank's record is listed. That manifest is the
  step's global commit.
* **promotion**: from the fastest shared tier holding the committed step, each rank copies its own
  files (read from its node's copy when that is there; after a change of world size, the files of
  the saved ranks ``q`` with ``q % world_size == rank``) to each slower tier, then leaves a marker
  named by a digest of the manifest; rank 0 copies the manifest (the same bytes) once every marker
  and every file is there, and removes the markers, which tells the other ranks it is done.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from tierio.errors import NotFoundError, TierioError
from tierio.format.manifest import Manifest, RankEntry, RecordRef
from tierio.format.shard import fragment_key, manifest_key, step_dir
from tierio.io.buffers import BufferPool
from tierio.io.checksum import xxh3
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store, list_sizes

from tierio.ckpt.steps.commit import CommitPlan, Fence, Waiting, await_commit, build_manifest, commit, commit_step, poll_until, write_record
from tierio.ckpt.promotion.copy import CopyStats, commit_copy, copy_rank, copy_shard, files_present
from tierio.ckpt.steps.tier_leases import TierLeases
from tierio.ckpt.steps.lineage import Lineage, Rollback, manifest_on
from tierio.ckpt.promotion.nodes import NodeLayout
from tierio.ckpt.steps.reader import read_manifest_raw
from tierio.ckpt.tier import TierState

log = logging.getLogger("tierio.ckpt")


@dataclass
class Cluster:
    """Who this rank is, and what it needs to write shared state with the other ranks."""

    rank: int
    world_size: int
    node: NodeLayout
    leases: TierLeases
    wait: Waiting
    limiter: TokenBucket | None
    pool: BufferPool  # promotion buffers
    inline_records: int

    def leads(self, ts: TierState) -> bool:
        """Rank 0 leads shared tiers; the lowest rank of each node leads that node's local tiers."""
        return self.rank == self.node.leader if ts.node_local else self.rank == 0

    def ensure(self, ts: TierState) -> None:
        self.leases.ensure(ts.store, self.leads(ts), ts.node_local)

    def fence(self, store: Store) -> Fence:
        """The lease check of this rank's commits and deletions on ``store`` (``TierLeases.fence``)."""
        return lambda: self.leases.fence(store)

    def run(self) -> str:
        """This run's id, as the lease check set it (before any write)."""
        run = self.leases.run
        assert run is not None, "the lease check sets the run id before any write"
        return run


@dataclass(frozen=True)
class Own:
    """This rank's part of a step, as it wrote it: its manifest entry and its record (if any)."""

    entry: RankEntry
    record: RecordRef | None


def commit_on(cl: Cluster, store: Store, step: int, own: Own, lineage: Lineage) -> None:
    """Run this rank's part of the commit protocol of ``step`` on ``store``."""
    if cl.rank != 0:
        await_commit(store, step, own.entry, own.record, cl.wait)
        return
    extra = lineage.extra()
    if cl.world_size == 1 and own.record is None:
        commit(store, build_manifest(store, CommitPlan(step, 1, {}, {}, extra, {0: own.entry})), [], cl.fence(store))
        return
    commit_step(store, lambda listing: CommitPlan.from_listing(listing, step, cl.world_size, extra, {0: own.entry},
                                                             cl.inline_records),
                cl.world_size, step, lineage.token, cl.wait, cl.fence(store))


def publish(cl: Cluster, node: TierState, shared: TierState, step: int, own: Own, lineage: Lineage,
            account: Callable[[TierState, CopyStats], None]) -> None:
    """Node-local tier 0: copy this rank's shard and record to the first shared tier and commit there."""
    cl.ensure(shared)
    stats = copy_shard(node.store, shared.store, step, own.entry, cl.pool, cl.limiter)
    ref = write_record(shared.store, step, cl.world_size, own.entry, lineage.token, lineage.extra())
    account(shared, stats)
    commit_on(cl, shared.store, step, Own(own.entry, ref), lineage)


def promote_step(cl: Cluster, tiers: list[TierState], step: int, rollback: Rollback | None,
                 account: Callable[[TierState, CopyStats], None]) -> None:
    """Copy a committed step from the fastest shared tier holding it to every slower one."""
    shared = [ts for ts in tiers if not ts.node_local]
    src = next((ts for ts in shared if ts.store.exists(manifest_key(step))), None)
    if src is None:
        raise NotFoundError(f"step {step} has no committed copy on any tier; nothing to promote")
    raw, man = read_manifest_raw(src.store, step)
    for dst in shared[shared.index(src) + 1 :]:
        there = manifest_on(dst.store, step)
        if there == raw:
            continue  # already there: the same checkpoint, byte for byte
        cl.ensure(dst)
        if cl.rank == 0:
            cl.fence(dst.store)()  # it deletes there
            clear_destination(dst.store, step, rollback, there is not None)
        account(dst, copy_own(cl, tiers, src, dst, man))
        commit_copy_on(cl, dst.store, raw, man)


def copy_own(cl: Cluster, tiers: list[TierState], src: TierState, dst: TierState, man: Manifest) -> CopyStats:
    """This rank's share of the files of ``man`` to ``dst`` (the saved ranks q with q % world_size ==
    rank: its own when the world size is the one saved), each from this node's copy when that is
    good, else from ``src``."""
    stats = CopyStats()
    for q in range(cl.rank, man.world_size, cl.world_size):
        for ts in [t for t in tiers if t.node_local] + [src]:
            try:
                stats.add(copy_rank(ts.store, dst.store, man, q, cl.pool, cl.limiter))
                break
            except TierioError as exc:
                if ts is src:
                    raise
                log.info("copying rank %d's files of step %d from %s instead of %s: %s", q, man.step, src.url, ts.url, exc)
    return stats


def clear_destination(dst: Store, step: int, rollback: Rollback | None, other: bool) -> None:
    """Rank 0, before promoting ``step`` to ``dst``: retire an abandoned branch there, and the
    manifest of ``other`` checkpoint of this step there (it must not pass for this one)."""
    if rollback is not None:
        rollback.retire_dirs(dst)
    if other:
        log.warning("%s holds another checkpoint of step %d (an abandoned run's); replacing it", dst.url, step)
        dst.delete(manifest_key(step))


def commit_copy_on(cl: Cluster, dst: Store, raw: bytes, man: Manifest) -> None:
    """Commit a promoted step on ``dst`` once every rank's files are there (markers carry a digest
    of the manifest's bytes, so a stale file never completes it)."""
    step = man.step
    if cl.world_size == 1:
        if not files_present(dst, man):
            raise NotFoundError(f"after copying step {step} to {dst.url}, some of its files are missing there; not committing")
        commit_copy(dst, step, raw, cl.fence(dst))
        return
    token = xxh3(raw)[:8]
    mine = fragment_key(step, cl.rank, token)
    dst.put_buffers(mine, [b"{}"])
    if cl.rank != 0:
        # Done when this checkpoint's manifest is there, or when rank 0 has removed this marker
        # (it does so only after committing). Either alone can miss: a marker a dead run left with
        # the same digest may let rank 0 commit and remove the markers before this one is written
        # (seen after a SIGKILL of a 2-rank job: then the manifest says it), and retention may
        # delete the committed step again before this rank looks (seen under Lightning with
        # frequent saves: then the marker's absence says it). A look is one or two existence
        # checks; the manifest is read only once one is there.
        poll_until(lambda: not dst.exists(mine) or (dst.exists(manifest_key(step)) and manifest_on(dst, step) == raw),
                   lambda: f"rank 0 to commit step {step} on {dst.url}; did rank 0 die?", cl.wait)
        try:
            dst.delete(mine)  # rank 0 removes the markers it saw; one written after that goes here
        except TierioError:
            pass
        return
    keys = [fragment_key(step, r, token) for r in range(cl.world_size)]

    def ready() -> bool:  # one listing per look, whatever the number of ranks
        sizes = list_sizes(dst, step_dir(step) + "/")
        return all(k in sizes for k in keys) and files_present(dst, man, sizes)

    poll_until(ready, lambda: f"every rank's files of step {step} on {dst.url}", cl.wait)
    commit_copy(dst, step, raw, cl.fence(dst))
    for key in keys:
        try:
            dst.delete(key)
        except TierioError as exc:
            log.warning("could not remove a marker of step %d on %s: %s", step, dst.url, exc)
