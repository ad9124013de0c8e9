"""Which byte ranges of a file are already in the page cache (mincore), and how to drop them.

Why: O_DIRECT bypasses the page cache. That is right for a cold file (no copy, no cache pollution),
but wasteful for a file that another process just read or wrote: its pages are in DRAM and a
buffered read copies them at memcpy speed instead of going back to the device. Readers ask
``residency`` once per file and pick buffered or direct I/O per window.

mincore(2) needs an address, so the file is mapped read-only (no page is touched by mapping it);
only the per-page residency vector is read. Outside Linux everything reports "not resident".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value


@lru_cache(maxsize=1)
def libc():
    """The C library with the memory calls tierio makes typed (mmap, munmap, mincore, madvise);
    None outside Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - Linux without a loadable libc (static builds)
        return None
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


@dataclass(frozen=True)
class Residency:
    """Per-page residency of a file: ``pages[i]`` is True when page i is in the page cache."""

    size: int
    pages: np.ndarray  # one uint8 per page, 1 = resident

    def fraction(self, offset: int = 0, length: int | None = None) -> float:
        """Resident fraction of the pages covering [offset, offset+length); 1.0 for an empty range."""
        end = self.size if length is None else min(self.size, offset + length)
        if end <= offset:
            return 1.0
        first, last = offset // PAGE, (end - 1) // PAGE + 1
        window = self.pages[first:last]
        return float(window.sum()) / max(1, len(window))

    @property
    def resident_bytes(self) -> int:
        return min(self.size, int(self.pages.sum()) * PAGE)


def residency(path: str | Path | int) -> Residency:
    """Residency of every page of a file (a path or an open file descriptor)."""
    own = not isinstance(path, int)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)) if own else path
    try:
        size = os.fstat(fd).st_size
        npages = -(-size // PAGE)
        lib = libc()
        if lib is None or size == 0:
            return Residency(size, np.zeros(npages, np.uint8))
        addr = lib.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            return Residency(size, np.zeros(npages, np.uint8))  # unmappable (some FUSE mounts): assume cold
        try:
            vec = (ctypes.c_ubyte * npages)()
            if lib.mincore(addr, size, vec) != 0:
                return Residency(size, np.zeros(npages, np.uint8))
            return Residency(size, np.frombuffer(vec, np.uint8) & 1)
        finally:
            lib.munmap(addr, size)
    finally:
        if own:
            os.close(fd)


def range_resident(fd: int, offset: int, length: int) -> float:
    """Resident fraction of bytes [offset, offset+length) of an open file (0.0 .. 1.0; 0.0 where
    it cannot be known). Maps only that range, so it costs the same for any file size."""
    lib = libc()
    if lib is None or length <= 0:
        return 0.0
    start = offset - offset % PAGE
    span = offset + length - start
    npages = -(-span // PAGE)
    addr = lib.mmap(None, span, _PROT_READ, _MAP_SHARED, fd, start)
    if addr in (None, _MAP_FAILED):
        return 0.0
    try:
        vec = (ctypes.c_ubyte * npages)()
        if lib.mincore(addr, span, vec) != 0:
            return 0.0
        return float((np.frombuffer(vec, np.uint8) & 1).sum()) / npages
    finally:
        lib.munmap(addr, span)


def resident_fraction(path: str | Path, offset: int = 0, length: int | None = None) -> float:
    """Fraction of [offset, offset+length) of ``path`` that is in the page cache (0.0 .. 1.0)."""
    return residency(path).fraction(offset, length)


def evict(path: str | Path) -> None:
    """Ask the kernel to drop a file's clean pages from the page cache (POSIX_FADV_DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped; write them back first
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


DEFAULT_READAHEAD = 128 << 10  # the kernel's default readahead, when the device's cannot be read


def queue_value(dev: int, name: str) -> int | None:
    """An integer of block device ``dev``'s /sys queue directory (a whole disk, or the disk of a
    partition); None where there is none (network and virtual filesystems)."""
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue"):
        try:
            return int((queue / name).read_text())
        except (OSError, ValueError):
            continue
    return None


@lru_cache(maxsize=64)
def _device_readahead(dev: int) -> int:
    """The most one readahead request of block device ``dev`` may read: max(read_ahead_kb, max_sectors_kb)."""
    kb = [queue_value(dev, f) for f in ("read_ahead_kb", "max_sectors_kb")]
    if None in kb:
        return DEFAULT_READAHEAD
    return max(k for k in kb if k is not None) << 10 or DEFAULT_READAHEAD


def prefetch(fd: int, offset: int, length: int) -> None:
    """Start reading [offset, offset+length) into the page cache without waiting for it.

    POSIX_FADV_WILLNEED reads exactly the range asked (ordinary reads may run ahead into bytes
    that are still being written), but the kernel cuts each call to the device's readahead size,
    so a large range is asked for in pieces of that size."""
    if not hasattr(os, "posix_fadvise") or length <= 0:
        return
    piece = _device_readahead(os.fstat(fd).st_dev)
    for at in range(offset, offset + length, piece):
        os.posix_fadvise(fd, at, min(piece, offset + length - at), os.POSIX_FADV_WILLNEED)
