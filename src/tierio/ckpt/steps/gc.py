"""The one garbage collector of checkpoint tiers: CheckpointManager, ``ckpt.steps.gc`` and ``tierio ckpt gc``.

From one listing per tier it removes, in this order:

1. **checkpoints retention does not keep**, decided across all tiers by ``retention.gc_plan``: the
   newest committed step is never deleted, the only copy of a step another tier still wants stays
   (its promotion is pending), at least ``min_keep`` checkpoints survive, and protected steps (in
   flight or awaiting promotion in the calling manager) are never touched;
2. **uncommitted directories** (no manifest) older than the tier's newest commit: debris of a save
   that died. A newer one may be a save in flight and stays;
3. **leftovers of interrupted writes** (temp files, S3 multipart uploads) that no live writer owns
   (a writer holds a lock on its temp file): at any age inside step directories that are committed
   or were just found abandoned, since nothing writes there any more; elsewhere only once older
   than ``temp_grace``, because another node's lock is invisible on a shared filesystem and an
   upload in progress carries no lock at all.

Deleting a step removes its manifest first, so an interrupted deletion never leaves something that
looks like a checkpoint, and keeps the files another committed step on the same tier still refers to
(incremental checkpoints, ``ckpt.steps.refs``): its directory then holds only those, and goes as debris
once nothing refers to them. A tier that cannot be read to count references loses nothing. Stores never follow a link below their root, so nothing is deleted
through one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierio.errors import StorageError, TierioError
from tierio.format.shard import manifest_key, step_dir
from tierio.storage.base import Store
from tierio.stats import Stats

from tierio.ckpt.steps.reader import commit_times, committed_in, committed_steps, step_dirs
from tierio.ckpt.steps.refs import referenced
from tierio.ckpt.steps.retention import Retention, gc_plan

log = logging.getLogger("tierio.ckpt")

TEMP_GRACE = 3600.0  # seconds: leftovers outside finished step directories are removed after this


@dataclass(frozen=True)
class GcTier:
    """One tier as the collector sees it."""

    store: Store
    retention: Retention | None = None  # None keeps every checkpoint
    writable: bool = True  # False: only listed (cross-tier rules), nothing deleted there
    sweep: bool = True  # also remove leftovers of interrupted writes (one walk per step directory)
    commits_on: Store | None = None  # a node-local tier: its steps are committed on this (shared) store

    @property
    def url(self) -> str:
        return self.store.url


@dataclass(frozen=True)
class GcOptions:
    min_keep: int = 3
    protected: frozenset[int] = frozenset()
    dry_run: bool = False
    temp_grace: float = TEMP_GRACE


@dataclass(frozen=True)
class Removed:
    tier: str
    step: int


@dataclass(frozen=True)
class Skipped:
    tier: str
    reason: str


@dataclass
class GcReport(Stats):
    deleted: list[Removed] = field(default_factory=list)  # committed checkpoints retention dropped
    uncommitted: list[Removed] = field(default_factory=list)  # manifest-less directories removed
    leftovers: int = 0  # temp files / multipart uploads removed (not counted in a dry run)
    kept: dict[str, list[int]] = field(default_factory=dict)  # tier url -> committed steps left
    warnings: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)  # tiers that could not be listed or cleaned


@dataclass
class _Listing:
    dirs: dict[int, list[str]]
    held: dict[int, float]  # committed step -> commit time


def delete_step(store: Store, step: int, keep: set[str] | None = None) -> None:
    """Delete one step's copy: the manifest first (it stops being a checkpoint), then the rest but
    the files in ``keep`` (default: those a later committed step on ``store`` refers to)."""
    if keep is None:
        keep = referenced(store, [s for s in committed_steps(store) if s > step])
    store.delete(manifest_key(step))
    prefix = step_dir(step) + "/"
    kept = {k for k in keep if k.startswith(prefix)}
    if not kept:
        store.delete_prefix(prefix)
        return
    for key in store.list(prefix):
        if key not in kept:
            store.delete(key)


def _still_referenced(tier: GcTier, steps: list[int], report: GcReport) -> set[str] | None:
    """The files the surviving committed ``steps`` of ``tier`` refer to; None (and the tier is
    skipped) when the tier cannot be read: nothing is deleted on a guess."""
    try:
        return referenced(tier.store, steps, tier.commits_on)
    except TierioError as exc:
        report.skipped.append(Skipped(tier.url, f"cannot count the references between its checkpoints: {exc}"))
        log.warning("garbage collection skipped %s: cannot count references: %s", tier.url, exc)
        return None


def _list(tier: GcTier, report: GcReport) -> _Listing:
    try:
        dirs = step_dirs(tier.store)
        if tier.commits_on is not None:  # a node's copies: committed when the shared manifest is there
            shared = set(committed_steps(tier.commits_on))
            return _Listing(dirs, commit_times(tier.commits_on, sorted(s for s in dirs if s in shared)))
        return _Listing(dirs, commit_times(tier.store, committed_in(dirs)))
    except StorageError as exc:
        report.skipped.append(Skipped(tier.url, str(exc)))
        log.warning("garbage collection skipped %s: %s", tier.url, exc)
        return _Listing({}, {})


def collect(tiers: Sequence[GcTier], options: GcOptions = GcOptions()) -> GcReport:
    """Apply retention, remove debris and leftovers on ``tiers`` (fastest first)."""
    report = GcReport()
    listed = [_list(t, report) for t in tiers]
    plan = gc_plan([x.held for x in listed], [t.retention for t in tiers], min_keep=options.min_keep,
                   protected=set(options.protected), names=[t.url for t in tiers])
    report.warnings += plan.warnings
    doomed = [(i, s) for i, s in plan.delete if tiers[i].writable]
    gone = {(i, s) for i, s in doomed}
    keeps: dict[int, set[str] | None] = {}
    for i, (tier, listing) in enumerate(zip(tiers, listed)):
        if tier.writable and (any(j == i for j, _ in doomed) or len(listing.dirs) > len(listing.held)):
            keeps[i] = _still_referenced(tier, sorted(s for s in listing.held if (i, s) not in gone), report)
    doomed = [(i, s) for i, s in doomed if keeps.get(i) is not None]
    gone = {(i, s) for i, s in doomed}
    for i, step in doomed:
        if not options.dry_run:
            delete_step(tiers[i].store, step, keeps[i])
        report.deleted.append(Removed(tiers[i].url, step))
    for i, (tier, listing) in enumerate(zip(tiers, listed)):
        if not tier.writable or (i in keeps and keeps[i] is None):
            continue
        newest = max(listing.held, default=-1)
        abandoned = sorted(s for s in listing.dirs if s < newest and s not in listing.held and s not in options.protected)
        try:
            keep = keeps.get(i) or set()
            for s in abandoned:
                if not options.dry_run:
                    delete_step(tier.store, s, keep)
                if not any(k.startswith(step_dir(s) + "/") for k in keep):  # else: shards a checkpoint refers to
                    report.uncommitted.append(Removed(tier.url, s))
            if tier.sweep and not options.dry_run:
                finished = [s for s in listing.held if (i, s) not in gone and s not in options.protected]
                report.leftovers += _sweep(tier.store, finished, options.temp_grace)
        except StorageError as exc:
            report.skipped.append(Skipped(tier.url, str(exc)))
            log.warning("garbage collection on %s stopped: %s", tier.url, exc)
        report.kept[tier.url] = sorted(s for s in listing.held if (i, s) not in gone)
    return report


def _sweep(store: Store, finished: list[int], grace: float) -> int:
    """Leftovers no live writer owns: any age in finished step directories, else older than ``grace``."""
    removed = 0
    for s in sorted(finished):
        removed += store.cleanup(step_dir(s) + "/", older_than=0.0)
    return removed + store.cleanup("", older_than=grace)
