"""The promotion thread of a CheckpointManager: publication, promotion to slower tiers, retention.

Every persisted step reaches ``persisted``; with more than one tier the promotion thread then
publishes it (node-local tier 0: the global commit, ``promotion.cluster``), copies it down every
slower tier, and applies retention on the tiers this rank leads (``steps.gc``). A step whose
promotion fails stays in the step book's retry list and is promoted again by the next run; the
faster copies stay meanwhile. Slow or stalled tiers therefore only ever hold up this thread.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tierio import events
from tierio.errors import ConfigError, FormatError, IntegrityError, LeaseError, StorageError, TierioError
from tierio.io import background

from tierio.ckpt.promotion.cluster import Cluster, Own, promote_step, publish
from tierio.ckpt.saving.job import SaveHandle
from tierio.ckpt.steps.book import StepBook
from tierio.ckpt.steps.gc import TEMP_GRACE, GcOptions, GcTier, collect
from tierio.ckpt.steps.lineage import Lineage
from tierio.ckpt.steps.reader import committed_steps
from tierio.ckpt.steps.retention import wanted
from tierio.ckpt.tier import TierState, commit_tier

log = logging.getLogger("tierio.ckpt")


class Promoter:
    """Runs publication, promotion and retention on one thread (see the module docstring)."""

    def __init__(self, tiers: list[TierState], cluster: Cluster, book: StepBook, min_keep: int,
                 nice: int = background.DEFAULT_NICE) -> None:
        self.tiers, self.cluster, self.book, self.min_keep = tiers, cluster, book, min_keep
        self._pool = background.pool("tierio-ckpt-promote", nice)
        self._gc_lock = threading.Lock()
        self._swept: set[str] = set()  # tiers whose leftovers this manager has cleaned up once
        self._warned_min_keep = False
        self._hold_lock = threading.Lock()
        self._held: list[tuple[int, SaveHandle]] | None = None  # persisted while held: promoted on release
        # The scan of slower tiers runs behind construction: a stalled tier must not block it.
        self._scan = self._pool.submit(self._find_unpromoted)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def persisted(self, step: int, handle: SaveHandle) -> None:
        """``step``'s shard is durable on tier 0 (any thread): promote it behind, or finish it."""
        if len(self.tiers) > 1:
            with self._hold_lock:
                if self._held is not None:
                    self._held.append((step, handle))
                    return
            self._pool.submit(self.run, [step], handle, False)
        else:
            self.done(step, handle)

    def hold(self, held: bool) -> None:
        """While held, steps persisted are not promoted (an emergency save gets the disks and the
        network to itself); on release they are, in order. A process that exits while held leaves
        them to the next run's manager, which finds unpromoted steps. A node-local step's global
        commit is made here too: do not hold while waiting for it."""
        with self._hold_lock:
            if held:
                if self._held is None:
                    self._held = []
                return
            waiting, self._held = self._held or [], None
        for step, handle in waiting:
            self._pool.submit(self.run, [step], handle, False)

    def publish_later(self, step: int, own: Own, lineage: Lineage) -> None:
        """A step restored from the nodes' tier 0 is committed nowhere yet: publish it behind, as
        the run that saved it would have (retention keeps it meanwhile: it is unpublished)."""
        self.book.unpublish(step, own, lineage)
        self._pool.submit(self.run, [], None, False)

    def done(self, step: int, handle: SaveHandle) -> None:
        """A one-tier save is complete: retention runs, the handle's last stage completes."""
        self.book.end(step)
        self.maybe_gc()
        handle.promoted.set_result(step)

    def run(self, extra: list[int], handle: SaveHandle | None, strict: bool) -> None:
        """On the promotion thread: publish and promote every pending step and ``extra``."""
        last_exc: BaseException | None = None
        done: list[int] = []
        steps, rollback = self.book.to_promote(extra)
        for step in steps:
            if self.book.abandoned(step):  # a restore to an earlier step came in meanwhile
                if handle is not None and step == handle.step:
                    handle.fail(ConfigError(f"step {step} was abandoned by a restore to an earlier step"))
                continue
            try:
                self._publish(step)
                promote_step(self.cluster, self.tiers, step, rollback, self.book.account)
                self.book.promoted(step)
                done.append(step)
                events.emit(events.CheckpointPromoted(step, self.tiers[0].url))
            except BaseException as exc:  # noqa: BLE001 - a retry comes with the next save
                last_exc = exc
                self.book.retry(step)
                events.emit(events.PromotionFailed(step, self.tiers[0].url, str(exc),
                                                   isinstance(exc, (IntegrityError, FormatError))))
                msg = f"promotion of step {step} failed ({exc}); the faster copy stays and promotion will be retried"
                log.warning("%s", msg)
                if not strict:
                    warnings.warn(msg, stacklevel=1)
                if handle is not None and step == handle.step:
                    handle.fail(exc)
        if handle is not None:
            self.book.end(handle.step)
        self.maybe_gc()
        if handle is not None and handle.step in done:
            handle.promoted.set_result(handle.step)
        if strict and last_exc is not None:
            raise last_exc

    def _publish(self, step: int) -> None:
        """A step saved on a node-local tier 0 and not yet committed globally: publish it."""
        item = self.book.unpublished(step)
        if item is None:
            return
        own, lineage = item
        publish(self.cluster, self.tiers[0], commit_tier(self.tiers), step, own, lineage, self.book.account)
        self.book.published(step)
        for h in self.book.waiting_commit(step):  # the save of this step (its own promotion run may have come first)
            h.committed.set_result(step)

    def _find_unpromoted(self) -> None:
        """Steps committed on a faster shared tier that a slower tier still wants (a promotion was
        cut short by a crash or an outage) join the retry list; the next save's promotion picks
        them up."""
        shared = [ts for ts in self.tiers if not ts.node_local]
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
                        self.book.retry(step)
                        break

    # -- retention and clean-up ------------------------------------------------------------------
    def leads_any(self) -> bool:
        return any(self.cluster.leads(ts) for ts in self.tiers)

    def maybe_gc(self) -> None:
        if not self.leads_any():
            return
        if all(t.tier.retention is None for t in self.tiers) and all(t.url in self._swept for t in self.tiers
                                                                     if self.cluster.leads(t)):
            return
        try:
            self.gc()
        except Exception as exc:  # noqa: BLE001 - retention must never fail a save
            log.warning("garbage collection failed: %s", exc)

    def gc(self, sweep_all: bool = False) -> list[tuple[str, int]]:
        """Retention and the sweep of leftovers on every tier this rank leads; the copies deleted."""
        self._scan.result()  # its pending steps must be protected
        shared = next((ts.store for ts in self.tiers if not ts.node_local), None)
        with self._gc_lock:
            tiers = []
            for ts in self.tiers:
                writable = self.cluster.leads(ts)
                if writable:
                    try:
                        self.cluster.ensure(ts)
                        self.cluster.fence(ts.store)()  # retention deletes there
                    except (LeaseError, StorageError, FormatError) as exc:
                        log.warning("not cleaning %s: %s", ts.url, exc)
                        writable = False
                tiers.append(GcTier(ts.store, ts.tier.retention, writable, sweep_all or ts.url not in self._swept,
                                    shared if ts.node_local else None))
            report = collect(tiers, GcOptions(self.min_keep, self.book.protected(), temp_grace=TEMP_GRACE))
            for w in report.warnings:
                if not self._warned_min_keep:  # once per manager; the log keeps every instance
                    warnings.warn(w, stacklevel=2)
                log.info("%s", w)
            self._warned_min_keep = self._warned_min_keep or bool(report.warnings)
            failed = {s.tier for s in report.skipped}
            self._swept |= {t.url for t in tiers if t.writable and t.sweep and t.url not in failed}
            return [(r.tier, r.step) for r in report.deleted]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
