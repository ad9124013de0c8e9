"""The step book of a CheckpointManager: the state of every step this rank has in hand, under one lock.

Three threads change it: the caller's (``save``, ``restore``), the persist thread and the promotion
thread. Everything they share lives here, and only here, behind ``lock``:

* the steps **in flight** (staged, not yet promoted everywhere), the steps whose promotion failed
  and waits for a retry (**pending**), and those saved on a node-local tier 0 and not yet
  committed globally (**unpublished**);
* the **error slot**: the first background failure no handle reported, raised by the next call;
* the **rollback** a restore set up, and the steps saved since it (the new branch);
* the incremental **base** (this rank's entry of its last committed step) and the base each step
  in flight refers to;
* the save **handles** and the **save log** (``stats()["saves"]``, the interval's measured cost);
* each tier's **written bytes** (``stats()["tiers"]``).

The book makes no I/O and calls nothing that waits, so no thread holds its lock across a write.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tierio import events
from tierio.errors import ConfigError
from tierio.format.manifest import RankEntry

from tierio.ckpt.promotion.cluster import Own
from tierio.ckpt.promotion.copy import CopyStats
from tierio.ckpt.saving.incremental import Base
from tierio.ckpt.saving.interval import SaveCost, measured_cost
from tierio.ckpt.saving.job import SaveHandle
from tierio.ckpt.steps.lineage import Lineage, Rollback
from tierio.ckpt.tier import TierState


class StepBook:
    """The steps one rank has in hand (see the module docstring); every method takes ``lock``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._error: BaseException | None = None
        self._handles: list[SaveHandle] = []
        self._saves: list[dict] = []
        self._inflight: set[int] = set()
        self._pending: set[int] = set()
        self._unpublished: dict[int, tuple[Own, Lineage]] = {}
        self._rollback: Rollback | None = None
        self._saved_since_restore: set[int] = set()
        self._base: Base | None = None
        self._bases: dict[int, int] = {}  # step in flight -> the base step it refers to (kept from retention)

    # -- the error slot ----------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """Keep ``exc`` for the next call unless an earlier failure is already kept."""
        with self.lock:
            if self._error is None:
                self._error = exc

    def forget(self, exc: BaseException) -> None:
        """``exc`` was reported to the caller another way: the next call does not raise it again."""
        with self.lock:
            if self._error is exc:
                self._error = None

    def raise_error(self) -> None:
        with self.lock:
            err, self._error = self._error, None
        if err is not None:
            raise err

    # -- steps in flight ---------------------------------------------------------------------------
    def check_new(self, step: int) -> Rollback | None:
        """Refuse a step already in flight or not after the restored one; the rollback it carries out."""
        with self.lock:
            if step in self._inflight:
                raise ConfigError(f"step {step} is already being saved; wait for it or use another step number")
            rollback = self._rollback
        if rollback is not None and step <= rollback.after:
            raise ConfigError(f"step {step} is not after the restored step {rollback.after}: after a restore, saves "
                              "continue with later step numbers (the steps after it belong to the abandoned run)")
        return rollback

    def saved_again(self, step: int) -> bool:
        """Whether this run has saved ``step`` since the last restore."""
        with self.lock:
            return step in self._saved_since_restore

    def saved_since_restore(self) -> set[int]:
        with self.lock:
            return set(self._saved_since_restore)

    def start(self, step: int) -> None:
        with self.lock:
            self._inflight.add(step)

    def started(self, step: int, rollback: Rollback | None) -> None:
        """``step`` is staged: it belongs to the branch after the restore."""
        if rollback is None:
            return
        with self.lock:
            rollback.first = step if rollback.first is None else rollback.first
            self._saved_since_restore.add(step)

    def end(self, step: int, failed: bool = False) -> None:
        with self.lock:
            self._inflight.discard(step)
            if failed:
                self._bases.pop(step, None)

    def in_flight(self, step: int) -> bool:
        with self.lock:
            return step in self._inflight

    # -- handles and the save log ------------------------------------------------------------------
    def add(self, handle: SaveHandle, log: bool = True) -> None:
        with self.lock:
            self._handles.append(handle)
            if log:
                self._saves.append({"step": handle.step, "bytes": handle.bytes,
                                    "blocking_seconds": handle.blocking_seconds, "wait_seconds": handle.wait_seconds,
                                    "returned_at": time.monotonic()})

    def handles(self) -> list[SaveHandle]:
        with self.lock:
            return list(self._handles)

    def waiting_commit(self, step: int) -> list[SaveHandle]:
        with self.lock:
            return [h for h in self._handles if h.step == step and not h.committed.done()]

    def drain(self, promotions: bool = True) -> None:
        """Wait for every handle's persist and commit (and promotion); drop the finished ones.
        Failures are not raised here: they reach the caller through the handles and the error slot."""
        for h in self.handles():
            try:
                h.persisted.exception()
                h.committed.exception()
                if promotions:
                    h.promoted.exception()
            except BaseException:  # noqa: BLE001 - see the docstring
                pass
        with self.lock:
            self._handles = [h for h in self._handles if not h.done()]

    def note(self, step: int, **kw: Any) -> None:
        """Add figures to the save log's entry of ``step``."""
        with self.lock:
            for s in reversed(self._saves):
                if s["step"] == step:
                    s.update(kw)
                    return

    def saves(self) -> list[dict]:
        with self.lock:
            return [dict(s) for s in self._saves]

    def cost(self) -> SaveCost | None:
        with self.lock:
            return measured_cost(self._saves)

    def persisting(self) -> tuple[bool, float | None]:
        """Whether a save still persists, and when the latest save returned (monotonic), if any."""
        with self.lock:
            busy = any(not h.persisted.done() for h in self._handles)
            return busy, self._saves[-1]["returned_at"] if self._saves else None

    # -- promotion ---------------------------------------------------------------------------------
    def abandoned(self, step: int) -> bool:
        """A step after the last restored one that this run has not saved again: the old branch's."""
        with self.lock:
            rb = self._rollback
            return rb is not None and step > rb.after and step not in self._saved_since_restore

    def retry(self, step: int) -> None:
        """``step``'s promotion failed (or never ran): the next promotion run retries it."""
        if not self.abandoned(step):
            with self.lock:
                self._pending.add(step)

    def promoted(self, step: int) -> None:
        with self.lock:
            self._pending.discard(step)

    def pending(self) -> list[int]:
        with self.lock:
            return sorted(self._pending)

    def to_promote(self, extra: list[int]) -> tuple[list[int], Rollback | None]:
        """The steps a promotion run takes (pending, unpublished and ``extra``) and the rollback it
        carries out on slower tiers (only once a save after the restore began it)."""
        with self.lock:
            steps = sorted(self._pending | set(extra) | set(self._unpublished))
            rb = self._rollback
            return steps, rb if rb is not None and rb.first is not None else None

    def unpublish(self, step: int, own: Own, lineage: Lineage) -> None:
        with self.lock:
            self._unpublished[step] = (own, lineage)

    def unpublished(self, step: int) -> tuple[Own, Lineage] | None:
        with self.lock:
            return self._unpublished.get(step)

    def published(self, step: int) -> None:
        with self.lock:
            self._unpublished.pop(step, None)

    def protected(self) -> frozenset[int]:
        """Steps retention must keep: in flight, pending, unpublished, or a base of one in flight."""
        with self.lock:
            return frozenset(self._inflight | self._pending | set(self._unpublished) | set(self._bases.values()))

    # -- incremental saves -------------------------------------------------------------------------
    def base_for(self, step: int) -> Base | None:
        """The base an incremental save of ``step`` refers to (kept from retention while it is in flight)."""
        with self.lock:
            if self._base is not None:
                self._bases[step] = self._base.step
            return self._base

    def committed(self, step: int, entry: RankEntry, done: Any) -> None:
        """An incremental save's commit settled: a committed step becomes the next saves' base."""
        with self.lock:
            self._bases.pop(step, None)
            if done.cancelled() or done.exception() is not None:
                return
            if self._base is None or step > self._base.step:
                self._base = Base(step, entry)

    # -- restore -----------------------------------------------------------------------------------
    def rollback(self) -> Rollback | None:
        with self.lock:
            return self._rollback

    def restored(self, step: int) -> None:
        """The next save starts a branch from ``step``: pending promotions of later steps are dropped
        (they belong to the abandoned branch) and that save retires them everywhere."""
        with self.lock:
            self._base = None  # the first save after a restore is a full one
            self._rollback = Rollback(step)
            self._saved_since_restore = set()
            self._pending = {s for s in self._pending if s <= step}
            self._unpublished = {s: v for s, v in self._unpublished.items() if s <= step}

    # -- tiers -------------------------------------------------------------------------------------
    def account(self, ts: TierState, stats: CopyStats) -> None:
        """Bytes written to ``ts`` (any thread)."""
        with self.lock:
            ts.bytes += stats.bytes
            ts.seconds += stats.seconds
            ts.files += stats.files
        events.emit(events.TierWritten(ts.url, stats.bytes, stats.seconds))
