"""Restoring into new memory: tensors as copy-on-write maps of the shard files.

A restore without ``into=`` (what a recovering process does) needs new memory, and new anonymous
memory costs a page fault and a page of zeroing per 4 KiB on first touch: on virtual machines that
runs slower than the disk, so reading into ``torch.empty`` tensors is bound by page faults. A
tensor that lies whole and contiguous in one local shard file (every tensor of a whole restore,
and a global tensor whose chunks all sit in one file) is instead mapped privately from that file
and populated through the page cache in parallel windows (io.mapping, as weight loads do);
every chunk's xxh3 is checked as soon as its last window is in, while the next windows are read. The
tensors are writable: a page is copied the first time it is written (copy-on-write).

Tensors spread over several files (a resharding restore onto fewer ranks), and files on a store
that is not a local directory (S3), are read as before into fresh tensors (ckpt.restore.reshard).
A copy whose chunk fails its checksum while populating is dropped and the next source is mapped.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tierio import events
from tierio.errors import FormatError, IntegrityError, NotFoundError, StorageError
from tierio.format.manifest import ChunkInfo, RankEntry, file_key
from tierio.format.safetensors import torch_dtype
from tierio.io.buffers import align_up
from tierio.io.checksum import verify_checksum
from tierio.io.mapping import FileMapping, page_start, populate_windows
from tierio.storage.local import LocalStore
from tierio.units import MiB
from tierio.storage.base import where

from tierio.ckpt.steps.reader import check_shard
from tierio.ckpt.steps.refs import no_good_copy
from tierio.ckpt.restore.reshard import Stored, Target, contiguous_at, cover
from tierio.ckpt.restore.source import Source

log = logging.getLogger("tierio.ckpt")


@dataclass(frozen=True)
class Placed:
    """A tensor that lies whole in ``file`` at bytes [begin, begin + nbytes), in row-major order."""

    key: tuple[bool, str]  # the restore's name for it (global?, name)
    stored: Stored
    file: str
    rank: int
    begin: int
    nbytes: int
    chunks: tuple[ChunkInfo, ...]


def placed(key: tuple[bool, str], stored: Stored, target: Target, label: str) -> Placed | None:
    """Where the whole tensor ``target`` wants lies in one file, or None when it does not (several
    files, chunks out of order, a misaligned start): such a tensor is read instead."""
    hits = cover(stored, target, label)  # the strict checks of every restore: overlaps, holes
    if not hits or target.box.numel == 0 or len({p.file for p, _ in hits}) != 1:
        return None
    base: int | None = None
    for piece, _ in hits:
        at = contiguous_at(target.dest, piece.chunk.offsets, piece.chunk.shape)
        if at is None or (base is not None and piece.chunk.begin - at != base):
            return None
        base = piece.chunk.begin - at
    nbytes = target.dest.numel() * target.dest.element_size()
    assert base is not None
    if base < 0 or base % target.dest.element_size():
        return None  # a typed view of the map must start on an element boundary
    return Placed(key, stored, hits[0][0].file, hits[0][0].rank, base, nbytes,
                  tuple(sorted((p.chunk for p, _ in hits), key=lambda c: c.begin)))


# Populate windows of a restore. Verifying a window is the first time the CPU touches its pages,
# and on virtual machines that touch is dear (the host maps each page of fresh page cache then:
# about as long as reading it), so the windows are short enough that the checksums of some overlap
# the reads of others and no long tail is left. Measured here, 277 MB and 2 GiB cold after 3 s
# idle, 4 windows in flight, checksum after each: 64 MiB windows 0.36-0.45 s / 1.1-2.2 s,
# 16 MiB windows 0.18-0.24 s / 0.9-1.2 s (32 MiB between the two).
VERIFY_WINDOW = 16 * MiB


@dataclass
class _Window:
    """Bytes [offset, offset + length) of a map (relative to its start) and the chunks they overlap."""

    offset: int
    length: int
    chunks: list[ChunkInfo]


def windows(chunks: Sequence[ChunkInfo], start: int, size: int = VERIFY_WINDOW) -> list[_Window]:
    """Populate windows of at most ``size`` bytes over ``chunks`` (sorted, not overlapping) of a map
    that starts at file byte ``start``: small consecutive chunks share a window, a larger chunk is
    cut into near-equal page-aligned pieces (it is verified once all of them are in)."""
    out: list[_Window] = []
    for c in chunks:
        lo, hi = c.begin - start, c.end - start
        if out and hi - out[-1].offset <= size and lo >= out[-1].offset + out[-1].length:
            out[-1].length = hi - out[-1].offset
            out[-1].chunks.append(c)
            continue
        pieces = max(1, -(-(hi - lo) // size))
        step = align_up(-(-(hi - lo) // pieces), mmap.PAGESIZE)
        at = lo
        while at < hi:
            out.append(_Window(at, min(step, hi - at), [c]))
            at += step
    return out


def map_file(store: LocalStore, key: str, label: str, tensors: Sequence[Placed]) -> dict[tuple[bool, str], torch.Tensor]:
    """Map the bytes of ``tensors`` in one file, populate them in parallel and verify every chunk
    as soon as all its bytes are in; returns the tensors (typed views of the map). IntegrityError on
    a bad chunk."""
    lo = page_start(min(t.begin for t in tensors))
    hi = max(t.begin + t.nbytes for t in tensors)
    fd, _ = store.open(key)
    try:
        m = FileMapping(fd, lo, hi - lo, where=label)
    finally:
        os.close(fd)  # the map holds the file
    chunks = sorted({c.begin: c for t in tensors for c in t.chunks}.values(), key=lambda c: c.begin)
    spans = windows(chunks, lo)
    by_offset = {w.offset: w for w in spans}
    missing = Counter(c.begin for w in spans for c in w.chunks)  # windows still to come, per chunk
    lock = threading.Lock()

    def check(offset: int, _length: int) -> None:
        for c in by_offset[offset].chunks:
            with lock:
                missing[c.begin] -= 1
                complete = missing[c.begin] == 0
            if complete:  # this thread brought in the chunk's last window
                verify_checksum(m.view[c.begin - lo : c.end - lo], c.xxh3,
                                f"{label}, chunk at offsets {list(c.offsets)} (bytes {c.begin}..{c.end})")

    populate_windows(m, [(w.offset, w.length) for w in spans], check)
    out = {}
    for t in tensors:
        dtype = torch_dtype(t.stored.dtype)
        out[t.key] = m.typed(t.begin - lo, dtype, t.nbytes // dtype.itemsize).view(t.stored.shape)
    return out


@dataclass
class MapOutcome:
    """What mapping gave: the tensors (the others are read) and where each file came from."""

    tensors: dict[tuple[bool, str], torch.Tensor] = field(default_factory=dict)
    read_from: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0


def map_all(step: int, entry_of: Callable[[int], RankEntry], placed_tensors: Sequence[Placed],
            sources: Sequence[Source]) -> MapOutcome:
    """Map every file of ``placed_tensors`` from the first source with a good local copy.
    A file whose first source holding it is not a local directory is left to be read."""
    by_file: dict[str, list[Placed]] = {}
    for p in placed_tensors:
        by_file.setdefault(p.file, []).append(p)
    out = MapOutcome()
    for file, tensors in sorted(by_file.items()):
        key = file_key(step, file)
        problems: list[str] = []
        for src in sources:
            if not isinstance(src.store, LocalStore):
                break  # not a local directory (S3): the restore reads this file through the store
            label = where(src.store, key)
            try:
                check_shard(src.store, step, entry_of(tensors[0].rank))
                out.tensors.update(map_file(src.store, key, label, tensors))
            except NotFoundError as exc:
                if not src.node_local:  # another node's file is never on this node's tier
                    problems.append(str(exc))
                continue
            except (IntegrityError, FormatError, StorageError) as exc:
                problems.append(str(exc))
                events.emit(events.CopyUnusable(step, src.store.url, str(exc)))
                continue
            out.read_from[file] = src.store.url
            out.nbytes += sum(t.nbytes for t in tensors)
            if problems:
                msg = (f"mapped {file} of step {step} from {src.store.url}; the copies passed over are unusable: "
                       + "; ".join(problems))
                warnings.warn(msg, stacklevel=5)
                log.warning("%s", msg)
            break
        else:
            raise no_good_copy(step, file, [t.stored.name for t in tensors], problems)
    return out


