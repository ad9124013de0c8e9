"""Operations on one tier URL, for the command line and scripts (no manager needed).

    list_checkpoints(url)            -> [CheckpointInfo]   committed steps, newest last
    list_node_parts(url, shared)     -> [NodeParts]        a node-local tier's steps (committed on ``shared``?)
    inspect(url, step=None)          -> Manifest           (latest when step is None)
    verify(url, step=None)           -> VerifyReport       every chunk of every shard
    promote(src_url, dst_url, step)  -> CopyStats          same bytes, verified, manifest last
    gc(url, retention, min_keep=3)   -> [int]              steps deleted (dry_run=True: would delete)
    collect_garbage(url, retention)  -> GcReport           the same, with debris and leftovers removed
    unlock(url, force=False)         -> Holder | None      break a stale lease

Writers (promote, gc) hold the tier's lease while they run, so they never race a training job.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tierio.errors import NotFoundError, TierioError
from tierio.format.manifest import Manifest, check_globals, parse_record_head
from tierio.format.shard import RecordName, manifest_key, parse_record_name, shard_name, step_dir, step_key
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store, read_bytes, where
from tierio.storage.url import open_store
from tierio.units import parse_size
from tierio.stats import Stats

from tierio.ckpt.steps.commit import check_record, read_records
from tierio.ckpt.promotion.copy import CopyStats, copy_step
from tierio.ckpt.steps.gc import GcOptions, GcReport, GcTier, collect
from tierio.ckpt.steps.lease import NODE_LOCK, Holder, tool_lease
from tierio.ckpt.steps.lease import unlock as unlock_lease
from tierio.ckpt.steps.lineage import Lineage
from tierio.ckpt.steps.reader import VerifyReport, committed_in, committed_steps, read_manifest, step_dirs, verify_copy
from tierio.ckpt.steps.retention import Retention, parse_retention


@dataclass
class CheckpointInfo(Stats):
    step: int
    time: str
    world_size: int
    bytes: int
    tensors: int | None  # None: the manifest refers to rank records (inspect(..., records=True) counts them)
    files: list[str]
    error: str | None = None  # set when the manifest is unreadable
    run: str | None = None  # the run that saved it (None: saved before runs were recorded)
    resumed_from: int | None = None  # the step that run had restored (None: a fresh start)
    reason: str | None = None  # why it was saved off schedule ("emergency: SIGTERM"); None: an ordinary save

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class NodeParts(Stats):
    """A step on a node-local tier (which never holds manifests): the parts of it this node's ranks
    wrote. It restores from the node-local tiers when every rank's part is on its node's tier 0,
    and is committed once a shared tier holds its manifest (``tierio ckpt ls`` there)."""

    step: int
    ranks: list[int]  # the ranks whose part (record and shard) is here
    world_size: int
    bytes: int
    run: str | None = None
    reason: str | None = None  # why it was saved off schedule ("emergency: SIGTERM")
    committed: bool | None = None  # its manifest is on the shared tier given (None: none given)
    error: str | None = None  # set when a record here is unreadable

    def to_dict(self) -> dict:
        return asdict(self)


def list_node_parts(url: str | Path | Store, shared: str | Path | Store | None = None) -> list[NodeParts]:
    """The steps a node-local tier holds parts of (empty on a shared tier: one with a manifest, or
    without a node tier's lock file); each record is checked against its xxh3. With ``shared``
    (the tier the steps are committed on), each says whether its manifest is there."""
    store = _store(url)
    dirs = step_dirs(store)
    if not store.exists(NODE_LOCK) or committed_in(dirs):
        return []
    done = None if shared is None else set(committed_steps(_store(shared)))
    out = []
    for step, keys in sorted(dirs.items()):
        names = {k.rsplit("/", 1)[-1] for k in keys}
        part = NodeParts(step, [], 0, 0, committed=None if done is None else step in done)
        for name in sorted(names):
            rn = parse_record_name(name)
            if rn is None or shard_name(rn.rank) not in names:
                continue
            try:
                part = _add_part(store, part, name, rn)
            except TierioError as exc:
                part.error = str(exc)
        if part.ranks or part.error:
            out.append(part)
    return out


def _add_part(store: Store, part: NodeParts, name: str, rn: RecordName) -> NodeParts:
    """``part`` with the rank whose record is ``name`` (checked against its xxh3) added."""
    key = step_key(part.step, name)
    raw = read_bytes(store, key)
    head = parse_record_head(raw, where(store, key))
    entry = check_record(raw, rn.digest, "name", where(store, key), part.step, head.world_size, "it is corrupt", rn.rank)
    lineage = Lineage.parse(head.extra, where(store, key))
    part.ranks.append(rn.rank)
    part.world_size, part.bytes = head.world_size, part.bytes + entry.bytes
    if lineage is not None:
        part.run, part.reason = lineage.run, lineage.reason
    return part


def _store(url: str | Path | Store) -> Store:
    return url if isinstance(url, Store) else open_store(url)


def list_checkpoints(url: str | Path | Store) -> list[CheckpointInfo]:
    """Committed checkpoints on one tier (directories without a manifest are not checkpoints)."""
    store = _store(url)
    out = []
    for step in committed_steps(store):
        try:
            m = read_manifest(store, step)
            lineage = Lineage.of(m, f"{store.url}/{manifest_key(step)}")
            count = m.num_tensors if all(r.loaded for r in m.ranks) else None
            out.append(CheckpointInfo(step, m.time, m.world_size, m.total_bytes, count, m.files,
                                      run=lineage.run if lineage else None,
                                      resumed_from=lineage.resumed_from if lineage else None,
                                      reason=lineage.reason if lineage else None))
        except TierioError as exc:
            out.append(CheckpointInfo(step, "", 0, 0, 0, [], str(exc)))
    return out


def _latest(store: Store) -> int:
    steps = committed_steps(store)
    if not steps:
        raise NotFoundError(f"no committed checkpoint in {store.url}")
    return steps[-1]


def inspect(url: str | Path | Store, step: int | None = None, *, records: bool = False) -> Manifest:
    """The parsed (strictly validated) manifest of ``step`` (default: latest). With ``records``,
    rank entries the manifest refers to are read from their records (each checked against its xxh3)."""
    store = _store(url)
    step = _latest(store) if step is None else step
    if not store.exists(manifest_key(step)):
        raise NotFoundError(f"no committed checkpoint of step {step} in {store.url}; `tierio ckpt ls` lists them")
    man = read_manifest(store, step)
    if records and not all(r.loaded for r in man.ranks):
        loaded = read_records(store, step, man.world_size, {r.rank: r.record for r in man.ranks if r.record is not None})
        man.ranks = [loaded.get(r.rank, r) for r in man.ranks]
        check_globals(man, f"{store.url}/{manifest_key(step)}")
    return man


def verify(url: str | Path | Store, step: int | None = None) -> VerifyReport:
    """Read every chunk of ``step`` (default: latest) and compare checksums; problems name file and chunk."""
    store = _store(url)
    if step is None:
        steps = committed_steps(store)
        step = steps[-1] if steps else max(step_dirs(store), default=None)
        if step is None:
            raise NotFoundError(f"no checkpoint in {store.url}")
    report = VerifyReport(step)
    verify_copy(store, step, report)
    return report


def promote(src_url: str | Path | Store, dst_url: str | Path | Store, step: int | None = None, *,
            bandwidth: float | str | None = None) -> CopyStats:
    """Copy ``step`` (default: latest) from one tier to another: verified, manifest last."""
    src, dst = _store(src_url), _store(dst_url)
    step = _latest(src) if step is None else step
    if not src.exists(manifest_key(step)):
        raise NotFoundError(f"no committed checkpoint of step {step} in {src.url}")
    rate = parse_size(bandwidth) if isinstance(bandwidth, str) else bandwidth
    limiter = TokenBucket(rate, burst=max(1 << 20, rate / 4)) if rate else None
    t0 = time.perf_counter()
    with tool_lease(dst):
        stats = copy_step(src, dst, step, limiter=limiter)
    stats.seconds = time.perf_counter() - t0
    return stats


def collect_garbage(url: str | Path | Store, retention: Retention | str, *, min_keep: int = 3, dry_run: bool = False,
                    temp_grace: float = 0.0) -> GcReport:
    """Apply ``retention`` to one tier and remove manifest-less directories older than its newest
    checkpoint and leftovers of interrupted writes no live writer owns (older than ``temp_grace``
    outside finished steps). Holds the tier's lease, so a live training run on the tier is not raced."""
    store = _store(url)
    policy = parse_retention(retention) if isinstance(retention, str) else retention
    tier = GcTier(store, policy)
    options = GcOptions(min_keep, dry_run=dry_run, temp_grace=temp_grace)
    if dry_run:
        return collect([tier], options)
    with tool_lease(store):
        return collect([tier], options)


def gc(url: str | Path | Store, retention: Retention | str, *, min_keep: int = 3, dry_run: bool = False) -> list[int]:
    """Apply ``retention`` to one tier; keeps at least ``min_keep`` checkpoints there. Returns the
    steps deleted (see ``collect_garbage`` for everything else it cleans)."""
    return [r.step for r in collect_garbage(url, retention, min_keep=min_keep, dry_run=dry_run).deleted]


def unlock(url: str | Path | Store, *, force: bool = False) -> Holder | None:
    """Break the tier's lease when its holder is gone: a dead process on this node, or a lease that
    stays unchanged while this call watches it for the lease expiry (``TIERIO_LEASE_EXPIRES``,
    default 120 s); ``force`` breaks any lease at once. Returns the holder removed, if any."""
    return unlock_lease(_store(url), force=force)


__all__ = ["CheckpointInfo", "NodeParts", "list_checkpoints", "list_node_parts", "inspect", "verify", "promote", "gc", "collect_garbage", "unlock", "step_dir"]
