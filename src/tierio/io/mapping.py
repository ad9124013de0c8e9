"""Host memory that is cheap to fill: file mappings populated through the page cache, and huge-page arenas.

Tensors built in freshly allocated memory pay a page fault and a page of zeroing per 4 KiB on
first touch. On virtual machines that runs below 1 GB/s and costs more CPU than the read itself,
so a reader that lands bytes in ``torch.empty`` tensors is bound by page faults, not by the disk.
Two kinds of memory avoid it (weight loads and checkpoint restores both use them):

* FileMapping: a copy-on-write mapping of a local file, populated by the kernel with
  ``MADV_POPULATE_READ`` in large windows from several threads (``populate_windows``). Page-cache
  pages are filled by the device and need no zeroing: the cheapest memory there is. Writing to a
  page copies it then (copy-on-write), one page at a time.
* Arena: one anonymous mapping advised to use transparent huge pages (one fault per 2 MiB) and
  populated by ``MADV_POPULATE_WRITE`` window by window in the reader threads, right before each
  window is read, so populating overlaps the I/O of the other windows.

Tensors are zero-copy views of either; the mapping lives as long as any of its tensors.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from tierio.errors import IntegrityError, os_error
from tierio.io.buffers import ALIGN, align_up
from tierio.io.engine import drain, run_windows
from tierio.io.pagecache import libc
from tierio.io.paths import open_regular
from tierio.units import MiB

HUGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_READ = 22  # Linux >= 5.14
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we touch pages instead
# Populate windows: on the machine we measured, 64 MiB x 4 populated 2 GiB at ~0.07 CPU-s/GB
# against ~0.18 for 16 MiB x 8 (fewer, longer readahead streams), at the same wall time.
MAP_CHUNK = 64 * MiB
MAP_DEPTH = 4

_populate_ok = True


class Arena:
    """``nbytes`` of page-aligned (2 MiB-aligned when large) anonymous memory, populated on demand."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        cap = align_up(max(nbytes, 1), ALIGN)
        slack = HUGE if cap >= HUGE else 0
        self._mm = mmap.mmap(-1, cap + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = int(np.frombuffer(self._mm, np.uint8).ctypes.data)
        self.base = (align_up(addr, HUGE) - addr) if slack else 0
        self.capacity = cap
        self.address = addr + self.base
        if slack:
            try:
                self._mm.madvise(MADV_HUGEPAGE, self.base, cap)
            except OSError:
                pass  # THP disabled: 4 KiB pages still work, only slower to populate
        self.view = memoryview(self._mm)[self.base : self.base + cap]

    def populate(self, offset: int, length: int) -> None:
        """Fault in [offset, offset+length) (page-aligned offset) without touching it from Python."""
        global _populate_ok
        if length <= 0:
            return
        lib = libc()
        if _populate_ok and lib is not None:
            # ctypes releases the GIL, so several reader threads populate in parallel.
            if lib.madvise(self.address + offset, align_up(length, ALIGN), MADV_POPULATE_WRITE) == 0:
                return
            _populate_ok = False
        arr = np.frombuffer(self.view, np.uint8, count=min(length, self.capacity - offset), offset=offset)
        arr[::ALIGN] = 0

    def tensor(self):
        """The whole arena as a torch.uint8 tensor; it keeps the mapping alive."""
        import torch

        return torch.frombuffer(self._mm, dtype=torch.uint8)[self.base : self.base + self.capacity]

    def typed(self, offset: int, dtype, count: int):
        """``count`` elements of torch ``dtype`` at byte ``offset`` as a tensor of their own storage."""
        import torch

        return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=self.base + offset)

    def populate_all(self, *, window: int = MAP_CHUNK, depth: int = MAP_DEPTH) -> None:
        """Fault the whole arena in, ``depth`` windows at a time on the shared I/O pool."""
        run_windows(list(range(0, self.capacity, window)), lambda at: self.populate(at, min(window, self.capacity - at)), depth)


class FileMapping:
    """A private (copy-on-write) mapping of bytes [start, start+nbytes) of a local file.

    ``start`` must be a multiple of the page size. ``source`` is a path, or an open descriptor
    (left open: a caller that resolved the file safely, without following links, maps exactly
    that file); ``where`` names it in errors. ``populate`` makes the kernel read a window into the
    page cache and map it (MADV_POPULATE_READ) from the calling thread, so several threads fill
    the mapping in parallel and no page is faulted from Python. The price is the usual one of
    mappings: truncating the file while its tensors live makes them fault (SIGBUS); deleting or
    replacing it (a rename) does not.
    """

    def __init__(self, source: str | Path | int, start: int, nbytes: int, *, where: str | None = None) -> None:
        self.path = where or str(source)
        self.start = start
        self.nbytes = nbytes
        self.capacity = nbytes
        fd = source if isinstance(source, int) else os.open(source, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        except ValueError:  # Python checks the size first
            raise IntegrityError(f"{self.path} ends before byte {start + nbytes} that its header promises: it was truncated") from None
        finally:
            if not isinstance(source, int):
                os.close(fd)
        self.address = int(np.frombuffer(self._mm, np.uint8).ctypes.data)
        self.view = memoryview(self._mm)

    def populate(self, offset: int, length: int) -> None:
        lib = libc()
        length = min(length, self.nbytes - offset)
        if length <= 0:
            return
        if lib is not None:
            # madvise needs a page-aligned address: start at the page holding ``offset``.
            lead = offset % mmap.PAGESIZE
            if lib.madvise(self.address + offset - lead, length + lead, MADV_POPULATE_READ) == 0:
                return
            err = ctypes.get_errno()
            if err in (errno.EFAULT, errno.EIO, 133):  # 133: EHWPOISON (not in Python's errno)
                # Touching these pages would kill the process with SIGBUS: say what happened instead.
                raise IntegrityError(
                    f"{self.path} could not be read at bytes {self.start + offset}..{self.start + offset + length}: "
                    "it was truncated while loading, or the device returned an I/O error")
            if err not in (errno.EINVAL, errno.ENOSYS):
                raise OSError(err, os.strerror(err), str(self.path))
        np.frombuffer(self.view, np.uint8, count=length, offset=offset)[::ALIGN].sum()  # kernels before 5.14: touch

    def tensor(self):
        import torch

        return torch.frombuffer(self._mm, dtype=torch.uint8)

    def typed(self, offset: int, dtype, count: int):
        """``count`` elements of torch ``dtype`` at byte ``offset`` as a tensor of their own storage
        (storage offset 0: some consumers, such as torch.set_rng_state, read a storage from its start)."""
        import torch

        return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)


def page_start(offset: int) -> int:
    """The first byte of the page holding ``offset`` (where a FileMapping of it must start)."""
    return offset - offset % mmap.PAGESIZE


def populate_windows(mapping: FileMapping, spans: Sequence[tuple[int, int]], after: Callable[[int, int], None] | None = None,
                     *, depth: int = MAP_DEPTH) -> None:
    """Populate each span ``(offset, length)`` of ``mapping`` (offsets relative to the mapping),
    ``depth`` at a time on the shared I/O pool, and call ``after(offset, length)`` in the same
    thread once its pages are in (a checksum, while the other windows are still being read).
    A thread done with its span takes the next at once (engine.drain): how long a span takes is
    up to the page cache and, on a virtual machine, the host."""

    def one(span: tuple[int, int]) -> None:
        mapping.populate(*span)
        if after is not None:
            after(*span)

    drain(spans, one, depth)


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
