"""Promotion: copy a committed step between stores, same bytes, verified, manifest last."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tierio.errors import ConfigError, DanglingReferenceError, IntegrityError, NotFoundError
from tierio.format.manifest import ChunkInfo, Manifest, RankEntry, RecordRef
from tierio.format.shard import step_dir, step_key
from tierio.io.buffers import BufferPool
from tierio.io.checksum import xxh3, xxh3_ranges
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store, list_sizes, read_bytes, where
from tierio.stats import Stats

from tierio.ckpt.steps.commit import Fence, put_manifest, read_record
from tierio.ckpt.steps.lineage import manifest_on
from tierio.ckpt.steps.reader import read_manifest_raw


@dataclass
class CopyStats(Stats):
    bytes: int = 0
    seconds: float = 0.0
    files: int = 0

    def add(self, other: CopyStats) -> None:
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.files += other.files


def copy_pool(offload: bool = False) -> BufferPool:
    """A promotion buffer pool: one buffer, reused, replaced by a larger one when a larger shard comes
    (``offload``: memory the persist process maps, ``io.offload``)."""
    return BufferPool(budget_bytes=None, max_buffers=1, offload=offload)


def copy_shard(src: Store, dst: Store, step: int, entry: RankEntry, pool: BufferPool,
               limiter: TokenBucket | None = None) -> CopyStats:
    """Read one shard from ``src``, verify every chunk, write it to ``dst`` atomically."""
    key = f"{step_dir(step)}/{entry.file}"
    size = src.stat(key).size
    if size != entry.bytes:
        raise IntegrityError(f"{where(src, key)} is {size} bytes but the manifest records {entry.bytes}; not promoting a bad copy")
    return _copy_verified(src, dst, key, size, pool, limiter,
                          lambda view: verify_chunks(view, entry, where(src, key), "not promoting a corrupt copy"))


def verify_chunks(view: memoryview, entry: RankEntry, label: str, then: str) -> None:
    """Every chunk of ``entry`` in ``view`` (its shard's bytes) against its xxh3; IntegrityError
    naming ``label``, the tensor and the chunk, followed by ``then`` (what is not done), otherwise.
    Chunks in an earlier step's shard are verified where that shard is copied (``copy_refs``)."""
    check_chunks(view, [(t.name, i, c) for t in entry.tensors.values() for i, c in enumerate(t.chunks) if not c.is_ref],
                 label, then)


def check_chunks(view: memoryview, chunks: list[tuple[str, int, ChunkInfo]], label: str, then: str) -> None:
    """Each (tensor name, chunk index, chunk) of ``chunks`` in ``view`` (one file's bytes) against its xxh3."""
    for name, i, c in chunks:
        if c.end > len(view):
            raise IntegrityError(f"{label} is {len(view)} bytes, too short for tensor {name!r} chunk {i}; {then}")
    sums = xxh3_ranges(view, [(c.begin, c.end) for _, _, c in chunks])
    for (name, i, c), got in zip(chunks, sums):
        if got != c.xxh3:
            raise IntegrityError(f"checksum mismatch in {label}, tensor {name!r} chunk {i}: expected {c.xxh3}, got {got}; {then}")


def _copy_verified(src: Store, dst: Store, key: str, size: int, pool: BufferPool, limiter: TokenBucket | None,
                   check: Callable[[memoryview], None]) -> CopyStats:
    """Read ``key`` (``size`` bytes) from ``src`` into a pool buffer, ``check`` it, write it to ``dst``."""
    t0 = time.perf_counter()
    buf = pool.acquire(size)
    try:
        view = buf.view[:size]
        if size:
            src.read_into(key, 0, view)
        check(view)
        if limiter is not None and getattr(dst, "limiter", None) is None:
            limiter.consume(size)
        dst.put_buffers(key, [view])
    finally:
        pool.release(buf)
    return CopyStats(size, time.perf_counter() - t0, 1)


def copy_record(src: Store, dst: Store, step: int, ref: RecordRef) -> CopyStats:
    """Copy a rank's record (a checkpoint referring to records holds them as files), verified."""
    t0 = time.perf_counter()
    raw = read_bytes(src, step_key(step, ref.name), 0, ref.bytes)
    if xxh3(raw) != ref.xxh3:
        raise IntegrityError(f"{where(src, step_key(step, ref.name))} does not match its manifest; not promoting a bad copy")
    dst.put_buffers(step_key(step, ref.name), [raw])
    return CopyStats(len(raw), time.perf_counter() - t0, 1)


def copy_refs(src: Store, dst: Store, step: int, entry: RankEntry, pool: BufferPool,
              limiter: TokenBucket | None = None) -> CopyStats:
    """The earlier steps' shards an incremental checkpoint's ``entry`` refers to and ``dst`` lacks,
    copied whole with every referenced chunk verified. A referenced file missing on ``src`` is a
    DanglingReferenceError naming the step, the tensor and the file."""
    chunks: dict[str, list[tuple[str, int, ChunkInfo]]] = {}
    for t in entry.tensors.values():
        for i, c in enumerate(t.chunks):
            if c.is_ref:
                chunks.setdefault(c.file, []).append((t.name, i, c))
    stats = CopyStats()
    for key, used in sorted(chunks.items()):
        try:
            size = src.stat(key).size
        except NotFoundError:
            raise DanglingReferenceError(
                f"dangling reference: step {step} rank {entry.rank} tensor {used[0][0]!r} refers to {where(src, key)}, "
                "which is missing; not promoting an incomplete checkpoint", step, used[0][0], key) from None
        if size in _sizes_on(dst, key):
            continue  # already there (promoted with the step that wrote it, or with another reference)
        then = f"referred to by step {step}; not promoting a corrupt copy"
        stats.add(_copy_verified(src, dst, key, size, pool, limiter,
                                 lambda view, used=used, key=key, then=then: check_chunks(view, used, where(src, key), then)))
    return stats


def _sizes_on(store: Store, key: str) -> list[int]:
    try:
        return [store.stat(key).size]
    except NotFoundError:
        return []


def copy_rank(src: Store, dst: Store, man: Manifest, rank: int, pool: BufferPool,
              limiter: TokenBucket | None = None) -> CopyStats:
    """Copy one rank's files of a committed step (its shard, its record when referenced, and the
    earlier shards an incremental checkpoint refers to that ``dst`` lacks)."""
    entry = man.ranks[rank]
    stats = CopyStats()
    if entry.record is not None:
        stats.add(copy_record(src, dst, man.step, entry.record))
        entry = read_record(src, man.step, man.world_size, entry.record)
    stats.add(copy_refs(src, dst, man.step, entry, pool, limiter))
    stats.add(copy_shard(src, dst, man.step, entry, pool, limiter))
    return stats


def files_present(dst: Store, man: Manifest, sizes: dict[str, int] | None = None) -> bool:
    """Every file of the checkpoint is on ``dst`` with its recorded size (one listing, or ``sizes``
    from one already made)."""
    sizes = list_sizes(dst, step_dir(man.step) + "/") if sizes is None else sizes
    for e in man.ranks:
        if sizes.get(step_key(man.step, e.file)) != e.bytes:
            return False
        if any(not dst.exists(key) for key in e.refs):  # copied by copy_refs before the shard
            return False
        if e.record is not None and sizes.get(step_key(man.step, e.record.name)) != e.record.bytes:
            return False
    return True


def commit_copy(dst: Store, step: int, manifest: bytes, fence: Fence | None = None) -> None:
    """Put the manifest (the same bytes as on the source) on ``dst``: the copy becomes a checkpoint
    (fenced by ``dst``'s lease when given; the bytes keep the generation of the tier that committed)."""
    put_manifest(dst, step, manifest, fence)


def copy_step(src: Store, dst: Store, step: int, *, limiter: TokenBucket | None = None,
              pool: BufferPool | None = None, progress: Callable[[str], None] | None = None) -> CopyStats:
    """Promote every rank's shard of ``step`` from ``src`` to ``dst``, then the manifest.

    A copy already on ``dst`` counts only when it is the same checkpoint (the same manifest bytes);
    another checkpoint of the same step there (an abandoned run's) is refused, not overwritten."""
    raw, man = read_manifest_raw(src, step)
    there = manifest_on(dst, step)
    if there == raw:
        return CopyStats()
    if there is not None:
        raise ConfigError(
            f"{dst.url} already holds another checkpoint of step {step} (its manifest differs from the one on "
            f"{src.url}); delete that step there first (tierio.ckpt.delete_step) if the copy on {src.url} is the one to keep"
        )
    pool = pool or copy_pool()
    stats = CopyStats()
    for entry in man.ranks:
        stats.add(copy_rank(src, dst, man, entry.rank, pool, limiter))
        if progress:
            progress(entry.file)
    if not files_present(dst, man):
        raise IntegrityError(f"after copying step {step} to {dst.url}, some shards are missing there; not committing")
    commit_copy(dst, step, raw)
    stats.files += 1
    return stats
