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
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from tierio.errors import DiskFullError, StorageError, os_error
from tierio.io import background
from tierio.io.buffers import ALIGN, BufferPool, HostBuffer, address_of, align_down, align_up, shared_pool
from tierio.io.engine import Request, settle_all, submit
from tierio.io.limiter import TokenBucket
from tierio.io.locks import hold_write_lock
from tierio.io.stats import IOStats, record
from tierio.units import MiB

log = logging.getLogger(__name__)

DEFAULT_CHUNK = 8 * MiB
DEFAULT_DEPTH = 8

__all__ = ["DEFAULT_CHUNK", "DEFAULT_DEPTH", "FileWriter", "bounce_pool", "open_file", "pread_full", "pwrite_all",
           "write_file"]

_warned_dirs: set[str] = set()
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def bounce_pool() -> BufferPool:
    """Shared aligned bounce buffers, faulted in once per process and reused."""
    return shared_pool("bounce", 16 * DEFAULT_CHUNK)

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
    written in place, with up to ``depth`` requests of ``chunk_size`` bytes in flight (by default
    8 MiB and 8; on a background thread fewer, longer ones: ``io.background.request_shape``).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        direct: bool = True,
        chunk_size: int | None = None,
        depth: int | None = None,
        limiter: TokenBucket | None = None,
        dir_fd: int | None = None,
    ) -> None:
        self.path = Path(path)
        chunk_size, depth = background.request_shape(chunk_size, depth, DEFAULT_CHUNK, DEFAULT_DEPTH)
        self.chunk_size = align_up(chunk_size)
        # unaligned bytes are gathered in bounce buffers of the shared pool: those stay small
        self.bounce_size = min(self.chunk_size, DEFAULT_CHUNK)
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
                self._bounce = bounce_pool().acquire(self.bounce_size)
            n = min(len(view), self.bounce_size - self._fill)
            self._bounce.view[self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == self.bounce_size:
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

