"""Reads of byte ranges into caller memory, whole-file reads and file copies, window by window.

The windows are cut and kept in flight by tierio.io.engine; O_DIRECT descriptors read whole
blocks in place when the caller's memory agrees with the file offset, through reused aligned
bounce buffers otherwise (tierio.io.direct opens the files).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tierio.errors import IntegrityError, os_error
from tierio.io import background
from tierio.io.buffers import ALIGN, BufferPool, HostBuffer, address_of, align_down, align_up
from tierio.io.engine import Window, Windowing, read_range
from tierio.io.limiter import TokenBucket
from tierio.io.locks import hold_write_lock
from tierio.io.stats import IOStats, record
from tierio.io.direct import DEFAULT_CHUNK, DEFAULT_DEPTH, bounce_pool, open_file, pread_full, pwrite_all

__all__ = ["copy_file", "read_file", "read_into"]


# -- reads -----------------------------------------------------------------------------------
def _truncated(path: str | Path, ended: int, needed: int) -> IntegrityError:
    return IntegrityError(f"{path} ended at byte {ended}, needed bytes up to {needed}: the file is truncated")


@dataclass(frozen=True)
class _RangeRead:
    """Bytes [offset, offset + len(view)) of an open file, read into ``view`` window by window.

    ``in_place``: the descriptor has O_DIRECT and ``view``'s address agrees with the file offset
    modulo 4 KiB (always the case for a HostBuffer read from offset 0), so whole blocks land in
    ``view`` by DMA and only a window's unaligned head and tail blocks pass through bounce buffers.
    With O_DIRECT and no agreement every window is bounced and copied once; without O_DIRECT the
    kernel copies straight into ``view``."""

    fd: int
    path: str | Path
    offset: int
    view: memoryview
    direct: bool
    in_place: bool

    def window(self, w: Window) -> None:
        lo, hi = max(w.offset, self.offset), w.end  # the first window starts on the grid below offset
        if not self.direct:
            self._read(lo, hi)
        elif not self.in_place:
            self._bounce(lo, hi)
        else:
            a = min(align_up(lo), hi)
            b = max(align_down(hi), a)
            if a > lo:
                self._bounce(lo, a)
            if b > a:
                self._read(a, b)
            if hi > b:
                self._bounce(b, hi)

    def _read(self, lo: int, hi: int) -> None:
        got = pread_full(self.fd, self.view[lo - self.offset : hi - self.offset], lo, self.path)
        if got < hi - lo:
            raise _truncated(self.path, lo + got, hi)

    def _bounce(self, lo: int, hi: int) -> None:
        """Read the aligned blocks holding [lo, hi) into a bounce buffer and copy the wanted part out."""
        start = align_down(lo)
        span = align_up(hi - start)
        buf = bounce_pool().acquire(span)
        try:
            got = pread_full(self.fd, buf.view[:span], start, self.path, need=hi - start)
            if got < hi - start:
                raise _truncated(self.path, start + got, hi)
            dest = np.frombuffer(self.view[lo - self.offset : hi - self.offset], dtype=np.uint8)
            np.copyto(dest, buf.array[lo - start : hi - start])  # numpy copies with the GIL released
        finally:
            bounce_pool().release(buf)


def read_into(
    path: str | Path,
    offset: int,
    buf,
    *,
    direct: bool = True,
    chunk_size: int | None = None,
    depth: int | None = None,
    fd: int | None = None,
) -> IOStats:
    """Fill ``buf`` with the bytes of ``path`` at [offset, offset+len(buf)) using parallel requests
    of ``chunk_size`` bytes, ``depth`` in flight (like fio's iodepth).

    When ``buf``'s address and ``offset`` agree modulo 4 KiB, the aligned interior is read by DMA
    straight into ``buf``; only the head and tail blocks pass through bounce buffers. Otherwise
    every window is bounced and copied once. ``fd``: an open descriptor of ``path`` (left open;
    ``direct`` then says whether it has O_DIRECT).
    """
    view = memoryview(buf).cast("B")
    n = len(view)
    t0 = time.perf_counter()
    own_fd = fd is None
    if own_fd:
        fd, is_direct = open_file(path, write=False, direct=direct)
    else:
        is_direct = direct
    try:
        size = os.fstat(fd).st_size
        if offset < 0 or offset + n > size:
            raise IntegrityError(f"{path} is {size} bytes; cannot read bytes {offset}..{offset + n}: the file is truncated or the range is wrong")
        in_place = is_direct and n > 0 and (address_of(view) - offset) % ALIGN == 0
        job = _RangeRead(fd, path, offset, view, is_direct, in_place)
        if in_place or not is_direct:  # no window passes through the shared bounce buffers
            chunk_size, depth = background.request_shape(chunk_size, depth, DEFAULT_CHUNK, DEFAULT_DEPTH)
        requests = len(read_range(offset, offset + n, Windowing(align_up(chunk_size or DEFAULT_CHUNK),
                                                                depth or DEFAULT_DEPTH), job.window))
    finally:
        if own_fd:
            os.close(fd)
    return record(IOStats("read", str(path), n, time.perf_counter() - t0, is_direct, requests))


def read_file(path: str | Path, *, direct: bool = True, pool: BufferPool | None = None) -> tuple[HostBuffer, int]:
    """Read a whole file into an aligned HostBuffer (from ``pool`` when given); returns (buffer, size)."""
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise os_error(exc, path, "reading") from exc
    buf = pool.acquire(size) if pool is not None else HostBuffer(size)
    read_into(path, 0, buf.view[:size], direct=direct)
    return buf, size


@dataclass(frozen=True)
class _FileCopy:
    """Copies windows of ``src`` to the same offsets of ``dst`` through bounce buffers."""

    src_fd: int
    dst_fd: int
    src: str | Path
    dst: str | Path
    direct_dst: bool
    on_chunk: Callable[[int, memoryview], None] | None
    limiter: TokenBucket | None

    def window(self, w: Window) -> None:
        off, n = w.offset, w.length
        if self.limiter is not None:
            self.limiter.consume(n)
        span = align_up(n)
        buf = bounce_pool().acquire(span)
        try:
            got = pread_full(self.src_fd, buf.view[:span], off, self.src, need=n)
            if got < n:
                raise IntegrityError(f"{self.src} shrank while being copied (read {off + got} of {off + n} bytes)")
            if self.on_chunk is not None:
                self.on_chunk(off, buf.view[:n])
            m = span if self.direct_dst else n
            buf.array[n:m] = 0  # O_DIRECT writes whole blocks; the padding is truncated away
            pwrite_all(self.dst_fd, buf.view[:m], off, self.dst)
        finally:
            bounce_pool().release(buf)


def copy_file(
    src: str | Path,
    dst: str | Path,
    *,
    direct: bool = True,
    chunk_size: int | None = None,
    depth: int | None = None,
    limiter: TokenBucket | None = None,
    on_chunk: Callable[[int, memoryview], None] | None = None,
    src_fd: int | None = None,
    dst_dir_fd: int | None = None,
) -> IOStats:
    """Copy ``src`` to ``dst`` (not atomic) with parallel aligned chunks; fsyncs ``dst``.

    ``on_chunk(offset, bytes)`` sees every chunk in memory (for checksums) before it is written.
    ``src_fd``: an open descriptor of ``src`` to read instead of opening the path (left open).
    ``dst_dir_fd``: create ``dst``'s name exclusively in that directory (see ``open_file``).
    """
    t0 = time.perf_counter()
    own_src = src_fd is None
    if own_src:
        src_fd, _ = open_file(src, write=False, direct=direct)
    try:
        dst_fd, dst_direct = open_file(dst, write=True, direct=direct, dir_fd=dst_dir_fd)
        hold_write_lock(dst_fd)
        try:
            size = os.fstat(src_fd).st_size
            job = _FileCopy(src_fd, dst_fd, src, dst, dst_direct, on_chunk, limiter)
            # read_range returns only once no request is running, also on error: dst_fd may close.
            windows = Windowing(align_up(chunk_size or DEFAULT_CHUNK), depth or DEFAULT_DEPTH)
            requests = len(read_range(0, size, windows, job.window))
            if dst_direct and size % ALIGN:
                os.ftruncate(dst_fd, size)
            os.fsync(dst_fd)
        except OSError as exc:
            raise os_error(exc, dst, "copying to") from exc
        finally:
            os.close(dst_fd)
    finally:
        if own_src:
            os.close(src_fd)
    return record(IOStats("copy", str(dst), size, time.perf_counter() - t0, dst_direct, requests))

