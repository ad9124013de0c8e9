"""Scatter reads: stream the parts of one object that hold many small destinations.

Restoring a checkpoint fills hundreds of tensors whose memory was allocated by someone else, at
addresses that do not line up with their file offsets, so O_DIRECT cannot land in them. Reading
each tensor on its own also keeps the device queue shallow. Instead the covering byte ranges are
read in large aligned windows by the io engine, ``depth`` at a time, into a few reused buffers, and
each window is copied out to every destination it overlaps (a memcpy at ~10 GB/s, in the reader
threads, with the GIL released) while the next windows are in flight. Destinations of several MiB
are read straight into instead (see ``read_scatter``).

``read_whole`` is the other shape of a restore: ranges that must be seen whole before any of their
bytes may be used (a checkpoint chunk is verified against its checksum, then only part of it is
copied out, as when a restore reshards). Each range is read into a reused buffer, ``depth`` at a
time, and handed to its own callback.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tierio.io.buffers import BufferPool, shared_pool
from tierio.io.engine import ByteRange, Window, Windowing, plan, read_windows, run_windows
from tierio.storage.base import Store
from tierio.units import MiB

WINDOW = 32 * MiB
DEPTH = 4
MERGE_GAP = 1 * MiB  # read through holes up to this size instead of issuing another request
# Windows sit on a MiB grid: requests that straddle the device's (or the host's) larger
# allocation units run at half speed on virtual disks, even when 4 KiB aligned.
GRID = 1 * MiB
WHOLE = 64 * MiB  # the largest range read_whole keeps buffers for (a checkpoint chunk)
STRAIGHT = 4 * MiB  # destinations at least this large are read straight into
STRAIGHT_DEPTH = 4  # of them at once (each is several requests in flight already)


def window_pool() -> BufferPool:
    """DEPTH reusable windows per process, faulted in once (first touch of fresh memory is slow)."""
    return shared_pool("scatter", DEPTH * WINDOW)


@dataclass(frozen=True)
class _Scatter:
    """Reads windows of one object and copies each into the destinations it overlaps."""

    store: Store
    key: str
    spans: list[tuple[int, memoryview]]  # (object offset, destination), sorted, not overlapping
    starts: list[int]  # the spans' offsets, for bisect
    pool: BufferPool
    window_size: int

    def window(self, w: Window) -> int:
        buf = self.pool.acquire(self.window_size)
        try:
            self.store.read_into(self.key, w.offset, buf.view[: w.length])
            return self._copy_out(w, buf.array)
        finally:
            self.pool.release(buf)

    def _copy_out(self, w: Window, src: np.ndarray) -> int:
        copied = 0
        # Walk from the last span that starts at or before the window: it may reach into it.
        i = max(0, bisect.bisect_right(self.starts, w.offset) - 1)
        while i < len(self.spans) and self.spans[i][0] < w.end:
            off, dest = self.spans[i]
            lo, hi = max(off, w.offset), min(off + len(dest), w.end)
            if lo < hi:
                d = np.frombuffer(dest, dtype=np.uint8)
                np.copyto(d[lo - off : hi - off], src[lo - w.offset : hi - w.offset])
                copied += hi - lo
            i += 1
        return copied


def read_scatter(store: Store, key: str, spans: Sequence[tuple[int, memoryview]], *,
                 window: int = WINDOW, depth: int = DEPTH, then: Callable[[int], None] | None = None) -> int:
    """Fill each ``dest`` with the object's bytes at [offset, offset + len(dest)); returns bytes copied.

    ``then(i)`` runs once span ``i`` (its index in ``spans``) holds its bytes: right after its read
    for a large span, in that reader thread (a checksum overlaps the other reads), after every
    window for the small ones (they share windows)."""
    todo = sorted(((i, off, memoryview(d).cast("B")) for i, (off, d) in enumerate(spans) if len(d)), key=lambda s: s[1])
    # A large destination is read straight into (the store cuts it into parallel requests itself):
    # buffered reads then land in it with no copy, and O_DIRECT does when its address agrees with
    # the file offset modulo 4 KiB. Only small ones share windows and are copied out of them.
    large = [s for s in todo if len(s[2]) >= STRAIGHT]
    small = [s for s in todo if len(s[2]) < STRAIGHT]

    def straight(s: tuple[int, int, memoryview]) -> int:
        n = store.read_into(key, s[1], s[2])
        if then is not None:
            then(s[0])
        return n

    n = sum(run_windows(large, straight, STRAIGHT_DEPTH))
    if small:
        shape = Windowing(window, depth, merge_gap=MERGE_GAP, grid=GRID)
        pool = window_pool() if window == WINDOW else BufferPool(budget_bytes=depth * window)
        job = _Scatter(store, key, [(off, d) for _, off, d in small], [off for _, off, _ in small], pool, window)
        regions = plan([ByteRange(off, off + len(d)) for _, off, d in small], shape)
        n += sum(read_windows(regions, shape, job.window))
    if then is not None:  # the small spans, and empty ones (which hold their bytes already)
        done = {i for i, _, _ in large}
        for i in range(len(spans)):
            if i not in done:
                then(i)
    return n


@dataclass(frozen=True)
class Whole:
    """Bytes [offset, offset + length) of an object, handed whole to ``use`` once read."""

    offset: int
    length: int
    use: Callable[[memoryview], None]


def read_whole(store: Store, key: str, ranges: Sequence[Whole], *, depth: int = DEPTH) -> int:
    """Read each range into a reused buffer and call its ``use`` on it (in the reader threads);
    returns the bytes read. Buffers are held only while their ``use`` runs."""
    todo = sorted((r for r in ranges if r.length), key=lambda r: r.offset)
    if not todo:
        return 0
    largest = max(r.length for r in todo)
    # One process-wide pool sized for checkpoint chunks (at most 64 MiB each): faulted in once.
    pool = shared_pool("scatter-whole", DEPTH * WHOLE) if largest <= WHOLE else BufferPool(budget_bytes=depth * largest)

    def one(r: Whole) -> int:
        buf = pool.acquire(r.length)
        try:
            view = buf.view[: r.length]
            store.read_into(key, r.offset, view)
            r.use(view)
        finally:
            pool.release(buf)
        return r.length

    return sum(run_windows(todo, one, depth))
