"""CheckpointManager: asynchronous, tiered, verified checkpoints.

Pipeline of one ``save(step, state)``:

1. *stage* (the only part the caller waits for): flatten the state, lay out the shard, copy the
   header and every tensor into a reused, pre-faulted staging buffer (pinned, on a side CUDA
   stream, where a GPU exists);
2. *persist* (background thread): xxh3 per chunk from memory, one large O_DIRECT write of the
   shard to tier 0 (temp + fsync + rename), a per-rank manifest fragment; rank 0 waits for every
   rank's fragment and commits ``manifest.json`` last. The staging buffer is free again as soon
   as the shard is written;
3. *promote* (second background thread): copy the same bytes to each slower tier, verifying every
   chunk, under the promotion bandwidth limit; rank 0 commits each tier's manifest once all shards
   are there. A failed promotion leaves the faster copies in place and is retried later.

Rank 0 holds each tier's lease (lease.py) before writing there; other ranks check it names their
run. Retention and clean-up run after each commit on rank 0 (gc.py). A save after ``restore()``
follows the rollback rule (lineage.py).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tierio import events
from tierio.dist import rank_world
from tierio.errors import (
    ConfigError,
    DiskFullError,
    FormatError,
    IntegrityError,
    LeaseError,
    NotFoundError,
    StorageError,
    TierioError,
)
from tierio.format.manifest import ChunkInfo, Manifest, RankEntry, TensorInfo, encode_fragment, parse_fragment, utc_now
from tierio.format.shard import (
    fragment_key,
    manifest_key,
    plan_shard,
    shard_key,
    shard_name,
    stage_into,
    step_dir,
)
from tierio.format.statetree import flatten
from tierio.io.buffers import BufferPool, HostBuffer, align_up
from tierio.io.checksum import xxh3
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store, read_bytes
from tierio.units import human_bytes, parse_size

from tierio.ckpt.copy import CopyStats, commit_copy, copy_pool, copy_shard, shards_present
from tierio.ckpt.gc import TEMP_GRACE, GcOptions, GcTier, collect
from tierio.ckpt.lease import TierLeases, agree_run_id
from tierio.ckpt.lineage import Lineage, Rollback, manifest_on
from tierio.ckpt.reader import VerifyReport, committed_steps, load_rank, read_manifest, read_manifest_raw, verify_copy, where
from tierio.ckpt.retention import wanted
from tierio.ckpt.tier import Tier, as_tier, open_tier_store

log = logging.getLogger("tierio.ckpt")

CAPACITY_WARN = 0.80
_POLL = 0.02


@dataclass
class SaveHandle:
    """Completion handles of one save: ``staged`` (state copied, the caller may go on),
    ``persisted`` (tier 0 durable and committed), ``promoted`` (every slower tier committed)."""

    step: int
    staged: Future = field(default_factory=Future)
    persisted: Future = field(default_factory=Future)
    promoted: Future = field(default_factory=Future)
    blocking_seconds: float = 0.0  # time save() held the caller, waiting included
    wait_seconds: float = 0.0  # part of it spent waiting for the previous persist
    bytes: int = 0

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every stage; raises the first failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in (self.staged, self.persisted, self.promoted):
            f.result(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def done(self) -> bool:
        return self.promoted.done() and self.persisted.done()


@dataclass
class _TierState:
    tier: Tier
    store: Store
    bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    warned_capacity: bool = False

    @property
    def url(self) -> str:
        return self.store.url


class CheckpointManager:
    """Asynchronous tiered checkpoints. ``tiers`` go from fastest to slowest (URLs, Stores or Tier).

    ``run_id`` names this run in tier leases and manifests (default: a fresh one, agreed across the
    ranks of an initialised process group at construction); ``break_lease=True`` takes over a tier
    another run still leases (only when that run is known to be gone)."""

    def __init__(
        self,
        tiers: Sequence[str | Tier | Store],
        *,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: Any = None,
        memory_budget: int | str | None = None,
        double_buffer: bool = False,
        promote_bandwidth: float | str | None = None,
        min_keep: int = 3,
        commit_timeout: float = 600.0,
        run_id: str | None = None,
        break_lease: bool = False,
    ) -> None:
        if isinstance(tiers, (str, Tier)) or not tiers:
            raise ConfigError("CheckpointManager needs a list of tiers, fastest first, e.g. ['/nvme/ckpt', 's3://bucket/run1']")
        rate = parse_size(promote_bandwidth) if isinstance(promote_bandwidth, str) else promote_bandwidth
        self.limiter = TokenBucket(rate, burst=max(1 << 20, (rate or 0) / 4)) if rate else None
        self._tiers: list[_TierState] = []
        for i, t in enumerate(tiers):
            tier = as_tier(t)
            self._tiers.append(_TierState(tier, open_tier_store(tier, self.limiter if i > 0 else None)))
        self.rank, self.world_size = rank_world(rank, world_size, process_group)
        from_group = rank is None or world_size is None
        self._leases = TierLeases(agree_run_id(run_id, self.rank, self.world_size, process_group, from_group),
                                  self.rank, self.world_size, force=break_lease, wait_timeout=commit_timeout)
        self.memory_budget = parse_size(memory_budget) if memory_budget is not None else None
        self.slots = 2 if double_buffer else 1
        self.min_keep = min_keep
        self.commit_timeout = commit_timeout
        self.restored_step: int | None = None
        self.restored_from: str | None = None  # the tier URL the last restore read

        self._lock = threading.Lock()
        # Staging buffers: at most `slots` exist, within the memory budget, reused by every save.
        self._staging = BufferPool(budget_bytes=self.memory_budget, max_buffers=self.slots)
        self._promo_pool = copy_pool()
        self._error: BaseException | None = None
        self._handles: list[SaveHandle] = []
        self._inflight: set[int] = set()
        self._pending: set[int] = set()  # steps whose promotion failed and waits for a retry
        self._rollback: Rollback | None = None  # set by restore(): what the next saves retire
        self._saved_since_restore: set[int] = set()
        self._saves: list[dict] = []
        self._swept: set[str] = set()  # tiers whose leftovers this manager has cleaned up once
        self._closed = False
        self._warned_min_keep = False
        self._stream = None
        self._gc_lock = threading.Lock()
        self._persist_pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-persist")
        self._checksum_pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-checksum")
        self._promote_pool = ThreadPoolExecutor(1, thread_name_prefix="tierio-ckpt-promote")
        # The scan of slower tiers runs behind construction: a stalled tier must not block it.
        self._scan = self._promote_pool.submit(self._find_unpromoted)

    # -- public API ------------------------------------------------------------------------------
    @property
    def tiers(self) -> list[str]:
        return [t.url for t in self._tiers]

    @property
    def run_id(self) -> str | None:
        """This run's id (on a non-zero rank without a process group: None until rank 0's lease is read)."""
        return self._leases.run

    def save(self, step: int, state: Any) -> SaveHandle:
        """Snapshot ``state`` into staging memory and return; persist and promotion run behind."""
        t0 = time.perf_counter()
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
        if self.rank == 0:
            self._leases.ensure(self._tiers[0].store)  # a second writer is refused here, before any write
        if self._tiers[0].store.exists(manifest_key(step)) and (rollback is None or step in self._saved_since_restore):
            raise ConfigError(
                f"step {step} already has a committed checkpoint on {self._tiers[0].url}; checkpoints are immutable: "
                "use a new step number or delete the old one first"
            )
        flat = flatten(state)
        meta = {"tierio.step": str(step), "tierio.rank": str(self.rank), "tierio.world_size": str(self.world_size)}
        layout = plan_shard(flat.tensors, meta)
        need = layout.total_bytes
        if self.memory_budget is not None and align_up(need) > self.memory_budget:
            raise ConfigError(
                f"rank {self.rank}'s shard for step {step} needs {human_bytes(need)} of staging memory, above "
                f"memory_budget={human_bytes(self.memory_budget)}; raise the budget"
            )
        handle = SaveHandle(step, bytes=need)
        tw = time.perf_counter()
        # Waits while the previous persist still owns the buffers; a background failure ends the wait.
        buf = self._staging.acquire(need, abort=self._raise_background_error)
        handle.wait_seconds = time.perf_counter() - tw
        try:
            self._raise_background_error()
            self._check_space(need, step)
            with self._lock:
                self._inflight.add(step)
            self._stage(layout, flat.tensors, buf)
        except BaseException:
            with self._lock:
                self._inflight.discard(step)
            self._staging.release(buf)
            raise
        handle.blocking_seconds = time.perf_counter() - t0
        handle.staged.set_result(step)
        with self._lock:
            if rollback is not None:
                rollback.first = step if rollback.first is None else rollback.first
                self._saved_since_restore.add(step)
            self._handles.append(handle)
            self._saves.append({"step": step, "bytes": need, "blocking_seconds": handle.blocking_seconds,
                                "wait_seconds": handle.wait_seconds})
        events.emit(events.CheckpointStaged(step, self._tiers[0].url, need, handle.blocking_seconds, handle.wait_seconds))
        self._persist_pool.submit(self._persist, handle, layout, flat.tree, flat.tensors, buf, rollback)
        return handle

    def restore(self, step: int | None = None, into: Any = None) -> Any:
        """Restore ``step`` (default: the latest committed) from the fastest tier with a good copy.

        A copy with a missing file or a checksum mismatch is skipped with a warning naming it, and
        the next tier is tried. With ``into=``, tensors are filled in place where shapes match.

        Saving after a restore of an older step is a rollback: the first save retires the steps after
        it on every tier (see ``tierio.ckpt.lineage``)."""
        self._check_open()
        # Persists in flight land first (none may land after the rollback point); promotions are not
        # waited for, so a stalled slower tier never holds up a restore from a faster one.
        self._drain(promotions=False)
        started = time.perf_counter()
        candidates = [step] if step is not None else sorted(self.steps(), reverse=True)
        if not candidates:
            raise NotFoundError(f"no committed checkpoint on any tier ({', '.join(self.tiers)})")
        failures: list[str] = []
        for s in candidates:
            for ts in self._tiers:
                try:
                    if not ts.store.exists(manifest_key(s)):
                        continue
                    man = read_manifest(ts.store, s)
                    if man.world_size != self.world_size:
                        raise ConfigError(
                            f"step {s} on {ts.url} was saved by {man.world_size} ranks, this job has {self.world_size}; "
                            "restore with the same world size (resharding is not supported yet)"
                        )
                    state = load_rank(ts.store, man, self.rank, into)
                    self._note_restore(s, ts.url)
                    events.emit(events.CheckpointRestored(s, ts.url, time.perf_counter() - started))
                    if failures:
                        log.warning("restored step %d from %s after: %s", s, ts.url, "; ".join(failures))
                    return state
                except ConfigError:
                    raise
                except (FormatError, IntegrityError, StorageError) as exc:
                    msg = f"copy of step {s} on {ts.url} is unusable: {exc}"
                    warnings.warn(msg + "; trying the next tier", stacklevel=2)
                    log.warning("%s", msg)
                    failures.append(msg)
                    events.emit(events.CopyUnusable(s, ts.url, str(exc)))
            if step is None and s != candidates[-1]:
                warnings.warn(f"no valid copy of step {s} on any tier; falling back to an older step", stacklevel=2)
        raise IntegrityError(
            f"no valid copy of step {candidates[0] if step is not None else 'any'} on any tier: " + "; ".join(failures or ["none found"])
        )

    def steps(self) -> list[int]:
        """Committed steps on any tier (an unreachable tier is skipped with a warning)."""
        out: set[int] = set()
        for ts in self._tiers:
            try:
                out.update(committed_steps(ts.store))
            except StorageError as exc:
                log.warning("cannot list %s: %s", ts.url, exc)
        return sorted(out)

    def latest(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def verify(self, step: int | None = None) -> VerifyReport:
        """Check every tier's copy of ``step`` (default: latest) byte for byte."""
        step = self.latest() if step is None else step
        if step is None:
            raise NotFoundError(f"no committed checkpoint on any tier ({', '.join(self.tiers)})")
        report = VerifyReport(step)
        for ts in self._tiers:
            verify_copy(ts.store, step, report)
        return report

    def promote(self, step: int | None = None) -> None:
        """Promote ``step`` (default: every pending step and the latest) to all slower tiers now; raises on failure."""
        self._check_open()
        if len(self._tiers) < 2:
            return
        steps = [step] if step is not None else committed_steps(self._tiers[0].store)[-1:]
        self._promote_pool.submit(self._promote_steps, steps, None, True).result()

    def gc(self) -> list[tuple[str, int]]:
        """Apply retention to every tier now and clean up what interrupted writes left there (rank 0);
        returns the (tier url, step) copies deleted."""
        if self.rank != 0:
            return []
        return self._gc(sweep_all=True)

    def wait(self) -> None:
        """Wait for every save in flight (persist and promotion); raises a background persist failure."""
        self._drain()
        self._raise_background_error()

    def _note_restore(self, step: int, url: str) -> None:
        """The next save starts a branch from ``step``: pending promotions of later steps are dropped
        (they belong to the abandoned branch) and that save retires them everywhere."""
        with self._lock:
            self.restored_step, self.restored_from = step, url
            self._rollback = Rollback(step)
            self._saved_since_restore = set()
            self._pending = {s for s in self._pending if s <= step}

    def _drain(self, promotions: bool = True) -> None:
        with self._lock:
            handles = list(self._handles)
        for h in handles:
            try:
                h.persisted.exception()
                if promotions:
                    h.promoted.exception()
            except BaseException:  # noqa: BLE001 - surfaced by wait() through _error
                pass
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()]

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._persist_pool.shutdown(wait=True)
            self._checksum_pool.shutdown(wait=True)
            self._promote_pool.shutdown(wait=True)
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
            "run_id": self.run_id,
            "leases": self._leases.status(),
            "staging_bytes": self._staging.allocated_bytes,
            "staging_allocations": self._staging.allocations,
            "tiers": [
                {"url": t.url, "bytes_written": t.bytes, "seconds": t.seconds, "files": t.files,
                 "gb_per_s": t.bytes / t.seconds / 1e9 if t.seconds else 0.0}
                for t in self._tiers
            ],
            "saves": saves,
            "pending_promotions": sorted(self._pending),
        }

    # -- staging ---------------------------------------------------------------------------------
    def _stage(self, layout, tensors: dict[str, torch.Tensor], buf: HostBuffer) -> None:
        cuda = any(t.is_cuda for t in tensors.values())
        stream = None
        if cuda and torch.cuda.is_available():
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            stage_into(layout, tensors, buf.tensor(), stream)
        if stream is not None:
            stream.synchronize()

    def _check_space(self, need: int, step: int) -> None:
        ts = self._tiers[0]
        cap = ts.store.capacity()
        if cap is None:
            return
        total, free = cap
        if free < need + (1 << 20):
            raise DiskFullError(
                f"tier 0 ({ts.url}) has {human_bytes(free)} free but step {step} needs {human_bytes(need)} on rank "
                f"{self.rank}: free space, keep fewer checkpoints there (retention) or point the tier elsewhere; "
                "earlier checkpoints are intact"
            )
        used = (total - free + need) / total if total else 0.0
        if used >= CAPACITY_WARN and not ts.warned_capacity:
            ts.warned_capacity = True
            warnings.warn(f"{ts.url} will be {used:.0%} full after step {step}; tighten retention or add space", stacklevel=3)
        elif used < CAPACITY_WARN:
            ts.warned_capacity = False

    # -- background: persist ---------------------------------------------------------------------
    def _persist(self, handle: SaveHandle, layout, tree: Any, tensors: dict[str, torch.Tensor], buf: HostBuffer,
                 rollback: Rollback | None) -> None:
        step = handle.step
        t0 = self._tiers[0]
        released = False
        try:
            self._leases.ensure(t0.store)  # other ranks: wait for rank 0's lease naming this run
            if rollback is not None and self.rank == 0:
                self._retire(rollback)
            view = buf.view[: layout.total_bytes]
            fname = shard_name(self.rank)

            def checksums() -> dict[str, TensorInfo]:
                out = {}
                for name, e in layout.header.tensors.items():
                    chunks = [
                        ChunkInfo(fname, c.begin, c.end, (c.row0,) + (0,) * (len(e.shape) - 1) if e.shape else (),
                                  c.shape, xxh3(view[c.begin : c.end]))
                        for c in layout.chunks[name]
                    ]
                    out[name] = TensorInfo(name, e.dtype, e.shape, chunks)
                return out

            # Checksum the staged bytes while the same bytes stream to disk (both only read the
            # buffer); the manifest entry needs them only at commit time.
            sums = self._checksum_pool.submit(checksums)
            start = time.perf_counter()
            try:
                t0.store.put_buffers(shard_key(step, self.rank), [view])
            finally:
                entry_tensors = sums.result()
            self._account(t0, layout.total_bytes, time.perf_counter() - start)
            entry = RankEntry(self.rank, fname, layout.total_bytes, tree, entry_tensors)
            self._staging.release(buf)
            released = True
            lineage = Lineage(self._run(), rollback.after if rollback is not None else None)
            if self.world_size == 1:
                self._commit(t0.store, step, lineage, entry)
            else:
                mine = fragment_key(step, self.rank, lineage.token)
                t0.store.put_buffers(mine, [encode_fragment(step, self.world_size, entry)])
                if self.rank == 0:
                    self._commit(t0.store, step, lineage)
                else:
                    self._await_commit(t0.store, step, mine)
            with self._lock:
                self._saves_update(step, persist_seconds=time.perf_counter() - start)
            events.emit(events.CheckpointPersisted(step, t0.url, layout.total_bytes, time.perf_counter() - start, len(self._tiers) > 1))
            handle.persisted.set_result(step)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the handle
            if not released:
                self._staging.release(buf)
            self._cleanup_failed(step)
            with self._lock:
                self._inflight.discard(step)
                if self._error is None:
                    self._error = exc
            self._staging.wake()  # a save waiting for a buffer raises this error instead
            handle.persisted.set_exception(exc)
            handle.promoted.set_exception(exc)
            log.error("checkpoint of step %d failed: %s", step, exc)
            return
        if len(self._tiers) > 1:
            self._promote_pool.submit(self._promote_steps, [step], handle, False)
        else:
            with self._lock:
                self._inflight.discard(step)
            self._maybe_gc()
            handle.promoted.set_result(step)

    def _run(self) -> str:
        run = self._leases.run
        assert run is not None, "the lease check sets the run id before any write"
        return run

    def _retire(self, rollback: Rollback) -> None:
        """Rank 0, before the first commit after a restore: the abandoned steps stop being
        checkpoints on every tier (manifests), and their directories go from tier 0. A slower tier
        that cannot be reached now is retired by its next promotion, before anything lands there."""
        for ts in self._tiers:
            try:
                self._leases.ensure(ts.store)
                rollback.retire_manifests(ts.store)
            except (StorageError, FormatError) as exc:
                if ts is self._tiers[0]:
                    raise
                log.warning("could not retire the abandoned steps on %s yet (%s); its next promotion will", ts.url, exc)
        rollback.retire_dirs(self._tiers[0].store)

    def _commit(self, store: Store, step: int, lineage: Lineage, own: RankEntry | None = None) -> None:
        """Rank 0: wait for every rank's fragment, merge them into the manifest, write it last."""
        entries: list[RankEntry | None] = [None] * self.world_size
        if own is not None:
            entries[0] = own

        def all_there() -> bool:
            for r in range(self.world_size):
                if entries[r] is None:
                    key = fragment_key(step, r, lineage.token)
                    try:
                        raw = read_bytes(store, key)
                    except NotFoundError:
                        continue  # that rank's shard is not durable yet
                    entries[r] = parse_fragment(raw, where(store, key), step, self.world_size)
            return all(e is not None for e in entries)

        self._await(all_there, f"every rank's shard of step {step} on {store.url}")
        stamp, ts = utc_now()
        man = Manifest(step, self.world_size, [e for e in entries if e is not None], stamp, ts, lineage.extra())
        store.put_buffers(manifest_key(step), [man.encode()])
        if own is None:
            self._drop_fragments(store, step, lineage.token)

    def _drop_fragments(self, store: Store, step: int, token: str) -> None:
        """After the commit: the manifest holds the fragments now; their removal tells the other
        ranks that this run's commit (not an older manifest of the same step) happened."""
        for r in range(self.world_size):
            try:
                store.delete(fragment_key(step, r, token))
            except StorageError as exc:
                log.warning("could not remove a fragment of step %d on %s: %s", step, store.url, exc)

    def _await_commit(self, store: Store, step: int, fragment: str) -> None:
        """Other ranks: rank 0 committed this run's step once it removed our fragment."""
        self._await(lambda: not store.exists(fragment) and store.exists(manifest_key(step)),
                    f"rank 0 to commit step {step} on {store.url}")

    def _await(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.commit_timeout
        delay = _POLL
        while not ready():
            if time.monotonic() > deadline:
                raise StorageError(f"timed out after {self.commit_timeout:.0f}s waiting for {what}; did a rank die?")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    def _cleanup_failed(self, step: int) -> None:
        """Remove this rank's partial files of a failed step (frees space after a full disk)."""
        store = self._tiers[0].store
        keys = [shard_key(step, self.rank)]
        if self._leases.run is not None:
            keys.append(fragment_key(step, self.rank, Lineage(self._leases.run).token))
        for key in keys:
            try:
                if not store.exists(manifest_key(step)):
                    store.delete(key)
            except Exception:  # noqa: BLE001 - best effort
                pass

    # -- background: promotion -------------------------------------------------------------------
    def _promote_steps(self, extra: list[int], handle: SaveHandle | None, strict: bool) -> None:
        """Runs on the promotion thread: promote every pending step and ``extra`` to every slower tier."""
        last_exc: BaseException | None = None
        done: list[int] = []
        with self._lock:
            steps = sorted(self._pending | set(extra))
            # A rollback is carried out by the saves after the restore, not by a promote() before them.
            rollback = self._rollback if self._rollback is not None and self._rollback.first is not None else None
        for step in steps:
            if self._abandoned(step):  # a restore to an earlier step came in meanwhile
                if handle is not None and step == handle.step:
                    handle.promoted.set_exception(ConfigError(f"step {step} was abandoned by a restore to an earlier step"))
                continue
            try:
                self._promote_one(step, rollback)
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
                    handle.promoted.set_exception(exc)
        if handle is not None:
            with self._lock:
                self._inflight.discard(handle.step)
        self._maybe_gc()
        if handle is not None and handle.step in done:
            handle.promoted.set_result(handle.step)
        if strict and last_exc is not None:
            raise last_exc

    def _promote_one(self, step: int, rollback: Rollback | None) -> None:
        src = None
        for ts in self._tiers:
            if ts.store.exists(manifest_key(step)):
                src = ts
                break
        if src is None:
            raise NotFoundError(f"step {step} has no committed copy on any tier; nothing to promote")
        raw, man = read_manifest_raw(src.store, step)
        if man.world_size != self.world_size:
            raise ConfigError(f"step {step} on {src.url} was saved by {man.world_size} ranks; this job has {self.world_size}")
        for dst in self._tiers[self._tiers.index(src) + 1 :]:
            there = manifest_on(dst.store, step)
            if there == raw:
                continue  # already there: the same checkpoint, byte for byte
            self._leases.ensure(dst.store)
            if self.rank == 0:
                self._clear_destination(dst.store, step, rollback, there is not None)
            stats: CopyStats = copy_shard(src.store, dst.store, step, man.ranks[self.rank], self._promo_pool, self.limiter)
            self._account(dst, stats.bytes, stats.seconds)
            self._commit_copy(dst.store, step, raw, man.ranks)

    def _clear_destination(self, dst: Store, step: int, rollback: Rollback | None, other: bool) -> None:
        """Rank 0, before promoting ``step`` to ``dst``: retire an abandoned branch there, and the
        manifest of ``other`` checkpoint of this step there (it must not pass for this one)."""
        if rollback is not None:
            rollback.retire_dirs(dst)
        if other:
            log.warning("%s holds another checkpoint of step %d (an abandoned run's); replacing it", dst.url, step)
            dst.delete(manifest_key(step))

    def _commit_copy(self, dst: Store, step: int, raw: bytes, ranks: list[RankEntry]) -> None:
        """Commit a promoted step on ``dst`` once every rank's shard is there (the manifest's bytes
        name the copy: markers carry a digest of them, so a stale shard never completes it)."""
        if self.world_size == 1:
            commit_copy(dst, step, raw)
            return
        token = xxh3(raw)[:8]
        mine = fragment_key(step, self.rank, token)
        dst.put_buffers(mine, [b"{}"])
        if self.rank != 0:
            self._await_commit(dst, step, mine)
            return
        keys = [fragment_key(step, r, token) for r in range(self.world_size)]
        self._await(lambda: all(dst.exists(k) for k in keys) and shards_present(dst, step, ranks),
                    f"every rank's shard of step {step} on {dst.url}")
        commit_copy(dst, step, raw)
        self._drop_fragments(dst, step, token)

    def _find_unpromoted(self) -> None:
        """Steps committed on a faster tier that a slower tier still wants (a promotion was cut short
        by a crash or an outage) join the retry list; the next save's promotion picks them up.
        Runs on the promotion thread, so a stalled tier delays only promotion."""
        if len(self._tiers) < 2:
            return
        try:
            held = [set(committed_steps(ts.store)) for ts in self._tiers]
        except TierioError as exc:
            log.warning("cannot look for unpromoted checkpoints: %s", exc)
            return
        for i, ts in enumerate(self._tiers[:-1]):
            for step in held[i]:
                for j in range(i + 1, len(self._tiers)):
                    if step in held[j]:
                        continue
                    policy = self._tiers[j].tier.retention
                    if wanted({s: 0.0 for s in held[j]}, policy, step, time.time()):
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
        if self.rank != 0:
            return
        if all(t.tier.retention is None for t in self._tiers) and all(t.url in self._swept for t in self._tiers):
            return
        try:
            self._gc()
        except Exception as exc:  # noqa: BLE001 - retention must never fail a save
            log.warning("garbage collection failed: %s", exc)

    def _gc(self, sweep_all: bool = False) -> list[tuple[str, int]]:
        self._scan.result()  # its pending steps must be protected
        with self._gc_lock:
            tiers = []
            for ts in self._tiers:
                try:
                    self._leases.ensure(ts.store)
                    writable = True
                except (LeaseError, StorageError, FormatError) as exc:
                    log.warning("not cleaning %s: %s", ts.url, exc)
                    writable = False
                tiers.append(GcTier(ts.store, ts.tier.retention, writable, sweep_all or ts.url not in self._swept))
            with self._lock:
                protected = frozenset(self._inflight | self._pending)
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
    def _account(self, ts: _TierState, nbytes: int, seconds: float) -> None:
        with self._lock:
            ts.bytes += nbytes
            ts.seconds += seconds
            ts.files += 1
        events.emit(events.TierWritten(ts.url, nbytes, seconds))

    def _saves_update(self, step: int, **kw: Any) -> None:
        for s in reversed(self._saves):
            if s["step"] == step:
                s.update(kw)
                return

    def _pop_error(self) -> BaseException:
        err, self._error = self._error, None
        assert err is not None
        return err

    def _raise_background_error(self) -> None:
        with self._lock:
            err = self._pop_error() if self._error is not None else None
        if err is not None:
            raise err

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")

