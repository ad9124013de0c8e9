"""Large aligned file I/O with O_DIRECT and several requests in flight.

Why: buffered writes copy every byte into the page cache and then wait on writeback at fsync;
O_DIRECT moves the bytes from the caller's buffer to the device with no copy, and keeping several
multi-MiB requests in flight keeps an NVMe queue full. Python's os.pwrite/os.preadv release the GIL,
so a small thread pool is enough to saturate a disk.

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
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tierio.errors import (
    DiskFullError,
    IntegrityError,
    NotFoundError,
    PermissionDeniedError,
    StorageError,
)
from tierio.io.buffers import ALIGN, BufferPool, HostBuffer, address_of, align_down, align_up, shared_pool
from tierio.io.limiter import TokenBucket
from tierio.io.stats import IOStats, record

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_CHUNK = 8 * MiB
DEFAULT_DEPTH = 8

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_warned_dirs: set[str] = set()


def _reset_after_fork() -> None:
    """A forked child (a DataLoader worker) inherits the thread pool object but none of its threads,
    and possibly a lock held by a parent thread: start afresh so its first I/O does not hang.
    (Buffer pools are reset the same way in io.buffers.)"""
    global _executor, _executor_lock
    _executor = None
    _executor_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def executor() -> ThreadPoolExecutor:
    """Shared pool for file requests (threads block in the kernel with the GIL released)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="tierio-io")
        return _executor


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


def open_file(path: str | Path, write: bool, direct: bool) -> tuple[int, bool]:
    """Open for writing (create/truncate) or reading, with O_DIRECT when asked and allowed."""
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    flags |= getattr(os, "O_CLOEXEC", 0)
    doing = "creating" if write else "opening"
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise os_error(exc, path, doing) from exc
            _note_fallback(path, "EINVAL on open")
    try:
        return os.open(path, flags, 0o644), False
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


def _pread_full(fd: int, view: memoryview, offset: int, path: str | Path) -> int:
    """Read until ``view`` is full or EOF; returns the bytes read."""
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise os_error(exc, path, "reading") from exc
        if n == 0:
            break
        done += n
    return done


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
    ) -> None:
        self.path = Path(path)
        self.chunk_size = align_up(chunk_size)
        self.depth = max(1, depth)
        self.limiter = limiter
        self.fd, self.direct = open_file(self.path, write=True, direct=direct)
        hold_write_lock(self.fd)
        self._offset = 0  # bytes submitted so far (file offset of the bounce buffer's start)
        self._bounce: HostBuffer | None = None
        self._fill = 0
        self._inflight: deque[tuple[Future, HostBuffer | None]] = deque()
        self._t0 = time.perf_counter()
        self._requests = 0
        self._closed = False

    # -- submission -------------------------------------------------------------------------
    def _submit(self, view: memoryview, offset: int, owned: HostBuffer | None) -> None:
        while len(self._inflight) >= self.depth:
            self._reap_one()
        if self.limiter is not None:
            self.limiter.consume(len(view))
        fut = executor().submit(pwrite_all, self.fd, view, offset, self.path)
        self._inflight.append((fut, owned))
        self._requests += 1

    def _reap_one(self) -> None:
        fut, owned = self._inflight.popleft()
        try:
            fut.result()
        finally:
            if owned is not None:
                bounce_pool().release(owned)

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
        while self._inflight:
            fut, owned = self._inflight.popleft()
            try:
                fut.result()
            except BaseException:
                pass
            if owned is not None:
                bounce_pool().release(owned)
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
def _bounce_read(fd: int, path, start: int, want_from: int, dest: np.ndarray, dest_off: int, length: int) -> int:
    """Read the aligned window holding [want_from, want_from+length) via a bounce buffer, copy it out."""
    buf = bounce_pool().acquire(align_up(want_from + length - start))
    try:
        span = align_up(want_from + length - start)
        got = _pread_full(fd, buf.view[:span], start, path)
        skip = want_from - start
        if got < skip + length:
            raise IntegrityError(f"{path} ended at byte {start + got}, needed bytes up to {want_from + length}: the file is truncated")
        np.copyto(dest[dest_off : dest_off + length], buf.array[skip : skip + length])
        return length
    finally:
        bounce_pool().release(buf)


def _direct_read(fd: int, path, view: memoryview, offset: int, length: int) -> int:
    got = _pread_full(fd, view[:length], offset, path)
    if got < length:
        raise IntegrityError(f"{path} ended at byte {offset + got}, needed bytes up to {offset + length}: the file is truncated")
    return got


def _run_bounded(jobs: list[tuple], depth: int) -> None:
    """Run ``(fn, *args)`` jobs on the shared pool with at most ``depth`` in flight; re-raise the first error."""
    pool = executor()
    inflight: deque[Future] = deque()
    try:
        for fn, *a in jobs:
            while len(inflight) >= max(1, depth):
                inflight.popleft().result()
            inflight.append(pool.submit(fn, *a))
        while inflight:
            inflight.popleft().result()
    finally:
        for f in inflight:  # on error: let running requests finish before the caller closes the fd
            f.exception()


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
    """Fill ``buf`` with the bytes of ``path`` at [offset, offset+len(buf)) using parallel requests.

    When ``buf``'s address and ``offset`` agree modulo 4 KiB (always the case for a HostBuffer read
    from offset 0), the aligned interior is read by DMA straight into ``buf``; only the head and
    tail blocks pass through bounce buffers. Otherwise every window is bounced and copied once.
    """
    view = memoryview(buf).cast("B")
    n = len(view)
    t0 = time.perf_counter()
    own_fd = fd is None
    if own_fd:
        fd, is_direct = open_file(path, write=False, direct=direct)
    else:
        is_direct = direct
    requests = 0
    try:
        size = os.fstat(fd).st_size
        if offset < 0 or offset + n > size:
            raise IntegrityError(f"{path} is {size} bytes; cannot read bytes {offset}..{offset + n}: the file is truncated or the range is wrong")
        # Build the request list first, then keep ``depth`` of them in flight (like fio's iodepth).
        jobs: list[tuple] = []
        chunk = align_up(chunk_size)
        if not is_direct:
            for i in range(0, n, chunk):
                jobs.append((_direct_read, fd, path, view[i:], offset + i, min(chunk, n - i)))
        else:
            arr = np.frombuffer(view, dtype=np.uint8) if n else np.empty(0, np.uint8)
            end = offset + n
            if n and (address_of(view) - offset) % ALIGN == 0:
                a, b = min(align_up(offset), end), max(align_down(end), offset)
                if a > b:  # whole range inside one block
                    a = b = offset
                if a > offset:
                    jobs.append((_bounce_read, fd, path, align_down(offset), offset, arr, 0, a - offset))
                for i in range(a, b, chunk):
                    jobs.append((_direct_read, fd, path, view[i - offset :], i, min(chunk, b - i)))
                if end > b and b >= a:
                    jobs.append((_bounce_read, fd, path, align_down(b), b, arr, b - offset, end - b))
            else:
                pos = offset
                while pos < end:
                    start = align_down(pos)
                    m = min(start + chunk, end) - pos
                    jobs.append((_bounce_read, fd, path, start, pos, arr, pos - offset, m))
                    pos += m
        requests = len(jobs)
        _run_bounded(jobs, depth)
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


def _copy_chunk(src_fd, dst_fd, src, dst, off, n, direct_dst, on_chunk, limiter):
    if limiter is not None:
        limiter.consume(n)
    buf = bounce_pool().acquire(align_up(n))
    try:
        got = _pread_full(src_fd, buf.view[: align_up(n)], off, src)
        if got < n:
            raise IntegrityError(f"{src} shrank while being copied (read {off + got} of {off + n} bytes)")
        if on_chunk is not None:
            on_chunk(off, buf.view[:n])
        m = align_up(n) if direct_dst else n
        if direct_dst:
            buf.array[n:m] = 0
        pwrite_all(dst_fd, buf.view[:m], off, dst)
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
) -> IOStats:
    """Copy ``src`` to ``dst`` (not atomic) with parallel aligned chunks; fsyncs ``dst``.

    ``on_chunk(offset, bytes)`` sees every chunk in memory (for checksums) before it is written.
    ``src_fd``: an open descriptor of ``src`` to read instead of opening the path (left open).
    """
    t0 = time.perf_counter()
    own_src = src_fd is None
    if own_src:
        src_fd, _ = open_file(src, write=False, direct=direct)
    try:
        dst_fd, dst_direct = open_file(dst, write=True, direct=direct)
        hold_write_lock(dst_fd)
        try:
            size = os.fstat(src_fd).st_size
            chunk = align_up(chunk_size)
            jobs = [(_copy_chunk, src_fd, dst_fd, src, dst, off, min(chunk, size - off), dst_direct, on_chunk, limiter)
                    for off in range(0, size, chunk)]
            _run_bounded(jobs, depth)  # returns only once no request is running, also on error
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
    return record(IOStats("copy", str(dst), size, time.perf_counter() - t0, dst_direct, -(-size // chunk_size)))

