"""Host memory for loaded weights: file mappings, huge-page arenas, and the staging ring.

Tensors built in freshly allocated memory pay a page fault and a page of zeroing per 4 KiB on
first touch. On virtual machines that runs below 1 GB/s and costs more CPU than the read itself,
so a loader that reads into ``torch.empty`` tensors is bound by page faults, not by the disk.

* FileMapping (the default for CPU loads of local files): a copy-on-write mapping of the file,
  populated by the kernel with ``MADV_POPULATE_READ`` in large windows from several threads.
  Page-cache pages are filled by the device and need no zeroing: the cheapest memory there is.
* Arena (``mapped=False``, and the memory a remote load lands in): one anonymous mapping per
  file (or per needed byte range), advised to use transparent huge pages (one fault per 2 MiB)
  and populated by ``MADV_POPULATE_WRITE`` window by window in the reader threads, right before
  the window is read by O_DIRECT, so populating overlaps the I/O of the other windows.

Tensors are zero-copy views of either; the mapping lives as long as any of its tensors.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np

from tierio.errors import IntegrityError
from tierio.io.buffers import ALIGN, BufferPool, align_up, shared_pool
from tierio.io.pagecache import libc

HUGE = 2 << 20
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; older kernels answer EINVAL and we touch pages instead
STAGING_BUDGET = 512 << 20  # the GPU / load_into staging ring never exceeds this

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


MADV_POPULATE_READ = 22  # Linux >= 5.14


class FileMapping:
    """A private (copy-on-write) mapping of bytes [start, start+nbytes) of a local file.

    Same surface as Arena, for the ``mapped`` load mode: ``populate`` makes the kernel read the
    window into the page cache and map it (MADV_POPULATE_READ) from the calling thread, so several
    threads fill the mapping in parallel and no page is faulted from Python. Page-cache pages need
    no zeroing, so this costs far less CPU than filling fresh anonymous memory; the price is the
    usual one of mappings: truncating the file while its tensors live makes them fault (SIGBUS).
    """

    def __init__(self, path, start: int, nbytes: int) -> None:
        self.path, self.start = path, start
        self.nbytes = nbytes
        self.capacity = nbytes
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        except ValueError:  # Python checks the size first
            raise IntegrityError(f"{path} ends before byte {start + nbytes} that its header promises: it was truncated") from None
        finally:
            os.close(fd)
        self.address = int(np.frombuffer(self._mm, np.uint8).ctypes.data)
        self.view = memoryview(self._mm)

    def populate(self, offset: int, length: int) -> None:
        lib = libc()
        length = min(length, self.nbytes - offset)
        if length <= 0:
            return
        if lib is not None:
            if lib.madvise(self.address + offset, length, MADV_POPULATE_READ) == 0:
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


def staging_pool() -> BufferPool:
    """The process-wide staging ring (pinned when CUDA exists), bounded by STAGING_BUDGET."""
    return shared_pool("weights-staging", STAGING_BUDGET)
