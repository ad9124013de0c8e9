"""Promotion: copy a committed step between stores, same bytes, verified, manifest last."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tierio.errors import IntegrityError, NotFoundError
from tierio.format.manifest import RankEntry
from tierio.format.shard import manifest_key, step_dir
from tierio.io.buffers import HostBuffer
from tierio.io.checksum import xxh3
from tierio.io.limiter import TokenBucket
from tierio.storage.base import Store

from tierio.ckpt.reader import read_manifest_raw, where


@dataclass
class CopyStats:
    bytes: int = 0
    seconds: float = 0.0
    files: int = 0

    def add(self, other: CopyStats) -> None:
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.files += other.files


class BufferSlot:
    """One reused promotion buffer, grown when a larger shard comes along."""

    def __init__(self) -> None:
        self.buf: HostBuffer | None = None

    def get(self, nbytes: int) -> HostBuffer:
        if self.buf is None or self.buf.capacity < nbytes:
            self.buf = None
            self.buf = HostBuffer(nbytes)
        return self.buf


def copy_shard(src: Store, dst: Store, step: int, entry: RankEntry, slot: BufferSlot,
               limiter: TokenBucket | None = None) -> CopyStats:
    """Read one shard from ``src``, verify every chunk, write it to ``dst`` atomically."""
    key = f"{step_dir(step)}/{entry.file}"
    t0 = time.perf_counter()
    size = src.stat(key).size
    if size != entry.bytes:
        raise IntegrityError(f"{where(src, key)} is {size} bytes but the manifest records {entry.bytes}; not promoting a bad copy")
    buf = slot.get(entry.bytes)
    view = buf.view[: entry.bytes]
    if entry.bytes:
        src.read_into(key, 0, view)
    for t in entry.tensors.values():
        for i, c in enumerate(t.chunks):
            got = xxh3(view[c.begin : c.end])
            if got != c.xxh3:
                raise IntegrityError(
                    f"checksum mismatch in {where(src, key)}, tensor {t.name!r} chunk {i}: expected {c.xxh3}, got {got}; "
                    "not promoting a corrupt copy"
                )
    if limiter is not None and getattr(dst, "limiter", None) is None:
        limiter.consume(entry.bytes)
    dst.put_buffers(key, [view])
    return CopyStats(entry.bytes, time.perf_counter() - t0, 1)


def shards_present(dst: Store, step: int, entries: list[RankEntry]) -> bool:
    for e in entries:
        try:
            if dst.stat(f"{step_dir(step)}/{e.file}").size != e.bytes:
                return False
        except NotFoundError:
            return False
    return True


def commit_copy(dst: Store, step: int, manifest: bytes) -> None:
    """Put the manifest (the same bytes as on the source) on ``dst``: the copy becomes a checkpoint."""
    dst.put_buffers(manifest_key(step), [manifest])


def copy_step(src: Store, dst: Store, step: int, *, limiter: TokenBucket | None = None,
              slot: BufferSlot | None = None, progress: Callable[[str], None] | None = None) -> CopyStats:
    """Promote every rank's shard of ``step`` from ``src`` to ``dst``, then the manifest."""
    raw, man = read_manifest_raw(src, step)
    slot = slot or BufferSlot()
    stats = CopyStats()
    for entry in man.ranks:
        stats.add(copy_shard(src, dst, step, entry, slot, limiter))
        if progress:
            progress(entry.file)
    if not shards_present(dst, step, man.ranks):
        raise IntegrityError(f"after copying step {step} to {dst.url}, some shards are missing there; not committing")
    commit_copy(dst, step, raw)
    stats.files += 1
    return stats
