"""CheckpointManager: asynchronous, tiered, verified checkpoints, on one node or a cluster.

The manager is the training loop's API only; the work is done by phase (docs/architecture.md,
"The checkpoint engine by phase"), wired by callbacks around one step book:

* ``saving.persist.Persister``: ``save`` stages the state (the only part the caller waits for);
  the persist thread writes the shard to tier 0, checksummed, then its record and the commit;
* ``promotion.promoter.Promoter``: the promotion thread publishes a node-local step (the global
  commit), copies committed steps down the slower tiers and applies retention;
* ``restore.recovery``: which step every rank restores and from which copy (one collective in the
  caller's thread), carried out by ``restore.load``;
* ``steps.book.StepBook``: every step's state, the error slot and the one lock they share.

No collective runs on a background thread: ranks coordinate through the tiers. The caller's thread
runs one collective at construction (the run id, and the node layout when a tier is node-local)
and, on ``restore``, the agreement on the step. The leader of a tier (rank 0; a node's lowest rank
for its node-local tier) holds its lease (``steps.lease``) and applies retention there. A save
after ``restore()`` follows the rollback rule (``steps.lineage``). DCP drives the same parts
through ``ckpt.dcp``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from tierio import events
from tierio.dist import rank_world
from tierio.errors import ConfigError, NotFoundError
from tierio.format.statetree import flatten
from tierio.io import offload
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store
from tierio.units import parse_size

from tierio.ckpt.options import CheckpointOptions
from tierio.ckpt.promotion.buddy import Buddy, check_buddy
from tierio.ckpt.promotion.buddy_restore import node_copies
from tierio.ckpt.promotion.cluster import Cluster
from tierio.ckpt.promotion.copy import copy_pool
from tierio.ckpt.promotion.fill import fill_after_restore
from tierio.ckpt.promotion.nodes import agree_job, gather, group_joined
from tierio.ckpt.promotion.promoter import Promoter
from tierio.ckpt.restore import recovery
from tierio.ckpt.restore.source import Source, read_order
from tierio.ckpt.saving.interval import IntervalPlan, check_mtbf, optimal_interval, save_due
from tierio.ckpt.saving.job import SaveHandle, check_tiers, to_write
from tierio.ckpt.saving.persist import Persister
from tierio.ckpt.steps.book import StepBook
from tierio.ckpt.steps.commit import Waiting
from tierio.ckpt.steps.lease import LeaseTiming
from tierio.ckpt.steps.reader import VerifyReport, steps_on, verify_tiers
from tierio.ckpt.steps.tier_leases import TierLeases
from tierio.ckpt.tier import Tier, TierState, as_tier

__all__ = ["CheckpointManager", "SaveHandle"]

log = logging.getLogger("tierio.ckpt")


def _rate(value: float | str | None) -> float | None:
    return parse_size(value) if isinstance(value, str) else value


class CheckpointManager:
    """Asynchronous tiered checkpoints. ``tiers`` go from fastest to slowest (URLs, Stores or Tier).

    Options come as a :class:`CheckpointOptions` or as keywords of the same names (``run_id``,
    ``commit_timeout``, ``memory_budget_bytes``, ...). Rank and world size come from the initialised
    process group (``process_group``, default the world) unless given."""

    def __init__(self, tiers: Sequence[str | Tier | Store], options: CheckpointOptions | None = None, *,
                 rank: int | None = None, world_size: int | None = None, process_group: Any = None,
                 **overrides: Any) -> None:
        if isinstance(tiers, (str, Tier)) or not tiers:
            raise ConfigError("CheckpointManager needs a list of tiers, fastest first, e.g. ['/nvme/ckpt', 's3://bucket/run1']")
        self.options = opts = CheckpointOptions.resolve(options, overrides)
        if opts.mtbf is not None:
            check_mtbf(opts.mtbf)
        rate = _rate(opts.promote_bandwidth)
        limiter = TokenBucket(rate, burst=max(1 << 20, rate / 4)) if rate else None
        specs = [as_tier(t) for t in tiers]
        check_tiers(specs)
        self._tiers = [TierState.open(t, limiter if i > 0 else None) for i, t in enumerate(specs)]
        self.rank, self.world_size = rank_world(rank, world_size, process_group)
        from_group = rank is None or world_size is None
        job = agree_job(opts.run_id, self.rank, self.world_size, process_group, from_group, opts.node,
                        any(t.node_local for t in specs), opts.ranks_per_node)
        self._group = group_joined(process_group, from_group) if self.world_size > 1 else None
        timing = LeaseTiming(opts.lease_expires) if opts.lease_expires is not None else None
        self._leases = TierLeases(job.run_id, self.rank, self.world_size, force=opts.break_lease,
                                  wait_timeout=opts.commit_timeout, timing=timing)
        self._cluster = Cluster(self.rank, self.world_size, job.node, self._leases, Waiting(opts.commit_timeout),
                                limiter, copy_pool(opts.persist_process), opts.inline_record_bytes)
        self._buddy = self._setup_buddy(rate) if opts.buddy else None
        self.restored_step: int | None = None
        self.restored_from: str | None = None  # the tier whose manifest the last restore used
        self._last_restore: dict | None = None  # how the last restore moved its bytes (stats())
        self._closed = False
        self._book = StepBook()
        self._promoter = Promoter(self._tiers, self._cluster, self._book, opts.min_keep, opts.background_nice)
        self._persister = Persister(self._tiers, self._cluster, self._book, memory_budget=opts.memory_budget_bytes,
                                    slots=2 if opts.double_buffer else 1, overlap=opts.overlap,
                                    incremental=opts.incremental, buddy=self._buddy, persisted=self._promoter.persisted,
                                    numa_node=opts.numa_node, nice=opts.background_nice, offload=opts.persist_process)

    def _setup_buddy(self, promote_rate: float | None) -> Buddy:
        """Buddy copies (``promotion.buddy``): the pairing and the buddy group, made here, in the caller's thread."""
        opts, t0 = self.options, self._tiers[0]
        check_buddy(t0.node_local, opts.incremental)
        rate = _rate(opts.buddy_bandwidth)
        rate = promote_rate if rate is None else rate
        return Buddy.setup(t0.store, self.rank, self.world_size, self._group, self.node, rate or None,
                           opts.commit_timeout, t0.tier.retention, opts.background_nice)

    @property
    def tiers(self) -> list[str]:
        return [t.url for t in self._tiers]

    @property
    def node_local(self) -> bool:
        """Whether tier 0 is per node: a save is ``persisted`` there before its global ``committed``."""
        return self._tiers[0].node_local

    @property
    def run_id(self) -> str | None:
        """This run's id: agreed by the ranks (process group, ``run_id``, or the launcher's job id)."""
        return self._leases.run

    @property
    def node(self) -> str:
        """The node this rank runs on (what node-local tiers are per)."""
        return self._cluster.node.name

    # -- saving ------------------------------------------------------------------------------------
    def save(self, step: int, state: Any, *, reason: str | None = None) -> SaveHandle:
        """Snapshot ``state`` into staging memory and return; persist and promotion run behind.
        ``reason`` (up to 128 characters) is recorded in the manifest and shown by ``tierio ckpt ls``:
        why this step was saved off the loop's schedule (``Preemption`` writes ``"emergency: SIGTERM"``)."""
        t0 = time.perf_counter()
        overlap = self._persister.overlap is not None
        handle = SaveHandle(step, settle=self._settle if overlap else None)
        if self._buddy is None:
            handle.buddied.set_result(None)
        try:
            self._check_open()
            if reason is not None and not (isinstance(reason, str) and 0 < len(reason) <= 128):
                raise ConfigError(f"save(reason=...) takes a short text (1 to 128 characters); got {reason!r}")
            self._settle(wait_copies=False)  # earlier overlapped saves whose copy is done: their verdict
            rollback = self._persister.check(step)
            flat = flatten(state)
            tensors, places = to_write(flat)
            job = self._persister.stage(step, tensors, places, flat.tree, rollback, handle, overlap=overlap)
            job.reason = reason
        except BaseException:
            if self._buddy is not None:  # each save is one exchange with the partner: it must not wait for this one
                self._buddy.send(step, None, handle.buddied)
            raise
        handle.blocking_seconds = time.perf_counter() - t0
        if job.snapshot is None:
            handle.staged.set_result(step)
        else:
            job.snapshot.copied.add_done_callback(lambda f: handle.staged.set_exception(f.exception())
                                                  if f.exception() is not None else handle.staged.set_result(step))
        self._book.add(handle)
        events.emit(events.CheckpointStaged(step, self._tiers[0].url, handle.bytes, handle.blocking_seconds, handle.wait_seconds))
        self._persister.submit(handle, job)
        return handle

    def interval_plan(self) -> IntervalPlan | None:
        """Young/Daly's interval from the ``mtbf`` option and the measured cost of the latest saves
        (blocking time; background write as a lower bound); None before the first save."""
        if self.options.mtbf is None:
            raise ConfigError("should_save needs the job's mean time between failures: "
                              "CheckpointManager(..., mtbf=SECONDS), e.g. mtbf=4 * 3600")
        cost = self._book.cost()
        return None if cost is None else optimal_interval(cost.blocking_s, self.options.mtbf, cost.write_s)

    def should_save(self, step: int, *, now: float | None = None) -> bool:
        """Whether to save ``step`` now, for the least expected work lost (``saving.interval``): True
        at the first call (that save measures the cost), then once Young/Daly's interval has gone by
        since the previous save returned, never while a save still persists or for a step already
        in flight. With a process group every rank must call it for the same steps: a step is saved
        when every rank finds it due (one all_gather in the caller's thread). ``now`` is a
        ``time.monotonic()`` reading (default: the current one)."""
        plan = self.interval_plan()
        if self._book.in_flight(step):
            return False
        persisting, last = self._book.persisting()
        if plan is None or last is None:
            due = not persisting
        else:
            due = save_due(plan, (time.monotonic() if now is None else now) - last, persisting)
        return due if self._group is None else all(gather(due, self._group, self.world_size))

    def before_update(self) -> None:
        """Wait for the copies of overlapped saves (``overlap=True``) before the saved tensors
        change, and give each its verdict: call it before an update in loops without a torch
        optimizer (``attach`` calls it from the optimizer's step pre-hook). Raises
        ``SnapshotChangedError`` when a saved tensor changed in place since its ``save`` (that step
        is not committed); without overlap it does nothing."""
        self._settle(update=True)

    def _settle(self, update: bool = False, wait_copies: bool = True, report: bool = True) -> None:
        """Judge the open snapshots of overlapped saves (``Overlap.judge``), in the caller's thread:
        the one that changes the saved tensors. ``update``: the wait is the update's (stats);
        ``report=False`` leaves a failure to the next save/wait, through the persist."""
        overlap = self._persister.overlap
        if overlap is None:
            return
        waited = overlap.judge(wait_copies=wait_copies, report=report)
        if update:
            for step, seconds in waited.seconds.items():
                self._book.note(step, update_wait_seconds=seconds)
        if report and waited.failed:
            for _snap, exc in waited.failed:  # reported here: the next save does not raise it again
                self._book.forget(exc)
            raise waited.failed[0][1]

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for the copies of overlapped saves first (a step pre-hook
        calling ``before_update``); returns the hook's handle (``.remove()`` detaches it)."""
        if self._persister.overlap is None:
            raise ConfigError("attach() is for overlapped saves: CheckpointManager(..., overlap=True)")
        return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.before_update())

    # -- restoring ---------------------------------------------------------------------------------
    def sources(self, first: str | None = None) -> list[Source]:
        """The tiers a restore reads files from, in order (``restore.source.read_order``)."""
        return read_order(self._tiers, first)

    def restore(self, step: int | None = None, into: Any = None, *, per_rank: str = "strict", mapped: bool = True,
                parts: Sequence[str] | None = None) -> Any:
        """Restore ``step`` (default: the newest step every rank can restore) from the fastest tiers
        holding good copies; every chunk verified.

        With a process group, the ranks agree on the step (a collective in this thread). Each file
        comes from the first tier with a good copy (a node-local tier first); a bad or missing copy
        is skipped with a warning naming it. Global tensors (saved as DTensors or TensorSlices)
        restore into any world size and placement: pass DTensors or TensorSlices in ``into=`` to
        receive the part they hold, or nothing to receive whole tensors. With ``into=``, tensors
        are filled in place where shapes match. On another world size, plain tensors that differ
        between the saved ranks are refused unless ``per_rank="own"``. Tensors restored into new
        memory are copy-on-write maps of local shard files where a tier holds them whole, verified
        before this returns (``restore.mapped``); ``mapped=False`` reads them into private memory.
        ``parts`` (top-level keys of a dict state, e.g. ``["model"]``): only those are read and returned.

        Saving after a restore of an older step is a rollback: the first save retires the steps after
        it on every tier (``steps.lineage``)."""
        self._check_open()
        # Persists and global commits in flight land first (none may land after the rollback
        # point); promotions are not waited for, so a stalled slower tier never holds up a restore.
        # Overlapped saves get their verdict first; a failed one is raised by the next save/wait.
        self._settle(report=False)
        self._book.drain(promotions=False)
        started = time.perf_counter()
        shared = self.steps()  # and, with a node-local tier 0, the steps every rank's part of is on the nodes
        copies = node_copies(self._tiers[0], self.rank, self.world_size, self._buddy, self._group, shared)
        candidates = [step] if step is not None else sorted(set(shared) | set(copies.plans if copies else ()), reverse=True)
        req = recovery.Request(self.rank, self.world_size, into, per_rank, self._tiers, self.sources, mapped=mapped,
                               node_copies=copies, parts=parts)
        got = recovery.restore(req, candidates, recovery.Agreement(self._group, self.world_size), step is not None)
        self._book.restored(got.step)
        if copies is not None and got.step in copies.plans:  # committed nowhere yet: published behind
            self._promoter.publish_later(got.step, *copies.publication(got.step, self._cluster.run()))
        self.restored_step, self.restored_from = got.step, got.url
        self._last_restore = {"step": got.step, "from": got.url, **got.stats.to_dict()}
        fill = fill_after_restore(self._tiers, got.step, got.url, self.world_size)
        if fill is not None:  # read from S3: copy it into tier 0 behind, for the next restore (promotion.fill)
            self._last_restore["fill"] = fill.dst.url
            self._promoter.submit(fill.run)
        events.emit(events.CheckpointRestored(got.step, got.url, time.perf_counter() - started))
        return got.state

    def steps(self) -> list[int]:
        """Committed steps on any tier (an unreachable tier is skipped with a warning)."""
        return steps_on(self._tiers)

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every tier's copy of ``step`` (default: latest) byte for byte (on a node-local tier,
        this node's files of it)."""
        step = self.latest() if step is None else step
        if step is None:
            raise NotFoundError(f"no committed checkpoint on any tier ({', '.join(self.tiers)})")
        return verify_tiers(self._tiers, step)

    # -- promotion, retention, shutdown ------------------------------------------------------------
    def promote(self, step: int | None = None) -> None:
        """Promote ``step`` (default: every pending step and the latest) to all slower tiers now; raises on failure."""
        self._check_open()
        if len(self._tiers) > 1:
            self._promoter.submit(self._promoter.run, [step] if step is not None else self.steps()[-1:], None, True).result()

    def hold_promotion(self, held: bool = True) -> None:
        """Start no promotion while ``held`` (``Promoter.hold``: a preemption's emergency save)."""
        self._promoter.hold(held)

    def gc(self) -> list[tuple[str, int]]:
        """Apply retention to every tier this rank leads now and clean up what interrupted writes
        left there (rank 0; a node's lowest rank for its node-local tiers); returns the (tier url,
        step) copies deleted."""
        return self._promoter.gc(sweep_all=True) if self._promoter.leads_any() else []

    def wait(self) -> None:
        """Wait for every save in flight (persist and promotion; an overlapped save's verdict first,
        ``saving.overlap``); raises a background persist failure."""
        try:
            self._settle()
        finally:
            self._book.drain()
        self._book.raise_error()

    def close(self) -> None:
        if self._closed:
            return
        self._promoter.hold(False)  # a hold left behind would keep close() waiting for ever
        try:
            self.wait()
        finally:
            self._closed = True
            self._persister.close()
            self._promoter.close()
            if self._buddy is not None:
                self._buddy.close()
            self._leases.close()
            pending = self._book.pending()
            if pending:
                log.warning("steps %s were not promoted to every tier; their faster copies remain", pending)
            for ts in self._tiers:
                try:
                    ts.store.close()
                except Exception:  # noqa: BLE001 - closing must not hide the real error
                    pass

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # noqa: BLE001 - do not mask the exception already raised
            log.warning("while closing after an error: %s", err)

    def stats(self) -> dict:
        staging = self._persister.staging
        return {"rank": self.rank, "world_size": self.world_size, "node": self.node, "run_id": self.run_id,
                "leases": self._leases.status(), "staging_bytes": staging.allocated_bytes,
                "staging_allocations": staging.allocations, "staging_numa": self._persister.numa.to_dict(),
                "tiers": [t.to_dict() for t in self._tiers],
                "saves": self._book.saves(), "pending_promotions": self._book.pending(), "restore": self._last_restore,
                "persist_process": offload.stats() if self._persister.staging.offload else None}

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")
