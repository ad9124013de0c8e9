"""A save's way to tier 0: staging the shard, then, on the persist thread, writing it and committing it.

1. *stage* (the caller's thread, the only part it waits for): lay out the shard and copy every
   tensor into a reused, pre-faulted staging buffer (``saving.stage``; an overlapped save copies
   the large tensors behind, ``saving.overlap``);
2. *write* (persist thread): xxh3 per chunk from memory while one large write sends the shard to
   tier 0; the staging buffer is free again as soon as the shard is written;
3. *record and commit* (persist thread): the rank's record; on a shared tier 0 the commit protocol
   follows (``steps.commit``); on a node-local tier 0 the step waits for publication
   (``promotion.cluster``) in the step book, and a buddy copy goes to the partner node.

When the shard is durable the persister hands the step on through ``persisted`` (the promoter's
entry); it never calls back into the manager.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from tierio import events
from tierio.errors import ConfigError, FormatError, StorageError
from tierio.format.manifest import RankEntry, TensorInfo
from tierio.format.shard import Placement, ShardBytes, describe, manifest_key, plan_shard, shard_key, shard_name, step_dir
from tierio.io import background
from tierio.io import offload as io_offload
from tierio.io.buffers import BufferPool, align_up
from tierio.io.numa import placement
from tierio.storage.local import LocalStore
from tierio.units import human_bytes

from tierio.ckpt.promotion.buddy import Buddy
from tierio.ckpt.promotion.cluster import Cluster, Own, commit_on
from tierio.ckpt.promotion.copy import CopyStats
from tierio.ckpt.saving.incremental import diff
from tierio.ckpt.saving.job import SaveHandle, Staged, check_space
from tierio.ckpt.saving.overlap import Overlap
from tierio.ckpt.saving.stage import Stager
from tierio.ckpt.steps.book import StepBook
from tierio.ckpt.steps.commit import drop_record, write_record
from tierio.ckpt.steps.lineage import Lineage, Rollback
from tierio.ckpt.tier import TierState, commit_tier

log = logging.getLogger("tierio.ckpt")


class Persister:
    """Stages saves and runs their persist thread (see the module docstring)."""

    def __init__(self, tiers: list[TierState], cluster: Cluster, book: StepBook, *, memory_budget: int | None,
                 slots: int, overlap: bool, incremental: bool, buddy: Buddy | None,
                 persisted: Callable[[int, SaveHandle], None], numa_node: int | str | None = None,
                 nice: int = background.DEFAULT_NICE, offload: bool = False) -> None:
        self.tiers, self.cluster, self.book, self.buddy = tiers, cluster, book, buddy
        self.memory_budget, self.incremental, self.persisted = memory_budget, incremental, persisted
        # Staging buffers: at most `slots` exist, within the memory budget, reused by every save.
        self.numa = placement(numa_node)
        self.staging = BufferPool(budget_bytes=memory_budget, max_buffers=slots, numa_node=self.numa.node,
                                  offload=offload)
        self.stager = Stager()
        self.overlap = Overlap(self.stager) if overlap else None
        # Behind training, at a lower priority (io.background): a contended core goes to the step.
        self._pool = background.pool("tierio-ckpt-persist", nice)
        self._checksums = background.pool("tierio-ckpt-checksum", nice)
        # offload: the byte loops move to the persist process (io.offload): the staging buffers are
        # its memory too, and the filesystem tiers' calls from background threads go there. (The
        # manager makes this last, so a constructor that raised holds no helper.)
        self._helper_held = offload
        if offload:
            io_offload.hold(nice)
            self._route_tiers(True)

    def _route_tiers(self, on: bool) -> None:
        for ts in self.tiers:
            if isinstance(ts.store, LocalStore):
                ts.store.offload = on

    @property
    def rank(self) -> int:
        return self.cluster.rank

    def check(self, step: int) -> Rollback | None:
        """The checks before any save of ``step``; the rollback it carries out, if any."""
        self.book.raise_error()
        step_dir(step)  # validates the number
        rollback = self.book.check_new(step)
        first = self.tiers[0]
        if self.cluster.leads(first):
            self.cluster.ensure(first)  # a second writer is refused here, before any write
        if not first.node_local and first.store.exists(manifest_key(step)) and \
                (rollback is None or self.book.saved_again(step)):
            raise ConfigError(
                f"step {step} already has a committed checkpoint on {first.url}; checkpoints are immutable: "
                "use a new step number or delete the old one first"
            )
        return rollback

    def layout(self, step: int, tensors: dict[str, torch.Tensor]) -> Any:
        meta = {"tierio.step": str(step), "tierio.rank": str(self.rank), "tierio.world_size": str(self.cluster.world_size)}
        return plan_shard(tensors, meta)

    def stage(self, step: int, tensors: dict[str, torch.Tensor], places: dict[str, Placement], tree: Any,
              rollback: Rollback | None, handle: SaveHandle, overlap: bool = False) -> Staged:
        """Lay out the shard and copy it into a staging buffer (the part a save blocks for; with
        ``overlap``, the large tensors are copied behind, ``saving.overlap``)."""
        layout = self.layout(step, tensors)
        if self.staging.offload:
            io_offload.warm()  # a first save's helper starts while its state is staged
        need = handle.bytes = layout.total_bytes
        if self.memory_budget is not None and align_up(need) > self.memory_budget:
            raise ConfigError(
                f"rank {self.rank}'s shard for step {step} needs {human_bytes(need)} of staging memory, above "
                f"memory_budget_bytes={human_bytes(self.memory_budget)}; raise the budget"
            )
        tw = time.perf_counter()
        # Waits while the previous persist still owns the buffers; a background failure ends the wait.
        buf = self.staging.acquire(need, abort=self.book.raise_error)
        handle.wait_seconds = time.perf_counter() - tw
        try:
            self.book.raise_error()
            check_space(self.tiers[0], need, step, self.rank)
            self.book.start(step)
            snapshot = None
            if overlap:
                assert self.overlap is not None
                snapshot = self.overlap.start(step, layout, tensors, buf)
            else:
                self.stager.stage(layout, tensors, buf)
        except BaseException:
            self.book.end(step)
            self.staging.release(buf)
            raise
        self.book.started(step, rollback)
        return Staged(layout, tree, places, buf, rollback, snapshot=snapshot)

    def stage_direct(self, step: int, tensors: dict[str, torch.Tensor], places: dict[str, Placement],
                     rollback: Rollback | None) -> Staged:
        """A shard written straight from ``tensors`` (no staging buffer): for a caller that blocks
        until the write is done, so the tensors do not change meanwhile (a DCP save). The bytes go
        out through the writer's bounce buffers, copied while earlier requests are in flight."""
        layout = self.layout(step, tensors)
        self.book.raise_error()
        check_space(self.tiers[0], layout.total_bytes, step, self.rank)
        self.book.start(step)
        self.book.started(step, rollback)
        return Staged(layout, None, places, None, rollback, ShardBytes(layout, tensors))

    def submit(self, handle: SaveHandle, job: Staged) -> None:
        self._pool.submit(self._persist, handle, job)

    # -- the persist thread ----------------------------------------------------------------------
    def _persist(self, handle: SaveHandle, job: Staged) -> None:
        """The first part: this rank's shard of the step on tier 0. An overlapped save commits only
        once the caller's thread gave its snapshot's verdict (``saving.overlap``): the rest runs when
        it comes, on this thread again, so nothing here blocks on the caller."""
        start = time.perf_counter()
        try:
            entry = self.write_shard(handle.step, job)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            self._failed(handle, job, None, exc, False)
            return
        written = time.perf_counter() - start
        if job.snapshot is None:
            self._finish(handle, job, entry, written)
            return
        job.snapshot.verdict.add_done_callback(lambda _v: self._after_verdict(handle, job, entry, written))

    def _after_verdict(self, handle: SaveHandle, job: Staged, entry: RankEntry, written: float) -> None:
        """Runs in the thread that gave the verdict (or the persist thread): queue the commit."""
        try:
            self._pool.submit(self._finish, handle, job, entry, written)
        except RuntimeError as exc:  # the manager is closed: the step stays uncommitted
            self._failed(handle, job, None, exc, False)

    def _finish(self, handle: SaveHandle, job: Staged, entry: RankEntry, written: float) -> None:
        """The second part: the record and the commit of a written shard."""
        step, t0 = handle.step, self.tiers[0]
        own: Own | None = None
        exchanged = False  # buddy=True: this step's exchange with the partner is under way
        try:
            start = time.perf_counter()
            if job.snapshot is not None:
                job.snapshot.verdict.result()  # SnapshotChangedError: the step is not committed
            own, lineage = self.record(step, job, entry, self.cluster.world_size > 1 or t0.node_local)
            if self.incremental:
                handle.committed.add_done_callback(lambda f, e=own.entry: self.book.committed(step, e, f))
            if t0.node_local:
                self.book.unpublish(step, own, lineage)
                if self.buddy is not None:
                    self.buddy.send(step, own.record.name if own.record is not None else None, handle.buddied)
                    exchanged = True
            else:
                commit_on(self.cluster, t0.store, step, own, lineage)
                handle.committed.set_result(step)
            took = written + time.perf_counter() - start  # the wait for the verdict is not persist time
            self.book.note(step, persist_seconds=took)
            events.emit(events.CheckpointPersisted(step, t0.url, job.layout.total_bytes, took, len(self.tiers) > 1))
            handle.persisted.set_result(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            self._failed(handle, job, own, exc, exchanged)
            return
        self.persisted(step, handle)

    def _failed(self, handle: SaveHandle, job: Staged, own: Own | None, exc: BaseException, exchanged: bool) -> None:
        step = handle.step
        self.cleanup_failed(step, own)
        self.book.end(step, failed=True)
        if not (job.snapshot is not None and job.snapshot.reported):
            self.book.fail(exc)
        self.staging.wake()  # a save waiting for a buffer raises this error instead
        if self.buddy is not None and not exchanged:
            self.buddy.send(step, None, handle.buddied)  # the partner must not wait for it
        handle.fail(exc)
        log.error("checkpoint of step %d failed: %s", step, exc)

    # -- the writes --------------------------------------------------------------------------------
    def write(self, step: int, job: Staged, record: bool) -> tuple[Own, Lineage]:
        """This rank's part of ``step`` on tier 0: the shard, then its record (when asked)."""
        return self.record(step, job, self.write_shard(step, job), record)

    def write_shard(self, step: int, job: Staged) -> RankEntry:
        """This rank's shard of ``step`` on tier 0 (checksummed while it streams out); the staging
        buffer is released whatever happens."""
        try:
            if job.snapshot is not None:
                job.snapshot.copied.result()  # an overlapped save: its tensors are in the buffer
            self.cluster.ensure(self.tiers[0])  # other ranks: wait for the leader's lease naming this run
            if job.rollback is not None:
                self._retire(job.rollback)
            fname = shard_name(self.rank)
            size, tensors = self._write_shard(step, job, fname)
        finally:
            if job.buf is not None:
                self.staging.release(job.buf)
        return RankEntry(self.rank, fname, size, job.tree, tensors)

    def record(self, step: int, job: Staged, entry: RankEntry, record: bool) -> tuple[Own, Lineage]:
        """After the shard: this rank's record of ``step`` on tier 0 (when asked) and its lineage."""
        lineage = Lineage(self.cluster.run(), job.rollback.after if job.rollback is not None else None, job.reason)
        ref = write_record(self.tiers[0].store, step, self.cluster.world_size, entry, lineage.token,
                           lineage.extra()) if record else None
        return Own(entry, ref), lineage

    def _write_shard(self, step: int, job: Staged, fname: str) -> tuple[int, dict[str, TensorInfo]]:
        """Write this rank's shard of ``step`` to tier 0; returns its size and tensors. An incremental
        save with a base writes only the tensors that changed since it (``saving.incremental``)."""
        t0 = self.tiers[0]
        parts, view = job.parts()
        base = self.book.base_for(step) if self.incremental and job.direct is None else None
        start = time.perf_counter()
        if base is not None:
            delta = diff(job.layout, view, fname, job.places, base)  # type: ignore[arg-type]
            t0.store.put_buffers(shard_key(step, self.rank), delta.parts)
            size, tensors = delta.layout.total_bytes, delta.tensors
            self.book.note(step, written_bytes=size, reused_bytes=delta.reused_bytes, base_step=base.step)
        else:
            # Checksum the bytes while the same bytes stream to disk (both only read them); the
            # record needs the checksums only once the shard is durable.
            sums = self._checksums.submit(describe, job.layout, view, fname, job.places)
            try:
                t0.store.put_buffers(shard_key(step, self.rank), parts)
            finally:
                tensors = sums.result()
            size = job.layout.total_bytes
        self.book.account(t0, CopyStats(size, time.perf_counter() - start, 1))
        return size, tensors

    def _retire(self, rollback: Rollback) -> None:
        """Before the first commit after a restore: the abandoned steps stop being checkpoints on
        every shared tier (rank 0 deletes their manifests), and their directories go from tier 0
        (rank 0) or from each node's local tier (its leader). A slower tier that cannot be reached
        now is retired by its next promotion, before anything lands there."""
        first_shared = commit_tier(self.tiers)
        for ts in self.tiers:
            if not self.cluster.leads(ts):
                continue
            try:
                self.cluster.ensure(ts)
                self.cluster.fence(ts.store)()  # it deletes there
                rollback.retire_manifests(ts.store)
            except (StorageError, FormatError) as exc:
                if ts is first_shared:
                    raise
                log.warning("could not retire the abandoned steps on %s yet (%s); its next promotion will", ts.url, exc)
        t0 = self.tiers[0]
        if self.cluster.leads(t0):
            rollback.retire_dirs(t0.store)
            if self.buddy is not None:
                self.buddy.retire_after(rollback.after, self.book.saved_since_restore())

    def cleanup_failed(self, step: int, own: Own | None) -> None:
        """Remove this rank's partial files of a failed step (frees space after a full disk)."""
        store = self.tiers[0].store
        try:
            if not store.exists(manifest_key(step)):
                store.delete(shard_key(step, self.rank))
        except Exception:  # noqa: BLE001 - best effort
            pass
        if own is not None:
            drop_record(store, step, own.record)
            self.book.published(step)

    def close(self) -> None:
        if self.overlap is not None:
            self.overlap.close()
        self._pool.shutdown(wait=True)
        self._checksums.shutdown(wait=True)
        self.staging.close()
        if self._helper_held:  # what still runs after this (a promotion's tail) runs here
            self._helper_held = False
            self._route_tiers(False)
            io_offload.let_go()
