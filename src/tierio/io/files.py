"""Large aligned file I/O with O_DIRECT and several requests in flight.

Why: buffered writes copy every byte into the page cache and then wait on writeback at fsync;
O_DIRECT moves the bytes from the caller's buffer to the device with no copy, and keeping several
multi-MiB requests in flight keeps an NVMe queue full. Python's os.pwrite/os.preadv release the GIL,
so the shared pool of the io engine (tierio.io.engine, which cuts the windows and keeps them in
flight) is enough to saturate a disk.

O_DIRECT needs buffer addresses, file offsets and lengths aligned to the logical block size (4 KiB
is always safe). Aligned caller buffers (HostBuffer) are written in place; anything else goes
through reused aligned bounce buffers. The unaligned tail of a file is written padded and the file
truncated back to its true size. Filesystems that refuse O_DIRECT (tmpfs, some FUSE and network
mounts) get buffered I/O instead, reported once per directory and visible in IOStats.direct.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from tierio.errors import (
    DiskFullError,
    IntegrityError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
)
from tierio.io.buffers import (
    ALIGN,
    BufferPool,
    HostBuffer,
    address_of,
    align_down,
    align_up,
    shared_pool,
)
from tierio.io.engine import (
    Request,
    Window,
    Windowing,
    executor,
    read_range,
    settle_all,
    submit,
)
from tierio.io.limiter import TokenBucket
from tierio.io.paths import open_regular
from tierio.io.stats import IOStats, record
from tierio.units import MiB

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 8 * MiB
DEFAULT_DEPTH = 8

__all__ = ["DEFAULT_CHUNK", "DEFAULT_DEPTH", "FileWriter", "bounce_pool", "copy_file", "executor", "hold_write_lock",
           "map_readonly", "open_file", "os_error", "pread_full", "pwrite_all", "read_file", "read_into", "write_file"]

_warned_dirs: set[str] = set()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def bounce_pool() -> BufferPool:
    """Shared aligned bounce buffers, faulted in once per process and reused."""
    return shared_pool("bounce", 16 * DEFAULT_CHUNK)


def os_error(exc: OSError, path: str | Path, doing: str) -> StorageError:
    """Turn an OSError into a typed tierio error that names the path and says what to do."""
    code = exc.errno
    if code in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left while {doing} {path}: free space on that filesystem or point this tier elsewhere")
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionDeniedError(f"permission denied while {doing} {path} ({exc.strerror}): check ownership and mount options")
    if code in (errno.ENOENT, errno.ENOTDIR):
        return NotFoundError(f"{path} does not exist (while {doing}); check the path")
    return StorageError(f"I/O error while {doing} {path}: {exc.strerror or exc}")


def _note_fallback(path: str | Path, why: str) -> None:
    d = str(Path(path).parent)
    if d not in _warned_dirs:
        _warned_dirs.add(d)
        log.warning("O_DIRECT not supported under %s (%s); using buffered I/O there", d, why)


def open_file(path: str | Path, write: bool, direct: bool, *, dir_fd: int | None = None) -> tuple[int, bool]:
    """Open for writing (create/truncate) or reading, with O_DIRECT when asked and allowed.

    ``dir_fd``: open ``path``'s last component in that directory instead of walking the path, and
    (writes) create it exclusively without following a link: a temp file made this way cannot be
    redirected by a directory or a name swapped for a symlink after the caller checked them."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    flags |= getattr(os, "O_CLOEXEC", 0)
    target: str | Path = path
    if dir_fd is not None:
        target = Path(path).name
        flags |= _NOFOLLOW | (os.O_EXCL if write else 0)
    doing = "creating" if write else "opening"
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(target, flags | os.O_DIRECT, 0o644, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise os_error(exc, path, doing) from exc
            _note_fallback(path, "EINVAL on open")
    try:
        return os.open(target, flags, 0o644, dir_fd=dir_fd), False
    except OSError as exc:
        raise os_error(exc, path, doing) from exc


def hold_write_lock(fd: int) -> None:
    """Mark a file being written as owned by a live process: an exclusive flock, held until the
    descriptor closes (the kernel drops it when the process dies). Cleanup of temp files
    (Store.cleanup) removes only files whose lock it can take. Filesystems without flock
    support are left unmarked; cleanup then goes by age alone."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass


def writer_gone(path: str | Path, *, dir_fd: int | None = None) -> bool:
    """True for a regular file (not a link) whose writer's lock (``hold_write_lock``) nobody holds:
    the process that wrote it died or finished, so a temp file under that name is garbage.
    ``dir_fd``: ``path`` is a name in that directory (a walk through directory descriptors)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing releases the lock


def pwrite_all(fd: int, view: memoryview, offset: int, path: str | Path) -> None:
    """Write all of ``view`` at ``offset`` (short writes continue; a zero-byte write means the disk is full)."""
    while len(view):
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as exc:
            raise os_error(exc, path, "writing") from exc
        if n == 0:
            raise DiskFullError(f"no space left while writing {path}: free space on that filesystem")
        view = view[n:]
        offset += n


def pread_full(fd: int, view: memoryview, offset: int, path: str | Path, need: int | None = None) -> int:
    """Read into ``view`` from ``offset`` until ``need`` bytes (default: all of ``view``) have
    arrived or the file ends; returns the bytes read. Stopping at ``need`` spares an O_DIRECT read
    of a file's padded tail a second request at an unaligned offset."""
    need = len(view) if need is None else need
    done = 0
    while done < need:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise os_error(exc, path, "reading") from exc
        if n == 0:
            break
        done += n
    return done


@dataclass
class _Write:
    """A write request in flight and the bounce buffer it writes from, if it owns one."""

    request: Request[None]
    owned: HostBuffer | None


class FileWriter:
    """Sequential writer: ``write()`` appends, ``close()`` waits, truncates the padding and fsyncs.

    Buffers passed to ``write`` must stay unchanged until ``close`` returns: aligned ones are
    written in place, with up to ``depth`` requests of ``chunk_size`` bytes in flight.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        direct: bool = True,
        chunk_size: int = DEFAULT_CHUNK,
        depth: int = DEFAULT_DEPTH,
        limiter: TokenBucket | None = None,
        dir_fd: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.chunk_size = align_up(chunk_size)
        self.depth = max(1, depth)
        self.limiter = limiter
        self.dir_fd = dir_fd  # given: the file is path.name in it, made exclusively (see open_file)
        self.fd, self.direct = open_file(self.path, write=True, direct=direct, dir_fd=dir_fd)
        hold_write_lock(self.fd)
        self._offset = 0  # bytes submitted so far (file offset of the bounce buffer's start)
        self._bounce: HostBuffer | None = None
        self._fill = 0
        self._inflight: deque[_Write] = deque()
        self._t0 = time.perf_counter()
        self._requests = 0
        self._closed = False

    # -- submission -------------------------------------------------------------------------
    def _submit(self, view: memoryview, offset: int, owned: HostBuffer | None) -> None:
        while len(self._inflight) >= self.depth:
            self._reap_one()
        if self.limiter is not None:
            self.limiter.consume(len(view))
        self._inflight.append(_Write(submit(partial(pwrite_all, self.fd, view, offset, self.path)), owned))
        self._requests += 1

    def _reap_one(self) -> None:
        write = self._inflight.popleft()
        try:
            write.request.result()
        finally:
            if write.owned is not None:
                bounce_pool().release(write.owned)

    def _flush_bounce(self, final: bool = False) -> None:
        if self._bounce is None or self._fill == 0:
            return
        n = self._fill
        if self.direct:
            padded = align_up(n)
            self._bounce.array[n:padded] = 0
            n = padded
        self._submit(self._bounce.view[:n], self._offset, self._bounce)
        self._offset += self._fill
        self._bounce, self._fill = None, 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        if not self.direct:
            for i in range(0, len(view), self.chunk_size):
                piece = view[i : i + self.chunk_size]
                self._submit(piece, self._offset, None)
                self._offset += len(piece)
            return
        while len(view):
            if self._fill == 0 and self._offset % ALIGN == 0 and address_of(view) % ALIGN == 0:
                # Zero-copy: aligned caller memory goes straight to the device.
                n = align_down(min(len(view), self.chunk_size))
                if n:
                    self._submit(view[:n], self._offset, None)
                    self._offset += n
                    view = view[n:]
                    continue
            if self._bounce is None:
                self._bounce = bounce_pool().acquire(self.chunk_size)
            n = min(len(view), self.chunk_size - self._fill)
            self._bounce.view[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == self.chunk_size:
                self._flush_bounce()

    # -- completion -------------------------------------------------------------------------
    @property
    def bytes_written(self) -> int:
        return self._offset + self._fill

    def close(self, fsync: bool = True) -> IOStats:
        """Wait for every request, trim padding, fsync; returns the stats of the whole file."""
        if self._closed:
            raise StorageError(f"{self.path} already closed")
        total = self.bytes_written
        try:
            self._flush_bounce(final=True)
            while self._inflight:
                self._reap_one()
            if self.direct and total % ALIGN:
                os.ftruncate(self.fd, total)
            if fsync:
                os.fsync(self.fd)
        except OSError as exc:
            self._abort_quietly()
            raise os_error(exc, self.path, "finishing") from exc
        except BaseException:
            self._abort_quietly()
            raise
        os.close(self.fd)
        self._closed = True
        stats = IOStats("write", str(self.path), total, time.perf_counter() - self._t0, self.direct, self._requests)
        return record(stats)

    def _abort_quietly(self) -> None:
        settle_all(w.request for w in self._inflight)  # the file is being dropped: unstarted writes need not run
        for w in self._inflight:
            if w.owned is not None:
                bounce_pool().release(w.owned)
        self._inflight.clear()
        if self._bounce is not None:
            bounce_pool().release(self._bounce)
            self._bounce = None
        if not self._closed:
            os.close(self.fd)
            self._closed = True

    def abort(self) -> None:
        """Stop, close and remove the file (used when a write fails half way)."""
        self._abort_quietly()
        try:
            if self.dir_fd is not None:
                os.unlink(self.path.name, dir_fd=self.dir_fd)
            else:
                os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()


def write_file(path: str | Path, buffers, **kw) -> IOStats:
    """Write the concatenation of ``buffers`` to ``path`` (not atomic: see durable.atomic_write)."""
    w = FileWriter(path, **kw)
    try:
        for b in buffers:
            w.write(b)
        return w.close()
    except BaseException:
        w.abort()
        raise


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
    chunk_size: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
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
        requests = len(read_range(offset, offset + n, Windowing(align_up(chunk_size), depth), job.window))
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
    chunk_size: int = DEFAULT_CHUNK,
    depth: int = DEFAULT_DEPTH,
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
            requests = len(read_range(0, size, Windowing(align_up(chunk_size), depth), job.window))
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


def map_readonly(path: str | Path, *, populate: bool = False) -> mmap.mmap | bytes:
    """A read-only shared mapping of the regular file at ``path`` (``b""`` when it is empty).

    A FIFO or a device in its place is refused, never waited on. ``populate`` maps every page at
    once (MAP_POPULATE): for a file just written or read, whose pages are in the page cache, that
    is one call instead of a page fault per 4 KiB later. The mapping keeps the file readable after
    it is unlinked, so an evicted cache entry stays valid for whoever still views it."""
    try:
        fd = open_regular(path)
    except OSError as exc:
        raise os_error(exc, path, "opening") from exc
    try:
        size = os.fstat(fd).st_size
        if not size:
            return b""
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    except OSError as exc:
        raise os_error(exc, path, "mapping") from exc
    finally:
        os.close(fd)
