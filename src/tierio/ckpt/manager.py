"""CheckpointManager: asynchronous, tiered, verified checkpoints, on one node or a cluster.

Pipeline of one ``save(step, state)``:

1. *stage* (the only part the caller waits for): flatten the state (a rank's own tensors, and its
   slices of global tensors: DTensors, TensorSlices), lay out the shard, copy the header and every
   tensor into a reused, pre-faulted staging buffer (pinned, on a side CUDA stream, where a GPU
   exists);
2. *persist* (background thread): xxh3 per chunk from memory, one large O_DIRECT write of the
   shard to tier 0, then the rank's record; on a shared tier 0 the commit protocol follows
   (``ckpt.steps.commit``: rank 0 commits ``manifest.json`` once every rank's record is listed). The
   staging buffer is free again as soon as the shard is written;
3. *promote* (second background thread): on a node-local tier 0, each rank first copies its shard
   and record to the first shared tier, where rank 0 commits (the global commit); then every
   committed step is copied to each slower tier, verified, under the promotion bandwidth limit
   (``ckpt.promotion.cluster``). A failed promotion leaves the faster copies in place and is retried.

No collective runs on a background thread: ranks coordinate through the tiers. The caller's thread
runs one collective at construction (the run id, and the node layout when a tier is node-local)
and, on ``restore``, the agreement on the step every rank restores.

The leader of a tier (rank 0; a node's lowest rank for its node-local tier) holds its lease
(lease.py) and applies retention there after each commit (gc.py). A save after ``restore()``
follows the rollback rule (lineage.py).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from tierio import events
from tierio.dist import rank_world
from tierio.errors import (
    ConfigError, FormatError, IntegrityError, LeaseError, NotFoundError, StorageError, TierioError,
)
from tierio.format.manifest import RankEntry, TensorInfo
from tierio.format.shard import Placement, ShardBytes, describe, manifest_key, plan_shard, shard_key, shard_name, step_dir
from tierio.format.statetree import flatten
from tierio.io.buffers import BufferPool, align_up
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store
from tierio.units import human_bytes, parse_size

from tierio.ckpt.steps.commit import CommitPlan, Waiting, await_commit, build_manifest, commit, drop_record, write_record
from tierio.ckpt.promotion.copy import CopyStats, copy_pool, copy_shard
from tierio.ckpt.promotion.fill import fill_after_restore
from tierio.ckpt.saving.interval import IntervalPlan, check_mtbf, measured_cost, optimal_interval, save_due
from tierio.ckpt.steps.gc import TEMP_GRACE, GcOptions, GcTier, collect
from tierio.ckpt.saving.incremental import Base, diff
from tierio.ckpt.steps.lease import LeaseTiming
from tierio.ckpt.steps.tier_leases import TierLeases
from tierio.ckpt.steps.lineage import Lineage, Rollback
from tierio.ckpt.promotion.buddy import Buddy
from tierio.ckpt.promotion.buddy_restore import agree as agree_node_copies
from tierio.ckpt.promotion.nodes import agree_job, gather, group_joined
from tierio.ckpt.options import CheckpointOptions
from tierio.ckpt.saving.overlap import Overlap
from tierio.ckpt.promotion.cluster import Cluster, Own, commit_on, promote_step, publish
from tierio.ckpt.steps.reader import VerifyReport, committed_steps, read_manifest, verify_copy
from tierio.ckpt.restore import recovery
from tierio.ckpt.restore.load import Source
from tierio.ckpt.steps.retention import wanted
from tierio.ckpt.saving.job import SaveHandle, Staged, check_space, check_tiers, to_write
from tierio.ckpt.saving.stage import Stager
from tierio.ckpt.tier import Tier, TierState, as_tier, open_tier_store

log = logging.getLogger("tierio.ckpt")



def _read_path(store: Any) -> dict | None:
    """How restores read this tier's files: O_DIRECT or buffered, as measured (a local directory), else None."""
    way = getattr(store, "read_path", None)
    return {**way().to_dict(), "bounced": way(bounced=True).to_dict()} if callable(way) else None


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
        rate = parse_size(opts.promote_bandwidth) if isinstance(opts.promote_bandwidth, str) else opts.promote_bandwidth
        self.limiter = TokenBucket(rate, burst=max(1 << 20, (rate or 0) / 4)) if rate else None
        specs = [as_tier(t) for t in tiers]
        check_tiers(specs)
        self._tiers = [TierState(t, open_tier_store(t, self.limiter if i > 0 else None)) for i, t in enumerate(specs)]
        self.rank, self.world_size = rank_world(rank, world_size, process_group)
        from_group = rank is None or world_size is None
        job = agree_job(opts.run_id, self.rank, self.world_size, process_group, from_group, opts.node,
                        any(t.node_local for t in specs), opts.ranks_per_node)
        self._group = group_joined(process_group, from_group) if self.world_size > 1 else None
        timing = LeaseTiming(opts.lease_expires) if opts.lease_expires is not None else None
        self._leases = TierLeases(job.run_id, self.rank, self.world_size, force=opts.break_lease,
                                  wait_timeout=opts.commit_timeout, timing=timing)
        self._cluster = Cluster(self.rank, self.world_size, job.node, self._leases, Waiting(opts.commit_timeout),
                                self.limiter, copy_pool(), opts.inline_record_bytes)
        self._buddy = self._setup_buddy(rate) if opts.buddy else None
        self.memory_budget = opts.memory_budget_bytes
        self.slots = 2 if opts.double_buffer else 1
        self.min_keep = opts.min_keep
        self.commit_timeout = opts.commit_timeout
        self.restored_step: int | None = None
        self.restored_from: str | None = None  # the tier whose manifest the last restore used
        self._last_restore: dict | None = None  # how the last restore moved its bytes (stats())

        self._lock = threading.Lock()
        # Staging buffers: at most `slots` exist, within the memory budget, reused by every save.
        self._staging = BufferPool(budget_bytes=self.memory_budget, max_buffers=self.slots)
        self._error: BaseException | None = None
        self._handles: list[SaveHandle] = []
        self._inflight: set[int] = set()
        self._pending: set[int] = set()  # steps whose promotion failed and waits for a retry
        self._unpublished: dict[int, tuple[Own, Lineage]] = {}  # node-local tier 0: not yet globally committed
        self._rollback: Rollback | None = None  # set by restore(): what the next saves retire
        self._saved_since_restore: set[int] = set()
        self._saves: list[dict] = []
        self._swept: set[str] = set()  # tiers whose leftovers this manager has cleaned up once
        self._closed = False
        self._warned_min_keep = False
        self._stager = Stager()
        self._overlap = Overlap(self._stager) if opts.overlap else None
        self._base: Base | None = None  # incremental saves: this rank's entry of its last committed step
        self._bases: dict[int, int] = {}  # step in flight -> the base step it refers to (kept from retention)
        self._gc_lock = threading.Lock()
        self._persist_pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-persist")
        self._checksum_pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-checksum")
        self._promote_pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-promote")
        # The scan of slower tiers runs behind construction: a stalled tier must not block it.
        self._scan = self._promote_pool.submit(self._find_unpromoted)

    def _setup_buddy(self, promote_rate: float | None) -> Buddy:
        """Buddy copies (``ckpt.promotion.buddy``): the pairing and the buddy group, made here, in the caller's thread."""
        opts, t0 = self.options, self._tiers[0]
        if not t0.node_local:
            raise ConfigError("buddy=True copies each node's tier 0 to another node: it needs a node-local tier 0, "
                              "e.g. Tier('/nvme/ckpt', scope='node')")
        if opts.incremental:  # a buddy copy carries one shard, not the earlier shards it refers to
            raise ConfigError("buddy=True and incremental=True cannot be combined: a buddy copy holds one step's "
                              "shard, not the earlier shards an incremental step refers to; choose one")
        rate = parse_size(opts.buddy_bandwidth) if isinstance(opts.buddy_bandwidth, str) else opts.buddy_bandwidth
        rate = promote_rate if rate is None else rate
        return Buddy.setup(t0.store, self.rank, self.world_size, self._group, self.node, rate or None,
                           opts.commit_timeout, t0.tier.retention)

    # -- public API ------------------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        return [t.url for t in self._tiers]

    @property
    def run_id(self) -> str | None:
        """This run's id: agreed by the ranks (process group, ``run_id``, or the launcher's job id)."""
        return self._leases.run

    @property
    def node(self) -> str:
        """The node this rank runs on (what node-local tiers are per)."""
        return self._cluster.node.name

    def save(self, step: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` into staging memory and return; persist and promotion run behind."""
        t0 = time.perf_counter()
        handle = SaveHandle(step, settle=self._settle if self._overlap is not None else None)
        if self._buddy is None:
            handle.buddied.set_result(None)
        try:
            self._settle(wait_copies=False)  # earlier overlapped saves whose copy is done: their verdict
            rollback = self._begin(step)
            flat = flatten(state)
            tensors, places = to_write(flat)
            job = self._staged(step, tensors, places, flat.tree, rollback, handle, overlap=self._overlap is not None)
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
        with self._lock:
            self._handles.append(handle)
            self._saves.append({"step": step, "bytes": handle.bytes, "blocking_seconds": handle.blocking_seconds,
                                "wait_seconds": handle.wait_seconds, "returned_at": time.monotonic()})
        events.emit(events.CheckpointStaged(step, self._tiers[0].url, handle.bytes, handle.blocking_seconds, handle.wait_seconds))
        self._persist_pool.submit(self._persist, handle, job)
        return handle

    def interval_plan(self) -> IntervalPlan | None:
        """Young/Daly's interval from the ``mtbf`` option and the measured cost of the latest saves
        (blocking time; background write as a lower bound); None before the first save."""
        mtbf = self.options.mtbf
        if mtbf is None:
            raise ConfigError("should_save needs the job's mean time between failures: "
                              "CheckpointManager(..., mtbf=SECONDS), e.g. mtbf=4 * 3600")
        with self._lock:
            cost = measured_cost(self._saves)
        if cost is None:
            return None
        return optimal_interval(cost.blocking_s, mtbf, cost.write_s)

    def should_save(self, step: int, *, now: float | None = None) -> bool:
        """Whether to save ``step`` now, for the least expected work lost (``ckpt.saving.interval``): True at
        the first call (that save measures the cost), then once Young/Daly's interval has gone by
        since the previous save returned, never while a save still persists or for a step already
        in flight. With a process group every rank must call it for the same steps: the ranks
        agree (one all_gather in the caller's thread), so a step is saved when every rank finds it
        due. ``now`` is a ``time.monotonic()`` reading (default: the current one)."""
        plan = self.interval_plan()
        with self._lock:
            if step in self._inflight:
                return False
            persisting = any(not h.persisted.done() for h in self._handles)
            last = self._saves[-1]["returned_at"] if self._saves else None
        if plan is None or last is None:
            due = not persisting
        else:
            due = save_due(plan, (time.monotonic() if now is None else now) - last, persisting)
        if self._group is None:
            return due
        # Every rank must save the same steps (a commit waits for all of them), while each measures
        # its own saves and clock: a step is saved when every rank finds it due.
        return all(gather(due, self._group, self.world_size))

    def _begin(self, step: int) -> Rollback | None:
        """The checks before any save of ``step``; the rollback it carries out, if any."""
        self._check_open()
        self._raise_background_error()
        step_dir(step)  # validates the number
        with self._lock:
            if step in self._inflight:
                raise ConfigError(f"step {step} is already being saved; wait for it or use another step number")
            rollback = self._rollback
        if rollback is not None and step <= rollback.after:
            raise ConfigError(f"step {step} is not after the restored step {rollback.after}: after a restore, saves "
                              "continue with later step numbers (the steps after it belong to the abandoned run)")
        first = self._tiers[0]
        if self._cluster.leads(first):
            self._cluster.ensure(first)  # a second writer is refused here, before any write
        if not first.node_local and first.store.exists(manifest_key(step)) and \
                (rollback is None or step in self._saved_since_restore):
            raise ConfigError(
                f"step {step} already has a committed checkpoint on {first.url}; checkpoints are immutable: "
                "use a new step number or delete the old one first"
            )
        return rollback

    def _staged(self, step: int, tensors: dict[str, torch.Tensor], places: dict[str, Placement], tree: Any,
                rollback: Rollback | None, handle: SaveHandle, overlap: bool = False) -> Staged:
        """Lay out the shard and copy it into a staging buffer (the part a save blocks for; with
        ``overlap``, the large tensors are copied behind, ``ckpt.saving.overlap``)."""
        meta = {"tierio.step": str(step), "tierio.rank": str(self.rank), "tierio.world_size": str(self.world_size)}
        layout = plan_shard(tensors, meta)
        need = handle.bytes = layout.total_bytes
        if self.memory_budget is not None and align_up(need) > self.memory_budget:
            raise ConfigError(
                f"rank {self.rank}'s shard for step {step} needs {human_bytes(need)} of staging memory, above "
                f"memory_budget_bytes={human_bytes(self.memory_budget)}; raise the budget"
            )
        tw = time.perf_counter()
        # Waits while the previous persist still owns the buffers; a background failure ends the wait.
        buf = self._staging.acquire(need, abort=self._raise_background_error)
        handle.wait_seconds = time.perf_counter() - tw
        try:
            self._raise_background_error()
            check_space(self._tiers[0], need, step, self.rank)
            with self._lock:
                self._inflight.add(step)
            snapshot = None
            if overlap:
                assert self._overlap is not None
                snapshot = self._overlap.start(step, layout, tensors, buf)
            else:
                self._stager.stage(layout, tensors, buf)
        except BaseException:
            with self._lock:
                self._inflight.discard(step)
            self._staging.release(buf)
            raise
        with self._lock:
            if rollback is not None:
                rollback.first = step if rollback.first is None else rollback.first
                self._saved_since_restore.add(step)
        return Staged(layout, tree, places, buf, rollback, snapshot=snapshot)

    # -- zero-stall snapshots (ckpt.saving.overlap) -----------------------------------------------------
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
        if self._overlap is None:
            return
        waited = self._overlap.judge(wait_copies=wait_copies, report=report)
        with self._lock:
            if update:
                for step, seconds in waited.seconds.items():
                    self._saves_update(step, update_wait_seconds=seconds)
            for snap, exc in waited.failed:  # reported here: the next save does not raise it again
                if report and self._error is exc:
                    self._error = None
        if report and waited.failed:
            raise waited.failed[0][1]

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for the copies of overlapped saves first (a step pre-hook
        calling ``before_update``); returns the hook's handle (``.remove()`` detaches it)."""
        if self._overlap is None:
            raise ConfigError("attach() is for overlapped saves: CheckpointManager(..., overlap=True)")
        return optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self.before_update())

    # -- torch.distributed.checkpoint (ckpt.dcp) -------------------------------------------------
    def write_now(self, step: int, tensors: dict[str, torch.Tensor], places: dict[str, Placement]) -> Own:
        """Write this rank's shard and record of ``step`` now, in this thread, and when tier 0 is
        node-local copy them to the first shared tier too (``ckpt.dcp``'s write_data). ``places``
        places the global tensors' slices; the step is committed by ``commit_now``."""
        rollback = self._begin(step)
        if all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values()):
            # DCP blocks while it saves: the tensors go out through the writer's bounce buffers,
            # copied while earlier requests are in flight, instead of all staged first.
            layout = plan_shard(tensors, {"tierio.step": str(step), "tierio.rank": str(self.rank),
                                          "tierio.world_size": str(self.world_size)})
            self._raise_background_error()
            check_space(self._tiers[0], layout.total_bytes, step, self.rank)
            with self._lock:
                self._inflight.add(step)
                if rollback is not None:
                    rollback.first = step if rollback.first is None else rollback.first
                    self._saved_since_restore.add(step)
            job = Staged(layout, None, places, None, rollback, ShardBytes(layout, tensors))
        else:
            job = self._staged(step, tensors, places, None, rollback, SaveHandle(step))
        own: Own | None = None
        try:
            own, lineage = self._write(step, job, True)
            if self._tiers[0].node_local:
                shared = self._commit_tier()
                self._cluster.ensure(shared)
                self._account(shared, copy_shard(self._tiers[0].store, shared.store, step, own.entry, self._cluster.pool,
                                                 self._cluster.limiter))
                write_record(shared.store, step, self.world_size, own.entry, lineage.token)
        except BaseException:
            self._cleanup_failed(step, own)
            with self._lock:
                self._inflight.discard(step)
            raise
        return own

    def commit_now(self, step: int, parts: dict[int, Own], tree: Any) -> None:
        """Commit ``step`` from every rank's part, with one job-wide state ``tree`` (``ckpt.dcp``'s
        finish, on the coordinator)."""
        store = self._commit_tier().store
        with self._lock:
            rollback = self._rollback
        lineage = Lineage(self._run(), rollback.after if rollback is not None else None)
        plan = CommitPlan(step, self.world_size, {r: p.record for r, p in parts.items() if p.record is not None},
                          {r: p.entry.bytes for r, p in parts.items()}, lineage.extra(),
                          {r: p.entry for r, p in parts.items()}, tree, self.options.inline_record_bytes)
        commit(store, build_manifest(store, plan), [p.record.name for p in parts.values() if p.record is not None],
               self._cluster.fence(store))

    def track(self, step: int, own: Own) -> SaveHandle:
        """After ``write_now``: wait for the commit of ``step`` and promote this rank's part of it,
        in the background, like a save's."""
        handle = SaveHandle(step, bytes=own.entry.bytes)
        handle.staged.set_result(step)
        handle.persisted.set_result(step)
        with self._lock:
            self._handles.append(handle)

        def run() -> None:
            try:
                await_commit(self._commit_tier().store, step, own.entry, own.record, self._cluster.wait)
                handle.committed.set_result(step)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
                with self._lock:
                    self._inflight.discard(step)
                handle.fail(exc)
                return
            if len(self._tiers) > 1:
                self._promote_steps([step], handle, False)
            else:
                with self._lock:
                    self._inflight.discard(step)
                self._maybe_gc()
                handle.promoted.set_result(step)
        self._promote_pool.submit(run)
        return handle

    def sources(self, first: str | None = None) -> list[Source]:
        """The tiers a restore reads files from: this node's local tiers, then the shared tier
        ``first`` (a url; the one whose manifest is used), then the other shared tiers, fastest first."""
        shared = [t for t in self._tiers if not t.node_local]
        shared.sort(key=lambda t: t.url != first)  # stable: otherwise fastest first
        return [Source(t.store, True) for t in self._tiers if t.node_local] + [Source(t.store) for t in shared]

    def _commit_tier(self) -> TierState:
        """Where a step is committed: tier 0, or the first shared tier after node-local ones."""
        return next(ts for ts in self._tiers if not ts.node_local)

    def restore(self, step: int | None = None, into: Any = None, *, per_rank: str = "strict", mapped: bool = True) -> Any:
        """Restore ``step`` (default: the newest step every rank can restore) from the fastest tiers
        holding good copies; every chunk verified.

        With a process group, the ranks agree on the step (a collective in this thread). Each file
        comes from the first tier with a good copy (a node-local tier first); a bad or missing copy
        is skipped with a warning naming it. Global tensors (saved as DTensors or TensorSlices)
        restore into any world size and placement: pass DTensors or TensorSlices in ``into=`` to
        receive the part they hold, or nothing to receive whole tensors (ckpt.restore.load). With
        ``into=``, tensors are filled in place where shapes match. On another world size, plain
        tensors that differ between the saved ranks are refused unless ``per_rank="own"``.

        Tensors restored into new memory (no ``into=`` target) are copy-on-write maps of the shard
        files where a local or shared-filesystem tier holds them whole, populated in parallel and
        verified before this returns (ckpt.restore.mapped); ``mapped=False`` reads them into private memory.

        Saving after a restore of an older step is a rollback: the first save retires the steps after
        it on every tier (see ``tierio.ckpt.steps.lineage``)."""
        self._check_open()
        # Persists and global commits in flight land first (none may land after the rollback
        # point); promotions are not waited for, so a stalled slower tier never holds up a restore.
        # Overlapped saves get their verdict first; a failed one is raised by the next save/wait.
        self._settle(report=False)
        self._drain(promotions=False)
        started = time.perf_counter()
        shared = self.steps()
        copies = None
        if self._buddy is not None and self._buddy.active:
            self._buddy.idle()  # the buddy group is this thread's now
            copies = agree_node_copies(self._buddy, self._group, shared)
        candidates = [step] if step is not None else sorted(set(shared) | set(copies.plans if copies else ()), reverse=True)
        req = recovery.Request(self.rank, self.world_size, into, per_rank, self._tiers, self.sources, mapped=mapped,
                               node_copies=copies)
        got = recovery.restore(req, candidates, recovery.Agreement(self._group, self.world_size), step is not None)
        self._note_restore(got.step, got.url)
        self._last_restore = {"step": got.step, "from": got.url, **got.stats.to_dict()}
        fill = fill_after_restore(self._tiers, got.step, got.url, self.world_size)
        if fill is not None:  # read from S3: copy it into tier 0 behind, for the next restore (ckpt.promotion.fill)
            self._last_restore["fill"] = fill.dst.url
            self._promote_pool.submit(fill.run)
        events.emit(events.CheckpointRestored(got.step, got.url, time.perf_counter() - started))
        return got.state

    def steps(self) -> list[int]:
        """Committed steps on any tier (an unreachable tier is skipped with a warning)."""
        out: set[int] = set()
        for ts in self._tiers:
            if ts.node_local:
                continue  # a node's copies are committed where the manifest is
            try:
                out.update(committed_steps(ts.store))
            except StorageError as exc:
                log.warning("cannot list %s: %s", ts.url, exc)
        return sorted(out)

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every tier's copy of ``step`` (default: latest) byte for byte (on a node-local tier,
        this node's files of it)."""
        step = self.latest() if step is None else step
        if step is None:
            raise NotFoundError(f"no committed checkpoint on any tier ({', '.join(self.tiers)})")
        report = VerifyReport(step)
        shared = [ts for ts in self._tiers if not ts.node_local]
        for ts in self._tiers:
            if ts.node_local:
                man = next((read_manifest(s.store, step) for s in shared if s.store.exists(manifest_key(step))), None)
                verify_copy(ts.store, step, report, manifest=man)
            else:
                verify_copy(ts.store, step, report)
        return report

    def promote(self, step: int | None = None) -> None:
        """Promote ``step`` (default: every pending step and the latest) to all slower tiers now; raises on failure."""
        self._check_open()
        if len(self._tiers) < 2:
            return
        steps = [step] if step is not None else self.steps()[-1:]
        self._promote_pool.submit(self._promote_steps, steps, None, True).result()

    def gc(self) -> list[tuple[str, int]]:
        """Apply retention to every tier this rank leads now and clean up what interrupted writes
        left there (rank 0; a node's lowest rank for its node-local tiers); returns the (tier url,
        step) copies deleted."""
        if not any(self._cluster.leads(ts) for ts in self._tiers):
            return []
        return self._gc(sweep_all=True)

    def wait(self) -> None:
        """Wait for every save in flight (persist and promotion; an overlapped save's verdict first,
        ``ckpt.saving.overlap``); raises a background persist failure."""
        try:
            self._settle()
        finally:
            self._drain()
        self._raise_background_error()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._overlap is not None:
                self._overlap.close()
            self._persist_pool.shutdown(wait=True)
            self._checksum_pool.shutdown(wait=True)
            self._promote_pool.shutdown(wait=True)
            if self._buddy is not None:
                self._buddy.close()
            self._leases.close()
            self._staging.close()
            if self._pending:
                log.warning("steps %s were not promoted to every tier; their faster copies remain", sorted(self._pending))
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
        else:
            try:
                self.close()
            except Exception as err:  # noqa: BLE001 - do not mask the exception already raised
                log.warning("while closing after an error: %s", err)

    def stats(self) -> dict:
        with self._lock:
            saves = [dict(s) for s in self._saves]
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "node": self.node,
            "run_id": self.run_id,
            "leases": self._leases.status(),
            "staging_bytes": self._staging.allocated_bytes,
            "staging_allocations": self._staging.allocations,
            "tiers": [
                {"url": t.url, "scope": t.tier.scope, "bytes_written": t.bytes, "seconds": t.seconds, "files": t.files,
                 "gb_per_s": t.bytes / t.seconds / 1e9 if t.seconds else 0.0, "read_path": _read_path(t.store)}
                for t in self._tiers
            ],
            "saves": saves,
            "pending_promotions": sorted(self._pending),
            "restore": self._last_restore,
        }

    # -- restore ---------------------------------------------------------------------------------
    def _note_restore(self, step: int, url: str) -> None:
        """The next save starts a branch from ``step``: pending promotions of later steps are dropped
        (they belong to the abandoned branch) and that save retires them everywhere."""
        with self._lock:
            self.restored_step, self.restored_from = step, url
            self._base = None  # the first save after a restore is a full one
            self._rollback = Rollback(step)
            self._saved_since_restore = set()
            self._pending = {s for s in self._pending if s <= step}
            self._unpublished = {s: v for s, v in self._unpublished.items() if s <= step}

    def _drain(self, promotions: bool = True) -> None:
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            try:
                h.persisted.exception()
                h.committed.exception()
                if promotions:
                    h.promoted.exception()
            except BaseException:  # noqa: BLE001 - surfaced by wait() through _error
                pass
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()]

    # -- staging ---------------------------------------------------------------------------------
    # -- background: persist ---------------------------------------------------------------------
    def _persist(self, handle: SaveHandle, job: Staged) -> None:
        """The persist thread's first part: this rank's shard of the step on tier 0. An overlapped
        save commits only once the caller's thread gave its snapshot's verdict (``ckpt.saving.overlap``):
        the rest runs when it comes, on this thread again, so nothing here blocks on the caller."""
        start = time.perf_counter()
        try:
            entry = self._write_shard_of(handle.step, job)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            self._persist_failed(handle, job, None, exc, False)
            return
        written = time.perf_counter() - start
        if job.snapshot is None:
            self._finish(handle, job, entry, written)
            return
        job.snapshot.verdict.add_done_callback(lambda _v: self._after_verdict(handle, job, entry, written))

    def _after_verdict(self, handle: SaveHandle, job: Staged, entry: RankEntry, written: float) -> None:
        """Runs in the thread that gave the verdict (or the persist thread): queue the commit."""
        try:
            self._persist_pool.submit(self._finish, handle, job, entry, written)
        except RuntimeError as exc:  # the manager is closed: the step stays uncommitted
            self._persist_failed(handle, job, None, exc, False)

    def _finish(self, handle: SaveHandle, job: Staged, entry: RankEntry, written: float) -> None:
        """The persist thread's second part: the record and the commit of a written shard."""
        step = handle.step
        own: Own | None = None
        exchanged = False  # buddy=True: this step's exchange with the partner is under way
        try:
            start = time.perf_counter()
            if job.snapshot is not None:
                job.snapshot.verdict.result()  # SnapshotChangedError: the step is not committed
            own, lineage = self._record(step, job, entry, self.world_size > 1 or self._tiers[0].node_local)
            if self.options.incremental:
                handle.committed.add_done_callback(lambda f, e=own.entry: self._committed(step, e, f))
            if self._tiers[0].node_local:
                with self._lock:
                    self._unpublished[step] = (own, lineage)
                if self._buddy is not None:
                    self._buddy.send(step, own.record.name if own.record is not None else None, handle.buddied)
                    exchanged = True
            else:
                commit_on(self._cluster, self._tiers[0].store, step, own, lineage)
                handle.committed.set_result(step)
            took = written + time.perf_counter() - start  # the wait for the verdict is not persist time
            with self._lock:
                self._saves_update(step, persist_seconds=took)
            events.emit(events.CheckpointPersisted(step, self._tiers[0].url, job.layout.total_bytes, took,
                                                   len(self._tiers) > 1))
            handle.persisted.set_result(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            self._persist_failed(handle, job, own, exc, exchanged)
            return
        if len(self._tiers) > 1:
            self._promote_pool.submit(self._promote_steps, [step], handle, False)
        else:
            with self._lock:
                self._inflight.discard(step)
            self._maybe_gc()
            handle.promoted.set_result(step)

    def _persist_failed(self, handle: SaveHandle, job: Staged, own: Own | None, exc: BaseException,
                        exchanged: bool) -> None:
        step = handle.step
        self._cleanup_failed(step, own)
        with self._lock:
            self._inflight.discard(step)
            self._bases.pop(step, None)
            if self._error is None and not (job.snapshot is not None and job.snapshot.reported):
                self._error = exc
        self._staging.wake()  # a save waiting for a buffer raises this error instead
        if self._buddy is not None and not exchanged:
            self._buddy.send(step, None, handle.buddied)  # the partner must not wait for it
        handle.fail(exc)
        log.error("checkpoint of step %d failed: %s", step, exc)

    def _write(self, step: int, job: Staged, record: bool) -> tuple[Own, Lineage]:
        """This rank's part of ``step`` on tier 0: the shard, then its record (when asked)."""
        return self._record(step, job, self._write_shard_of(step, job), record)

    def _write_shard_of(self, step: int, job: Staged) -> RankEntry:
        """This rank's shard of ``step`` on tier 0 (checksummed while it streams out); the staging
        buffer is released whatever happens."""
        t0 = self._tiers[0]
        try:
            if job.snapshot is not None:
                job.snapshot.copied.result()  # an overlapped save: its tensors are in the buffer
            self._cluster.ensure(t0)  # other ranks: wait for the leader's lease naming this run
            if job.rollback is not None:
                self._retire(job.rollback)
            fname = shard_name(self.rank)
            size, tensors = self._write_shard(step, job, fname)
        finally:
            if job.buf is not None:
                self._staging.release(job.buf)
        return RankEntry(self.rank, fname, size, job.tree, tensors)

    def _record(self, step: int, job: Staged, entry: RankEntry, record: bool) -> tuple[Own, Lineage]:
        """After the shard: this rank's record of ``step`` on tier 0 (when asked) and its lineage."""
        lineage = Lineage(self._run(), job.rollback.after if job.rollback is not None else None)
        ref = write_record(self._tiers[0].store, step, self.world_size, entry, lineage.token) if record else None
        return Own(entry, ref), lineage

    def _write_shard(self, step: int, job: Staged, fname: str) -> tuple[int, dict[str, TensorInfo]]:
        """Write this rank's shard of ``step`` to tier 0; returns its size and tensors. An incremental
        save with a base writes only the tensors that changed since it (``ckpt.saving.incremental``)."""
        t0 = self._tiers[0]
        parts, view = job.parts()
        with self._lock:
            base = self._base if self.options.incremental and job.direct is None else None
            if base is not None:
                self._bases[step] = base.step
        start = time.perf_counter()
        if base is not None:
            delta = diff(job.layout, view, fname, job.places, base)  # type: ignore[arg-type]
            t0.store.put_buffers(shard_key(step, self.rank), delta.parts)
            size, tensors = delta.layout.total_bytes, delta.tensors
            with self._lock:
                self._saves_update(step, written_bytes=size, reused_bytes=delta.reused_bytes, base_step=base.step)
        else:
            # Checksum the bytes while the same bytes stream to disk (both only read them); the
            # record needs the checksums only once the shard is durable.
            sums = self._checksum_pool.submit(describe, job.layout, view, fname, job.places)
            try:
                t0.store.put_buffers(shard_key(step, self.rank), parts)
            finally:
                tensors = sums.result()
            size = job.layout.total_bytes
        self._account(t0, CopyStats(size, time.perf_counter() - start, 1))
        return size, tensors

    def _committed(self, step: int, entry: RankEntry, done: Any) -> None:
        """An incremental save's commit settled: a committed step becomes the next saves' base."""
        with self._lock:
            self._bases.pop(step, None)
            if done.cancelled() or done.exception() is not None:
                return
            if self._base is None or step > self._base.step:
                self._base = Base(step, entry)

    def _run(self) -> str:
        run = self._leases.run
        assert run is not None, "the lease check sets the run id before any write"
        return run

    def _retire(self, rollback: Rollback) -> None:
        """Before the first commit after a restore: the abandoned steps stop being checkpoints on
        every shared tier (rank 0 deletes their manifests), and their directories go from tier 0
        (rank 0) or from each node's local tier (its leader). A slower tier that cannot be reached
        now is retired by its next promotion, before anything lands there."""
        first_shared = self._commit_tier()
        for ts in self._tiers:
            if not self._cluster.leads(ts):
                continue
            try:
                self._cluster.ensure(ts)
                self._cluster.fence(ts.store)()  # it deletes there
                rollback.retire_manifests(ts.store)
            except (StorageError, FormatError) as exc:
                if ts is first_shared:
                    raise
                log.warning("could not retire the abandoned steps on %s yet (%s); its next promotion will", ts.url, exc)
        t0 = self._tiers[0]
        if self._cluster.leads(t0):
            rollback.retire_dirs(t0.store)
            if self._buddy is not None:
                with self._lock:
                    saved = set(self._saved_since_restore)
                self._buddy.retire_after(rollback.after, saved)

    def _cleanup_failed(self, step: int, own: Own | None) -> None:
        """Remove this rank's partial files of a failed step (frees space after a full disk)."""
        store = self._tiers[0].store
        try:
            if not store.exists(manifest_key(step)):
                store.delete(shard_key(step, self.rank))
        except Exception:  # noqa: BLE001 - best effort
            pass
        if own is not None:
            drop_record(store, step, own.record)
            with self._lock:
                self._unpublished.pop(step, None)

    # -- background: publication and promotion ---------------------------------------------------
    def _promote_steps(self, extra: list[int], handle: SaveHandle | None, strict: bool) -> None:
        """Runs on the promotion thread: publish and promote every pending step and ``extra``."""
        last_exc: BaseException | None = None
        done: list[int] = []
        with self._lock:
            steps = sorted(self._pending | set(extra) | set(self._unpublished))
            # A rollback is carried out by the saves after the restore, not by a promote() before them.
            rollback = self._rollback if self._rollback is not None and self._rollback.first is not None else None
        for step in steps:
            if self._abandoned(step):  # a restore to an earlier step came in meanwhile
                if handle is not None and step == handle.step:
                    handle.fail(ConfigError(f"step {step} was abandoned by a restore to an earlier step"))
                continue
            try:
                self._publish(step)
                promote_step(self._cluster, self._tiers, step, rollback, self._account)
                with self._lock:
                    self._pending.discard(step)
                done.append(step)
                events.emit(events.CheckpointPromoted(step, self._tiers[0].url))
            except BaseException as exc:  # noqa: BLE001 - a retry comes with the next save
                last_exc = exc
                self._add_pending(step)
                events.emit(events.PromotionFailed(step, self._tiers[0].url, str(exc), isinstance(exc, (IntegrityError, FormatError))))
                msg = f"promotion of step {step} failed ({exc}); the faster copy stays and promotion will be retried"
                log.warning("%s", msg)
                if not strict:
                    warnings.warn(msg, stacklevel=1)
                if handle is not None and step == handle.step:
                    handle.fail(exc)
        if handle is not None:
            with self._lock:
                self._inflight.discard(handle.step)
        self._maybe_gc()
        if handle is not None and handle.step in done:
            handle.promoted.set_result(handle.step)
        if strict and last_exc is not None:
            raise last_exc

    def _publish(self, step: int) -> None:
        """A step saved on a node-local tier 0 and not yet committed globally: publish it."""
        with self._lock:
            item = self._unpublished.get(step)
        if item is None:
            return
        own, lineage = item
        shared = self._commit_tier()
        publish(self._cluster, self._tiers[0], shared, step, own, lineage, self._account)
        with self._lock:
            self._unpublished.pop(step, None)
            waiting = [h for h in self._handles if h.step == step and not h.committed.done()]
        for h in waiting:  # the save of this step (its own promotion run may have come first)
            h.committed.set_result(step)

    def _find_unpromoted(self) -> None:
        """Steps committed on a faster shared tier that a slower tier still wants (a promotion was
        cut short by a crash or an outage) join the retry list; the next save's promotion picks
        them up. Runs on the promotion thread, so a stalled tier delays only promotion."""
        shared = [ts for ts in self._tiers if not ts.node_local]
        if len(shared) < 2:
            return
        try:
            held = [set(committed_steps(ts.store)) for ts in shared]
        except TierioError as exc:
            log.warning("cannot look for unpromoted checkpoints: %s", exc)
            return
        for i in range(len(shared) - 1):
            for step in held[i]:
                for j in range(i + 1, len(shared)):
                    if step in held[j]:
                        continue
                    if wanted({s: 0.0 for s in held[j]}, shared[j].tier.retention, step, time.time()):
                        self._add_pending(step)
                        break

    def _abandoned(self, step: int) -> bool:
        """A step after the last restored one that this run has not saved again: the old branch's."""
        with self._lock:
            rb = self._rollback
            return rb is not None and step > rb.after and step not in self._saved_since_restore

    def _add_pending(self, step: int) -> None:
        if not self._abandoned(step):
            with self._lock:
                self._pending.add(step)

    # -- retention and clean-up ------------------------------------------------------------------
    def _maybe_gc(self) -> None:
        if not any(self._cluster.leads(ts) for ts in self._tiers):
            return
        if all(t.tier.retention is None for t in self._tiers) and all(t.url in self._swept for t in self._tiers
                                                                      if self._cluster.leads(t)):
            return
        try:
            self._gc()
        except Exception as exc:  # noqa: BLE001 - retention must never fail a save
            log.warning("garbage collection failed: %s", exc)

    def _gc(self, sweep_all: bool = False) -> list[tuple[str, int]]:
        self._scan.result()  # its pending steps must be protected
        shared = next((ts.store for ts in self._tiers if not ts.node_local), None)
        with self._gc_lock:
            tiers = []
            for ts in self._tiers:
                writable = self._cluster.leads(ts)
                if writable:
                    try:
                        self._cluster.ensure(ts)
                        self._cluster.fence(ts.store)()  # retention deletes there
                    except (LeaseError, StorageError, FormatError) as exc:
                        log.warning("not cleaning %s: %s", ts.url, exc)
                        writable = False
                tiers.append(GcTier(ts.store, ts.tier.retention, writable, sweep_all or ts.url not in self._swept,
                                    shared if ts.node_local else None))
            with self._lock:
                protected = frozenset(self._inflight | self._pending | set(self._unpublished) | set(self._bases.values()))
            report = collect(tiers, GcOptions(self.min_keep, protected, temp_grace=TEMP_GRACE))
            for w in report.warnings:
                if not self._warned_min_keep:  # once per manager; the log keeps every instance
                    warnings.warn(w, stacklevel=2)
                log.info("%s", w)
            self._warned_min_keep = self._warned_min_keep or bool(report.warnings)
            failed = {s.tier for s in report.skipped}
            self._swept |= {t.url for t in tiers if t.writable and t.sweep and t.url not in failed}
            return [(r.tier, r.step) for r in report.deleted]

    # -- helpers ---------------------------------------------------------------------------------
    def _account(self, ts: TierState, stats: CopyStats) -> None:
        with self._lock:
            ts.bytes += stats.bytes
            ts.seconds += stats.seconds
            ts.files += stats.files
        events.emit(events.TierWritten(ts.url, stats.bytes, stats.seconds))

    def _saves_update(self, step: int, **kw: Any) -> None:
        for s in reversed(self._saves):
            if s["step"] == step:
                s.update(kw)
                return

    def _raise_background_error(self) -> None:
        with self._lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")
