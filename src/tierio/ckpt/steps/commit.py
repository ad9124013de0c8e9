"""The commit protocol of one step on one store: shard -> record -> manifest.

1. **Shard.** Each rank writes its shard (temp name, fsync, rename): durable or absent.
2. **Record.** Then it writes its record ``rank_<r>.<token>.<xxh3>.json``: its manifest entry (state
   tree, tensors, chunks with their xxh3). ``token`` names the run, so a committer never takes a
   record another run left in the directory; the record's own xxh3 is in its name, so a committer
   knows it from a listing, without reading it.
3. **Manifest.** The committer (rank 0; DCP's coordinator) polls with one listing of the step
   directory (one request per 1,000 files on S3) until every rank's record is there, then writes
   ``manifest.json``, last. While the records are small (``INLINE_RECORD_BYTES`` together) it reads
   them and inlines them, and removes them once the manifest is durable: one file holds the whole
   checkpoint. Beyond that the manifest names each record with its size and xxh3 and the records
   stay: the commit then reads nothing and writes one line per rank, so its cost grows with the
   listing, not with the number of tensors.
4. **The other ranks** poll for the manifest (one metadata request per poll, backing off to two a
   second) and are done when it describes their shard as they wrote it (an older manifest of the
   same step, being retired by a rollback, does not count).

Nothing here runs a collective: ranks coordinate through the store only. The CheckpointManager
and the DCP storage writer (``ckpt.dcp``) both commit through this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tierio.errors import FormatError, IntegrityError, LeaseError, NotFoundError, StorageError, TierioError
from tierio.format.manifest import (
    INCREMENTAL_FIELD, MAX_MANIFEST_BYTES, Manifest, RankEntry, RecordRef, encode_record, parse_manifest, parse_record, utc_now,
)
from tierio.format.shard import manifest_key, parse_record_name, record_name, shard_name, step_dir, step_key
from tierio.io.checksum import xxh3
from tierio.io.engine import run_windows
from tierio.storage.base import Store, list_sizes, read_bytes, where

from tierio.ckpt.steps.lease import GENERATION_FIELD

log = logging.getLogger("tierio.ckpt")

INLINE_RECORD_BYTES = 256 << 10  # records up to this size together are merged into the manifest
READ_DEPTH = 16  # records read at once


@dataclass(frozen=True)
class Waiting:
    """How long a wait may take and how often it looks (seconds; the delay grows by half each time)."""

    timeout: float
    first: float = 0.005
    most: float = 0.25


def read_manifest_bytes(store: Store, step: int) -> bytes:
    """A step's manifest bytes, refused above MAX_MANIFEST_BYTES from the stat, before any read."""
    key = manifest_key(step)
    size = store.stat(key).size
    if size > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where(store, key)} is {size} bytes, above the {MAX_MANIFEST_BYTES}-byte limit; it is corrupt or hostile")
    return read_bytes(store, key, 0, size)


def poll_until(ready: Callable[[], bool], what: Callable[[], str], wait: Waiting) -> None:
    """Call ``ready`` until it is true; StorageError naming ``what()`` after ``wait.timeout``."""
    deadline = time.monotonic() + wait.timeout
    delay = wait.first
    while not ready():
        if time.monotonic() > deadline:
            raise StorageError(f"timed out after {wait.timeout:.0f} s waiting for {what()}")
        time.sleep(delay)
        delay = min(delay * 1.5, wait.most)


# -- ranks -----------------------------------------------------------------------------------------
def write_record(store: Store, step: int, world_size: int, entry: RankEntry, token: str,
                 extra: dict | None = None) -> RecordRef:
    """Step 2: the rank's record, after its shard is durable (``extra``: ``encode_record``'s)."""
    raw = encode_record(step, world_size, entry, extra)
    ref = RecordRef(record_name(entry.rank, token, xxh3(raw)), len(raw), xxh3(raw))
    store.put_buffers(step_key(step, ref.name), [raw])
    return ref


def same_entry(committed: RankEntry, mine: RankEntry, ref: RecordRef | None) -> bool:
    """Does a committed rank entry describe the shard this rank wrote?"""
    if committed.record is not None:
        return ref is not None and committed.record == ref
    return committed == mine


def await_commit(store: Store, step: int, mine: RankEntry, ref: RecordRef | None, wait: Waiting) -> Manifest:
    """Step 4 (ranks other than the committer): wait until the manifest describes ``mine``."""

    key = manifest_key(step)
    seen: list[str] = []

    def ready() -> bool:
        if not store.exists(key):
            return False
        try:
            raw = read_manifest_bytes(store, step)  # its size limit applies from the stat, before any read
            man = parse_manifest(raw, where(store, key), expect_step=step)
        except (FormatError, NotFoundError) as exc:  # being replaced right now, or not ours
            seen[:] = [str(exc)]
            return False
        if man.world_size > mine.rank and same_entry(man.ranks[mine.rank], mine, ref):
            seen[:] = [man]  # type: ignore[list-item]
            return True
        seen[:] = ["a manifest of this step is there, but it does not describe this rank's new shard"]
        return False

    # The other ranks look less often than the committer: they are many, it is one.
    poll_until(ready, lambda: f"rank 0 to commit step {step} on {store.url}"
               + (f" ({seen[0]})" if seen and isinstance(seen[0], str) else "") + "; did rank 0 die?",
               Waiting(wait.timeout, wait.first, 2 * wait.most))
    return seen[0]  # type: ignore[return-value]


# -- the committer ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Listing:
    """One listing of a step directory: each rank's record (of one token) and every file's size."""

    records: dict[int, RecordRef]
    sizes: dict[str, int]
    duplicates: list[int]  # ranks with more than one record of the token (a re-save in progress)

    def missing(self, world_size: int) -> list[int]:
        return [r for r in range(world_size) if r not in self.records or r in self.duplicates]


def list_step(store: Store, step: int, world_size: int, token: str) -> Listing:
    sizes = {k.rsplit("/", 1)[1]: v for k, v in list_sizes(store, step_dir(step) + "/").items()}
    records: dict[int, RecordRef] = {}
    duplicates: list[int] = []
    for name, size in sizes.items():
        rn = parse_record_name(name)
        if rn is None or rn.token != token or rn.rank >= world_size:
            continue
        if rn.rank in records:
            duplicates.append(rn.rank)
        records[rn.rank] = RecordRef(name, size, rn.digest)
    return Listing(records, sizes, duplicates)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:20])) + (f" and {len(ranks) - 20} more" if len(ranks) > 20 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def await_records(store: Store, step: int, world_size: int, token: str, wait: Waiting) -> Listing:
    """Step 3a: poll one listing until every rank's record (and shard) is there."""
    last: list[Listing] = []

    def ready() -> bool:
        listing = list_step(store, step, world_size, token)
        last[:] = [listing]
        return not listing.missing(world_size) and all(shard_name(r) in listing.sizes for r in range(world_size))

    def what() -> str:
        missing = last[0].missing(world_size) if last else list(range(world_size))
        return (f"{_ranks(missing)} of {world_size} to write their shard of step {step} on {store.url}; did they "
                f"die, or not call save({step})? Step {step} is not committed; earlier checkpoints are intact")

    poll_until(ready, what, wait)
    return last[0]


def read_record(store: Store, step: int, world_size: int, ref: RecordRef) -> RankEntry:
    """A record, checked against its size and xxh3, strictly parsed."""
    key = step_key(step, ref.name)
    raw = read_bytes(store, key, 0, ref.bytes)  # exactly the bytes the xxh3 covers (a short file raises)
    return check_record(raw, ref.xxh3, "manifest", where(store, key), step, world_size, "this copy is corrupt")


def check_record(raw: bytes, digest: str, named_by: str, label: str, step: int, world_size: int, then: str,
                 rank: int | None = None) -> RankEntry:
    """A record's bytes checked against the xxh3 that names it (in its ``named_by``: the manifest's
    reference, or its own file name), strictly parsed, and describing its rank's shard (of ``rank``
    when given); IntegrityError / FormatError naming ``label``, followed by ``then``, otherwise."""
    got = xxh3(raw)
    if got != digest:
        raise IntegrityError(f"{label}: the record does not match its {named_by} (xxh3 {got}, expected {digest}); {then}")
    entry = parse_record(raw, label, step, world_size)
    want = shard_name(entry.rank if rank is None else rank)
    if entry.file != want or (rank is not None and entry.rank != rank):
        raise FormatError(f"{label}: the record describes shard {entry.file!r} of rank {entry.rank}, expected {want!r}")
    return entry


def read_records(store: Store, step: int, world_size: int, refs: dict[int, RecordRef]) -> dict[int, RankEntry]:
    ranks = sorted(refs)
    got = run_windows(ranks, lambda r: read_record(store, step, world_size, refs[r]), READ_DEPTH)
    return dict(zip(ranks, got))


@dataclass(frozen=True)
class CommitPlan:
    """What the committer knows: every rank's record and shard size, the entries it holds in
    memory (its own; every rank's under DCP), and what else the manifest says."""

    step: int
    world_size: int
    records: dict[int, RecordRef]
    shard_bytes: dict[int, int]
    extra: dict[str, Any]
    known: dict[int, RankEntry]
    tree: Any = None  # one job-wide tree (DCP)
    inline_limit: int = INLINE_RECORD_BYTES

    @staticmethod
    def from_listing(listing: Listing, step: int, world_size: int, extra: dict[str, Any],
                     known: dict[int, RankEntry], inline_limit: int = INLINE_RECORD_BYTES) -> CommitPlan:
        shards = {r: listing.sizes[shard_name(r)] for r in range(world_size) if shard_name(r) in listing.sizes}
        return CommitPlan(step, world_size, dict(listing.records), shards, extra, known, inline_limit=inline_limit)


def build_manifest(store: Store, plan: CommitPlan) -> Manifest:
    """Step 3b: the manifest: records inlined while small, else referenced."""
    stamp, ts = utc_now()
    if len(plan.known) == plan.world_size and not plan.records or \
            sum(ref.bytes for ref in plan.records.values()) <= plan.inline_limit:
        todo = {r: plan.records[r] for r in range(plan.world_size) if r not in plan.known}
        entries = {**plan.known, **read_records(store, plan.step, plan.world_size, todo)}
        ranks = [entries[r] for r in range(plan.world_size)]
    else:
        ranks = [RankEntry(r, shard_name(r), plan.shard_bytes[r], None, {}, plan.records[r])
                 for r in range(plan.world_size)]
    extra = plan.extra
    if any(e.refs for e in plan.known.values()):  # readers of the manifest alone see it (records by reference)
        extra = {**extra, INCREMENTAL_FIELD: True}
    return Manifest(plan.step, plan.world_size, ranks, stamp, ts, extra, plan.tree)


Fence = Callable[[], int]  # the leader's lease check: its generation, or LeaseError (ckpt.steps.lease)


def put_manifest(store: Store, step: int, raw: bytes, fence: Fence | None) -> None:
    """The commit point. With ``fence``, the lease is checked right before the write and right
    after it: a writer deposed while it wrote (paused, cut off) retracts its manifest, so the step
    it committed under a superseded generation does not stay listed."""
    if fence is not None:
        fence()
    key = manifest_key(step)
    store.put_buffers(key, [raw])
    if fence is None:
        return
    try:
        fence()
    except LeaseError:
        try:
            if read_bytes(store, key) == raw:
                store.delete(key)
        except TierioError as exc:
            log.error("could not retract the manifest of step %d on %s, committed under a lost lease: %s",
                      step, store.url, exc)
        raise


def commit(store: Store, manifest: Manifest, merged: list[str], fence: Fence | None = None) -> bytes:
    """Step 3c: write the manifest (the commit), then remove the records it merged. With ``fence``
    the manifest records the lease generation it is committed under (``lease.GENERATION_FIELD``)."""
    if fence is not None:
        manifest = replace(manifest, extra={**manifest.extra, GENERATION_FIELD: fence()})
    raw = manifest.encode()
    put_manifest(store, manifest.step, raw, fence)
    if all(r.loaded for r in manifest.ranks):  # after the commit point: the manifest holds them now

        def drop(name: str) -> None:
            try:
                store.delete(step_key(manifest.step, name))
            except StorageError as exc:
                log.warning("could not remove the merged record %s of step %d on %s: %s", name, manifest.step,
                            store.url, exc)
        run_windows(merged, drop, READ_DEPTH)
    return raw


def commit_step(store: Store, plan_for: Callable[[Listing], CommitPlan], world_size: int, step: int, token: str,
                wait: Waiting, fence: Fence | None = None) -> bytes:
    """The committer's whole part: await every record (one listing per look), build the manifest,
    commit it."""
    listing = await_records(store, step, world_size, token, wait)
    man = build_manifest(store, plan_for(listing))
    return commit(store, man, [ref.name for ref in listing.records.values()], fence)


def drop_record(store: Store, step: int, ref: RecordRef | None) -> None:
    """After a failed save: this rank's record goes (a committer must not take it)."""
    if ref is None:
        return
    try:
        if not store.exists(manifest_key(step)):
            store.delete(step_key(step, ref.name))
    except TierioError:
        pass


__all__ = [
    "INLINE_RECORD_BYTES", "CommitPlan", "Listing", "Waiting", "await_commit", "await_records", "build_manifest",
    "Fence", "commit", "commit_step", "drop_record", "list_step", "poll_until", "put_manifest", "read_record", "read_records", "same_entry", "write_record",
]
