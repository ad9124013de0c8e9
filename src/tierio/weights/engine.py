"""Weight loads on the io read engine: extents of shards, read by residency, two destinations.

A load is a list of *extents* (a byte range of one shard that holds the wanted tensors; the whole
file in the common case), cut into aligned windows of ``chunk_size`` bytes by the io engine
(tierio.io.engine), ``depth`` of them in flight on the shared I/O pool, in file order (the threads
block in the kernel with the GIL released):

* ``read_to_arenas``: each extent lands in its own huge-page Arena; the window is populated and
  read by O_DIRECT straight into its final place (the arena's address agrees with the file
  offset modulo 4 KiB, so no bounce buffer). Tensors are then views of the arena.
* ``read_through_ring``: each window lands in a reused staging buffer of the bounded ring
  (pinned when CUDA exists) and a ``sink`` copies it to its destination (GPU memory on a
  per-thread CUDA stream, or the caller's existing tensors), then the buffer is reused.

Windows that are already in the page cache are read buffered (a memcpy from DRAM) instead of
going back to the device. A ``hook(shard, file_offset, view, n)`` sees every window while it
is in memory (the weight cache writes and checksums it there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from tierio.errors import FormatError, IntegrityError
from tierio.format.safetensors import TensorEntry
from tierio.io import pagecache
from tierio.io.buffers import ALIGN, align_up
from tierio.io.engine import ByteRange, Window, Windowing, plan, read_windows
from tierio.io.direct import open_file, pread_full
from tierio.units import MiB
from tierio.io.mapping import MAP_CHUNK, MAP_DEPTH, Arena, FileMapping
from tierio.weights.memory import staging_pool
from tierio.weights.sources import Shard

log = logging.getLogger(__name__)
DEFAULT_CHUNK = 16 * MiB
DEFAULT_DEPTH = 8
MERGE_GAP = 4 * MiB  # read through gaps up to this size rather than issue another request
RESIDENT = 0.5  # a window at least this much in the page cache is read buffered

Hook = Callable[[Shard, int, memoryview, int], None]


@dataclass
class Extent:
    """Bytes [start, end) of a shard (start aligned) holding ``entries``."""

    shard: Shard
    start: int
    end: int
    entries: list[TensorEntry] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return align_up(self.end - self.start)

    def offset_of(self, e: TensorEntry) -> int:
        """Offset of a tensor's first byte inside this extent."""
        return self.shard.data_offset + e.begin - self.start


def plan_extents(shard: Shard, entries: list[TensorEntry], whole_file: bool = False, merge_gap: int = MERGE_GAP) -> list[Extent]:
    """Group a shard's wanted tensors into extents, merging ranges separated by at most ``merge_gap``."""
    if whole_file:
        return [Extent(shard, 0, shard.size, [e for e in entries if e.nbytes])] if shard.size else []
    base = shard.data_offset
    ranges = [ByteRange(base + e.begin, base + e.end) for e in entries]
    regions = plan(ranges, Windowing(DEFAULT_CHUNK, DEFAULT_DEPTH, merge_gap=merge_gap))
    return [Extent(shard, r.start, r.end, [entries[i] for i in r.members]) for r in regions]


Progress = Callable[[int, int], None]  # (bytes done, bytes in all), called from the I/O threads


@dataclass
class Counters:
    """Bytes moved, by way; ``progress`` (if any) hears every window as it lands, in order of
    completion, with a done count that only grows."""

    direct_bytes: int = 0
    buffered_bytes: int = 0
    remote_bytes: int = 0
    total: int = 0
    progress: Progress | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, n: int) -> None:
        with self._lock:
            setattr(self, kind, getattr(self, kind) + n)
            if self.progress is not None:
                self.progress(self.direct_bytes + self.buffered_bytes + self.remote_bytes, self.total)


class ShardReader:
    """Reads windows of one shard: O_DIRECT or buffered by page-cache residency, or ranged GETs."""

    def __init__(self, shard: Shard, direct: bool, counters: Counters) -> None:
        self.shard = shard
        self.counters = counters
        self.fd_direct: int | None = None
        self.fd_buffered: int | None = None
        self.residency: pagecache.Residency | None = None
        if shard.path is not None:
            self.fd_buffered, _ = open_file(shard.path, write=False, direct=False)
            if direct:
                fd, is_direct = open_file(shard.path, write=False, direct=True)
                if is_direct:
                    self.fd_direct = fd
                    self.residency = pagecache.residency(self.fd_buffered)
                else:
                    os.close(fd)

    def close(self) -> None:
        for fd in (self.fd_direct, self.fd_buffered):
            if fd is not None:
                os.close(fd)
        self.fd_direct = self.fd_buffered = None

    def read(self, offset: int, view: memoryview, n: int) -> None:
        """Fill view[:n] with the shard's bytes at ``offset`` (aligned); view holds align_up(n) bytes."""
        shard = self.shard
        if shard.path is None:
            shard.store.read_into(shard.key, offset, view[:n])
            self.counters.add("remote_bytes", n)
            return
        use_direct = (
            self.fd_direct is not None
            and offset % ALIGN == 0
            and len(view) >= align_up(n)
            and (self.residency is None or self.residency.fraction(offset, n) < RESIDENT)
        )
        fd = self.fd_direct if use_direct else self.fd_buffered
        want = align_up(n) if use_direct else n
        done = pread_full(fd, view[:want], offset, shard.where, need=n)
        if done < n:
            raise IntegrityError(f"{shard.where} ended at byte {offset + done}, expected at least {offset + n}: the file is truncated")
        self.counters.add("direct_bytes" if use_direct else "buffered_bytes", n)


WindowBody = Callable[[ShardReader, Window], None]  # Window.of indexes the extents


def _read_windows(extents: list[Extent], chunk: int, depth: int, direct: bool, counters: Counters,
                  body: WindowBody) -> None:
    """Run ``body(reader, window)`` for every window, ``depth`` in flight, one reader per shard."""
    readers: dict[int, ShardReader] = {}
    try:
        for ext in extents:
            if id(ext.shard) not in readers:
                readers[id(ext.shard)] = ShardReader(ext.shard, direct, counters)

        def window(w: Window) -> None:
            body(readers[id(extents[w.of].shard)], w)

        # Returns only once no window is running, also on error: the readers' descriptors may close.
        read_windows(extents, Windowing(chunk, depth), window)
    finally:
        for r in readers.values():
            r.close()


def read_to_arenas(
    extents: list[Extent],
    *,
    chunk_size: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
    direct: bool = True,
    hook: Hook | None = None,
    counters: Counters | None = None,
) -> list[Arena]:
    """Read every extent into its own Arena (one per extent, same order)."""
    counters = counters or Counters()
    chunk = align_up(chunk_size, 2 * MiB)  # whole huge pages per window
    arenas = [Arena(ext.end - ext.start) for ext in extents]

    def window(reader: ShardReader, w: Window) -> None:
        arena, rel, n = arenas[w.of], w.offset - extents[w.of].start, w.length
        cap = min(align_up(n), arena.capacity - rel)
        arena.populate(rel, cap)
        view = arena.view[rel : rel + cap]
        reader.read(w.offset, view, n)
        if hook is not None:
            hook(reader.shard, w.offset, view, n)

    _read_windows(extents, chunk, depth, direct, counters, window)
    return arenas


def map_extents(
    extents: list[Extent],
    *,
    chunk_size: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
    hook: Hook | None = None,
    counters: Counters | None = None,
) -> list[FileMapping]:
    """Map every (local) extent privately and populate it through the page cache, a few large
    windows at a time (the ``mapped`` load mode).

    Windows of at least MAP_CHUNK with at most MAP_DEPTH in flight (io.mapping says why). The
    window is a whole multiple of ``chunk_size``
    so that a hook sees whole checksum windows of the weight cache."""
    counters = counters or Counters()
    chunk_size = align_up(chunk_size) * max(1, -(-MAP_CHUNK // align_up(chunk_size)))
    depth = min(depth, MAP_DEPTH)
    maps = [FileMapping(ext.shard.path, ext.start, ext.end - ext.start) for ext in extents]

    def window(w: Window) -> None:
        ext, m = extents[w.of], maps[w.of]
        rel, n = w.offset - ext.start, w.length
        m.populate(rel, n)
        counters.add("buffered_bytes", n)
        if hook is not None:
            hook(ext.shard, w.offset, m.view[rel : rel + n], n)

    read_windows(extents, Windowing(chunk_size, depth), window)
    return maps


Sink = Callable[[Extent, int, memoryview, int, object], None]


def read_through_ring(
    extents: list[Extent],
    sink: Sink | None,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
    direct: bool = True,
    hook: Hook | None = None,
    counters: Counters | None = None,
    numa_node: int | None = None,
) -> None:
    """Stream every extent through the bounded staging ring (on ``numa_node`` when given);
    ``sink(ext, rel, view, n, buffer)`` copies each window out before its staging buffer is reused."""
    counters = counters or Counters()
    chunk = align_up(chunk_size)
    pool = staging_pool(numa_node)
    depth = max(1, min(depth, pool.budget_bytes // chunk))  # staging memory stays within the budget

    def window(reader: ShardReader, w: Window) -> None:
        ext, n = extents[w.of], w.length
        buf = pool.acquire(chunk)
        try:
            view = buf.view[: align_up(n)]
            reader.read(w.offset, view, n)
            if hook is not None:
                hook(ext.shard, w.offset, view, n)
            if sink is not None:
                sink(ext, w.offset - ext.start, view, n, buf)
        finally:
            pool.release(buf)

    _read_windows(extents, chunk, depth, direct, counters, window)


def check_entries_fit(extents: list[Extent]) -> None:
    for ext in extents:
        for e in ext.entries:
            if ext.shard.data_offset + e.end > ext.shard.size:
                raise FormatError(f"{ext.shard.where}: tensor {e.name!r} ends past the end of the file")
